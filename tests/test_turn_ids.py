"""Turn ids and the merge window (pure, with a scripted client clock: every frame comes now)."""

from __future__ import annotations

import gc
import weakref

import pytest

from pipeline.config import TurnConfig
from pipeline.session.turn_ids import MERGE_CLOCK_SLACK_S, TurnIds
from pipeline.session.types import SpeechEnd

RATE = 16000


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self, sample: int = 0) -> float:
        return self.t


class Turn:
    """A speech turn stand-in (any object that takes a weak reference)."""


def ids_with(clock: Clock, **turn) -> TurnIds:
    return TurnIds(TurnConfig(**{"merge_window_ms": 2000, **turn}), arrival=clock)


def ended(ids: TurnIds, clock: Clock, start_s: float, end_s: float, reason: str = "silence") -> None:
    """A speech turn from ``start_s`` to ``end_s`` of audio, its end come now on ``clock``."""
    ids.speech_started(int(start_s * RATE), continues=False)
    ids.speech_ended(SpeechEnd(int(start_s * RATE), int(end_s * RATE), reason))  # type: ignore[arg-type]


def test_ids_count_up_across_spoken_and_typed_turns():
    ids = ids_with(Clock())
    assert ids.speech_id == 0 and ids.span is None
    assert ids.speech_started(1600, continues=False) == 1
    assert ids.new() == 2  # a typed turn
    assert ids.speech_started(48000, continues=False) == 3
    assert ids.speech_id == 3 and ids.span == (48000, 48000)


def test_continued_speech_keeps_the_turns_id_and_span_start():
    clock = Clock()
    ids = ids_with(clock)
    ended(ids, clock, 1.0, 2.0)
    clock.t += 0.5
    start = int(2.5 * RATE)
    assert ids.continues(start)
    assert ids.speech_started(start, continues=True) == 1
    ids.speech_ended(SpeechEnd(start, int(3.0 * RATE), "silence"))
    assert ids.span == (int(1.0 * RATE), int(3.0 * RATE)) and ids.end_t == clock.t


def test_the_merge_window_holds_in_the_audio_and_on_the_clock():
    clock = Clock()
    ids = ids_with(clock)
    assert not ids.continues(0)  # no turn yet
    ended(ids, clock, 1.0, 2.0)
    assert ids.continues(int(4.0 * RATE))  # 2 s after its end in the audio
    assert not ids.continues(int(4.0 * RATE) + 1)
    clock.t += 0.5 + MERGE_CLOCK_SLACK_S  # late on the client's clock (a loaded client), by the slack
    assert ids.continues(int(2.5 * RATE))
    clock.t += 0.001  # close in the audio, long after on the clock: a client that stopped sending
    assert not ids.continues(int(2.5 * RATE))
    assert ids.gaps(int(2.5 * RATE)) == (0.5, pytest.approx(clock.t - 100.0))


def test_a_turn_the_client_closed_is_never_continued():
    clock = Clock()
    ids = ids_with(clock)
    ended(ids, clock, 1.0, 2.0, reason="input_end")
    assert ids.closed and not ids.continues(int(2.1 * RATE))
    ended(ids, clock, 3.0, 4.0)
    assert not ids.closed and ids.continues(int(4.1 * RATE))
    ids.close()  # input.end after the turn ended
    assert not ids.continues(int(4.1 * RATE))


def test_a_merged_turn_stays_well_under_max_turn_s():
    clock = Clock()
    ids = ids_with(clock, max_turn_s=10.0)
    ended(ids, clock, 0.0, 7.9)
    assert ids.continues(int(7.99 * RATE))  # the merged turn would start 7.99 s back: < 8 s
    ended(ids, clock, 10.0, 18.0)
    assert not ids.continues(int(18.1 * RATE))  # 8.1 s: ≥ 0.8 × max_turn_s


def test_reset_forgets_the_latest_turn_but_not_the_count():
    clock = Clock()
    ids = ids_with(clock)
    ended(ids, clock, 1.0, 2.0)
    ids.reset()
    assert ids.span is None and not ids.continues(int(2.1 * RATE))
    assert ids.speech_started(0, continues=False) == 2


def test_each_turn_keeps_its_registered_id_while_it_lives():
    ids = ids_with(Clock())
    first, second = Turn(), Turn()
    ids.register(first, ids.speech_started(0, continues=False))
    ids.register(second, ids.speech_started(RATE * 10, continues=False))
    assert (ids.of(first), ids.of(second), ids.of(Turn())) == (1, 2, 2)  # unknown: the latest speech turn's
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None  # a finished turn is not kept alive by its id


def test_a_join_remembers_the_earlier_turn_it_continued_along_a_chain():
    ids = ids_with(Clock())
    a, b, c = Turn(), Turn(), Turn()
    for turn in (a, b, c):
        ids.register(turn, ids.new())
    assert [ids.of(t) for t in (a, b, c)] == [1, 2, 3]
    ids.join(a, 2)  # turn 2's speech continued turn 1: turn 1 goes on as 2
    assert (ids.of(a), ids.joined_to(2), ids.joined_to(1)) == (2, 1, None)
    ids.join(a, 3)  # and turn 3's continued that
    assert (ids.of(a), ids.joined_to(3), ids.joined_to(2)) == (3, 2, 1)
    ids.join(c, 3)  # a turn going on under its own id joins nothing
    assert ids.joined_to(3) == 2
