"""Protocol edges a newcomer found: blank ``text.input``, ``type`` required in the schema,
jittered ``busy`` retries, turn ids on per-turn events, and first-audio metrics of
cancelled replies. No models, no server; the session runs on the fakes of tests/fakes.py."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from pipeline import metrics
from pipeline.config import TurnConfig, VoxpipeConfig
from pipeline.errors import Busy
from pipeline.serving.admission import Admission
from pipeline.session import events as ev
from pipeline.session.replies import BUSY_JITTER, jittered_retry_ms, send_busy
from server.protocol import ProtocolError, json_schema, parse_client_event
from tests.fakes import FakeAsr, FakeLlm, LlmReply, fake_engines, noise, silence, tone
from tests.session_harness import (
    Audio,
    Cancel,
    Harness,
    InputEnd,
    RecordingOutbox,
    Start,
    Text,
    WaitFor,
    WaitUntil,
    run_session,
)
from tests.test_protocol_docs import SAMPLES


def of(seen, kind) -> list:
    return [e for e in seen if isinstance(e, kind)]


def cfg(**turn) -> VoxpipeConfig:
    c = VoxpipeConfig()
    c.turn = TurnConfig(**turn)
    return c


# ---- 1. blank text.input ------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", " ", "   \n", "\t\r\n", "\u3000\u00a0"])
def test_blank_text_input_is_a_bad_event_at_the_edge(text):
    with pytest.raises(ProtocolError) as exc:
        parse_client_event(json.dumps({"type": "text.input", "text": text}))
    assert exc.value.code == "bad_event" and "text" in str(exc.value)


def test_text_with_words_keeps_its_whitespace():
    event = parse_client_event(json.dumps({"type": "text.input", "text": "  hi\n"}))
    assert isinstance(event, ev.TextInput) and event.text == "  hi\n"


@pytest.mark.parametrize("text", ["   \n", "\t"])
def test_schema_rejects_blank_text_input(text):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"type": "text.input", "text": text},
                            {**json_schema(), "oneOf": [{"$ref": "#/$defs/ClientEvent"}]})


async def test_blank_text_input_gets_bad_event_and_starts_no_turn():
    llm = FakeLlm(default=LlmReply.of("Should not be asked."))
    seen = await run_session([Start(), Text("   \n"), Text(""), Audio(silence(300)), InputEnd(),
                              WaitFor(ev.TurnEmpty)], engines=fake_engines(llm=llm))
    assert [e.code for e in of(seen, ev.Error)] == ["bad_event", "bad_event"]
    assert llm.requests == [] and not of(seen, ev.ResponseStarted) and not of(seen, ev.Busy)
    assert [e.turn_id for e in of(seen, ev.TurnEmpty)] == [1]  # the blanks used no turn id


# ---- 2. type is required on every event in the schema -------------------------------------


def test_every_event_in_the_schema_requires_type():
    schema = json_schema()
    for union in ("ClientEvent", "ServerEvent"):
        for ref in schema["$defs"][union]["discriminator"]["mapping"].values():
            name = ref.rsplit("/", 1)[1]
            assert "type" in schema["$defs"][name]["required"], f"{name}: type not required"


CLIENT_FRAMES = [{"type": "session.start", "sample_rate": 48000}, {"type": "input.end"},
                 {"type": "text.input", "text": "hello"}, {"type": "response.cancel"}, {"type": "session.end"}]


@pytest.mark.parametrize("frame", [json.loads(e.model_dump_json()) for e in SAMPLES] + CLIENT_FRAMES,
                         ids=lambda f: f["type"])
def test_an_event_without_type_fails_validation(frame):
    jsonschema.validate(frame, json_schema())  # as sent: valid
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({k: v for k, v in frame.items() if k != "type"}, json_schema())


# ---- 3. busy retries are jittered ----------------------------------------------------------


async def test_busy_events_from_one_refusal_value_are_spread_and_never_below_it():
    out = RecordingOutbox()
    base = 1000
    for _ in range(100):
        await send_busy(out, Busy("a burst", reason="queue", retry_after_ms=base), turn_id=1)
    values = [e.retry_after_ms for e in out.events(ev.Busy)]
    assert len(values) == 100 and all(isinstance(v, int) for v in values)
    assert len(set(values)) > 10, values  # not lockstep
    assert min(values) >= base and max(values) <= round(base * (1 + BUSY_JITTER))


@pytest.mark.parametrize("base", [0, 1, 7, 1300])
def test_jitter_is_whole_ms_and_never_below_the_policy(base):
    values = {jittered_retry_ms(base) for _ in range(200)}
    assert all(base <= v <= round(base * (1 + BUSY_JITTER)) for v in values)


# ---- 4. turn ids ----------------------------------------------------------------------------

PER_TURN = (ev.SpeechStarted, ev.SpeechStopped, ev.TranscriptPartial, ev.TranscriptFinal, ev.TurnEmpty, ev.Busy)


def test_every_per_turn_event_requires_a_turn_id():
    schema = json_schema()["$defs"]
    for cls in PER_TURN:
        assert "turn_id" in cls.model_fields and cls.model_fields["turn_id"].is_required()
        assert "turn_id" in schema[cls.__name__]["required"]


class GatedAsr(FakeAsr):
    """Final decodes wait until :attr:`release` is set (partials run freely)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def run(self, item):
        if getattr(item, "final", False):
            await self.release.wait()
        return await super().run(item)


async def test_interleaved_turns_are_told_apart_by_turn_id():
    """Audio faster than real time: turn 2 starts (and ends) before turn 1's final
    transcript is out; every event names its turn."""
    asr = GatedAsr()
    h = Harness(engines=fake_engines(asr=asr, llm=FakeLlm(default=LlmReply.of("Sure."))),
                cfg=cfg(early_end_ms=0))
    try:
        # turn 1: words; then past the merge window (2 s), turn 2: a wordless burst
        await h.play([Start(), Audio(tone(1000)), Audio(silence(2600)), Audio(noise(900)), Audio(silence(700)),
                      WaitFor(ev.SpeechStopped, count=2)])
        asr.release.set()
        await h.play([WaitFor(ev.TurnEmpty), WaitFor(ev.ResponseDone)])
        seen = h.out.seen
    finally:
        await h.close()
    assert [e.turn_id for e in of(seen, ev.SpeechStarted)] == [1, 2]
    assert [e.turn_id for e in of(seen, ev.SpeechStopped)] == [1, 2]
    assert {e.turn_id for e in of(seen, ev.TranscriptPartial)} <= {1}
    final, empty = of(seen, ev.TranscriptFinal), of(seen, ev.TurnEmpty)
    assert [(f.turn_id, f.text.split()[0]) for f in final] == [(1, "alpha")]
    assert [(e.turn_id, e.reason) for e in empty] == [(2, "no_words")]
    # the interleaving the ids are for: turn 1's final came after turn 2 began
    assert seen.index(final[0]) > seen.index(of(seen, ev.SpeechStarted)[1])


async def test_a_continued_turn_keeps_its_id():
    llm = FakeLlm([LlmReply.of("First half reply.", delay_s=30.0), LlmReply.of("Whole reply.")])
    seen = await run_session([Start(), Audio(tone(800)), Audio(silence(600)), WaitFor(ev.ResponseStarted),
                              Audio(tone(800)), Audio(silence(600)), WaitFor(ev.ResponseDone),
                              Audio(silence(2500), pace=1.0), Audio(tone(800)), Audio(silence(600)),
                              WaitFor(ev.ResponseDone, count=2)],
                             engines=fake_engines(llm=llm), cfg=cfg(early_end_ms=0))
    # (the pause in real time: the client has played the whole reply by then, by the wall clock)
    assert [c.reason for c in of(seen, ev.ResponseCancelled)] == ["continued"]
    assert [e.turn_id for e in of(seen, ev.SpeechStarted)] == [1, 1, 2]
    assert [e.turn_id for e in of(seen, ev.SpeechStopped)] == [1, 1, 2]
    assert [e.turn_id for e in of(seen, ev.TranscriptFinal)] == [1, 1, 2]


async def test_typed_turns_and_bare_input_end_get_their_own_ids():
    llm = FakeLlm([Busy("llm is busy"), LlmReply.of("Typed answer.")])
    seen = await run_session([Start(), Text("first"), WaitFor(ev.Busy),
                              Audio(silence(300)), InputEnd(), WaitFor(ev.TurnEmpty),
                              Text("second"), WaitFor(ev.ResponseDone),
                              Audio(tone(800)), Audio(silence(600)), WaitFor(ev.ResponseDone, count=2)],
                             engines=fake_engines(llm=llm), cfg=cfg(early_end_ms=0))
    assert [(b.turn_id, b.reason) for b in of(seen, ev.Busy)] == [(1, "stage")]
    assert [(e.turn_id, e.reason) for e in of(seen, ev.TurnEmpty)] == [(2, "no_speech")]
    assert [e.turn_id for e in of(seen, ev.SpeechStarted)] == [4]  # "second" was turn 3
    assert [e.turn_id for e in of(seen, ev.TranscriptFinal)] == [4]


async def test_a_refused_spoken_turn_names_itself_in_busy():
    llm = FakeLlm(default=LlmReply.of("Sure."))
    llm.active, llm.slots, llm.depth = 8, 8, 16  # batch full, a queue behind it: admission refuses
    c = cfg(early_end_ms=200)
    h = Harness(engines=fake_engines(llm=llm), cfg=c, admission=Admission(c.admission))
    try:
        seen = await h.play([Start(), Audio(tone(1500)), Audio(silence(1000)), WaitFor(ev.Busy)])
    finally:
        await h.close()
    assert [b.turn_id for b in of(seen, ev.Busy)] == [1]
    assert [e.turn_id for e in of(seen, ev.SpeechStopped)] == [1]


async def test_a_restart_ends_the_turn_in_progress_under_its_id():
    h = Harness(engines=fake_engines(llm=FakeLlm(default=LlmReply.of("Sure."))), cfg=cfg(early_end_ms=0))
    try:
        await h.play([Start(), Audio(tone(800)), WaitFor(ev.SpeechStarted), Start(),
                      Audio(tone(800)), Audio(silence(600)), WaitFor(ev.ResponseDone)])
        seen = h.out.seen
    finally:
        await h.close()
    assert [(e.turn_id, e.reason) for e in of(seen, ev.SpeechStopped)] == [(1, "restart"), (2, "silence")]
    assert [(e.turn_id, e.reason) for e in of(seen, ev.TurnEmpty)] == [(1, "restart")]
    assert [e.turn_id for e in of(seen, ev.SpeechStarted)] == [1, 2]
    assert [e.turn_id for e in of(seen, ev.TranscriptFinal)] == [2]


# ---- 5. first-audio metrics of cancelled replies ---------------------------------------------


class StuckAudioOutbox(RecordingOutbox):
    """A client that stops reading: the first audio frame never goes out."""

    def __init__(self) -> None:
        super().__init__()
        self.audio_waiting = asyncio.Event()

    async def audio(self, response_id: int, pcm16: bytes) -> None:
        self.audio_waiting.set()
        await asyncio.Event().wait()


def _count(name: str) -> float:
    return metrics.REGISTRY.get_sample_value(f"{name}_count") or 0.0


async def test_a_reply_cancelled_before_its_first_audio_went_out_is_not_counted():
    out = StuckAudioOutbox()
    h = Harness(engines=fake_engines(llm=FakeLlm(default=LlmReply.of("Hello there."))), out=out)
    before = (_count("voxpipe_first_audio_seconds"), _count("voxpipe_voice_to_voice_seconds"))
    try:
        await h.play([Start(), Text("hi"), WaitUntil(out.audio_waiting.is_set, "the first audio frame"),
                      Cancel(), WaitFor(ev.ResponseCancelled)])
    finally:
        await h.close()
    assert (_count("voxpipe_first_audio_seconds"), _count("voxpipe_voice_to_voice_seconds")) == before
