"""Which speech continues the latest turn: a refused turn that the user goes on with keeps
its words; speech close in the audio but long after on the clock is a new turn.
Orchestration only: the session over scripted fakes (tests/fakes.py)."""

from __future__ import annotations

from pipeline.config import TurnConfig, VoxpipeConfig
from pipeline.serving.admission import Admission
from pipeline.session import events as ev
from tests.fakes import FakeAsr, FakeLlm, LlmReply, fake_engines, silence, tone
from tests.session_harness import Audio, Harness, Sleep, Start, WaitFor


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
        # the client stopped sending while it listened; 3.5 s later it speaks again, its
        # audio resuming 600 ms after the last turn's end
        seen = await h.play([Sleep(3.5), Audio(tone(1200)), Audio(silence(600)), WaitFor(ev.SpeechStarted, 2)])
        assert of(seen, ev.SpeechStarted)[-1].turn_id != first
        assert not [c for c in of(seen, ev.ResponseCancelled) if c.reason == "continued"]
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
        assert len(ids) == 2 and ids[0] == ids[1]
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
