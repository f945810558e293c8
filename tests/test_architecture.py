"""The house rules of the two packages, read from the source (docs/architecture.md).

* No import loops, lazy or not: every ``import`` counts, at module level, inside functions and
  under ``TYPE_CHECKING``.
* Floors go one way: a room of ``circuits_llm`` imports only rooms on lower floors (or its own).
* ``circuits`` imports nothing of ``circuits_llm``.
* The package face exports exactly what a user needs first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("circuits", "circuits_llm")

#: Floor of each room of circuits_llm: a module may import modules on its own floor or below.
FLOORS = {
    "circuits_llm.protocols": 1, "circuits_llm.heads": 1, "circuits_llm.runtime": 1,
    "circuits_llm.embedded": 1,
    "circuits_llm.text": 2,
    "circuits_llm.backbone": 3, "circuits_llm.constraints": 3,
    "circuits_llm.decoding": 4, "circuits_llm.draft_block": 4,
    "circuits_llm.training": 5,
    "circuits_llm.app": 6,
    "circuits_llm.__main__": 7,
}

def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of both packages."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name an ``import`` statement anywhere in ``path`` reaches (relative resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of both packages it imports (the longest known prefix of each name)."""
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for name in imported_names(path, module):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def floor_of(module: str) -> int | None:
    for room, floor in sorted(FLOORS.items(), key=lambda item: -len(item[0])):
        if module == room or module.startswith(room + "."):
            return floor
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(module_files())


def test_the_loop_finder_finds_loops() -> None:
    """Negative control: a loop through a lazy import, and one of three modules, are found."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": set()}) == [["x", "y", "z"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_local_and_type_checking_imports_are_edges(tmp_path: Path) -> None:
    """The reader sees imports inside functions and under TYPE_CHECKING, and relative ones."""
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import X\n"
                      "def f():\n    from . import b\n    import p.c.d\n")
    assert {"p.a", "p.a.X", "p", "p.b", "p.c.d"} <= imported_names(source, "p.m")


def test_no_import_loops(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == [], "import loops (lazy and type-only imports count too)"


def test_every_circuits_llm_module_has_a_floor(graph: dict[str, set[str]]) -> None:
    homeless = [m for m in graph if m.startswith("circuits_llm.") and floor_of(m) is None]
    assert homeless == [], "give each new room a floor in FLOORS (and in docs/architecture.md)"


def test_floors_go_one_way(graph: dict[str, set[str]]) -> None:
    """Application -> training -> decoding -> backbone -> text -> heads/runtime; never back up."""
    upward = []
    for module, targets in graph.items():
        floor = floor_of(module)
        if floor is None:
            continue
        for target in targets:
            target_floor = floor_of(target)
            if target_floor is not None and target_floor > floor:
                upward.append(f"{module} (floor {floor}) -> {target} (floor {target_floor})")
    assert upward == []


def test_circuits_imports_nothing_llm_specific(graph: dict[str, set[str]]) -> None:
    leaks = [f"{m} -> {t}" for m, targets in graph.items() if m.split(".")[0] == "circuits"
             for t in targets if t.split(".")[0] == "circuits_llm"]
    assert leaks == []


def test_the_package_face() -> None:
    import circuits_llm
    from circuits_llm.app.head_cache import shipped_drafter, shipped_head
    from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
    from circuits_llm.decoding.draft_length import DraftLength
    from circuits_llm.decoding.lookup import ContextLookup
    from circuits_llm.decoding.stopping import StopCondition
    from circuits_llm.heads import MTPHead, load_head, register_head_kind, save_head
    from circuits_llm.text.models import load_model

    face = {"DraftLength": DraftLength, "ContextLookup": ContextLookup,
            "load_model": load_model, "MTPHead": MTPHead, "SpeculativeDecoder": SpeculativeDecoder,
            "AutoregressiveDecoder": AutoregressiveDecoder, "StopCondition": StopCondition,
            "save_head": save_head, "load_head": load_head, "register_head_kind": register_head_kind,
            "shipped_head": shipped_head, "shipped_drafter": shipped_drafter}
    assert sorted(circuits_llm.__all__) == sorted(face)
    for name, value in face.items():
        assert getattr(circuits_llm, name) is value

