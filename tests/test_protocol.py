"""Client event validation at the edge (no server)."""

from __future__ import annotations

import json

import pytest

from server.protocol import ProtocolError, parse_client_event


@pytest.mark.parametrize("field, value", [("channels", True), ("channels", 2.0), ("sample_rate", True),
                                          ("sample_rate", 16000.0), ("vad", 1), ("output_sample_rate", "24000")])
def test_strict_types_reject_look_alikes(field, value):
    with pytest.raises(ProtocolError) as exc:
        parse_client_event(json.dumps({"type": "session.start", field: value}))
    assert exc.value.code == "bad_event" and field in str(exc.value)


def test_valid_start_keeps_its_values():
    ev = parse_client_event(json.dumps({"type": "session.start", "channels": 2, "sample_rate": 44100}))
    assert (ev.channels, ev.sample_rate, ev.format, ev.vad) == (2, 44100, "pcm16", True)


def test_unknown_type_error_does_not_echo_a_huge_value():
    with pytest.raises(ProtocolError) as exc:
        parse_client_event(json.dumps({"type": "x" * 1_000_000}))
    assert exc.value.code == "unknown_type" and len(str(exc.value)) < 300


def test_a_number_over_pythons_digit_limit_is_bad_json_not_a_crash():
    """json.loads raises ValueError (not JSONDecodeError) for an int over 4300 digits: it is a
    protocol error of that frame (it killed the session with ``internal``)."""
    from server.protocol import ProtocolError, parse_client_event

    with pytest.raises(ProtocolError) as err:
        parse_client_event('{"type": "response.cancel", "x": ' + "1" * 5000 + "}")
    assert err.value.code == "bad_json"


@pytest.mark.parametrize("frame, kind", [("null", "null"), ("[1, 2]", "an array"), ("3.5", "a number"),
                                         ('"hi"', "a string"), ("true", "a boolean")])
def test_a_frame_that_is_not_an_object_is_named_in_json_terms(frame, kind):
    """The client wrote JSON: the error names what it sent as JSON does (no Python type
    such as NoneType), in both protocols."""
    from server.realtime.types import RealtimeError
    from server.realtime.wire import parse_event

    with pytest.raises(ProtocolError) as exc:
        parse_client_event(frame)
    assert exc.value.code == "bad_json" and str(exc.value).endswith(f"got {kind}"), exc.value
    with pytest.raises(RealtimeError) as rt:
        parse_event(frame)
    assert str(rt.value).endswith(f"got {kind}"), rt.value


def test_a_validators_message_reaches_the_client_without_pydantics_prefix():
    with pytest.raises(ProtocolError) as err:
        parse_client_event(json.dumps({"type": "text.input", "text": "   "}))
    assert err.value.code == "bad_event"
    assert str(err.value).endswith("text: text is blank (only whitespace)"), str(err.value)
    assert "Value error" not in str(err.value)
