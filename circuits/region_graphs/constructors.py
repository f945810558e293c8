"""The standard region graphs: fully factorised, linear (HMM), balanced and random binary trees
(RAT-SPN), quad trees and Poon-Domingos rectangle graphs over images.

Every constructor returns a validated :class:`~circuits.region_graphs.RegionGraph` whose nodes are
ints numbered in creation order (the root is node 0). Variables are ``0 .. n-1``; image
constructors number pixel ``(r, c)`` as ``r * width + c``. Over a single variable every
constructor returns the one-region graph (the root is then a leaf).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from numbers import Integral

import networkx as nx
import numpy as np

from circuits.errors import RegionGraphError
from circuits.region_graphs.graph import KIND_KEY, SCOPE_KEY, NodeKind, RegionGraph

Rectangle = tuple[int, int, int, int]  # rows [r0, r1) x columns [c0, c1)


def check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int, or a RegionGraphError saying it must be an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise RegionGraphError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class GraphBuilder:
    """Accumulates region and partition nodes (int ids, in creation order) for a RegionGraph.

    ``region(scope, key)`` reuses the node made earlier with the same ``key`` (None: always a new
    node), which is how DAG-shaped graphs share regions.
    """

    def __init__(self) -> None:
        self.graph = nx.DiGraph()
        self._shared: dict[Hashable, int] = {}

    def region(self, scope: Iterable[int], key: Hashable | None = None) -> int:
        if key is not None and key in self._shared:
            return self._shared[key]
        node = self.graph.number_of_nodes()
        self.graph.add_node(node, **{KIND_KEY: NodeKind.REGION, SCOPE_KEY: frozenset(scope)})
        if key is not None:
            self._shared[key] = node
        return node

    def has(self, key: Hashable) -> bool:
        return key in self._shared

    def partition(self, region: int, children: Sequence[int]) -> int:
        node = self.graph.number_of_nodes()
        self.graph.add_node(node, **{KIND_KEY: NodeKind.PARTITION})
        self.graph.add_edge(region, node)
        for child in children:
            self.graph.add_edge(node, child)
        return node

    def build(self) -> RegionGraph:
        return RegionGraph.from_networkx(self.graph)


def fully_factorized(num_variables: int) -> RegionGraph:
    """The root region ``{0..n-1}`` with one partition into the ``n`` singletons."""
    n = check_positive_int("num_variables", num_variables)
    builder = GraphBuilder()
    root = builder.region(range(n))
    if n > 1:
        builder.partition(root, [builder.region((v,)) for v in range(n)])
    return builder.build()


def linear(num_variables: int) -> RegionGraph:
    """The HMM chain: region ``{i..n-1}`` splits into ``{i}`` and ``{i+1..n-1}``.

    Built with CP this is exactly an inhomogeneous HMM over ``x_0 .. x_{n-1}``.
    """
    n = check_positive_int("num_variables", num_variables)
    builder = GraphBuilder()
    region = builder.region(range(n))
    for i in range(n - 1):
        head = builder.region((i,))
        tail = builder.region(range(i + 1, n))
        builder.partition(region, [head, tail])
        region = tail
    return builder.build()


def balanced_binary_tree(num_variables: int) -> RegionGraph:
    """Split a region of ``m`` variables into its first ``floor(m/2)`` and the rest, down to
    singletons: the MTPC paper's BTree (same structure as :func:`circuits.templates.btree`)."""
    n = check_positive_int("num_variables", num_variables)
    builder = GraphBuilder()

    def grow(lo: int, hi: int) -> int:
        region = builder.region(range(lo, hi))
        if hi - lo > 1:
            mid = lo + (hi - lo) // 2
            builder.partition(region, [grow(lo, mid), grow(mid, hi)])
        return region

    grow(0, n)
    return builder.build()


def random_binary_tree(num_variables: int, depth: int, num_repetitions: int = 1,
                       seed: int = 0) -> RegionGraph:
    """A RAT-SPN region graph (Peharz et al., 2019).

    Each of the ``num_repetitions`` repetitions shuffles the variables (``numpy`` generator seeded
    with ``seed``, so the graph is a function of the arguments) and splits the root recursively
    into two halves of sizes ``floor(m/2)`` and ``ceil(m/2)`` for ``depth`` levels; a region of
    one variable stops early. All repetitions share the root region, which therefore has
    ``num_repetitions`` partitions; the other regions belong to one repetition each (two
    repetitions may produce regions with equal scopes; they stay separate nodes). Leaves hold
    ``~ n / 2**depth`` variables. ``depth=0`` makes the root a leaf.
    """
    n = check_positive_int("num_variables", num_variables)
    depth = check_positive_int("depth", depth, minimum=0)
    repetitions = check_positive_int("num_repetitions", num_repetitions)
    if isinstance(seed, bool) or not isinstance(seed, Integral):
        raise RegionGraphError(f"seed must be an int, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    builder = GraphBuilder()
    root = builder.region(range(n))
    if n == 1 or depth == 0:
        return builder.build()

    def grow(variables: list[int], level: int) -> int:
        region = builder.region(variables)
        if level < depth and len(variables) > 1:
            half = len(variables) // 2
            builder.partition(region, [grow(variables[:half], level + 1),
                                       grow(variables[half:], level + 1)])
        return region

    for _ in range(repetitions):
        order = [int(v) for v in rng.permutation(n)]
        half = n // 2
        builder.partition(root, [grow(order[:half], 1), grow(order[half:], 1)])
    return builder.build()


def _pixels(rect: Rectangle, width: int) -> list[int]:
    r0, r1, c0, c1 = rect
    return [r * width + c for r in range(r0, r1) for c in range(c0, c1)]


def _check_shape(height: object, width: object) -> tuple[int, int]:
    return check_positive_int("height", height), check_positive_int("width", width)


def quad_tree(height: int, width: int) -> RegionGraph:
    """A quad tree over a ``height x width`` image (pixel ``(r, c)`` is variable ``r*width + c``).

    Each rectangle splits at its middle row and column (first halves ``floor(len/2)``) into four
    quadrants in the order top-left, top-right, bottom-left, bottom-right; a rectangle one pixel
    tall or wide splits into two halves instead; single pixels are the leaves.
    """
    height, width = _check_shape(height, width)
    builder = GraphBuilder()

    def grow(rect: Rectangle) -> int:
        r0, r1, c0, c1 = rect
        region = builder.region(_pixels(rect, width))
        rows = [(r0, r1)] if r1 - r0 == 1 else [(r0, r0 + (r1 - r0) // 2), (r0 + (r1 - r0) // 2, r1)]
        cols = [(c0, c1)] if c1 - c0 == 1 else [(c0, c0 + (c1 - c0) // 2), (c0 + (c1 - c0) // 2, c1)]
        if len(rows) * len(cols) > 1:
            builder.partition(region, [grow((a, b, c, d)) for a, b in rows for c, d in cols])
        return region

    grow((0, height, 0, width))
    return builder.build()


def _check_delta(delta: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(delta, Integral) and not isinstance(delta, bool):
        step = check_positive_int("delta", delta)
        return step, step
    if isinstance(delta, Sequence) and not isinstance(delta, str) and len(delta) == 2:
        return (check_positive_int("delta[0] (row step)", delta[0]),
                check_positive_int("delta[1] (column step)", delta[1]))
    raise RegionGraphError(
        f"delta must be an int >= 1 or a pair (row_step, column_step) of ints >= 1, got {delta!r}")


def poon_domingos(shape: Sequence[int], delta: int | Sequence[int] = 1) -> RegionGraph:
    """The Poon-Domingos (2011) region graph over a ``height x width`` image.

    Every rectangle is split in two, horizontally at every row that is a multiple of the row
    step and vertically at every column that is a multiple of the column step (positions are
    absolute image coordinates, strictly inside the rectangle), one partition per cut. Equal
    rectangles are one shared region, so the graph is a DAG. Rectangles with no cut are leaves
    (several pixels when a step exceeds 1).

    Args:
        shape: ``(height, width)``; pixel ``(r, c)`` is variable ``r * width + c``.
        delta: the resolution of the cuts: an int for both axes or a pair ``(row_step,
            column_step)`` (one step per axis). ``delta=1`` cuts everywhere, down to pixels.
    """
    if isinstance(shape, str) or not isinstance(shape, Sequence) or len(shape) != 2:
        raise RegionGraphError(f"shape must be a pair (height, width), got {shape!r}")
    height, width = _check_shape(shape[0], shape[1])
    row_step, col_step = _check_delta(delta)
    builder = GraphBuilder()

    def grow(rect: Rectangle) -> int:
        if builder.has(rect):
            return builder.region((), key=rect)
        r0, r1, c0, c1 = rect
        region = builder.region(_pixels(rect, width), key=rect)
        for cut in range(r0 + 1, r1):
            if cut % row_step == 0:
                builder.partition(region, [grow((r0, cut, c0, c1)), grow((cut, r1, c0, c1))])
        for cut in range(c0 + 1, c1):
            if cut % col_step == 0:
                builder.partition(region, [grow((r0, r1, c0, cut)), grow((r0, r1, cut, c1))])
        return region

    grow((0, height, 0, width))
    return builder.build()


__all__ = [
    "GraphBuilder", "balanced_binary_tree", "check_positive_int", "fully_factorized", "linear",
    "poon_domingos", "quad_tree", "random_binary_tree",
]
