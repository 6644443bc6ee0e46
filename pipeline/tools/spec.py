"""A :class:`~pipeline.tools.types.ToolSpec` from a Python function: its name, its docstring's
summary as the description, its parameters' type hints as a JSON Schema (pydantic's
``create_model(...).model_json_schema()``), each parameter described by the docstring's
Google-style ``Args:`` section."""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import pydantic

from pipeline.tools.types import TOOL_NAME, ToolSpec

F = TypeVar("F", bound=Callable[..., Any])
SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Yields|Raises|Examples?|Notes?|Attributes):\s*$")
ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
LITERAL_KEYS = ("default", "const", "enum", "examples")
"""Schema keywords whose values are data, not schemas (kept as they are by :func:`untitled`)."""
SCHEMA_MAPS = ("properties", "$defs", "patternProperties")
"""Schema keywords whose values map names to schemas (the names are kept, even ``title``)."""


EXAMPLE_ATTR = "__tool_example__"
"""Where :func:`example` puts a tool's worked example on its function."""


def example(utterance: str, **arguments: Any) -> Callable[[F], F]:
    """Decorate a tool with something a person says that it answers, and the call's arguments:
    ``@example("Set a timer for ten seconds.", seconds=10)``. The model is shown it as a
    worked example when the tool is offered (:func:`~pipeline.tools.render.demo_exchange`):
    small models answer in words what they should call a tool for without one (measured:
    Qwen2.5-Coder-0.5B with voxpipe's two spoken examples called no tool for "What time is
    it?" or "What's twelve times seven?", and called both with one worked call added)."""
    def mark(fn: F) -> F:
        setattr(fn, EXAMPLE_ATTR, (utterance, arguments))
        return fn
    return mark


def spec_from_callable(fn: Callable[..., Any]) -> ToolSpec:
    """The tool spec of ``fn``: keyword-callable parameters with type hints, and a docstring.

    Raises:
        ValueError: no docstring; a name that is not a tool name; ``*args``/``**kwargs`` or a
            positional-only parameter (a call passes arguments by name); a parameter without a
            type hint, whose name starts with ``_``, or whose type has no JSON Schema; a hint
            that does not resolve.
    """
    name = getattr(fn, "__name__", "")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"tool {name or fn!r}: no docstring (its text before the first section describes the tool)")
    if not TOOL_NAME.match(name):
        raise ValueError(f"tool {name!r}: not a tool name (1-64 letters, digits, '_' or '-')")
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except (NameError, TypeError) as exc:
        raise ValueError(f"tool {name}: a type hint does not resolve ({exc})") from None
    summary, described = parse_docstring(doc)
    params = inspect.signature(fn).parameters.values()
    # fields named p0, p1, ... with the parameter names as aliases: no name clashes with BaseModel's own
    fields = {f"p{i}": field_of(name, p, hints, described.get(p.name)) for i, p in enumerate(params)}
    try:
        schema = pydantic.create_model(f"{name}_arguments", **fields).model_json_schema()  # type: ignore[call-overload]
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, TypeError, NameError) as exc:
        raise ValueError(f"tool {name}: its parameters have no JSON Schema ({exc})") from None
    return ToolSpec(name, summary, untitled(schema), getattr(fn, EXAMPLE_ATTR, None))


def field_of(tool: str, param: inspect.Parameter, hints: dict[str, Any], about: str | None) -> tuple[Any, Any]:
    """``(type, pydantic.Field)`` of one parameter (named by its alias).

    Raises:
        ValueError: a parameter :func:`spec_from_callable` does not take.
    """
    if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
        raise ValueError(f"tool {tool}: parameter {param} cannot be passed by name (no *args, **kwargs or '/')")
    if param.name.startswith("_"):
        raise ValueError(f"tool {tool}: parameter {param.name!r} starts with '_'")
    if param.name not in hints:
        raise ValueError(f"tool {tool}: parameter {param.name!r} has no type hint")
    default = ... if param.default is param.empty else param.default
    return hints[param.name], pydantic.Field(default, alias=param.name, description=about)


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(summary, {parameter: description}) of a Google-style docstring: the summary is the
    text before the first section, joined into one line; in ``Args:``, a line at the first
    entry's indent starts a parameter (``name: text`` or ``name (type): text``) and deeper
    lines continue it."""
    summary: list[str] = []
    described: dict[str, str] = {}
    section = current = indent = None
    for line in doc.splitlines():
        text = line.strip()
        header = SECTION.match(text)
        if header:
            section, current, indent = header.group(1), None, None
        elif section is None:
            summary.append(text)
        elif section in ("Args", "Arguments", "Parameters") and text:
            indent = len(line) - len(line.lstrip()) if indent is None else indent
            match = ARG_LINE.match(text) if len(line) - len(line.lstrip()) <= indent else None
            if match:
                current = match.group(1).lstrip("*")
                described[current] = match.group(2)
            elif current:
                described[current] = f"{described[current]} {text}".strip()
    return " ".join(" ".join(summary).split()), described


def untitled(schema: Any) -> Any:
    """``schema`` without pydantic's ``title`` keywords (prompt tokens that say nothing the
    property names do not)."""
    if isinstance(schema, list):
        return [untitled(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title":
            continue
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {n: untitled(s) for n, s in value.items()}
        else:
            out[key] = value if key in LITERAL_KEYS else untitled(value)
    return out
