"""Wire protocol v1 at the edge: text frames ↔ typed events.

The event classes of both directions live in :mod:`pipeline.session.events`.
:func:`parse_client_event` turns any text frame into a client event or a
:class:`ProtocolError` with an error ``code``; :func:`encode_event` serializes a server
event. Binary server frames carry reply audio: their codec is :mod:`audio.frames`, shared
with the clients. The full reference is docs/PROTOCOL.md; docs/protocol.schema.json is
generated from the classes.
"""

from __future__ import annotations

import json

from pydantic import TypeAdapter, ValidationError

from pipeline.session.events import CLIENT_EVENTS, PROTOCOL_VERSION, ClientEvent, ErrorCode, ServerEvent, event_type

_ADAPTER: TypeAdapter = TypeAdapter(ClientEvent)
CLIENT_TYPES = tuple(event_type(cls) for cls in CLIENT_EVENTS)


class ProtocolError(ValueError):
    """A client frame that is not a valid event; ``code`` goes into the error event."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def json_kind(value: object) -> str:
    """What JSON value ``value`` (from :func:`json.loads`) is, in JSON's own words: "an
    array", "null"... (an error message for a client names no Python type)."""
    return _JSON_TYPES.get(type(value), "a value")


def parse_client_event(text: str) -> ClientEvent:
    """Parse one text frame into a client event.

    Raises:
        ProtocolError: ``bad_json`` (not JSON, or not an object), ``unknown_type``
            (missing or unknown ``type``), ``bad_event`` (fields missing or wrong type).
    """
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: bad JSON, or an int over Python's 4300 digits
        raise ProtocolError("bad_json", f"text frame is not JSON we accept: {str(exc)[:200]}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("bad_json", f"event must be a JSON object, got {json_kind(raw)}")
    kind = raw.get("type")
    if kind not in CLIENT_TYPES:
        shown = repr(kind) if len(repr(kind)) <= 64 else repr(kind)[:60] + "...'"
        raise ProtocolError("unknown_type", f"unknown event type {shown}; expected one of {list(CLIENT_TYPES)}")
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:])) or 'event'}: {_message(e)}" for e in exc.errors())
        raise ProtocolError("bad_event", f"invalid {kind}: {problems}") from None


def _message(error) -> str:
    """A validation error's message as the client reads it: a validator's own sentence without
    pydantic's "Value error, " prefix."""
    msg = str(error["msg"])
    return msg.removeprefix("Value error, ") if error.get("type") == "value_error" else msg


def encode_event(event: ServerEvent) -> str:
    """Serialize a server → client event as one JSON text frame (UTF-8, ``type`` first)."""
    return event.model_dump_json()


def json_schema() -> dict:
    """The protocol's JSON Schema (draft 2020-12), both directions, generated from the event
    classes: ``$defs/ClientEvent`` (what a client may send, as validated) and
    ``$defs/ServerEvent`` (what the server sends). docs/protocol.schema.json is this,
    written by ``python -m server.protocol``."""
    schemas, defs = TypeAdapter.json_schemas(
        [("client", "validation", _ADAPTER), ("server", "serialization", TypeAdapter(ServerEvent))],
        ref_template="#/$defs/{model}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"voxpipe WebSocket protocol, version {PROTOCOL_VERSION}",
        "description": "JSON text frames, one event each; binary frames carry audio (see docs/PROTOCOL.md).",
        "$defs": {**defs["$defs"], "ClientEvent": schemas[("client", "validation")],
                  "ServerEvent": schemas[("server", "serialization")]},
        "oneOf": [{"$ref": "#/$defs/ClientEvent"}, {"$ref": "#/$defs/ServerEvent"}],
    }


if __name__ == "__main__":  # python -m server.protocol > docs/protocol.schema.json
    print(json.dumps(json_schema(), indent=2, ensure_ascii=False))
