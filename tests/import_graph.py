"""The first-party import graph of a source tree, read with ast (nothing is imported), its
circles between files and between folders, and the private names one module takes from
another. tests/test_layers.py holds the house to it.

An arrow runs from file A to file B when A imports B anywhere: at the top, inside a
function, or under ``if TYPE_CHECKING:`` (a circle is a circle, however it is hidden).
``from P import N`` is an arrow to ``P/N`` when N is a module, else to P's own file (its
``.py`` or ``__init__.py``); ``import P.Q.R`` is an arrow to R's file only (the packages on
the way are the folders themselves, not arrows).

Between folders, the graph is read room by room, as a plan of the house is: inside each
folder F, its rooms are its subfolders (each with everything below it) and the files directly
in F. A file arrow from A to B is a room arrow inside the deepest folder holding both, from
the room holding A to the room holding B; a circle of rooms inside any folder is a circle
between folders (e.g. ``pipeline/serving_config.py`` → ``pipeline/serving/`` while a file in
``pipeline/serving/`` imports ``pipeline/config.py``, which imports
``pipeline/serving_config.py``), even where no circle of files closes.
"""

from __future__ import annotations

import ast
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

N = TypeVar("N", bound=Hashable)

Arrow = tuple[Path, Path]
"""(importing file, imported file), both relative to the tree's root."""


@dataclass(frozen=True)
class Tree:
    """A source tree: ``root`` and its first-party top-level packages."""

    root: Path
    packages: tuple[str, ...]

    def files(self) -> list[Path]:
        """Every ``.py`` file of the packages, relative to the root, sorted."""
        return sorted(p.relative_to(self.root) for pkg in self.packages for p in (self.root / pkg).rglob("*.py"))

    def resolve(self, module: str) -> Path | None:
        """The file of a first-party module name (``a/b.py`` or ``a/b/__init__.py``,
        relative), or None (a class, a function, a third-party module)."""
        if module.split(".")[0] not in self.packages:
            return None
        base = Path(*module.split("."))
        for rel in (base.with_suffix(".py"), base / "__init__.py"):
            if (self.root / rel).is_file():
                return rel
        return None


def module_name(rel: Path) -> str:
    """``a/b/c.py`` → ``a.b.c``; ``a/b/__init__.py`` → ``a.b``."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package(rel: Path) -> str:
    """The package a relative import in ``rel`` starts from."""
    name = module_name(rel)
    return name if rel.name == "__init__.py" else name.rpartition(".")[0]


def from_base(rel: Path, node: ast.ImportFrom) -> str:
    """The absolute module name of ``from BASE import ...`` in ``rel`` (relative levels
    resolved)."""
    base = node.module or ""
    if not node.level:
        return base
    anchor = _package(rel).split(".")
    anchor = anchor[: len(anchor) - node.level + 1]
    return ".".join(anchor + ([base] if base else []))


def imported_files(tree: Tree, rel: Path) -> set[Path]:
    """Every first-party file that the file ``rel`` imports, anywhere in it (see the module
    docstring for what counts)."""
    out: set[Path] = set()
    for node in ast.walk(ast.parse((tree.root / rel).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {f for a in node.names if (f := tree.resolve(a.name)) is not None}
        elif isinstance(node, ast.ImportFrom):
            base = from_base(rel, node)
            modules = [tree.resolve(f"{base}.{a.name}") for a in node.names]
            out |= {f for f in modules if f is not None}
            if None in modules and (f := tree.resolve(base)) is not None:
                out.add(f)  # a name defined in (or handed on by) the base module itself
    out.discard(rel)
    return out


def file_graph(tree: Tree) -> dict[Path, set[Path]]:
    """File → the files it imports, for every file of the tree."""
    return {rel: imported_files(tree, rel) for rel in tree.files()}


def room_of(folder: Path, rel: Path) -> Path:
    """The room of ``folder`` that holds the file ``rel`` (below ``folder``): the file itself
    if it lies directly in ``folder``, else the subfolder of ``folder`` it lies under."""
    return Path(*rel.parts[: len(folder.parts) + 1])


def common_folder(a: Path, b: Path) -> Path:
    """The deepest folder holding both files (``Path()`` for the tree's root)."""
    shared: list[str] = []
    for x, y in zip(a.parent.parts, b.parent.parts):
        if x != y:
            break
        shared.append(x)
    return Path(*shared)


def room_graphs(files: Mapping[Path, Iterable[Path]]) -> dict[Path, dict[Path, dict[Path, list[Arrow]]]]:
    """Folder → (room → room it imports → the file arrows behind that room arrow, sorted),
    for every folder in which some file arrow crosses between two of its rooms (see the
    module docstring)."""
    out: dict[Path, dict[Path, dict[Path, list[Arrow]]]] = {}
    for a, targets in files.items():
        for b in targets:
            folder = common_folder(a, b)
            ra, rb = room_of(folder, a), room_of(folder, b)
            if ra != rb:
                out.setdefault(folder, {}).setdefault(ra, {}).setdefault(rb, []).append((a, b))
    for rooms in out.values():
        for arrows in rooms.values():
            for pairs in arrows.values():
                pairs.sort()
    return out


def circles(graph: Mapping[N, Iterable[N]]) -> list[list[N]]:
    """The circles of a directed graph: its strongly connected components of two or more
    nodes (Tarjan's algorithm, iterative), each sorted, the list sorted. A node's arrow to
    itself is no circle."""
    index: dict[N, int] = {}
    low: dict[N, int] = {}
    stack: list[N] = []
    on_stack: set[N] = set()
    found: list[list[N]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph.get(start, ())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, ()))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component, key=str))
    return sorted(found, key=lambda c: [str(n) for n in c])


def describe_file_circle(circle: list[Path], files: Mapping[Path, Iterable[Path]]) -> str:
    """A circle of files and the arrows between its members, one per line."""
    members = set(circle)
    lines = [f"circle of {len(circle)} files: " + ", ".join(map(str, circle))]
    lines += [f"  {a} -> {b}" for a in circle for b in sorted(files.get(a, ())) if b in members]
    return "\n".join(lines)


def describe_room_circle(folder: Path, circle: list[Path], rooms: Mapping[Path, Mapping[Path, list[Arrow]]]) -> str:
    """A circle of rooms inside ``folder``, each room arrow between its members with the file
    arrows behind it."""
    members = set(circle)
    lines = [f"circle of {len(circle)} rooms in {folder}/: " + ", ".join(map(str, circle))]
    for a in circle:
        for b, pairs in sorted(rooms.get(a, {}).items()):
            if b in members:
                lines.append(f"  {a} -> {b}: " + "; ".join(f"{x} -> {y}" for x, y in pairs))
    return "\n".join(lines)


def private_imports(tree: Tree, rel: Path) -> list[str]:
    """Where the file ``rel`` takes a private name (``_x``, not a dunder) from another
    first-party module: ``from M import _x``, or ``M._x`` on a module it imported.
    Returns one ``line: what`` string each."""
    found: list[str] = []
    modules: dict[str, str] = {}  # a local name bound to a first-party module → the module
    nodes = list(ast.walk(ast.parse((tree.root / rel).read_text(encoding="utf-8"))))
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if tree.resolve(a.name) is not None and a.asname:
                    modules[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = from_base(rel, node)
            if base.split(".")[0] not in tree.packages:
                continue
            for a in node.names:
                if _private(a.name):
                    found.append(f"{node.lineno}: from {base} import {a.name}")
                elif tree.resolve(f"{base}.{a.name}") is not None:
                    modules[a.asname or a.name] = f"{base}.{a.name}"
    for node in nodes:
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name) \
                and node.value.id in modules:
            found.append(f"{node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")
