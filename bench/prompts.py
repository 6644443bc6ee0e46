"""The fixed prompt set of the reply benchmarks (``bench/prompts.tsv``, issue 16).

At least 40 spoken-style prompts: statements, questions, and the default ASR's transcripts
of the shared English clips. The file's own header explains the format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PROMPTS_TSV = Path(__file__).with_name("prompts.tsv")
"""The prompt set: ``kind<TAB>text`` lines after a ``kind<TAB>text`` header; ``#`` comments."""
Kind = Literal["statement", "question", "clip"]
KINDS: tuple[Kind, ...] = ("statement", "question", "clip")


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt: its ``kind`` and the user's ``text``."""

    kind: Kind
    text: str


def load_prompts(path: Path = PROMPTS_TSV, kinds: tuple[Kind, ...] = KINDS) -> list[Prompt]:
    """The prompts of ``path`` whose kind is in ``kinds``, in file order.

    Raises:
        ValueError: a line without a tab, an unknown kind, or an empty text (with its line number).
    """
    out: list[Prompt] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#") or line == "kind\ttext":
            continue
        kind, sep, text = line.partition("\t")
        if not sep or kind not in KINDS or not text.strip():
            raise ValueError(f"{path}:{n}: want 'statement|question|clip<TAB>text', got {line!r}")
        if kind in kinds:
            out.append(Prompt(kind, text.strip()))
    return out
