"""Check a tool call the model wrote: JSON, a tool that was offered, arguments its JSON Schema
accepts (the ``jsonschema`` library, the draft each schema declares, 2020-12 when none)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from jsonschema import exceptions, validators

from pipeline.tools.types import ToolCall, ToolCallError, ToolCallFault, ToolSpec, new_call_id

SHAPE = 'expected a JSON object {"name": <tool name>, "arguments": {...}}'
MOST_SCHEMA_ERRORS = 3
"""Schema errors named in one message (the model repairs the first few; more is noise)."""


def validate_call(raw: str, specs: Iterable[ToolSpec], *, call_id: str | None = None) -> ToolCall | ToolCallError:
    """The call in ``raw`` (a block's text: Hermes' ``{"name": ..., "arguments": {...}}``)
    checked against the offered ``specs``.

    ``arguments`` given as a JSON string holding an object (OpenAI's wire form) is decoded;
    missing ``arguments`` counts as ``{}``. Never raises for anything the model writes.

    Args:
        raw: the text between the call tags (surrounding whitespace allowed).
        specs: the tools offered with the prompt.
        call_id: the id of the :class:`ToolCall` (None: :func:`~pipeline.tools.types.new_call_id`).

    Returns:
        a :class:`ToolCall`, or a :class:`ToolCallError` whose ``message`` says what to fix.

    Raises:
        ValueError: a spec whose ``parameters`` is not a valid JSON Schema (a programming
            error, not the model's).
    """
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError; nesting deeper than the stack
        return ToolCallError(ToolCallFault.NOT_JSON, f"not JSON ({exc}); {SHAPE}", raw)
    name, args = call_parts(obj)
    if name is None or args is None:
        return ToolCallError(ToolCallFault.NOT_JSON, SHAPE, raw, name)
    by_name = {spec.name: spec for spec in specs}
    spec = by_name.get(name)
    if spec is None:
        offered = ", ".join(sorted(by_name)) or "none"
        return ToolCallError(ToolCallFault.UNKNOWN_TOOL, f"no tool named {name!r} (tools: {offered})", raw, name)
    problems = schema_problems(spec, args)
    if problems:
        return ToolCallError(ToolCallFault.SCHEMA, f"arguments of {name} do not fit its parameters: {problems}",
                             raw, name)
    return ToolCall(call_id or new_call_id(), name, args, raw)


def call_parts(obj: Any) -> tuple[str | None, dict[str, Any] | None]:
    """(name, arguments) of a decoded call; None for a part that is missing or malformed."""
    if not isinstance(obj, dict):
        return None, None
    name = obj.get("name") if isinstance(obj.get("name"), str) else None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            args = None
    return name, args if isinstance(args, dict) else None


MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of a tool's ``parameters`` accepted (objects and lists): checking a schema
recurses, and a client's schema nested a hundred levels deep hit Python's recursion limit."""


def schema_error(schema: Any) -> str | None:
    """What is wrong with ``schema`` as a JSON Schema (``jsonschema``'s check of the draft it
    declares, 2020-12 when none), or None. Never raises: nesting deeper than
    :data:`MAX_SCHEMA_DEPTH` is an answer too."""
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        return f"nested deeper than {MAX_SCHEMA_DEPTH} levels"
    try:
        validators.validator_for(schema, default=validators.Draft202012Validator).check_schema(schema)
    except exceptions.SchemaError as exc:
        return exc.message
    except RecursionError:
        return "nested too deeply"
    return None


def _depth(value: Any, limit: int = MAX_SCHEMA_DEPTH + 1) -> int:
    """Nesting depth of a JSON value, counted up to ``limit`` (iterative: no recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth < limit:
                todo += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def schema_problems(spec: ToolSpec, args: dict[str, Any]) -> str:
    """What ``spec``'s schema finds wrong with ``args`` (the first few errors, by place), or ''.

    Raises:
        ValueError: ``spec.parameters`` is not a valid JSON Schema.
    """
    problem = schema_error(spec.parameters)
    if problem is not None:
        raise ValueError(f"tool {spec.name}: parameters is not a valid JSON Schema ({problem})")
    cls = validators.validator_for(spec.parameters, default=validators.Draft202012Validator)
    try:
        errors = sorted(cls(spec.parameters).iter_errors(args), key=lambda e: list(map(str, e.absolute_path)))
    except RecursionError:
        return "arguments: nested too deeply"
    return "; ".join(describe(e) for e in errors[:MOST_SCHEMA_ERRORS])


def describe(error: exceptions.ValidationError) -> str:
    """One schema error: where (``arguments.a.0``) and what."""
    where = ".".join(["arguments", *map(str, error.absolute_path)])
    return f"{where}: {error.message}"
