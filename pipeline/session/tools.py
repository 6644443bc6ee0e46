"""The tools one session's replies may call: the server's (``--tools``, ``--builtin-tool``)
and the client's own (declared in ``session.start``, answered with ``tool.result``).

Every call is announced (``tool.call``) and its result reported (``tool.output``) on the
session's wire, so a client shows what the assistant did whichever side ran it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

from pipeline import metrics
from pipeline.session import events as ev
from pipeline.session.types import Outbox
from pipeline.tools.toolbox import Toolbox, ToolResult
from pipeline.tools.types import ToolCall, ToolSpec
from pipeline.tools.validate import schema_error
from pipeline.tools_config import ToolsConfig

PENDING_LIMIT = 16
"""Client calls waiting for their ``tool.result`` at once, at most (older ones fail first)."""


class SessionTools:
    """The server's toolbox and the client's declared tools for one session.

    Args:
        toolbox: the server's tools (None or empty: none).
        cfg: the time limit of a call (``timeout_s``; a client's call gets the same).

    Attributes:
        client: the client's declared tools.
        choice: how a reply's first model request chooses tools
            (:attr:`~pipeline.llm.types.GenRequest.tool_choice`): ``auto`` (default),
            ``none`` (no tool offered), ``required`` or a tool's name (that call is forced;
            the reply's later rounds choose freely). Set by ``/v1/realtime``'s
            ``session.update``; ``/ws`` leaves it ``auto``.
        client_filler: whether a client's call may get the reply's filler ("One moment.",
            ``--tool-filler-ms``): True on ``/ws``; ``/v1/realtime`` sets it False, since
            there the reply waits for ``response.create`` and a filler would come after the
            result.
    """

    def __init__(self, toolbox: Toolbox | None, cfg: ToolsConfig) -> None:
        self.toolbox, self.cfg = toolbox, cfg
        self.client: tuple[ToolSpec, ...] = ()
        self.choice = "auto"
        self.client_filler = True
        self._pending: dict[str, asyncio.Future[str]] = {}

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        """Every tool offered to the model: the server's, then the client's (none when
        :attr:`choice` is ``none``)."""
        if self.choice == "none":
            return ()
        server = self.toolbox.specs if self.toolbox else ()
        return server + self.client

    def declare(self, tools: Sequence[ev.ClientTool]) -> None:
        """The client's tools from ``session.start`` (replacing any it declared before).

        Raises:
            ValueError: a tool whose ``parameters`` is not a valid JSON Schema of an object,
                two tools with one name, or a name the server's own tools use.
        """
        server = {s.name for s in self.toolbox.specs} if self.toolbox else set()
        specs: list[ToolSpec] = []
        for tool in tools:
            if tool.name in server or any(s.name == tool.name for s in specs):
                raise ValueError(f"tools: the name {tool.name!r} is taken")
            problem = schema_error(tool.parameters)
            if problem is not None:
                raise ValueError(f"tools: {tool.name}'s parameters is not a JSON Schema ({problem})")
            specs.append(ToolSpec(tool.name, tool.description, tool.parameters))
        self.client = tuple(specs)

    async def run(self, call: ToolCall, *, rid: int, out: Outbox) -> ToolResult:
        """Run ``call`` where its tool lives, announcing it and its result on ``out``.
        Never raises but for cancellation (a client's pending call is dropped then)."""
        on_client = any(s.name == call.name for s in self.client)
        await out.send(ev.ToolCallEvent(response_id=rid, call_id=call.id, name=call.name, arguments=call.arguments,
                                        runs_on="client" if on_client else "server"))
        if on_client:
            result = await self._client_call(call)
        elif self.toolbox is not None:
            result = await self.toolbox.run(call)
        else:  # the call was checked against the offered specs: cannot happen
            result = ToolResult(call, json.dumps({"error": "no such tool"}), "no such tool", 0.0)
        metrics.TOOL_CALLS.labels("client" if on_client else "server", "ok" if result.error is None else "error").inc()
        metrics.TOOL_SECONDS.observe(result.ms / 1000)
        await out.send(ev.ToolOutput(response_id=rid, call_id=call.id, name=call.name, output=result.output,
                                     error=result.error, ms=round(result.ms, 1)))
        return result

    async def _client_call(self, call: ToolCall) -> ToolResult:
        t0 = time.perf_counter()
        while len(self._pending) >= PENDING_LIMIT:
            oldest = next(iter(self._pending))
            self._pending.pop(oldest).cancel()
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pending[call.id] = future
        error: str | None = None
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                output = await future
        except TimeoutError:
            error = f"the client did not answer {call.name} within {self.cfg.timeout_s:g} s"
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # this reply was cancelled (a barge-in)
                raise
            error = f"{call.name} was dropped: too many calls waited for the client"
        finally:
            self._pending.pop(call.id, None)
        if error is not None:
            output = json.dumps({"error": error})
        return ToolResult(call, output, error, (time.perf_counter() - t0) * 1000)

    def filler_for(self, call: ToolCall) -> bool:
        """Whether ``call`` may get a filler while it runs (see :attr:`client_filler`)."""
        return self.client_filler or not any(s.name == call.name for s in self.client)

    def waiting(self, call_id: str) -> bool:
        """Whether a client call ``call_id`` waits for its result."""
        future = self._pending.get(call_id)
        return future is not None and not future.done()

    def result(self, call_id: str, output: str) -> bool:
        """The client's ``tool.result``: True if a call was waiting for it."""
        future = self._pending.pop(call_id, None)
        if future is None or future.done():
            return False
        future.set_result(output)
        return True

    def close(self) -> None:
        """Drop the calls waiting for the client."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
