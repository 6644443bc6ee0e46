"""Server-side tools: the functions a person running voxpipe plugs in (``--tools
module:object``) and the built-ins they turn on (``--builtin-tool``), run with a timeout
off the event loop.

A tool is a Python function (or coroutine function) with type hints and a docstring; its
JSON Schema comes from the hints (:func:`~pipeline.tools.spec.spec_from_callable`). Plain
functions run on daemon threads of their own, 4 at a time, so a tool that hangs holds one of
those, never the server's default executor (which counts tokens and resamples audio for
every session); after ``timeout_s`` its caller gets a timeout error and goes on.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.tools.builtins import BUILTINS
from pipeline.tools.spec import spec_from_callable
from pipeline.tools.types import ToolCall, ToolSpec

logger = logging.getLogger(__name__)

TOOL_THREADS = 4
"""Threads running plain-function tools at once (more calls wait for one)."""
MAX_RESULT_CHARS = 1500
"""A result longer than this (as JSON) is cut: it goes into the model's prompt."""


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What running a call gave.

    Attributes:
        call: the call run.
        output: the tool's return value as JSON text (the ``role: tool`` message's content),
            or an ``{"error": ...}`` object's JSON when it failed.
        error: what went wrong (it raised, timed out, returned what JSON cannot hold), or None.
        ms: how long it ran (ms).
    """

    call: ToolCall
    output: str
    error: str | None
    ms: float


class Toolbox:
    """The server's tools, by name.

    Args:
        functions: the tools (each a function with type hints and a docstring).
        timeout_s: the longest a call may run (s).

    Raises:
        ValueError: a function that cannot be a tool (:func:`spec_from_callable`), or two
            with the same name.
    """

    def __init__(self, functions: Iterable[Callable[..., Any]], *, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._fns: dict[str, Callable[..., Any]] = {}
        specs: list[ToolSpec] = []
        for fn in functions:
            spec = spec_from_callable(fn)
            if spec.name in self._fns:
                raise ValueError(f"two tools are named {spec.name!r}")
            self._fns[spec.name] = fn
            specs.append(spec)
        self.specs = tuple(specs)
        self._slots = threading.BoundedSemaphore(TOOL_THREADS)

    def __bool__(self) -> bool:
        return bool(self._fns)

    async def run(self, call: ToolCall) -> ToolResult:
        """Run ``call`` (already checked against its spec); never raises but for cancellation
        (a barge-in cancels a running call: a plain function's thread runs to its end, its
        result dropped)."""
        fn = self._fns.get(call.name)
        t0 = time.perf_counter()
        error: str | None = None
        value: Any = None
        try:
            if fn is None:
                raise LookupError(f"no tool named {call.name!r}")
            kwargs = known_arguments(fn, call.arguments)
            async with asyncio.timeout(self.timeout_s):
                if inspect.iscoroutinefunction(fn):
                    value = await fn(**kwargs)
                else:
                    value = await self._in_thread(fn, kwargs)
        except TimeoutError:
            error = f"{call.name} did not answer within {self.timeout_s:g} s"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a tool's failure is its call's result
            error = f"{call.name} failed: {type(exc).__name__}: {exc}"
        ms = (time.perf_counter() - t0) * 1000
        if error is None:
            try:
                output = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as exc:
                error = f"{call.name} returned what JSON cannot hold ({exc})"
        if error is not None:
            logger.info("tool call %s: %s", call.id, error)
            output = json.dumps({"error": error}, ensure_ascii=False)
        if len(output) > MAX_RESULT_CHARS:
            output = output[:MAX_RESULT_CHARS] + "…"
        return ToolResult(call, output, error, ms)

    def _in_thread(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        """``fn(**kwargs)`` on a daemon thread of its own, at most :data:`TOOL_THREADS` running
        at once (a call that cannot start within ``timeout_s`` fails as timed out). Daemon: a
        tool that never returns must not keep the server from exiting (a thread pool's
        workers are joined at exit: a hung tool held a stopped server up for minutes)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)

        def work() -> None:
            if not self._slots.acquire(timeout=self.timeout_s):
                value: Any = TimeoutError()
                ok = False
            else:
                try:
                    value, ok = fn(**kwargs), True
                except BaseException as exc:  # noqa: BLE001 - even SystemExit is this call's failure only
                    value = exc if isinstance(exc, Exception) else RuntimeError(f"{type(exc).__name__}: {exc}")
                    ok = False
                finally:
                    self._slots.release()
            try:
                loop.call_soon_threadsafe(settle, ok, value)
            except RuntimeError:  # the loop is closed: nobody waits
                pass

        threading.Thread(target=work, name=f"voxpipe-tool-{fn.__name__}", daemon=True).start()
        return future

    def close(self) -> None:
        """Nothing to release: a running call's daemon thread ends with it, or with the process."""

def known_arguments(fn: Callable[..., Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` less the names ``fn`` has no parameter for. A schema from type hints
    allows more properties than the function takes, and a small model adds some (Qwen2.5-Coder
    -0.5B copied ``"type": "object"`` from the schema into a ``calculate`` call): dropped, the
    call still runs."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in arguments.items() if k in params}


def load_tools(plugin: str | None, builtins: Sequence[str] = (), *, timeout_s: float = 5.0) -> Toolbox:
    """The server's toolbox: the built-ins named (:data:`~pipeline.tools.builtins.BUILTINS`)
    and the functions ``plugin`` names.

    Args:
        plugin: ``module:object`` or ``path/to/file.py:object``; the object is a function, or
            a list/tuple of them, or a mapping whose values are functions. None: no plugin.
        builtins: built-in tool names.
        timeout_s: each call's time limit (s).

    Raises:
        ValueError: an unknown built-in, a plugin that cannot be imported or lacks the object,
            an object that holds no functions, or a function that cannot be a tool.
    """
    unknown = sorted(set(builtins) - set(BUILTINS))
    if unknown:
        raise ValueError(f"unknown built-in tool(s) {', '.join(unknown)} (choose from {', '.join(BUILTINS)})")
    fns: list[Callable[..., Any]] = [BUILTINS[name] for name in dict.fromkeys(builtins)]
    if plugin:
        fns += plugin_functions(plugin)
    return Toolbox(fns, timeout_s=timeout_s)


def plugin_functions(plugin: str) -> list[Callable[..., Any]]:
    """The functions ``module:object`` (or ``file.py:object``) names (see :func:`load_tools`).

    Raises:
        ValueError: as :func:`load_tools` says.
    """
    where, sep, name = plugin.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"--tools {plugin!r}: write module:object or path/to/file.py:object")
    try:
        if where.endswith(".py"):
            path = Path(where)
            spec = importlib.util.spec_from_file_location(f"voxpipe_tools_{path.stem}", path)
            if spec is None or spec.loader is None or not path.is_file():
                raise ImportError(f"no such file {where}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of the user's module is reported as such
        raise ValueError(f"--tools {plugin!r}: cannot import {where} ({type(exc).__name__}: {exc})") from None
    if not hasattr(module, name):
        raise ValueError(f"--tools {plugin!r}: {where} has no {name!r}")
    obj = getattr(module, name)
    items = list(obj.values()) if isinstance(obj, Mapping) else [obj] if callable(obj) else list(obj) \
        if isinstance(obj, (list, tuple)) else []
    if not items or not all(callable(f) for f in items):
        raise ValueError(f"--tools {plugin!r}: {name} must be a function, a list of functions or a mapping of them")
    return items
