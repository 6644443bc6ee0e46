"""``voxpipe serve``'s configuration flags, generated from the config dataclasses: one flag per
field of every :class:`~pipeline.config.VoxpipeConfig` section, one argparse group per section
(vLLM's ``EngineArgs`` pattern). The field gives the type and default, the docstring under it
the help (its first sentence), its :func:`~pipeline.config_fields.flag` metadata the flag's name,
placeholder and environment variable where they are not derived.

A flag's destination is ``"section.field"`` (``"llm.max_new_tokens"``), and argparse holds no
defaults (``SUPPRESS``): a flag not given is absent, so its field keeps the dataclass default —
there is no second copy of a default to drift. Flags by the field's type:

- ``bool``: ``--X`` sets True, or ``--no-X`` sets False when the default is True;
- ``int``, ``float``, ``str`` (or ``… | None``): one value;
- ``tuple[str, ...]``: repeatable, each use adds an item;
- ``dict[str, V]``: repeatable ``KEY=VALUE``, each use replaces one key of the default;
- anything else: one JSON value, lists read as tuples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.config import VoxpipeConfig
from pipeline.config_fields import ENV, FLAG, METAVAR, PREFIX, field_docs

_UNITS = {"_ms": "ms", "_s": "s", "_mb": "MiB", "_x": "x"}
"""The unit of a number whose field name ends so: its placeholder (upper case) and the unit
of its default in the help line."""
_SHORT_DEFAULT = 40
"""Defaults whose text is longer than this are left out of the help line."""


@dataclass(frozen=True, slots=True)
class ConfigFlag:
    """One field's flag.

    Attributes:
        section: the :class:`VoxpipeConfig` field holding the section (``"llm"``).
        owner: the section's class (:class:`~pipeline.config.LlmConfig`).
        field: the section's dataclass field.
        hint: the field's resolved type (``int``, ``str | None``, ``tuple[str, ...]``, ...).
        default: the field's default (from a fresh section instance).
        doc: the field's docstring ('' if none).
        name: the flag (``--max-new-tokens``).
    """

    section: str
    owner: Any
    field: dataclasses.Field
    hint: Any
    default: Any
    doc: str
    name: str

    @property
    def dest(self) -> str:
        """The argparse destination: ``"section.field"``."""
        return f"{self.section}.{self.field.name}"

    @property
    def kind(self) -> str:
        """``bool`` | ``scalar`` | ``list`` | ``mapping`` | ``json`` (see the module docstring)."""
        base, origin = _base(self.hint), typing.get_origin(self.hint)
        if base is bool:
            return "bool"
        if base in (int, float, str):
            return "scalar"
        if origin is tuple and typing.get_args(self.hint) == (str, ...):
            return "list"
        if origin is dict:
            return "mapping"
        return "json"

    def argparse_kwargs(self) -> dict[str, Any]:
        """``add_argument`` keywords for this flag (no default: ``SUPPRESS``)."""
        kw: dict[str, Any] = {"dest": self.dest, "default": argparse.SUPPRESS, "help": self.help()}
        kind = self.kind
        if kind == "bool":
            kw["action"] = "store_false" if self.default else "store_true"
            return kw
        kw["metavar"] = self.metavar()
        if kind == "scalar":
            kw["type"] = _base(self.hint)
        elif kind in ("list", "mapping"):
            kw["action"] = "append"
        return kw

    def metavar(self) -> str:
        """The value's placeholder in ``--help``: the metadata's, else by type and unit."""
        if METAVAR in self.field.metadata:
            return self.field.metadata[METAVAR]
        kind, base = self.kind, _base(self.hint)
        if kind == "json":
            return "JSON"
        if base is str:
            return self.field.name.upper()
        unit = self.unit()
        if unit:
            return "MB" if unit == "MiB" else unit.upper()
        return "N" if base is int else "NUM"

    def unit(self) -> str:
        """The number's unit by the field's name (:data:`_UNITS`); '' if none."""
        return next((u for suffix, u in _UNITS.items() if self.field.name.endswith(suffix)), "")

    def help(self) -> str:
        """The help line: the first sentence of the field's docstring, then its default
        (``%`` escaped for argparse)."""
        text, default = first_sentence(self.doc), self.default
        env = self.field.metadata.get(ENV)
        kind, unit = self.kind, self.unit()
        if unit:  # "... (ms)" or "... (ms; 0: off)": the unit goes with the default
            text = re.sub(rf" \({unit}\)$", "", text)
            text = re.sub(rf"\({unit}; ([^()]*)\)$", r"(\1)", text)
        if kind == "bool":
            text = f"Turn off (on by default): {text[:1].lower()}{text[1:]}" if default else text
        elif kind == "list":
            text += f" (repeatable{f'; also ${env}' if env else ''})"
        elif kind == "mapping":
            text += f" (repeatable; defaults {', '.join(f'{k}={v:g}' for k, v in default.items())})"
        elif env:
            text += f" (default: ${env})"
        elif kind == "scalar" and default is not None and len(str(default)) <= _SHORT_DEFAULT:
            shown = f"{default:g}" if isinstance(default, float) else str(default)
            text += f" (default: {shown}{f' {unit}' if unit and unit != 'x' else ''})"
        return text.replace("%", "%%")

    def value(self, given: Any) -> Any:
        """The field's value from what argparse collected for it.

        Raises:
            ValueError: a ``KEY=VALUE`` or JSON value that does not parse (says which flag).
        """
        kind = self.kind
        if kind == "list":
            return tuple(self.default) + tuple(given)
        if kind == "mapping":
            value_type = typing.get_args(self.hint)[1]
            out = dict(self.default)
            for item in given:
                key, sep, text = item.partition("=")
                try:
                    if not (sep and key.strip()):
                        raise ValueError
                    out[key.strip()] = value_type(text)
                except ValueError:
                    raise ValueError(f"{self.name} {item!r}: expected {self.metavar()}") from None
            return out
        if kind == "json":
            try:
                return _tuples(json.loads(given))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{self.name}: not JSON ({exc})") from None
        return given

    def with_env(self, value: Any, environ: Mapping[str, str], *, given: bool) -> Any:
        """``value`` with the field's environment variable applied: a tuple gets the variable's
        value as one more item; a scalar takes it when the flag was not ``given`` (an empty
        variable: not set).

        Raises:
            ValueError: the variable's value fails its section's check (says which variable).
        """
        env = self.field.metadata.get(ENV)
        text = environ.get(env) if env else None
        if text is None:
            return value
        if self.kind == "list":
            item: Any = (text,)
        elif given or not text:
            return value
        else:
            item = _base(self.hint)(text)
        try:
            self.owner(**{self.field.name: item}).validate()
        except ValueError as exc:
            raise ValueError(f"{env}: {exc}") from None
        return value + item if self.kind == "list" else item


def config_flags() -> Iterator[ConfigFlag]:
    """Every configuration flag, section by section in :class:`VoxpipeConfig` order, fields in
    declaration order."""
    cfg = VoxpipeConfig()
    for sec in dataclasses.fields(VoxpipeConfig):
        defaults = getattr(cfg, sec.name)
        cls: Any = type(defaults)
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            yield ConfigFlag(section=sec.name, owner=cls, field=f, hint=hints[f.name],
                             default=getattr(defaults, f.name), doc=docs.get(f.name, ""),
                             name=_flag_name(sec.metadata[PREFIX], f))


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add every configuration flag to ``parser``, one argument group per section (titled with
    the section's name, described by its class docstring's first sentence)."""
    groups: dict[str, Any] = {}
    for flag in config_flags():
        if flag.section not in groups:
            groups[flag.section] = parser.add_argument_group(
                f"{flag.section} ({flag.owner.__name__})", first_sentence(flag.owner.__doc__ or "").replace("%", "%%"))
        groups[flag.section].add_argument(flag.name, **flag.argparse_kwargs())


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> VoxpipeConfig:
    """The :class:`VoxpipeConfig` of parsed flags: each field given takes its flag's value, each
    other one its environment variable's (``environ``, default ``os.environ``) or its default.
    Not validated (:meth:`VoxpipeConfig.validate`).

    Raises:
        ValueError: a ``KEY=VALUE`` or JSON flag, or an environment variable, that is bad.
    """
    environ = os.environ if environ is None else environ
    given = vars(args)
    values: dict[str, dict[str, Any]] = {}
    for flag in config_flags():
        value = flag.value(given[flag.dest]) if flag.dest in given else flag.default
        value = flag.with_env(value, environ, given=flag.dest in given)
        if value is not flag.default:
            values.setdefault(flag.section, {})[flag.field.name] = value
    cfg = VoxpipeConfig()
    for name, changed in values.items():
        setattr(cfg, name, dataclasses.replace(getattr(cfg, name), **changed))
    return cfg


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring as one plain line: reStructuredText roles and literals
    unwrapped (``:mod:`~a.b``` → ``b``, ````x```` → ``x``), no closing period."""
    text = " ".join(doc.strip().split("\n\n", 1)[0].split())
    text = re.sub(r":\w+:`~?([^`]*)`", lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1),
                  text)
    text = text.replace("``", "")
    end = re.search(r"(?<!e\.g)(?<!i\.e)(?<! al)\.(\s|$)", text)
    return text[: end.start()] if end else text


def _flag_name(prefix: str, f: dataclasses.Field) -> str:
    """The metadata's flag, else ``--{prefix}{name}`` (``--no-…`` for a boolean defaulting
    to True), underscores as dashes."""
    if FLAG in f.metadata:
        return f.metadata[FLAG]
    name = f"{prefix}{f.name}".replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def _base(hint: Any) -> Any:
    """``X`` of ``X | None``; else the hint itself."""
    if isinstance(hint, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def _tuples(value: Any) -> Any:
    """``value`` with every JSON list turned into a tuple (nested ones too)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
