"""The import graph keeps the layout's promises (README "Layout"): no import runs from a
lower room to a higher one, sibling stages meet only through their ``types`` modules, and
torch stays behind the LLM runner's fence. Static (ast): no module is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("audio", "pipeline", "server", "clients", "cli", "bench")
INFRA = {"pipeline.config", "pipeline.config_fields", "pipeline.serving_config", "pipeline.worker", "pipeline.metrics",
         "pipeline.model_files", "pipeline.cpu_share", "pipeline"}
INFRA_ROOMS = ("serving",)  # pure serving policies (admission, ...): beside the infrastructure
STAGES = ("asr", "llm", "tts")
RANK = {"audio": 0, "infra": 1, "asr": 2, "llm": 2, "tts": 2, "engines": 3, "session": 4, "server": 5,
        "clients": 6, "bench": 7, "cli": 8}
TORCH_ALLOWED = ("pipeline/llm/runner/", "pipeline/llm/loader.py", "pipeline/tts/coqui_loader.py",
                 "bench/")  # bench: int8 rows, WER normalizer, the random VITS


def room(module: str) -> str | None:
    """The room (layer) of a first-party module name, or None for third-party ones."""
    parts = module.split(".")
    top = parts[0]
    if top not in PACKAGES:
        return None
    if top != "pipeline":
        return top
    if module in INFRA:
        return "infra"
    sub = parts[1]
    if sub in INFRA_ROOMS:
        return "infra"
    if sub in STAGES:
        return sub
    if sub in ("engines", "stages", "remote"):  # remote: the stages as Ray Serve deployments, beside engines
        return "engines"
    if sub == "session":
        return "session"
    raise AssertionError(f"{module}: not in any room of the layout")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append(base)
            out += [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")]
    return out


def _is_module(name: str) -> bool:
    """True for a first-party module (``from pipeline import metrics``), not a class or function."""
    path = ROOT / Path(*name.split("."))
    return name.split(".")[0] in PACKAGES and (path.with_suffix(".py").exists() or path.is_dir())


SOURCES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_every_source_file_is_in_a_room():
    assert SOURCES
    for path in SOURCES:
        room(module_name(path))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down_or_through_types(path: Path):
    me = module_name(path)
    mine = room(me)
    assert mine is not None
    for target in imports(path):
        theirs = room(target)
        if theirs is None or theirs == mine:
            continue
        if RANK[theirs] < RANK[mine] and not (mine in STAGES and theirs in STAGES):
            continue
        if mine in STAGES and theirs in STAGES and target.endswith(".types"):
            continue  # sibling stages meet through their message types only
        if mine == "clients" and target == "server.protocol":
            continue  # the wire codec is shared by the server and its clients
        if target == "pipeline" or target in ("server", "clients", "bench", "cli", "audio"):
            continue  # bare package (``from pipeline import metrics`` resolves below)
        pytest.fail(f"{me} ({mine}) imports {target} ({theirs}): a lower or sibling room may not depend on it")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_torch_stays_behind_the_runner_fence(path: Path):
    rel = str(path.relative_to(ROOT))
    if rel.startswith(TORCH_ALLOWED):
        return
    heavy = [t for t in imports(path) if t.split(".")[0] in ("torch", "transformers")]
    assert not heavy, f"{rel} imports {heavy}: torch and transformers belong in pipeline/llm/runner/ or the loader"
