"""Which speech continues the latest turn: a refused turn that the user goes on with keeps
its words; speech close in the audio but long after on the client's clock is a new turn,
and a server that reads frames late does not make the client late.
Orchestration only: the session over scripted fakes (tests/fakes.py)."""

from __future__ import annotations

import asyncio

import numpy as np

from pipeline.config import TurnConfig, VoxpipeConfig
from pipeline.serving.admission import Admission
from pipeline.session import events as ev
from pipeline.session.turn_ids import MERGE_CLOCK_SLACK_S
from server.idle import FrameReader
from tests.fakes import FakeAsr, FakeLlm, LlmReply, fake_engines, silence, tone
from tests.session_harness import Audio, Harness, Sleep, Start, WaitFor, WaitUntil

LATE_S = MERGE_CLOCK_SLACK_S + 1.5  # a client this late resumes a new turn (the audio gap is < 1 s)


def of(seen, kind):
    return [e for e in seen if isinstance(e, kind)]


async def test_a_refused_turn_that_goes_on_keeps_its_first_words():
    llm, asr = FakeLlm(default=LlmReply.of("Sure.")), FakeAsr()
    llm.active, llm.slots, llm.depth = 8, 8, 16  # full batch, a queue behind it: refuse
    cfg = VoxpipeConfig()
    cfg.turn = TurnConfig(early_end_ms=0, merge_window_ms=2000)
    h = Harness(engines=fake_engines(llm=llm, asr=asr), cfg=cfg, admission=Admission(cfg.admission))
    try:
        first_half = tone(1500)
        seen = await h.play([Start(), Audio(first_half), Audio(silence(700)), WaitFor(ev.Busy)])
        busy = of(seen, ev.Busy)[0]
        llm.active = llm.depth = 0  # the load passes while the user goes on speaking
        seen = await h.play([Audio(tone(1000)), Audio(silence(700)), WaitFor(ev.ResponseDone)])
        final = of(seen, ev.TranscriptFinal)[-1]
        words = final.text.split()
        expected = len(FakeAsr.words(first_half)) + len(FakeAsr.words(tone(1000)))
        assert len(words) >= expected - 1, (final.text, expected)  # both halves (one join may merge)
        assert final.turn_id == busy.turn_id  # the same turn, decided again at its new end
        assert not [c for c in of(seen, ev.ResponseCancelled) if c.reason == "continued"]
    finally:
        await h.close()


async def test_speech_close_in_the_audio_but_long_after_on_the_clock_is_a_new_turn():
    cfg = VoxpipeConfig()
    cfg.turn = TurnConfig(early_end_ms=0, merge_window_ms=2000)
    llm = FakeLlm(default=LlmReply.of("A long answer. ", "It goes on and on. " * 20, delay_s=0.05))
    h = Harness(engines=fake_engines(llm=llm), cfg=cfg)
    try:
        seen = await h.play([Start(), Audio(tone(1200)), Audio(silence(600)), WaitFor(ev.ResponseStarted)])
        first = of(seen, ev.SpeechStarted)[0].turn_id
        # the client stopped sending while it listened; LATE_S later it speaks again, its
        # audio resuming 600 ms after the last turn's end
        seen = await h.play([Sleep(LATE_S), Audio(tone(1200)), Audio(silence(600)), WaitFor(ev.SpeechStarted, 2)])
        assert of(seen, ev.SpeechStarted)[-1].turn_id != first
        assert not [c for c in of(seen, ev.ResponseCancelled) if c.reason == "continued"]
    finally:
        await h.close()


async def test_a_server_that_reads_the_frames_late_still_continues_the_turn():
    """The same LATE_S on the clock, but the client's frames were there all along (a loaded
    server read them late; its reader never waited): the client is on time and the speech
    continues the turn, over the reply that speaks meanwhile."""
    cfg = VoxpipeConfig()
    cfg.turn = TurnConfig(early_end_ms=0, merge_window_ms=2000)
    llm = FakeLlm(default=LlmReply.of("A long answer. ", "It goes on and on. " * 20, delay_s=0.05))
    h = Harness(engines=fake_engines(llm=llm), cfg=cfg)
    h.session.client_clock = lambda: 0.0  # as the server's FrameReader.waited: no wait for a frame
    try:
        seen = await h.play([Start(), Audio(tone(1200)), Audio(silence(600)), WaitFor(ev.ResponseStarted)])
        first = of(seen, ev.SpeechStarted)[0].turn_id
        seen = await h.play([Sleep(LATE_S), Audio(tone(1200)), Audio(silence(600)),
                             WaitFor(ev.ResponseCancelled, where=lambda e: e.reason == "continued"),
                             WaitFor(ev.ResponseStarted, 2)])
        final = of(seen, ev.TranscriptFinal)[-1]
        assert final.turn_id != first  # held over the audible reply as a turn of its own, then joined
        assert len(final.text.split()) >= 2 * len(FakeAsr.words(tone(1200))) - 1, final.text  # both halves
    finally:
        await h.close()


async def test_speech_that_resumes_at_once_still_continues_the_turn():
    cfg = VoxpipeConfig()
    cfg.turn = TurnConfig(early_end_ms=0, merge_window_ms=2000)
    h = Harness(cfg=cfg)
    try:
        seen = await h.play([Start(), Audio(tone(1200)), Audio(silence(600)), WaitFor(ev.SpeechStopped),
                             Audio(tone(1200)), Audio(silence(600)), WaitFor(ev.SpeechStopped, 2)])
        ids = [e.turn_id for e in of(seen, ev.SpeechStarted)]
        assert len(ids) == 2
        if ids[0] != ids[1]:  # its short reply was all sent and still played: held until words, then merged
            seen = await h.play([WaitFor(ev.ResponseStarted, 2)])
            final = of(seen, ev.TranscriptFinal)[-1]
            assert final.turn_id == ids[1]
            assert len(final.text.split()) >= 2 * len(FakeAsr.words(tone(1200))), final.text
    finally:
        await h.close()


class _QueuedAsr(FakeAsr):
    """Counts its final decodes in flight as urgent queue depth, as the real ASR stage's
    queue does while they wait for the model."""

    def __init__(self, *, delay_s: float) -> None:
        super().__init__(delay_s=delay_s)
        self.in_flight = 0

    @property  # type: ignore[override]
    def urgent_depth(self) -> int:
        return self.in_flight

    async def run(self, item):
        urgent = getattr(item, "final", False) or getattr(item, "urgent", False)
        self.in_flight += urgent
        try:
            return await super().run(item)
        finally:
            self.in_flight -= urgent


async def test_a_session_alone_is_not_refused_for_its_own_final_decode():
    # the speculative final decode that the pause started is still queued when the turn
    # ends: the turn's own work, so the session is still alone on the server (PROTOCOL.md:
    # "a session alone ... is always answered"), whatever the prediction says
    asr = _QueuedAsr(delay_s=1.0)
    cfg = VoxpipeConfig()
    cfg.admission.slo_ms = 100.0  # every prediction is over it: only an idle server admits
    h = Harness(engines=fake_engines(asr=asr), cfg=cfg, admission=Admission(cfg.admission))
    try:
        seen = await h.play([Start(), Audio(tone(1500)), Audio(silence(900)), WaitFor(ev.ResponseDone)])
        assert asr.in_flight == 0 and any(getattr(r, "final", False) for r in asr.requests)
        assert not of(seen, ev.Busy), of(seen, ev.Busy)
        assert of(seen, ev.TranscriptFinal)
    finally:
        await h.close()


class _WaitingLlm(FakeLlm):
    """Counts its requests that have no token yet and were not aborted as queue depth, as
    the engine's ``load().depth`` does while a request waits for a batch slot."""

    @property  # type: ignore[override]
    def depth(self) -> int:
        return sum(not s.aborted and s.stats.output_tokens == 0 for s in self.streams)


def _alone(asr: FakeAsr | None = None) -> tuple[_WaitingLlm, Harness]:
    """A session alone on a server whose SLO every prediction exceeds (only an idle server
    admits), over an LLM whose replies wait 30 s for their first token."""
    llm = _WaitingLlm(default=LlmReply.of("Sure.", delay_s=30.0))
    cfg = VoxpipeConfig()
    cfg.admission.slo_ms = 100.0
    return llm, Harness(engines=fake_engines(asr=asr, llm=llm), cfg=cfg, admission=Admission(cfg.admission))


def _one_frame(*parts) -> Audio:
    """``parts`` sent as one frame (audio faster than real time: its turn events come at once)."""
    samples = np.concatenate(parts)
    return Audio(samples, frame_ms=len(samples) / 16)


async def test_a_dropped_speculation_does_not_make_its_own_turn_look_queued():
    # a pause starts a speculative reply (its LLM request waits for a slot); the speech goes
    # on and ends within one frame (audio sent faster than real time): the dropped
    # speculation's request is this turn's own, so the session is still alone on the server
    llm, h = _alone()
    try:
        await h.play([Start(), Audio(tone(1500)), Audio(silence(300)),
                      WaitUntil(lambda: len(llm.requests) == 1, "the speculative reply's LLM request")])
        assert llm.depth == 1  # it waits for a slot
        seen = await h.play([_one_frame(tone(1000), silence(900)), WaitFor(ev.SpeechStopped)])
        assert llm.aborted[:1] == [0]
        assert not of(seen, ev.Busy), of(seen, ev.Busy)
        seen = await h.play([WaitUntil(lambda: len(llm.requests) == 2, "the merged turn's LLM request")])
        assert not of(seen, ev.Busy), of(seen, ev.Busy)
    finally:
        await h.close()


async def test_a_new_turn_is_not_refused_for_its_own_sessions_earlier_reply():
    # the first turn's reply still waits for a batch slot when the user asks again, well after
    # the merge window (a new turn) and sent in one frame, so no partial barges in first: the
    # earlier reply is the session's own work, which the new turn's reply replaces
    llm, h = _alone()
    try:
        seen = await h.play([Start(), Audio(tone(1500)), Audio(silence(900)),
                             WaitUntil(lambda: len(llm.requests) == 1, "the first turn's LLM request")])
        assert llm.depth == 1 and not of(seen, ev.Busy)
        first = of(seen, ev.SpeechStarted)[0].turn_id
        seen = await h.play([Sleep(LATE_S), _one_frame(tone(1000), silence(900)),
                             WaitUntil(lambda: len(llm.requests) == 2, "the second turn's LLM request")])
        assert not of(seen, ev.Busy), of(seen, ev.Busy)
        assert [e.turn_id for e in of(seen, ev.SpeechStarted)] == [first, first + 1]  # a new turn
        assert llm.aborted == [0]  # the new turn's reply replaced the first
    finally:
        await h.close()


async def test_speech_that_resumes_before_the_turns_task_ran_leaves_no_orphan_reply():
    # a pause starts a speculation (its final decode is slow); the turn ends and the speech
    # resumes within one frame, so the turn's confirmation task is cancelled before it ran.
    # The speculation must go with it: else its decode, once back, starts a reply nobody
    # will hear, which holds an LLM request (and made the merged turn look queued: busy)
    asr = _QueuedAsr(delay_s=0.5)
    llm, h = _alone(asr)
    try:
        await h.play([Start(), Audio(tone(1500)), Audio(silence(300)),
                      WaitUntil(lambda: asr.in_flight == 1, "the speculative final decode")])
        seen = await h.play([_one_frame(silence(300), tone(1000)),
                             WaitUntil(lambda: asr.in_flight == 0, "the speculative decode to come back"),
                             Audio(silence(900)), WaitFor(ev.ResponseStarted)])
        assert [c.reason for c in of(seen, ev.ResponseCancelled)] == []  # nothing of the pause was sent
        assert not of(seen, ev.Busy), of(seen, ev.Busy)
        live = [i for i in range(len(llm.requests)) if i not in llm.aborted]
        assert len(live) == 1, (len(llm.requests), llm.aborted)  # the merged turn's reply only
    finally:
        await h.close()


async def test_a_turn_continued_before_its_task_ran_can_still_speculate():
    """Speech that ends and resumes within one frame continues the turn before the ended
    turn's task has run: the cancelled task never starts. The merged turn must not wait
    for that task's transcript forever: its own pause speculates, and the speculation is
    what answers it (one reply, used)."""
    from pipeline import metrics

    used = metrics.SPECULATIONS.labels("used")
    cfg = VoxpipeConfig()
    cfg.turn = TurnConfig(early_end_ms=200, end_silence_ms=500, merge_window_ms=2000)
    h = Harness(cfg=cfg)
    try:
        # one frame: speech, a turn-ending silence, speech again (the same turn, resumed)
        burst = np.concatenate([tone(1200), silence(700), tone(1200)])
        seen = await h.play([Start(), Audio(burst, frame_ms=len(burst) * 1000 / 16000), WaitFor(ev.SpeechStarted, 2)])
        ids = [e.turn_id for e in of(seen, ev.SpeechStarted)]
        assert ids[0] == ids[1]  # continued
        # nothing of the ended turn is awaited any more (its cancelled task ended)
        await h.play([WaitUntil(lambda: not h.session.turn_state.busy, "the ended turn's task is let go")])
        before = used._value.get()
        seen = await h.play([Audio(silence(700)), WaitFor(ev.ResponseDone)])
        assert used._value.get() == before + 1  # the merged turn's pause speculated, and its end used it
        assert len(of(seen, ev.ResponseStarted)) == 1
    finally:
        await h.close()


class _Frames:
    """A connection stand-in: ``recv`` gives the frames put in its queue, in order."""

    def __init__(self) -> None:
        self.q: asyncio.Queue[bytes] = asyncio.Queue()

    async def recv(self) -> bytes:
        return await self.q.get()


async def test_the_readers_clock_counts_waits_for_the_client_not_frames_already_there():
    ws = _Frames()
    reader = FrameReader(ws, 0.0, lambda: False)  # type: ignore[arg-type]
    for _ in range(3):  # frames the client sent while the server was busy: no wait to read them
        ws.q.put_nowait(b"x")
    for _ in range(3):
        await reader.recv()
    queued = reader.waited
    asyncio.get_running_loop().call_later(0.3, ws.q.put_nowait, b"y")  # the client sends 0.3 s later
    assert await reader.recv() == b"y"
    assert reader.waited - queued >= 0.29  # the wait for the client counts …
    assert queued < 0.29  # … frames already there do not (nothing awaited to read them)
