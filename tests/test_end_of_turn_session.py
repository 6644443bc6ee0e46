"""The semantic end of turn in a real Session over fakes: a scripted end-of-turn model
decides where turns end (pipeline/session/end_of_turn.py, the endpointer's checks)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from audio.pcm import RATE
from pipeline.config import VoxpipeConfig
from pipeline.errors import Busy
from pipeline.session import events as ev
from pipeline.session.end_of_turn import EAGERNESS, EOT_WINDOW_S
from tests.fakes import FakeEot, fake_engines, silence, tone
from tests.session_harness import Audio, Harness, InputEnd, Start, WaitFor

SMART = VoxpipeConfig()
SMART = replace(SMART, turn=replace(SMART.turn, end_of_turn="smart-turn"))


async def play(script, eot: FakeEot, cfg: VoxpipeConfig = SMART):
    h = Harness(engines=fake_engines(eot=eot), cfg=cfg)
    try:
        return await h.play(script)
    finally:
        await h.close()


def stops(seen) -> list[ev.SpeechStopped]:
    return [e for e in seen if isinstance(e, ev.SpeechStopped)]


async def test_complete_ends_the_turn_and_the_reply_follows():
    eot = FakeEot([0.95])
    seen = await play([Start(), Audio(np.concatenate([tone(1200), silence(1500)])),
                       WaitFor(ev.ResponseDone)], eot)
    (stop,) = stops(seen)
    assert stop.reason == "end_of_turn"
    assert len(eot.calls) == 1
    audio = eot.calls[0]
    assert audio.dtype == np.float32 and RATE * 1.2 <= len(audio) <= RATE * (1.2 + 0.5 + 0.5)


async def test_incomplete_keeps_a_thinking_pause_inside_one_turn():
    """1.2 s of silence mid-turn: the model says "not yet" at every check; the speech goes on
    and the client sees one turn, one transcript and one reply."""
    eot = FakeEot([0.05], default=0.95)  # asked once in the pause: "not yet"
    x = np.concatenate([tone(1000), silence(1200), tone(800, hz=330), silence(1500)])
    seen = await play([Start(), Audio(x), WaitFor(ev.ResponseDone)], eot)
    assert len(stops(seen)) == 1 and stops(seen)[0].reason == "end_of_turn"
    assert len([e for e in seen if isinstance(e, ev.TranscriptFinal)]) == 1
    assert len([e for e in seen if isinstance(e, ev.ResponseStarted)]) == 1
    assert len(eot.calls) == 2  # asked once in the pause, once at the end


async def test_never_complete_ends_at_the_eagerness_cap():
    eot = FakeEot(default=0.0)
    cap = EAGERNESS["high"].cap_ms
    seen = await play([Start(eagerness="high"), Audio(np.concatenate([tone(1000), silence(cap + 600)])),
                       WaitFor(ev.SpeechStopped)], eot)
    (stop,) = stops(seen)
    assert stop.reason == "silence"
    assert len(eot.calls) == 1  # a "not yet" waits for the cap


async def test_a_busy_model_falls_back_to_the_silence_rule():
    eot = FakeEot(default=0.0, script=[Busy("end-of-turn queue full")] * 10)
    seen = await play([Start(), Audio(np.concatenate([tone(1000), silence(900)])), WaitFor(ev.SpeechStopped)], eot)
    assert stops(seen)[0].reason == "silence"
    assert stops(seen)[0].audio_ms <= 1100


async def test_a_model_that_does_not_answer_in_time_falls_back_to_the_silence_rule():
    """A stuck model (an answer after 60 s) must not hold the session's audio: past
    ``eot_timeout_ms`` the silence rule decides, and the check counts as no answer."""
    from pipeline import metrics

    cfg = replace(SMART, turn=replace(SMART.turn, eot_timeout_ms=50))
    none = metrics.EOT_CHECKS.labels("none")._value.get()
    eot = FakeEot(default=0.95, delay_s=60)
    seen = await play([Start(), Audio(np.concatenate([tone(1000), silence(900)])), WaitFor(ev.SpeechStopped)], eot,
                      cfg)
    assert stops(seen)[0].reason == "silence" and len(eot.calls) >= 1
    assert metrics.EOT_CHECKS.labels("none")._value.get() >= none + 1


async def test_session_start_may_choose_the_silence_rule():
    eot = FakeEot(default=0.95)
    seen = await play([Start(end_of_turn="silence"), Audio(np.concatenate([tone(1000), silence(900)])),
                       WaitFor(ev.SpeechStopped)], eot)
    assert stops(seen)[0].reason == "silence" and eot.calls == []


async def test_session_started_says_which_rule_is_in_force():
    def started(seen) -> ev.SessionStarted:
        return next(e for e in seen if isinstance(e, ev.SessionStarted))

    smart = started(await play([Start(eagerness="low")], FakeEot()))
    assert (smart.end_of_turn, smart.eagerness) == ("smart-turn", "low")
    server_default = started(await play([Start()], FakeEot()))
    assert (server_default.end_of_turn, server_default.eagerness) == ("smart-turn", SMART.turn.eagerness)
    chose = started(await play([Start(end_of_turn="silence")], FakeEot()))
    assert (chose.end_of_turn, chose.eagerness) == ("silence", None)
    no_vad = started(await play([Start(vad=False)], FakeEot()))
    assert (no_vad.end_of_turn, no_vad.eagerness) == ("input_end", None)
    h = Harness(engines=fake_engines(), cfg=SMART)  # asked for, but the server has no model
    try:
        no_model = started(await h.play([Start(end_of_turn="smart-turn")]))
    finally:
        await h.close()
    assert (no_model.end_of_turn, no_model.eagerness) == ("silence", None)


async def test_the_model_reads_at_most_the_last_8_seconds():
    eot = FakeEot(default=0.95)
    await play([Start(), Audio(np.concatenate([tone(10_000), silence(600)])), WaitFor(ev.SpeechStopped)], eot)
    assert len(eot.calls[0]) == int(EOT_WINDOW_S * RATE)


async def test_input_end_still_ends_the_turn_at_once():
    eot = FakeEot(default=0.0)
    seen = await play([Start(), Audio(np.concatenate([tone(1000), silence(100)])), InputEnd(),
                       WaitFor(ev.SpeechStopped)], eot)
    assert stops(seen)[0].reason == "input_end"


async def test_a_pause_waited_to_the_cap_is_not_charged_as_lateness():
    """The model says "not yet" up to the cap (2 s of silence at ``medium``): that wait is the
    user's pause. With another user waiting (not idle) and the default 2 s SLO, charged as
    lateness it made admission refuse the turn (2 s > 85 % of the SLO) and back its limit off."""
    import time

    from pipeline.serving.admission import Admission

    cfg = replace(SMART, turn=replace(SMART.turn, early_end_ms=0))  # no speculation: the end's own admission
    admission = Admission(cfg.admission)
    engines = fake_engines(eot=FakeEot(default=0.0))
    other = object()  # someone else's admitted turn, still waiting for its first audio
    assert admission.decide(engines.load(cfg), spoken=False, end_silence_ms=0.0, kv_tokens=0,
                            now=time.monotonic(), key=other) is None
    limit = admission.limit
    h = Harness(engines=engines, cfg=cfg, admission=admission)
    cap = EAGERNESS["medium"].cap_ms
    try:
        seen = await h.play([Start(eagerness="medium"), Audio(np.concatenate([tone(1000), silence(cap + 600)])),
                             WaitFor(ev.ResponseDone)])
    finally:
        await h.close()
    assert not [e for e in seen if isinstance(e, ev.Busy)]
    assert stops(seen)[0].reason == "silence"  # ended at the cap
    assert admission.limit >= limit  # its first audio was not a miss
