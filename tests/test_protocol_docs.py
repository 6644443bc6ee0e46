"""The protocol's three descriptions agree: the event classes (pipeline/session/events.py),
docs/PROTOCOL.md and docs/protocol.schema.json — every event type and field in one is in
the others. No server, no model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import get_args

import jsonschema
import pytest

from pipeline.errors import BusyReason
from pipeline.session import events as ev
from server.protocol import encode_event, json_schema

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "PROTOCOL.md").read_text(encoding="utf-8")
SCHEMA_FILE = ROOT / "docs" / "protocol.schema.json"


def _section(title: str) -> str:
    """The text of the ``## title`` section of PROTOCOL.md."""
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start : end if end >= 0 else None]


def _documented_client_types() -> set[str]:
    return set(re.findall(r"^### `([a-z_.]+)`", _section("Client → server"), flags=re.M))


def _server_rows() -> dict[str, str]:
    """``type`` → its row in the server event table."""
    table = _section("Server → client").split("| event | fields | when |", 1)[1].split("\n\n", 1)[0]
    return dict(re.findall(r"^\| `([a-z_.]+)` \|(.*)$", table, flags=re.M))


def _fields(cls) -> list[str]:
    return [name for name in cls.model_fields if name != "type"]


def test_every_client_event_is_documented_and_every_documented_one_exists():
    code = {ev.event_type(cls) for cls in ev.CLIENT_EVENTS}
    assert code == _documented_client_types()


def test_every_server_event_is_documented_with_its_fields_and_the_reverse():
    rows = _server_rows()
    assert {ev.event_type(cls) for cls in ev.SERVER_EVENTS} == set(rows)
    for cls in ev.SERVER_EVENTS:
        row = rows[ev.event_type(cls)]
        missing = [f for f in _fields(cls) if f"`{f}`" not in row]
        assert not missing, f"{ev.event_type(cls)}: fields {missing} not in PROTOCOL.md's table"


def test_session_start_fields_are_documented():
    section = _section("Client → server")
    for field in _fields(ev.SessionStart):
        assert f"| `{field}` |" in section


def test_error_codes_match_the_documented_table():
    table = _section("Server → client").split("### Error codes", 1)[1]
    documented = set(re.findall(r"`([a-z_]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()
                                                            if line.startswith("| `"))))
    assert documented == set(get_args(ev.ErrorCode))


def test_committed_schema_is_generated_from_the_classes():
    committed = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    assert committed == json_schema(), "docs/protocol.schema.json is stale: python -m server.protocol > it"


def test_schema_names_every_event_type_in_both_directions():
    schema = json_schema()
    client = schema["$defs"]["ClientEvent"]["discriminator"]["mapping"]
    server = schema["$defs"]["ServerEvent"]["discriminator"]["mapping"]
    assert set(client) == {ev.event_type(c) for c in ev.CLIENT_EVENTS}
    assert set(server) == {ev.event_type(c) for c in ev.SERVER_EVENTS}


SAMPLES: list[ev.ServerEvent] = [
    ev.SessionStarted(session_id="abc", input=ev.AudioFormat(sample_rate=48000, format="f32", channels=2),
                      output=ev.AudioFormat(sample_rate=24000, format="pcm16", channels=1)),
    ev.SpeechStarted(turn_id=1, audio_ms=320),
    ev.SpeechStopped(turn_id=1, audio_ms=2790, reason="silence"),
    ev.TranscriptPartial(turn_id=1, committed="Go", unstable="forward", text="Go forward", language="en"),
    ev.TranscriptFinal(turn_id=1, text="Go forward ten meters.", language="en", audio_ms=2870),
    ev.TurnEmpty(turn_id=2, reason="no_words"),
    ev.ResponseStarted(response_id=1, user_text="Hi"),
    ev.ResponseTextDelta(response_id=1, delta="Sure"),
    ev.ResponseDone(response_id=1, text="Sure.", fallback=False, finish_reason="stop", output_tokens=3,
                    audio_s=0.5, timings_ms={"llm_ttft": 120.5}),
    ev.ResponseCancelled(response_id=1, spoken_text="", reason="barge_in"),
    ev.ResponsePaused(response_id=1, reason="speech"),
    ev.ResponseResumed(response_id=1, paused_ms=780),
    ev.ToolCallEvent(response_id=2, call_id="call_1f", name="set_timer", arguments={"minutes": 5}, runs_on="server"),
    ev.ToolOutput(response_id=2, call_id="call_1f", name="set_timer", output='{"status": "set"}', ms=0.4),
    ev.TurnEmpty(turn_id=5, reason="backchannel"),
    ev.Busy(turn_id=3, reason="queue", retry_after_ms=1200, message="a reply now would take ~3200 ms, over the SLO"),
    ev.Busy(turn_id=4, reason="ladder", retry_after_ms=3000, message="llm ran out of memory twice"),
    ev.ResponseDone(response_id=2, text="Sure.", fallback=False, text_only=True, finish_reason="stop",
                    output_tokens=3, audio_s=0.0, timings_ms={}),
    ev.ServerStatus(degraded=True, conditions=[
        ev.Condition(source="ladder", stage="llm", level="2", effect="new turns are refused for a moment"),
        ev.Condition(source="breaker", stage="tts", level="open", effect="replies are text only"),
        ev.Condition(source="slo", stage=None, level="1", effect="shorter replies")]),
    ev.ServerStatus(degraded=False, conditions=[]),
    ev.Error(code="bad_json", message="text frame is not JSON", fatal=False),
]


def test_samples_cover_every_server_event():
    assert {type(s) for s in SAMPLES} == set(ev.SERVER_EVENTS)


def test_every_busy_reason_is_documented():
    row = _server_rows()["busy"]
    assert set(re.findall(r"`([a-z_]+)`", row.split("`reason`", 1)[1].split(")", 1)[0])) == set(get_args(BusyReason))


def test_degraded_service_is_documented_with_an_example_that_validates():
    section = _section("Degraded service")
    for word in ("ladder", "breaker", "slo", "text_only", "half_open", "fallback"):
        assert f"`{word}" in section, word  # in code: `text_only: true` counts
    example = json.loads(re.search(r'^← (\{"type":"server\.status".*\})$', section, flags=re.M).group(1))
    assert ev.ServerStatus.model_validate(example).degraded
    jsonschema.validate(example, {**json_schema(), "oneOf": [{"$ref": "#/$defs/ServerEvent"}]})


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.type)
def test_server_events_on_the_wire_validate_against_the_schema(event):
    frame = json.loads(encode_event(event))
    assert frame["type"] == event.type and list(frame)[0] == "type"
    jsonschema.validate(frame, {**json_schema(), "oneOf": [{"$ref": "#/$defs/ServerEvent"}]})


@pytest.mark.parametrize("frame", [
    {"type": "session.start", "sample_rate": 48000, "format": "f32", "channels": 1},
    {"type": "input.end"}, {"type": "text.input", "text": "hello"}, {"type": "response.cancel"},
    {"type": "session.end"},
])
def test_client_examples_validate_against_the_schema(frame):
    jsonschema.validate(frame, {**json_schema(), "oneOf": [{"$ref": "#/$defs/ClientEvent"}]})


@pytest.mark.parametrize("frame", [
    {"type": "session.start", "sample_rate": 4000}, {"type": "text.input", "text": ""}, {"type": "nope"},
    {"type": "session.start", "format": "mp3"},
])
def test_schema_rejects_what_the_server_rejects(frame):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(frame, {**json_schema(), "oneOf": [{"$ref": "#/$defs/ClientEvent"}]})
