"""The import graph keeps the layout's promises (docs/ARCHITECTURE.md, "Layout: the rooms"): no import runs from a
lower room to a higher one, sibling stages meet only through their ``types`` modules,
torch stays behind the LLM runner's fence, no two files and no two folders import each
other in a circle (tests/import_graph.py), and no module takes another's private name.
Static (ast): no module is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import import_graph
from tests.import_graph import (
    Tree,
    circles,
    common_folder,
    describe_file_circle,
    describe_room_circle,
    file_graph,
    private_imports,
    room_graphs,
    room_of,
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("audio", "pipeline", "server", "clients", "cli", "bench")
INFRA = {"pipeline.config", "pipeline.config_fields", "pipeline.serving_config", "pipeline.worker", "pipeline.errors",
         "pipeline.fault_rules", "pipeline.metrics", "pipeline.model_files", "pipeline.cpu_share", "pipeline",
         "pipeline.turn_config", "pipeline.tools_config", "pipeline.memory_parts"}
INFRA_ROOMS = ("serving", "tools")  # pure policies (admission, ...; tool-call parsing): beside the infrastructure
STAGES = ("asr", "llm", "tts", "eot")
RANK = {"audio": 0, "infra": 1, "asr": 2, "llm": 2, "tts": 2, "eot": 2, "engines": 3, "session": 4, "server": 5,
        "clients": 6, "bench": 7, "cli": 8}
TREE = Tree(ROOT, PACKAGES)
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
    return import_graph.module_name(path.relative_to(ROOT))


def imports(path: Path) -> list[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved), and of
    each first-party module named in a ``from`` import."""
    rel = path.relative_to(ROOT)
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = import_graph.from_base(rel, node)
            out.append(base)
            out += [f"{base}.{a.name}" for a in node.names if TREE.resolve(f"{base}.{a.name}") is not None]
    return out


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


# ---- circles --------------------------------------------------------------------------


PRIVATE_USES_TO_REMOVE: set[tuple[str, str]] = set()
"""Private names still taken across modules (none: keep it so). The test fails once an entry is
gone: take it off."""


@pytest.fixture(scope="module")
def graph() -> dict[Path, set[Path]]:
    return file_graph(TREE)


def test_no_circle_between_files(graph):
    found = circles(graph)
    assert not found, "files that import each other:\n" + "\n".join(describe_file_circle(c, graph) for c in found)


def test_no_circle_between_folders(graph):
    found = [describe_room_circle(folder, c, rooms) for folder, rooms in sorted(room_graphs(graph).items())
             for c in circles(rooms)]
    assert not found, "folders (rooms of a folder) that import each other:\n" + "\n".join(found)


def test_no_module_takes_another_modules_private_name():
    found = {(str(rel), use.split(": ", 1)[1]): use for rel in TREE.files() for use in private_imports(TREE, rel)}
    unknown = [f"{rel}:{use}" for (rel, name), use in found.items() if (rel, name) not in PRIVATE_USES_TO_REMOVE]
    assert not unknown, "private names taken from another module (make them public where they belong):\n" + \
        "\n".join(unknown)
    stale = sorted(PRIVATE_USES_TO_REMOVE - set(found))
    assert not stale, f"no longer used: take {stale} off PRIVATE_USES_TO_REMOVE"


# ---- the checker itself, on planted circles ------------------------------------------------

def test_circles_finds_each_planted_circle_and_nothing_else():
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["e"], "e": ["d"], "f": ["a", "f"], "g": []}
    assert circles(graph) == [["a", "b", "c"], ["d", "e"]]  # f's arrow to itself is no circle
    assert circles({"a": ["b"], "b": ["c"], "c": []}) == []
    chain = {i: [i + 1] for i in range(5000)} | {5000: [0]}  # deep: no recursion limit
    assert circles(chain) == [sorted(range(5001), key=str)]


def _plant(root: Path, files: dict[str, str]) -> Tree:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return Tree(root, ("pkg",))


def test_the_checker_sees_circles_hidden_in_functions_and_type_checking(tmp_path):
    tree = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import thing\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\nthing = 1\n",
        "pkg/c.py": "def late():\n    import pkg.d\n",
        "pkg/d.py": "def later():\n    from .c import late\n",
        "pkg/e.py": "import os\nfrom pkg import a\n",
    })
    graph = file_graph(tree)
    assert graph[Path("pkg/e.py")] == {Path("pkg/a.py")}  # a module named in a from-import: no arrow to __init__
    found = circles(graph)
    assert found == [[Path("pkg/a.py"), Path("pkg/b.py")], [Path("pkg/c.py"), Path("pkg/d.py")]]
    assert "pkg/b.py -> pkg/a.py" in describe_file_circle(found[0], graph)


def test_the_checker_sees_a_circle_between_folders_without_one_between_files(tmp_path):
    tree = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/top.py": "from pkg.sub.low import x\n",  # down into sub/: fine alone
        "pkg/base.py": "def late():\n    from pkg.sub import other\n",  # ... but base.py goes down too
        "pkg/sub/__init__.py": "",
        "pkg/sub/low.py": "from ..base import late\nx = late\n",  # and sub/ comes back up to base.py
        "pkg/sub/other.py": "y = 1\n",
        "pkg/side/__init__.py": "from pkg.sub import low\n",  # a sibling folder: one way only
    })
    graph = file_graph(tree)
    assert circles(graph) == []
    rooms = room_graphs(graph)
    assert set(rooms) == {Path("pkg")}
    found = circles(rooms[Path("pkg")])
    assert found == [[Path("pkg/base.py"), Path("pkg/sub")]]
    text = describe_room_circle(Path("pkg"), found[0], rooms[Path("pkg")])
    assert "pkg/base.py -> pkg/sub: pkg/base.py -> pkg/sub/other.py" in text
    assert "pkg/sub -> pkg/base.py: pkg/sub/low.py -> pkg/base.py" in text
    del graph[Path("pkg/base.py")]  # base.py no longer goes down: no circle left
    assert all(not circles(r) for r in room_graphs(graph).values())


def test_rooms_are_the_subfolders_and_the_files_of_a_folder():
    assert common_folder(Path("a/b/c.py"), Path("a/d/e.py")) == Path("a")
    assert common_folder(Path("a/x.py"), Path("b/y.py")) == Path()
    assert room_of(Path("a"), Path("a/b/c/d.py")) == Path("a/b")
    assert room_of(Path("a"), Path("a/f.py")) == Path("a/f.py")
    assert room_of(Path(), Path("a/f.py")) == Path("a")


def test_the_checker_sees_private_names_taken_from_another_module(tmp_path):
    tree = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/lib.py": "def _helper(): ...\n__all__ = []\n",
        "pkg/user.py": "from pkg.lib import _helper\nfrom pkg import lib\nimport pkg.lib as l2\n"
                       "lib._helper()\nl2._helper()\nprint(lib.__all__)\nfrom os import _exit\n",
    })
    assert private_imports(tree, Path("pkg/user.py")) == [
        "1: from pkg.lib import _helper", "4: pkg.lib._helper", "5: pkg.lib._helper"]
    assert private_imports(tree, Path("pkg/lib.py")) == []
