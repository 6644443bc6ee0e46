"""The docs say nothing that is not there: README.md and every docs/*.md are checked for

- relative links ``[text](path)`` / ``[text](path#anchor)``: the file exists, and an anchor into
  a Markdown file names one of its headings (GitHub's slugs);
- ``voxpipe ...`` commands in fenced code blocks and in inline code: the real argument parser
  of ``cli.main`` accepts them (parsed, never run);
- ``python -m MODULE`` in code blocks and inline code: the module can be found;
- repository paths in inline code (``pipeline/...``, ``tests/...``, ...): they exist;
- README.md has at most 200 lines, and CI runs its test command.

No server, no model."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

import cli.main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

REPO_PREFIXES = ("audio/", "pipeline/", "server/", "clients/", "cli/", "bench/", "tests/", "web/", "docs/",
                 "deploy/", ".ci/")
"""Inline code starting with one of these names a path in the repository."""

TEST_COMMAND = ".venv/bin/python -m pytest -q"
"""The README's test command; ``.ci/run`` runs it (with more reporting flags)."""
SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}
NOT_SHELL = {"python", "py", "json", "js", "javascript", "html", "yaml", "yml", "toml", "text"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
VOXPIPE_SUBCOMMANDS = ("serve", "ask", "mic", "bench")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its info string's language and its lines."""

    lang: str
    lines: tuple[str, ...]


def split_markdown(text: str) -> tuple[list[str], list[Block]]:
    """The lines outside fenced code blocks, and the fenced blocks themselves."""
    prose: list[str] = []
    blocks: list[Block] = []
    fence: str | None = None
    lang = ""
    body: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if fence is None:
            m = re.match(r"^(`{3,}|~{3,})\s*([\w+-]*)", stripped)
            if m:
                fence, lang, body = m.group(1), m.group(2).lower(), []
            else:
                prose.append(line)
        elif stripped.startswith(fence) and stripped.strip(fence[0]) == "":
            blocks.append(Block(lang, tuple(body)))
            fence = None
        else:
            body.append(line)
    return prose, blocks


def inline_code(lines: list[str]) -> list[str]:
    """Every inline code span of ``lines`` (single backticks, or double around a backtick)."""
    spans = []
    for line in lines:
        spans += [a or b for a, b in re.findall(r"``\s?(.+?)\s?``|`([^`]+)`", line)]
    return spans


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: links and emphasis reduced to their text,
    lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The heading anchors of a Markdown file (duplicates numbered as GitHub does)."""
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def looks_like_repo_path(word: str) -> bool:
    """Whether an inline code word names a path in the repository: it starts with one of
    :data:`REPO_PREFIXES` and is a folder (``.../``), a file (an extension) or three levels
    deep; not a pattern (``{a,b}``, ``*``) and not a media type such as ``audio/pcmu``."""
    path = re.split(r"[:#]", word)[0]
    if not path.startswith(REPO_PREFIXES) or re.search(r"[{}*<>|]", path):
        return False
    return path.endswith("/") or "." in path.rsplit("/", 1)[-1] or path.count("/") >= 2


def strip_comment(line: str) -> str:
    """``line`` without a shell comment: a ``#`` that starts a word, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def shell_commands(block: Block) -> list[str]:
    """The block's commands: continuation lines joined, comments removed."""
    commands: list[str] = []
    pending = ""
    for raw in block.lines:
        line = strip_comment(raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command:
            commands.append(command)
    if pending.strip():
        commands.append(pending.strip())
    return commands


def voxpipe_invocations(command: str) -> list[list[str]]:
    """The words after ``voxpipe`` (or ``.venv/bin/voxpipe``) of every simple command in
    ``command`` that runs it, after any ``NAME=value`` prefixes."""
    try:
        words = shlex.split(command)
    except ValueError:
        return []
    segments: list[list[str]] = [[]]
    for word in words:
        if word in SHELL_OPERATORS:
            segments.append([])
        else:
            segments[-1].append(word)
    out = []
    for seg in segments:
        while seg and ENV_ASSIGNMENT.match(seg[0]):
            seg = seg[1:]
        if seg and (seg[0] == "voxpipe" or seg[0].endswith("/voxpipe")):
            out.append(seg[1:])
    return out


def parser():
    """``voxpipe``'s argument parser."""
    return cli.main.build_parser()


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def collect() -> dict[str, list]:
    """Everything to check, per kind: (doc, item) pairs."""
    found: dict[str, list] = {"links": [], "commands": [], "modules": [], "paths": []}
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        prose, blocks = split_markdown(text)
        for line in prose:
            for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", re.sub(r"`[^`]*`", "", line)):
                if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked
                    found["links"].append((path, target))
        spans = inline_code(prose)
        for span in spans:
            words = span.split()
            if len(words) > 2 and words[0] in ("voxpipe", ".venv/bin/voxpipe") and words[1] in VOXPIPE_SUBCOMMANDS:
                found["commands"].append((path, span))  # a command with arguments, not the bare name
            found["modules"] += [(path, m) for m in re.findall(r"python3?\s+-m\s+([\w.]+)", span)]
            if words and looks_like_repo_path(words[0]):
                found["paths"].append((path, re.split(r"[:#]", words[0])[0]))
        for block in blocks:
            if block.lang in NOT_SHELL:
                continue
            for command in shell_commands(block):
                if voxpipe_invocations(command):
                    found["commands"].append((path, command))
                found["modules"] += [(path, m) for m in re.findall(r"python3?\s+-m\s+([\w.]+)", command)]
    return found


FOUND = collect()


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_readme_commands_agree_with_ci():
    """The README's two commands are there, and CI runs the README's test command."""
    _, blocks = split_markdown((ROOT / "README.md").read_text(encoding="utf-8"))
    commands = [c for block in blocks for c in shell_commands(block)]
    assert "bash .ci/setup.sh && .venv/bin/voxpipe serve" in commands
    assert TEST_COMMAND in commands
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert any(line == TEST_COMMAND or line.startswith(TEST_COMMAND + " ") for line in ci), \
        f".ci/run does not run the README's test command ({TEST_COMMAND})"


def test_the_checks_find_what_they_check():
    """The collectors are not vacuous: each kind has items, the docs folder is read."""
    assert {doc_id(p) for p in DOCS} >= {"README.md", "docs/ARCHITECTURE.md", "docs/OPERATIONS.md",
                                         "docs/BENCHMARKS.md", "docs/RAY.md", "docs/KERNELS.md"}
    assert all(FOUND[kind] for kind in FOUND), {kind: len(v) for kind, v in FOUND.items()}


@pytest.mark.parametrize(("doc", "target"), FOUND["links"], ids=lambda v: doc_id(v) if isinstance(v, Path) else v)
def test_relative_link_resolves(doc: Path, target: str):
    file_part, _, anchor = target.partition("#")
    dest = (doc.parent / file_part).resolve() if file_part else doc
    assert dest.exists(), f"{doc_id(doc)}: link to {target}: no such file"
    assert ROOT in dest.parents or dest == ROOT, f"{doc_id(doc)}: link to {target} leaves the repository"
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), f"{doc_id(doc)}: link to {target}: no heading with that anchor in {dest.name}"


@pytest.mark.parametrize(("doc", "command"), FOUND["commands"], ids=lambda v: doc_id(v) if isinstance(v, Path) else v)
def test_voxpipe_command_parses(doc: Path, command: str):
    p = parser()
    for words in voxpipe_invocations(command):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                p.parse_args(words)
        except SystemExit as exc:  # argparse: 2 on an error; 0 for --help
            assert exc.code == 0, f"{doc_id(doc)}: `{command}` does not parse: {err.getvalue().strip()}"


@pytest.mark.parametrize(("doc", "module"), FOUND["modules"], ids=lambda v: doc_id(v) if isinstance(v, Path) else v)
def test_python_module_exists(doc: Path, module: str):
    assert importlib.util.find_spec(module) is not None, f"{doc_id(doc)}: `python -m {module}`: no such module"


@pytest.mark.parametrize(("doc", "path"), FOUND["paths"], ids=lambda v: doc_id(v) if isinstance(v, Path) else v)
def test_repository_path_exists(doc: Path, path: str):
    assert (ROOT / path).exists(), f"{doc_id(doc)}: `{path}` is not in the repository"
