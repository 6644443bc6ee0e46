"""Fault-injection rules: what ``--fault`` and ``VOXPIPE_FAULTS`` say, parsed.

A rule names a stage, a kind, the call it starts at and how many calls it lasts::

    STAGE:KIND[@FIRST][xCOUNT]      e.g.  llm:oom@1x2   tts:slow:2000@1x6   asr:error@3x*

The grammar lives below the serving policies so that the configuration can check its rules
(:class:`pipeline.serving_config.DegradeConfig`) without importing them; what a rule does
when it hits is :mod:`pipeline.serving.faults`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, cast

StageName = Literal["asr", "llm", "tts"]
FaultKind = Literal["oom", "error", "slow"]
STAGES: tuple[StageName, ...] = ("asr", "llm", "tts")
ENV = "VOXPIPE_FAULTS"
"""The environment variable that adds rules (separated by ``,`` or ``;``)."""
_RULE = re.compile(r"^(asr|llm|tts):(oom|error|slow:(\d+))(?:@(\d+))?(?:x(\d+|\*))?$")


@dataclass(slots=True, frozen=True)
class FaultRule:
    """One parsed rule (see the module docstring).

    Attributes:
        stage: the stage hit. kind: ``oom`` | ``error`` | ``slow``. slow_ms: the delay of
        a ``slow`` rule (ms). first: the first call hit (1-based). count: calls hit (None: all).
    """

    stage: StageName
    kind: FaultKind
    slow_ms: int = 0
    first: int = 1
    count: int | None = 1

    @classmethod
    def parse(cls, text: str) -> FaultRule:
        """Parse ``STAGE:KIND[@FIRST][xCOUNT]``.

        Raises:
            ValueError: not a rule, or a first call < 1 or a count < 1.
        """
        m = _RULE.match(text.strip())
        if m is None:
            raise ValueError(f"bad fault rule {text!r}: expected STAGE:KIND[@FIRST][xCOUNT] with STAGE asr|llm|tts "
                             "and KIND oom|error|slow:<ms>, e.g. llm:oom@1x2 or tts:slow:2000@1x*")
        stage, kind, slow, first, count = m.groups()
        n_first = int(first) if first else 1
        n_count = None if count == "*" else int(count) if count else 1
        if n_first < 1 or (n_count is not None and n_count < 1):
            raise ValueError(f"bad fault rule {text!r}: the first call and the count start at 1")
        return cls(stage=cast(StageName, stage), kind=cast(FaultKind, "slow" if slow else kind),
                   slow_ms=int(slow or 0), first=n_first, count=n_count)

    def hits(self, call: int) -> bool:
        """Whether call number ``call`` (1-based) is hit."""
        return call >= self.first and (self.count is None or call < self.first + self.count)


def parse_rules(specs: list[str] | tuple[str, ...]) -> tuple[FaultRule, ...]:
    """Parse rules; each spec may hold several, separated by ``,`` or ``;``.

    Raises:
        ValueError: a bad rule, or a spec with none.
    """
    rules: list[FaultRule] = []
    for spec in specs:
        parts = [part for part in re.split(r"[,;]", spec) if part.strip()]
        if not parts:
            raise ValueError(f"empty fault rule {spec!r}: expected STAGE:KIND[@FIRST][xCOUNT]")
        rules.extend(FaultRule.parse(part) for part in parts)
    return tuple(rules)
