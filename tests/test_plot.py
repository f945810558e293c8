"""Tests of circuits.plot (circuits.plotting): what is drawn, the renderer chooser, renderers, files.

The matplotlib renderer is exercised always. The graphviz renderer's graph (its DOT text) is
built without the ``dot`` binary; rendering through ``dot`` runs only where the binary exists,
and the chooser is tested by faking its presence and absence.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import shutil
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

import circuits
from circuits import InvalidInputError, templates
from circuits.plotting import ImageFormat, NodeStyle, Renderer, choose_renderer, drawing, format_scope, plot
from circuits.region_graphs import (
    SumProductPattern,
    build_circuit,
    chow_liu,
    poon_domingos,
    quad_tree,
)

# the module itself (``circuits.plot`` is the function the package exports)
plotting = importlib.import_module("circuits.plotting")

MAGIC = {ImageFormat.PNG: b"\x89PNG\r\n\x1a\n", ImageFormat.SVG: b"<svg", ImageFormat.PDF: b"%PDF"}


def only_file(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------ what is drawn
def test_region_graph_drawing_has_every_region_and_partition() -> None:
    rg = poon_domingos((2, 3), 1)  # a DAG: shared regions
    picture = drawing(rg)
    assert len(picture.nodes) == len(rg.graph) and len(picture.edges) == rg.graph.number_of_edges()
    assert len({n.key for n in picture.nodes}) == len(picture.nodes)
    regions = [n for n in picture.nodes if n.style is NodeStyle.REGION]
    assert len(regions) == len(rg.regions())
    assert sorted(n.lines[0] for n in regions) == sorted(format_scope(rg.scope_of(r)) for r in rg.regions())
    assert sum(n.style is NodeStyle.PARTITION for n in picture.nodes) == len(rg.partitions())
    assert picture.nodes[0].lines == ("{0-5}",) and picture.nodes[0].level == 0
    level = {n.key: n.level for n in picture.nodes}
    assert all(level[child] > level[parent] for parent, child in picture.edges)
    # the drawn graph is the region graph: same edges up to the renaming of nodes
    drawn = nx.DiGraph(list(picture.edges))
    assert nx.is_isomorphic(drawn, nx.DiGraph(rg.graph.edges()))
    assert picture.title == repr(rg)
    assert drawing(rg, title="mine").title == "mine"


def test_circuit_drawing_has_every_layer_with_its_units_and_scope() -> None:
    circuit = build_circuit(quad_tree(2, 2), SumProductPattern.TUCKER, 3, 2, num_categories=5)
    picture = drawing(circuit)
    assert len(picture.nodes) == len(circuit.layers)
    assert len(picture.edges) == sum(len(layer.inputs) for layer in circuit.layers)
    lines = {n.lines for n in picture.nodes}
    assert ("sum, 1 unit", "{0-3}") in lines  # the output, first
    assert picture.nodes[0].lines == ("sum, 1 unit", "{0-3}")
    assert ("kronecker, 16 units", "{0-3}") in lines  # 2^4 units of a Tucker product
    assert {("x" + str(v), "Categorical(5)", "2 units") for v in range(4)} <= lines
    styles = [n.style for n in picture.nodes]
    assert styles.count(NodeStyle.INPUT) == 4 and styles.count(NodeStyle.PRODUCT) == 1
    hadamard = drawing(templates.hclt(np.array([[0, 1, 1], [1, 0, 1]]), 2, 2))
    assert any(n.lines[0] == "hadamard, 2 units" for n in hadamard.nodes)
    compiled = circuits.compile(circuit)
    assert drawing(compiled).nodes == picture.nodes  # a compiled circuit draws its circuit


def test_integrated_inputs_are_labelled() -> None:
    circuit = circuits.integrate(templates.build("hmm", 3, 2, rank=2), [1])
    labels = {n.lines[0] for n in drawing(circuit).nodes if n.style is NodeStyle.INPUT}
    assert labels == {"x0", "integrated x1", "x2"}


def test_format_scope() -> None:
    assert format_scope({3}) == "{3}"
    assert format_scope(range(8)) == "{0-7}"
    assert format_scope({0, 1, 4, 5}) == "{0, 1, 4, 5}"
    assert format_scope({0, 1, 2, 8, 9, 10}) == "{0-2, 8-10}"
    assert format_scope(range(0, 40, 2)) == "{0, 2, 4, 6, ...} (20 vars)"


def test_layout_puts_parents_over_their_children_and_keeps_rows_apart() -> None:
    picture = drawing(poon_domingos((3, 3), 1))
    pos = plotting.layout(picture)
    children: dict[str, list[str]] = {}
    for parent, child in picture.edges:
        children.setdefault(parent, []).append(child)
    rows: dict[float, list[float]] = {}
    for node in picture.nodes:
        x, y = pos[node.key]
        assert y == -node.level
        rows.setdefault(y, []).append(x)
    for xs in rows.values():
        xs.sort()
        assert all(b - a >= 1.0 - 1e-9 for a, b in itertools.pairwise(xs))
    tree = drawing(quad_tree(4, 4))
    tree_pos = plotting.layout(tree)
    for parent, child_keys in [(p, [c for q, c in tree.edges if q == p]) for p, _ in tree.edges]:
        mean = sum(tree_pos[c][0] for c in child_keys) / len(child_keys)
        assert tree_pos[parent][0] == pytest.approx(mean)  # a tree needs no pushing apart


# ------------------------------------------------------------------ choosing the renderer
def fake_tools(monkeypatch: pytest.MonkeyPatch, *, dot: bool, package: bool) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: "/usr/bin/dot" if dot and name == "dot"
                        else None)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "graphviz" and not package
                        else real_find_spec(name, *a))


@pytest.mark.parametrize(("dot", "package", "expected"), [
    (True, True, Renderer.GRAPHVIZ), (False, True, Renderer.MATPLOTLIB),
    (True, False, Renderer.MATPLOTLIB), (False, False, Renderer.MATPLOTLIB)])
def test_chooser_picks_graphviz_only_with_dot_and_the_package(
        monkeypatch: pytest.MonkeyPatch, dot: bool, package: bool, expected: Renderer) -> None:
    fake_tools(monkeypatch, dot=dot, package=package)
    assert choose_renderer() is expected


@pytest.mark.parametrize("dot", [True, False])
def test_plot_renders_with_the_chosen_renderer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               dot: bool) -> None:
    fake_tools(monkeypatch, dot=dot, package=True)
    calls: list[tuple[Renderer, ImageFormat]] = []
    monkeypatch.setattr(plotting, "_render_graphviz",
                        lambda d, fmt: calls.append((Renderer.GRAPHVIZ, fmt)) or b"graphviz")
    monkeypatch.setattr(plotting, "_render_matplotlib",
                        lambda d, fmt: calls.append((Renderer.MATPLOTLIB, fmt)) or b"matplotlib")
    path = plot(quad_tree(2, 2), tmp_path / "rg.SVG")
    expected = Renderer.GRAPHVIZ if dot else Renderer.MATPLOTLIB
    assert calls == [(expected, ImageFormat.SVG)]
    assert path == tmp_path / "rg.SVG" and path.read_bytes() == expected.value.encode()
    calls.clear()
    plot(quad_tree(2, 2), tmp_path / "forced.png", renderer=Renderer.MATPLOTLIB)
    assert calls == [(Renderer.MATPLOTLIB, ImageFormat.PNG)]


# ------------------------------------------------------------------ the renderers
@pytest.mark.parametrize("fmt", list(ImageFormat))
def test_matplotlib_renderer_writes_each_format(tmp_path: Path, fmt: ImageFormat) -> None:
    rg = chow_liu(np.random.default_rng(0).integers(0, 2, size=(50, 6)), root=None)
    path = plot(rg, tmp_path / f"tree.{fmt.value}", renderer=Renderer.MATPLOTLIB)
    head = path.read_bytes()[:200]
    assert MAGIC[fmt] in head
    assert only_file(tmp_path) == [f"tree.{fmt.value}"]  # no temporary file left


def test_matplotlib_renderer_draws_circuits_and_big_graphs(tmp_path: Path) -> None:
    from matplotlib.image import imread

    small = plot(build_circuit(quad_tree(2, 2), "cp", 2, 2, num_categories=3), tmp_path / "c.png",
                 renderer=Renderer.MATPLOTLIB)
    image = imread(small)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.01  # something was drawn
    big = plot(quad_tree(8, 8), tmp_path / "big.png", renderer=Renderer.MATPLOTLIB)
    width = imread(big).shape[1]
    assert width <= 60 * 100  # the figure is capped at 60 inches


def test_graphviz_graph_source_without_dot() -> None:
    picture = drawing(build_circuit(quad_tree(2, 2), "cp", 2, 2, num_categories=3), title="t")
    source = plotting.graphviz_graph(picture).source
    for node in picture.nodes:
        assert f'{node.key} [label="' + "\\n".join(node.lines) in source
    for parent, child in picture.edges:
        assert f"{parent} -> {child}" in source
    assert 'label=t' in source and "rankdir=TB" in source


@pytest.mark.skipif(shutil.which("dot") is None, reason="the graphviz `dot` binary is not installed")
def test_graphviz_renderer_with_dot(tmp_path: Path) -> None:
    path = plot(quad_tree(2, 2), tmp_path / "rg.png", renderer=Renderer.GRAPHVIZ)
    assert path.read_bytes().startswith(MAGIC[ImageFormat.PNG])


# ------------------------------------------------------------------ errors, nothing written
def test_unsupported_objects_and_suffixes(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="plot draws a RegionGraph, a Circuit or a compiled "
                                                "circuit, got DiGraph; wrap a networkx graph"):
        plot(nx.DiGraph([(0, 1)]), tmp_path / "g.png")
    with pytest.raises(InvalidInputError, match="got str"):
        plot("quad_tree", tmp_path / "g.png")
    with pytest.raises(InvalidInputError, match=r"suffix must be one of \.png, \.svg, \.pdf"):
        plot(quad_tree(2, 2), tmp_path / "g.jpg")
    with pytest.raises(InvalidInputError, match="cannot tell the picture format of"):
        plot(quad_tree(2, 2), tmp_path / "no_suffix")
    with pytest.raises(InvalidInputError, match="renderer must be a Renderer or None"):
        plot(quad_tree(2, 2), tmp_path / "g.png", renderer="graphviz")  # type: ignore[arg-type]
    assert only_file(tmp_path) == []


def test_graphviz_forced_without_dot_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    fake_tools(monkeypatch, dot=False, package=True)
    with pytest.raises(InvalidInputError, match=r"needs the graphviz Python package and the `dot` "
                                                r"binary.*use Renderer\.MATPLOTLIB"):
        plot(quad_tree(2, 2), tmp_path / "g.png", renderer=Renderer.GRAPHVIZ)
    assert only_file(tmp_path) == []


def test_a_failed_render_leaves_the_old_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "keep.png"
    path.write_bytes(b"old picture")

    def broken(*args: object) -> bytes:
        raise RuntimeError("renderer crashed")

    monkeypatch.setattr(plotting, "_render_matplotlib", broken)
    with pytest.raises(RuntimeError, match="renderer crashed"):
        plot(quad_tree(2, 2), path, renderer=Renderer.MATPLOTLIB)
    assert path.read_bytes() == b"old picture" and only_file(tmp_path) == ["keep.png"]


def test_region_graph_node_kinds_are_the_two_styles() -> None:
    rg = quad_tree(2, 4)
    styles = {n.style for n in drawing(rg).nodes}
    assert styles == {NodeStyle.REGION, NodeStyle.PARTITION}
