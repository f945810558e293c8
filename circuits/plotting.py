"""Pictures of structures: a region graph (regions and partitions) or a circuit (its layers).

``circuits.plot(obj, "structure.png")`` draws ``obj`` top-down, root (or output layer) first:

* a :class:`~circuits.region_graphs.RegionGraph`: every region as a box labelled with its scope,
  every partition as a small ``x`` node under its region, joined to the regions it splits into;
* a :class:`~circuits.symbolic.Circuit` (or a compiled one, which draws its symbolic circuit):
  every layer as one node: input layers with their variable, family and units; sum layers with
  their units and scope; product layers with their kind (Hadamard or Kronecker) and units.

Two renderers draw the same :class:`Drawing`: :attr:`Renderer.GRAPHVIZ` (the ``graphviz`` Python
package; it needs the ``dot`` binary, e.g. Debian's ``graphviz`` package) lays graphs out best and
is chosen whenever both are present (:func:`choose_renderer`); :attr:`Renderer.MATPLOTLIB` (with a
layered layout computed here) needs nothing beyond the project's dependencies. The format comes
from the path's suffix (:class:`ImageFormat`: ``.png``, ``.svg``, ``.pdf``), and the file is
written whole or not at all (:func:`circuits.files.atomic_write`).
"""

from __future__ import annotations

import importlib.util
import io
import itertools
import os
import shutil
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from circuits.compiled.core import CircuitCore
from circuits.errors import InvalidInputError
from circuits.files import atomic_write
from circuits.region_graphs.graph import NodeKind, RegionGraph
from circuits.symbolic import Circuit, InputLayer, Layer, ProductKind, ProductLayer, SumLayer


class Renderer(Enum):
    """Who draws the picture."""

    #: the ``graphviz`` package and the ``dot`` binary (best layouts)
    GRAPHVIZ = "graphviz"
    #: matplotlib, with the layered layout of :func:`layout` (always available)
    MATPLOTLIB = "matplotlib"


class ImageFormat(Enum):
    """The picture formats both renderers write, named by the path's suffix."""

    PNG = "png"
    SVG = "svg"
    PDF = "pdf"


class NodeStyle(Enum):
    """What a drawn node stands for (sets its shape and colour)."""

    REGION = "region"
    PARTITION = "partition"
    INPUT = "input"
    SUM = "sum"
    PRODUCT = "product"


#: fill colour and (graphviz shape, matplotlib box style) of each node style
_LOOK: dict[NodeStyle, tuple[str, str, str]] = {
    NodeStyle.REGION: ("#dbe9f6", "box", "round,pad=0.3"),
    NodeStyle.PARTITION: ("#e0e0e0", "circle", "circle,pad=0.15"),
    NodeStyle.INPUT: ("#d9f0d3", "box", "round,pad=0.3"),
    NodeStyle.SUM: ("#fde0c5", "ellipse", "round4,pad=0.3"),
    NodeStyle.PRODUCT: ("#e8dff5", "ellipse", "round4,pad=0.3"),
}


@dataclass(frozen=True)
class DrawingNode:
    """One node: ``key`` (unique), text ``lines``, ``style``, and ``level`` (0 at the top)."""

    key: str
    lines: tuple[str, ...]
    style: NodeStyle
    level: int


@dataclass(frozen=True)
class Drawing:
    """What both renderers draw: nodes top-down in depth-first order, edges parent -> child."""

    title: str
    nodes: tuple[DrawingNode, ...]
    edges: tuple[tuple[str, str], ...]


# ------------------------------------------------------------------------------ what to draw
def format_scope(scope: Iterable[int], max_runs: int = 4) -> str:
    """``{0-3, 8-11}``: a scope as runs of consecutive variables; past ``max_runs`` runs the
    rest is elided and the size given (``{0, 2, 4, ... } (40 vars)``)."""
    values = sorted(scope)
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    parts = [str(a) if a == b else (f"{a}, {b}" if b == a + 1 else f"{a}-{b}") for a, b in runs]
    if len(parts) <= max_runs:
        return "{" + ", ".join(parts) + "}"
    return "{" + ", ".join(parts[:max_runs]) + f", ...}} ({len(values)} vars)"


def _levels(top: Hashable, children: dict[Hashable, Sequence[Hashable]]) -> tuple[list[Hashable],
                                                                                  dict[Hashable, int]]:
    """Depth-first preorder from ``top`` (each node once) and each node's longest distance from it."""
    order: list[Hashable] = []
    seen: set[Hashable] = set()
    stack = [top]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(reversed([c for c in children[node] if c not in seen]))
    level = dict.fromkeys(order, 0)
    indegree = dict.fromkeys(order, 0)
    for node in order:
        for child in children[node]:
            indegree[child] += 1
    ready = [top]
    while ready:  # Kahn's order: a node is placed after all its parents
        node = ready.pop()
        for child in children[node]:
            level[child] = max(level[child], level[node] + 1)
            indegree[child] -= 1
            if indegree[child] == 0:
                ready.append(child)
    return order, level


def _region_graph_drawing(rg: RegionGraph, title: str) -> Drawing:
    children = {node: tuple(rg.graph.successors(node)) for node in rg.graph}
    order, level = _levels(rg.root, children)
    key = {node: f"n{i}" for i, node in enumerate(order)}
    nodes = []
    for node in order:
        if rg.kind(node) is NodeKind.REGION:
            nodes.append(DrawingNode(key[node], (format_scope(rg.scope_of(node)),), NodeStyle.REGION,
                                     level[node]))
        else:
            nodes.append(DrawingNode(key[node], ("x",), NodeStyle.PARTITION, level[node]))
    edges = tuple((key[node], key[child]) for node in order for child in children[node])
    return Drawing(title, tuple(nodes), edges)


def _units(count: int) -> str:
    return f"{count} unit" if count == 1 else f"{count} units"


def _layer_lines(layer: Layer) -> tuple[str, ...]:
    if isinstance(layer, InputLayer):
        head = f"integrated x{layer.variable}" if layer.integrated else f"x{layer.variable}"
        return (head, layer.distribution.describe(), _units(layer.num_units))
    if isinstance(layer, SumLayer):
        return (f"sum, {_units(layer.num_units)}", format_scope(layer.scope))
    assert isinstance(layer, ProductLayer)
    kind = "hadamard" if layer.kind is ProductKind.HADAMARD else "kronecker"
    return (f"{kind}, {_units(layer.num_units)}", format_scope(layer.scope))


def _circuit_drawing(circuit: Circuit, title: str) -> Drawing:
    by_uid = {layer.uid: layer for layer in circuit.layers}
    children = {layer.uid: tuple(i.uid for i in layer.inputs) for layer in circuit.layers}
    order, level = _levels(circuit.output.uid, children)
    styles = {InputLayer: NodeStyle.INPUT, SumLayer: NodeStyle.SUM, ProductLayer: NodeStyle.PRODUCT}
    nodes = tuple(DrawingNode(f"L{uid}", _layer_lines(by_uid[uid]), styles[type(by_uid[uid])], level[uid])
                  for uid in order)
    edges = tuple((f"L{uid}", f"L{child}") for uid in order for child in children[uid])
    return Drawing(title, nodes, edges)


def drawing(obj: object, title: str | None = None) -> Drawing:
    """The :class:`Drawing` of a region graph, a circuit or a compiled circuit.

    Raises:
        InvalidInputError: ``obj`` is none of these.
    """
    if isinstance(obj, CircuitCore):
        obj = obj.circuit
    if isinstance(obj, RegionGraph):
        return _region_graph_drawing(obj, title if title is not None else repr(obj))
    if isinstance(obj, Circuit):
        return _circuit_drawing(obj, title if title is not None else repr(obj))
    raise InvalidInputError(
        f"plot draws a RegionGraph, a Circuit or a compiled circuit, got {type(obj).__name__}; "
        "wrap a networkx graph with RegionGraph.from_networkx first")


# ------------------------------------------------------------------------------ renderers
def choose_renderer() -> Renderer:
    """:attr:`Renderer.GRAPHVIZ` when the ``graphviz`` package is importable and the ``dot``
    binary is on the PATH, else :attr:`Renderer.MATPLOTLIB`."""
    if shutil.which("dot") is not None and importlib.util.find_spec("graphviz") is not None:
        return Renderer.GRAPHVIZ
    return Renderer.MATPLOTLIB


def image_format(path: str | os.PathLike[str]) -> ImageFormat:
    """The :class:`ImageFormat` named by ``path``'s suffix (any case), or an InvalidInputError."""
    suffix = Path(path).suffix.lower().lstrip(".")
    try:
        return ImageFormat(suffix)
    except ValueError:
        known = ", ".join(f".{f.value}" for f in ImageFormat)
        raise InvalidInputError(
            f"cannot tell the picture format of {str(path)!r}: its suffix must be one of {known}"
        ) from None


def layout(drawing: Drawing) -> dict[str, tuple[float, float]]:
    """``{key: (x, y)}``: a layered layout, top level at ``y = 0`` going down by 1 per level.

    Nodes without children take consecutive slots in depth-first order; a parent sits over the
    mean of its children; nodes of one level are then pushed apart to at least one slot.
    """
    children: dict[str, list[str]] = {node.key: [] for node in drawing.nodes}
    for parent, child in drawing.edges:
        children[parent].append(child)
    x: dict[str, float] = {}
    slot = 0
    for node in drawing.nodes:  # depth-first order
        if not children[node.key]:
            x[node.key] = float(slot)
            slot += 1
    for node in sorted(drawing.nodes, key=lambda n: -n.level):  # bottom-up
        if children[node.key]:
            x[node.key] = sum(x[c] for c in children[node.key]) / len(children[node.key])
    rows: dict[int, list[DrawingNode]] = {}
    for node in drawing.nodes:
        rows.setdefault(node.level, []).append(node)
    for row in rows.values():
        row.sort(key=lambda n: x[n.key])
        for left, right in itertools.pairwise(row):
            x[right.key] = max(x[right.key], x[left.key] + 1.0)
    return {node.key: (x[node.key], -float(node.level)) for node in drawing.nodes}


def _render_matplotlib(drawing: Drawing, fmt: ImageFormat) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure

    pos = layout(drawing)
    xs = [p[0] for p in pos.values()]
    depth = 1 + max(node.level for node in drawing.nodes)
    span = max(xs) - min(xs) + 1
    width, height = min(60.0, max(4.0, 1.3 * span)), min(40.0, max(2.5, 1.0 * depth + 0.8))
    font = max(2.5, min(8.0, 8.0 * width / (1.3 * span)))
    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.add_axes((0.01, 0.01, 0.98, 0.92 if drawing.title else 0.98))
    ax.set_axis_off()
    segments = [(pos[parent], pos[child]) for parent, child in drawing.edges]
    ax.add_collection(LineCollection(segments, colors="#666666", linewidths=0.7, zorder=1))
    for node in drawing.nodes:
        fill, _, box = _LOOK[node.style]
        ax.text(*pos[node.key], "\n".join(node.lines), ha="center", va="center", fontsize=font,
                zorder=2, bbox={"boxstyle": box, "facecolor": fill, "edgecolor": "#444444",
                                "linewidth": 0.6})
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.set_ylim(-(depth - 1) - 0.6, 0.6)
    if drawing.title:
        figure.suptitle(drawing.title, fontsize=max(font, 7.0))
    buffer = io.BytesIO()
    figure.savefig(buffer, format=fmt.value)
    return buffer.getvalue()


def graphviz_graph(drawing: Drawing) -> Any:
    """The :class:`graphviz.Digraph` of ``drawing`` (its DOT text is ``.source``; building it
    needs the ``graphviz`` package but not the ``dot`` binary, which only rendering needs)."""
    import graphviz

    graph = graphviz.Digraph(
        graph_attr={"rankdir": "TB", "label": drawing.title, "labelloc": "t", "fontsize": "12",
                    "nodesep": "0.15", "ranksep": "0.35"},
        node_attr={"fontname": "Helvetica", "fontsize": "10", "style": "filled",
                   "color": "#444444", "penwidth": "0.6", "margin": "0.05,0.03", "height": "0.3"},
        edge_attr={"arrowhead": "none", "color": "#666666"})
    for node in drawing.nodes:
        fill, shape, _ = _LOOK[node.style]
        style = "filled,rounded" if shape == "box" else "filled"
        graph.node(node.key, "\\n".join(node.lines), shape=shape, fillcolor=fill, style=style)
    for parent, child in drawing.edges:
        graph.edge(parent, child)
    return graph


def _render_graphviz(drawing: Drawing, fmt: ImageFormat) -> bytes:
    return graphviz_graph(drawing).pipe(format=fmt.value)


def plot(obj: RegionGraph | Circuit | CircuitCore, path: str | os.PathLike[str], *,
         renderer: Renderer | None = None, title: str | None = None) -> Path:
    """Draw a region graph or a circuit into ``path`` (``.png``, ``.svg`` or ``.pdf``).

    Args:
        obj: a :class:`~circuits.region_graphs.RegionGraph`, a :class:`~circuits.Circuit`, or a
            compiled circuit (its symbolic circuit is drawn).
        path: the picture to write, atomically; its suffix sets the format.
        renderer: None picks one (:func:`choose_renderer`); :attr:`Renderer.GRAPHVIZ` needs the
            ``graphviz`` package and the ``dot`` binary.
        title: drawn above the picture; default ``repr(obj)`` (its sizes).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        InvalidInputError: an object that is not drawable, a suffix of no supported format, or
            a renderer that is not available. Nothing is written then.
    """
    fmt = image_format(path)
    content = drawing(obj, title)
    if renderer is None:
        renderer = choose_renderer()
    if not isinstance(renderer, Renderer):
        raise InvalidInputError(f"renderer must be a Renderer or None, got {renderer!r}")
    if renderer is Renderer.GRAPHVIZ:
        if importlib.util.find_spec("graphviz") is None or shutil.which("dot") is None:
            raise InvalidInputError(
                "Renderer.GRAPHVIZ needs the graphviz Python package and the `dot` binary (Debian: "
                "apt install graphviz); use Renderer.MATPLOTLIB, or renderer=None to pick one")
        data = _render_graphviz(content, fmt)
    else:
        data = _render_matplotlib(content, fmt)
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


__all__ = ["Drawing", "DrawingNode", "ImageFormat", "NodeStyle", "Renderer", "choose_renderer",
           "drawing", "format_scope", "graphviz_graph", "image_format", "layout", "plot"]
