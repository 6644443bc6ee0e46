"""The turn runner's state machine: scripted transitions (pure), invalid ones, and the
stages a real session's runner walks through over scripted fakes (tests/fakes.py)."""

from __future__ import annotations

import itertools

import pytest

from pipeline.config import TurnConfig, VoxpipeConfig
from pipeline.serving.admission import Admission
from pipeline.session import events as ev
from pipeline.session.turn_machine import TRANSITIONS, InvalidTransition, TurnMachine
from pipeline.session.types import StageEvent, TurnStage
from tests.fakes import FakeLlm, LlmReply, fake_engines, silence, tone
from tests.session_harness import Audio, Harness, Start, WaitFor, WaitUntil

S, E = TurnStage, StageEvent


def run(*events: StageEvent, machine: TurnMachine | None = None) -> list[TurnStage]:
    m = machine or TurnMachine()
    return [m.fire(e) for e in events]


# ---- pure: scripted transitions -----------------------------------------------------------


def test_a_turn_without_speculation_is_transcribed_then_done():
    assert run(E.SPEECH, E.SUBMIT, E.TASK_DONE) == [S.HEARING, S.TRANSCRIBING, S.DONE]


def test_a_speculated_turn_is_confirmed_then_done():
    assert run(E.SPEECH, E.SPECULATE, E.SUBMIT, E.TASK_DONE) == [S.HEARING, S.SPECULATING, S.CONFIRMING, S.DONE]


def test_resumed_speech_drops_the_speculation_and_may_speculate_again():
    m = TurnMachine()
    run(E.SPEECH, E.SPECULATE, machine=m)
    assert m.speculating and not m.may_speculate(busy=False)
    assert m.fire(E.DROP) is S.HEARING
    assert m.may_speculate(busy=False) and not m.may_speculate(busy=True)
    assert m.fire(E.SPECULATE) is S.SPECULATING


def test_a_refused_turn_is_continued_by_more_speech():
    m = TurnMachine()
    assert run(E.SPEECH, E.REFUSE, machine=m) == [S.HEARING, S.REFUSED]
    assert m.refused and not m.hearing
    assert m.fire(E.CONTINUE) is S.HEARING and not m.refused


@pytest.mark.parametrize("working", [S.TRANSCRIBING, S.CONFIRMING, S.DONE])
def test_speech_continues_an_answered_turn_and_its_cancelled_task_ends_late(working):
    m = TurnMachine()
    m.stage = working
    assert m.fire(E.CONTINUE) is S.HEARING
    if working is not S.DONE:
        assert m.fire(E.TASK_DONE) is S.HEARING  # the cancelled task's end changes nothing


def test_new_speech_while_the_last_turn_is_transcribed_leaves_its_task_running():
    m = TurnMachine()
    run(E.SPEECH, E.SUBMIT, machine=m)
    assert run(E.SPEECH, E.REFUSE, E.TASK_DONE, machine=m) == [S.HEARING, S.REFUSED, S.REFUSED]


@pytest.mark.parametrize("stage", list(S))
def test_reset_returns_to_idle_from_any_stage(stage):
    m = TurnMachine()
    m.stage = stage
    assert m.fire(E.RESET) is S.IDLE


@pytest.mark.parametrize(("stage", "event"), [
    (S.IDLE, E.CONTINUE),  # nothing to continue
    (S.HEARING, E.SPEECH),  # speech cannot start while speech is in progress
    (S.SPECULATING, E.CONTINUE),
    (S.IDLE, E.SUBMIT),  # no speech ended
    (S.REFUSED, E.SUBMIT),
    (S.HEARING, E.DROP),  # no speculation to drop
    (S.SPECULATING, E.SPECULATE),  # one speculation at a time
    (S.SPECULATING, E.REFUSE),  # the speculation is dropped first
    (S.DONE, E.TASK_DONE),  # its task already ended
    (S.TRANSCRIBING, E.SPECULATE),
])
def test_an_invalid_transition_raises_and_changes_nothing(stage, event):
    m = TurnMachine()
    m.stage = stage
    with pytest.raises(InvalidTransition) as info:
        m.fire(event)
    assert m.stage is stage and info.value.stage is stage and info.value.event is event
    assert event.name in str(info.value) and stage.name in str(info.value)


def test_every_pair_either_moves_as_the_table_says_or_raises():
    for stage, event in itertools.product(S, E):
        m = TurnMachine()
        m.stage = stage
        if (stage, event) in TRANSITIONS:
            assert m.fire(event) is TRANSITIONS[stage, event]
        else:
            with pytest.raises(InvalidTransition):
                m.fire(event)


def test_every_stage_is_reachable_from_idle():
    reached, frontier = {S.IDLE}, [S.IDLE]
    while frontier:
        stage = frontier.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src is stage and dst not in reached:
                reached.add(dst)
                frontier.append(dst)
    assert reached == set(S)


# ---- a real session's runner over fakes ---------------------------------------------------


def record(h: Harness) -> list[tuple[StageEvent, TurnStage]]:
    """Every transition of ``h``'s runner from now on, in order."""
    machine, trace = h.session.runner.machine, []
    fire = machine.fire

    def recording(event: StageEvent) -> TurnStage:
        stage = fire(event)
        trace.append((event, stage))
        return stage
    machine.fire = recording  # type: ignore[method-assign]
    return trace


def of(seen, kind) -> list:
    return [e for e in seen if isinstance(e, kind)]


async def test_a_paused_turn_speculates_and_its_end_confirms_it():
    h = Harness()
    trace = record(h)
    try:
        await h.play([Start(), Audio(tone(1200)), Audio(silence(800)), WaitFor(ev.ResponseDone),
                      WaitUntil(lambda: h.session.runner.machine.stage is S.DONE, "the turn's task to end")])
        assert trace == [(E.RESET, S.IDLE), (E.SPEECH, S.HEARING), (E.SPECULATE, S.SPECULATING),
                         (E.SUBMIT, S.CONFIRMING), (E.TASK_DONE, S.DONE)]
    finally:
        await h.close()


async def test_speech_after_the_pause_drops_the_speculation():
    h = Harness()
    trace = record(h)
    try:
        await h.play([Start(), Audio(tone(1200)), Audio(silence(350)), Audio(tone(800)), Audio(silence(800)),
                      WaitFor(ev.ResponseDone)])
        assert [stage for _, stage in trace[:5]] == [S.IDLE, S.HEARING, S.SPECULATING, S.HEARING, S.SPECULATING]
        assert trace[5] == (E.SUBMIT, S.CONFIRMING)
        assert len(of(h.out.seen, ev.SpeechStarted)) == 1  # one speech turn: the pause did not end it
    finally:
        await h.close()


async def test_a_refused_turn_waits_refused_and_speech_continues_it():
    llm = FakeLlm(default=LlmReply.of("Sure."))
    llm.active, llm.slots, llm.depth = 8, 8, 16  # full batch, a queue behind it: refuse
    cfg = VoxpipeConfig()
    cfg.turn = TurnConfig(early_end_ms=0, merge_window_ms=2000)
    h = Harness(engines=fake_engines(llm=llm), cfg=cfg, admission=Admission(cfg.admission))
    trace = record(h)
    try:
        await h.play([Start(), Audio(tone(1500)), Audio(silence(700)), WaitFor(ev.Busy)])
        assert h.session.runner.machine.stage is S.REFUSED
        llm.active = llm.depth = 0  # the load passes while the user goes on speaking
        await h.play([Audio(tone(1000)), Audio(silence(700)), WaitFor(ev.ResponseDone),
                      WaitUntil(lambda: h.session.runner.machine.stage is S.DONE, "the turn's task to end")])
        assert trace == [(E.RESET, S.IDLE), (E.SPEECH, S.HEARING), (E.REFUSE, S.REFUSED), (E.CONTINUE, S.HEARING),
                         (E.SUBMIT, S.TRANSCRIBING), (E.TASK_DONE, S.DONE)]
    finally:
        await h.close()
