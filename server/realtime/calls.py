"""Client function calls on ``/v1/realtime``: voxpipe's one reply waiting for a client tool
→ OpenAI's response that ends with a ``function_call`` item, then a new response.

In the Realtime API a response that calls a function ends (``response.done``, its
``output`` holding the ``function_call`` item); the client adds a ``function_call_output``
item and sends ``response.create``, and the model answers in a new response. voxpipe's
session instead keeps one reply going: it waits for the client's result
(:meth:`~pipeline.session.tools.SessionTools.result`) and asks the model again.

The mapping (docs/REALTIME.md, "Function calling"): on a ``tool.call`` with ``runs_on:
"client"`` the Realtime response ends with the call, and the reply is *parked*: what the
session sends for it from then on (text, audio, more calls, its end) is held. The next
``response.create`` (:func:`resume`) opens a new Realtime response for the same reply and
replays what was held, then the reply streams on as usual. A client call that ends in an
error (the client never answered: ``--tool-timeout-s``) gets an ``error`` event and, if the
reply is parked, opens the next response at once, so the model's answer to the error is
still heard. Server-side tools are the server's own: their calls are not shown and their
results just feed the reply.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from pipeline.session import events as ev

from .state import OutboxState, ReplyState
from .types import Settings, new_id


class CallsOutbox(Protocol):
    """What this module uses of :class:`server.realtime.outbox.RealtimeOutbox`."""

    st: OutboxState
    settings: Settings

    async def send(self, event: ev.ServerEvent) -> None: ...
    async def audio(self, response_id: int, pcm16: bytes) -> None: ...
    async def emit(self, kind: str, **fields: Any) -> None: ...
    async def error(self, code: str, message: str, *, kind: str = ..., param: str | None = None,
                    event_id: str | None = None, **extra: Any) -> None: ...
    async def item_added(self, item: dict[str, Any]) -> None: ...
    async def close_message(self, r: ReplyState, text: str, status: str) -> dict[str, Any]: ...
    def response(self, r: ReplyState, status: str, details: dict | None = None, output: list | None = None,
                 usage: dict[str, int] | None = None) -> dict[str, Any]: ...


HELD_TYPES = frozenset({"response.text.delta", "response.done", "tool.call", "tool.output"})
"""Session events of a parked reply that wait for its next Realtime response (audio too;
``response.cancelled`` drops the parked reply instead)."""


def hold(out: CallsOutbox, event: ev.ServerEvent) -> bool:
    """Whether ``event`` belongs to a parked reply and was held (the caller then drops it).
    A ``tool.output`` of a call already shown to the client is never held: it may be what
    un-parks the reply (an error: the client never answered)."""
    rid = getattr(event, "response_id", None)
    r = out.st.replies.get(rid) if isinstance(rid, int) else None
    if r is None or r.held is None or event.type not in HELD_TYPES:
        return False
    if isinstance(event, ev.ToolOutput) and event.call_id in out.st.calls:
        return False
    r.held.append(event)
    return True


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, *, status: str) -> dict[str, Any]:
    """A ``function_call`` item: ``arguments`` is the JSON text of the arguments object."""
    return {"id": item_id, "object": "realtime.item", "type": "function_call", "status": status, "name": name,
            "call_id": call_id, "arguments": arguments}


def function_call_output_item(item_id: str, call_id: str, output: str) -> dict[str, Any]:
    """A ``function_call_output`` item (the client's result of call ``call_id``)."""
    return {"id": item_id, "object": "realtime.item", "type": "function_call_output", "status": "completed",
            "call_id": call_id, "output": output}


async def on_tool_call(out: CallsOutbox, e: ev.ToolCallEvent) -> None:
    """A client call ends the reply's Realtime response: its message so far (if any), the
    ``function_call`` item (``response.output_item.added``, ``conversation.item.added``,
    ``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``,
    ``conversation.item.done`` in GA), ``response.done`` ``completed``; the reply is parked.
    A server call shows nothing."""
    r = out.st.replies.get(e.response_id)
    if r is None or e.runs_on != "client":
        return
    if r.item_id is not None:
        r.output.append(await out.close_message(r, r.text, "completed"))
    item_id, index = new_id("item"), len(r.output)
    arguments = json.dumps(e.arguments, ensure_ascii=False)
    ids = {"response_id": r.id, "item_id": item_id, "output_index": index, "call_id": e.call_id}
    item = function_call_item(item_id, e.call_id, e.name, "", status="in_progress")
    await out.emit("response.output_item.added", response_id=r.id, output_index=index, item=item)
    await out.item_added(item)
    await out.emit("response.function_call_arguments.delta", **ids, delta=arguments)
    await out.emit("response.function_call_arguments.done", **ids, name=e.name, arguments=arguments)
    item = function_call_item(item_id, e.call_id, e.name, arguments, status="completed")
    await out.emit("response.output_item.done", response_id=r.id, output_index=index, item=item)
    if out.settings.dialect == "ga":
        await out.emit("conversation.item.done", item=item)
    r.output.append(item)
    await out.emit("response.done", response=out.response(r, "completed", None, r.output))
    out.st.calls.add(e.call_id)
    _park(r)


async def on_tool_output(out: CallsOutbox, e: ev.ToolOutput) -> None:
    """A client call's result reached the model: nothing to show, unless it failed (the
    client did not answer in time, or too many calls waited): an ``error`` event (code
    ``function_call_timeout``, ``param: call_id``) and, if the reply is parked, its next
    response opens now."""
    if e.call_id not in out.st.calls:
        return  # a server tool's result: it just feeds the reply
    out.st.calls.discard(e.call_id)
    if e.error is None:
        return
    await out.error("function_call_timeout", f"function call {e.call_id} ({e.name}) got no output: {e.error}; "
                    "the model was told so", param="call_id")
    r = out.st.replies.get(e.response_id)
    if r is not None and r.held is not None:
        await _open(out, e.response_id)


def waiting(out: CallsOutbox, call_id: str) -> bool:
    """Whether ``call_id`` is a client call shown to the client and not yet answered."""
    return call_id in out.st.calls


async def resume(out: CallsOutbox) -> bool:
    """``response.create`` for a parked reply: a new Realtime response (``response.created``)
    carries on with what was held. False (nothing sent) when no reply is parked."""
    for rid, r in out.st.replies.items():
        if r.held is not None:
            await _open(out, rid)
            return True
    return False


def _park(r: ReplyState) -> None:
    r.before += r.text
    r.text, r.item_id, r.audio_bytes, r.output, r.held = "", None, 0, [], []


async def _open(out: CallsOutbox, rid: int) -> None:
    """Open reply ``rid``'s next Realtime response and replay what was held (a call among
    it parks the reply again, and the rest is held anew)."""
    r = out.st.replies[rid]
    held, r.held = r.held or [], None
    r.id = new_id("resp")
    await out.emit("response.created", response=out.response(r, "in_progress"))
    for thing in held:
        if isinstance(thing, bytes):
            await out.audio(rid, thing)
        else:
            await out.send(thing)
