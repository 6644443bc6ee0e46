"""Typed configuration of tool calling: the server's own tools and how a voice turn runs them.
Part of :class:`pipeline.config.VoxpipeConfig`, which re-exports it; fields are declared as
there (:mod:`pipeline.config_fields`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config_fields import check_ranges, flag


@dataclass(slots=True, kw_only=True)
class ToolsConfig:
    """Server-side tools (:mod:`pipeline.tools.toolbox`): offered to the model on every voice
    turn; none by default."""

    plugin: str | None = flag(None, name="--tools", metavar="MODULE:OBJECT")
    """Your own tools: ``module:object`` or ``path/to/file.py:object``, a function with type
    hints and a docstring, or a list or mapping of them (docs/TOOLS.md)."""
    builtin: tuple[str, ...] = flag((), name="--builtin-tool", metavar="NAME")
    """A built-in tool to offer: ``time``, ``timer``, ``calculator``."""
    timeout_s: float = flag(5.0, name="--tool-timeout-s")
    """The longest one tool call may run (s); then the model hears that it timed out."""
    filler_ms: int = flag(700, name="--tool-filler-ms")
    """A voice turn whose tool call runs longer than this says a short filler ("One moment.")
    so the line is never silent (ms; 0: never)."""
    max_rounds: int = 3
    """Model requests in one reply at most: the last offers no tool, so it answers in words
    (at least 2: one to call, one to say the result)."""

    def validate(self) -> None:
        """Raises:
            ValueError: a field out of range."""
        check_ranges("tools", self, {"timeout_s": (0, 3600), "filler_ms": (0, 600_000), "max_rounds": (2, 16)},
                     above=frozenset({"timeout_s"}))

    @property
    def enabled(self) -> bool:
        """Whether any server-side tool is configured."""
        return bool(self.plugin or self.builtin)
