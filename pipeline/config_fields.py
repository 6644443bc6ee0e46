"""How a configuration field is declared once: its type and default in the dataclass, its help
in the string right under it (an attribute docstring, PEP 257), and how ``voxpipe serve``
spells it in the field's metadata (:func:`flag`). ``cli.flags`` turns these into argparse
groups and parsed flags back into a :class:`~pipeline.config.VoxpipeConfig` (the pattern of
vLLM's ``EngineArgs`` and ``get_attr_docs``). Nothing here knows argparse.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any

FLAG = "flag"
"""Metadata key: the field's full flag name (``--llm``) where the derived one is not it."""
METAVAR = "metavar"
"""Metadata key: the placeholder ``--help`` shows for the value."""
ENV = "env"
"""Metadata key: an environment variable: a scalar field's default when the flag is not given,
one more item of a tuple field's."""
PREFIX = "flag_prefix"
"""Metadata key, on a :class:`~pipeline.config.VoxpipeConfig` section: what its fields'
derived flags start with after ``--`` (``asr-`` → ``--asr-beam-size``)."""


def flag(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, name: str | None = None,
         metavar: str | None = None, env: str | None = None) -> Any:
    """A dataclass field (``default`` or ``factory``) that says how ``voxpipe serve`` spells it:
    ``name`` (the whole flag, e.g. ``--max-new-tokens``; None: ``--`` + the section's prefix +
    the field's name with dashes, ``--no-…`` for a boolean that defaults to True), ``metavar``
    and ``env`` (see :data:`ENV`)."""
    meta = {k: v for k, v in ((FLAG, name), (METAVAR, metavar), (ENV, env)) if v is not None}
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)


def section(cls: type, prefix: str) -> Any:
    """A :class:`~pipeline.config.VoxpipeConfig` field holding ``cls()`` whose fields' flags
    start with ``--{prefix}``."""
    return dataclasses.field(default_factory=cls, metadata={PREFIX: prefix})


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field name: its docstring}`` for the string literals right under the fields in the
    source of ``cls`` (dedented, stripped); fields without one are left out.

    Raises:
        OSError: the class's source cannot be read.
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs

