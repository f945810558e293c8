"""Region graphs: the variable decompositions that circuits are built from.

A *region graph* is a rooted DAG, bipartite between

* **region** nodes, each carrying a *scope* (a non-empty set of variable indices), and
* **partition** nodes, each splitting its parent region's scope into the pairwise-disjoint scopes
  of its child regions.

Edges point from parent to child (region -> partition -> region). The single root is a region;
*leaves* are regions without partitions. A region with several partitions is a mixture of several
ways of factorising its scope, which is how RAT-SPN and Poon-Domingos graphs share structure.

:class:`RegionGraph` wraps a frozen :class:`networkx.DiGraph` whose nodes carry the attribute
:data:`KIND_KEY` (a :class:`NodeKind`) and :data:`SCOPE_KEY` (a ``frozenset[int]``). Any user
graph written this way is accepted by :meth:`RegionGraph.from_networkx`, which validates it and
raises :class:`~circuits.errors.RegionGraphError` naming the first problem found.

Orders are part of the contract: the children of a partition and the partitions of a region are
taken in the order of the node's out-edges (networkx keeps insertion order); circuits built from
the graph (:func:`circuits.region_graphs.build_circuit`) follow that order.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from enum import Enum
from numbers import Integral
from typing import Any

import networkx as nx

from circuits.errors import RegionGraphError

Scope = frozenset[int]

#: Node attribute holding the node's :class:`NodeKind` (or its string value ``"region"``/``"partition"``).
KIND_KEY = "kind"
#: Node attribute holding a region's scope: a collection of ints (optional on inner regions).
SCOPE_KEY = "scope"


class NodeKind(Enum):
    """The two kinds of node of a region graph."""

    REGION = "region"
    PARTITION = "partition"


def format_scope(scope: Iterable[int]) -> str:
    """``{0, 2, 5}``: a scope written for error messages."""
    return "{" + ", ".join(map(str, sorted(scope))) + "}"


def _parse_kind(node: Hashable, value: Any) -> NodeKind:
    if isinstance(value, NodeKind):
        return value
    if isinstance(value, str):
        try:
            return NodeKind(value.lower())
        except ValueError:
            pass
    raise RegionGraphError(
        f"node {node!r} has {KIND_KEY}={value!r}; set the node attribute {KIND_KEY!r} to "
        "NodeKind.REGION or NodeKind.PARTITION")


def _parse_scope(node: Hashable, value: Any, label: str = "region") -> Scope:
    """A user-supplied scope as a frozenset of ints >= 0, or a RegionGraphError."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise RegionGraphError(
            f"{label} {node!r} has {SCOPE_KEY}={value!r}; a scope must be a collection of "
            "variable indices (ints), e.g. frozenset({0, 1})")
    items = list(value)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, Integral):
            raise RegionGraphError(
                f"{label} {node!r} has a non-integer variable {item!r} in its scope; variables "
                "are ints >= 0")
        if item < 0:
            raise RegionGraphError(
                f"{label} {node!r} has a negative variable {item} in its scope; variables are "
                "ints >= 0")
    scope = frozenset(int(item) for item in items)
    if len(scope) != len(items):
        raise RegionGraphError(
            f"{label} {node!r} lists a variable twice in its scope {items!r}; list each once")
    if not scope:
        raise RegionGraphError(
            f"{label} {node!r} has an empty scope; every region covers at least one variable")
    return scope


def _cycle_message(cycle: list[tuple[Any, ...]]) -> str:
    path = " -> ".join(repr(edge[0]) for edge in cycle) + f" -> {cycle[0][0]!r}"
    return f"region graph is cyclic: {path}; a region graph must be a DAG"


class RegionGraph:
    """A validated, immutable region graph (see the module docstring for the definitions).

    Build one with the constructors of :mod:`circuits.region_graphs` or from any
    :class:`networkx.DiGraph` with :meth:`from_networkx`.

    Attributes:
        graph: the frozen DiGraph (edges parent -> child); every node has :data:`KIND_KEY` set to
            a :class:`NodeKind` and :data:`SCOPE_KEY` set to its ``frozenset`` scope (a
            partition's scope is its parent region's). ``graph.copy()`` gives a mutable copy.
        root: the root region node.
    """

    def __init__(self, graph: nx.DiGraph) -> None:
        self.graph: nx.DiGraph = _validated_copy(graph)
        self.root: Hashable = next(n for n in self.graph if self.graph.in_degree(n) == 0)
        self._ranks: dict[Hashable, int] = {node: i for i, node in enumerate(self.graph)}

    @classmethod
    def from_networkx(cls, graph: nx.DiGraph) -> RegionGraph:
        """Validate a user DiGraph and wrap a normalised, frozen copy of it.

        Every node needs the attribute ``kind`` (:class:`NodeKind` or ``"region"`` /
        ``"partition"``). Leaf regions need ``scope`` (a collection of ints >= 0); inner regions
        may omit it, it is then the union of their partitions' children. The input graph is not
        modified.
        """
        return cls(graph)

    # ------------------------------------------------------------------ queries
    def kind(self, node: Hashable) -> NodeKind:
        """The kind of ``node``."""
        return self.graph.nodes[node][KIND_KEY]

    def scope_of(self, node: Hashable) -> Scope:
        """The scope of a region, or of a partition (= its parent region's scope)."""
        return self.graph.nodes[node][SCOPE_KEY]

    def regions(self) -> tuple[Hashable, ...]:
        """All region nodes, in node insertion order."""
        return tuple(n for n, kind in self.graph.nodes(data=KIND_KEY) if kind is NodeKind.REGION)

    def partitions(self) -> tuple[Hashable, ...]:
        """All partition nodes, in node insertion order."""
        return tuple(n for n, kind in self.graph.nodes(data=KIND_KEY)
                     if kind is NodeKind.PARTITION)

    def leaves(self) -> tuple[Hashable, ...]:
        """Regions without partitions, in node insertion order."""
        return tuple(n for n in self.regions() if self.graph.out_degree(n) == 0)

    def partitions_of(self, region: Hashable) -> tuple[Hashable, ...]:
        """The partitions of ``region``, in out-edge order (empty for a leaf)."""
        return tuple(self.graph.successors(region))

    def children_of(self, partition: Hashable) -> tuple[Hashable, ...]:
        """The child regions of ``partition``, in out-edge order."""
        return tuple(self.graph.successors(partition))

    def is_leaf(self, region: Hashable) -> bool:
        return self.graph.out_degree(region) == 0

    def topological_order(self) -> tuple[Hashable, ...]:
        """All nodes, every node before its children (root first); deterministic."""
        return tuple(nx.lexicographical_topological_sort(self.graph, key=self._insertion_rank))

    @property
    def scope(self) -> Scope:
        """The root's scope: every variable of the graph."""
        return self.scope_of(self.root)

    @property
    def num_variables(self) -> int:
        """How many variables the root covers (indices need not be contiguous; see ``scope``)."""
        return len(self.scope)

    def is_tree(self) -> bool:
        """True when every node has at most one parent (the graph is an arborescence)."""
        return all(degree <= 1 for _, degree in self.graph.in_degree())

    def splits(self) -> dict[Scope, set[frozenset[Scope]]]:
        """For every scope, the distinct ways the graph factorises it.

        Partitions count with the set of their children's scopes; a leaf region of several
        variables counts as a split into singletons (how :func:`build_circuit` realises it).
        """
        table: dict[Scope, set[frozenset[Scope]]] = {}
        for region in self.regions():
            scope = self.scope_of(region)
            if self.is_leaf(region):
                if len(scope) > 1:
                    table.setdefault(scope, set()).add(frozenset(frozenset((v,)) for v in scope))
                continue
            for partition in self.partitions_of(region):
                split = frozenset(self.scope_of(c) for c in self.children_of(partition))
                table.setdefault(scope, set()).add(split)
        return table

    def is_structured_decomposable(self) -> bool:
        """True when every scope is factorised in one way only.

        Circuits built from such a graph follow a single vtree, so they are
        structured-decomposable (and products of two of them are tractable). Trees always are;
        RAT-SPN graphs with several repetitions and Poon-Domingos graphs usually are not.
        """
        return all(len(ways) == 1 for ways in self.splits().values())

    def _insertion_rank(self, node: Hashable) -> int:
        return self._ranks[node]

    def __len__(self) -> int:
        return self.graph.number_of_nodes()

    def __repr__(self) -> str:
        return (f"RegionGraph(variables={self.num_variables}, regions={len(self.regions())}, "
                f"partitions={len(self.partitions())}, leaves={len(self.leaves())}, "
                f"tree={self.is_tree()})")


def _validated_copy(graph: nx.DiGraph) -> nx.DiGraph:
    """A frozen copy of ``graph`` with parsed kinds and scopes, or a RegionGraphError."""
    if not isinstance(graph, nx.DiGraph) or isinstance(graph, nx.MultiDiGraph):
        raise RegionGraphError(
            f"a region graph must be a networkx.DiGraph (not a multigraph), got "
            f"{type(graph).__name__}")
    if graph.number_of_nodes() == 0:
        raise RegionGraphError("the region graph is empty; it needs at least one root region")
    copy = nx.DiGraph()
    for node, data in graph.nodes(data=True):
        if KIND_KEY not in data:
            raise RegionGraphError(
                f"node {node!r} has no {KIND_KEY!r} attribute; set it to NodeKind.REGION or "
                "NodeKind.PARTITION")
        copy.add_node(node, **{KIND_KEY: _parse_kind(node, data[KIND_KEY])})
    for parent, child in graph.edges():
        if parent == child:
            raise RegionGraphError(f"region graph is cyclic: {parent!r} -> {parent!r} (self-loop)")
        parent_kind, child_kind = copy.nodes[parent][KIND_KEY], copy.nodes[child][KIND_KEY]
        if parent_kind is child_kind:
            raise RegionGraphError(
                f"edge {parent!r} -> {child!r} joins two {parent_kind.value} nodes; edges must go "
                "region -> partition -> region")
        copy.add_edge(parent, child)
    try:
        cycle = nx.find_cycle(copy)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle is not None:
        raise RegionGraphError(_cycle_message(list(cycle)))
    _check_parents(copy)
    _assign_scopes(copy, graph)
    return nx.freeze(copy)


def _check_parents(graph: nx.DiGraph) -> None:
    """One root region; every partition has exactly one parent region and >= 1 child."""
    roots = [n for n in graph if graph.in_degree(n) == 0]
    for node in graph:
        if graph.nodes[node][KIND_KEY] is not NodeKind.PARTITION:
            continue
        parents = list(graph.predecessors(node))
        if not parents:
            raise RegionGraphError(
                f"partition {node!r} has no parent region; attach it to the region it splits")
        if len(parents) > 1:
            raise RegionGraphError(
                f"partition {node!r} has {len(parents)} parent regions {parents!r}; a partition "
                "splits exactly one region (copy it for each region)")
        if graph.out_degree(node) < 1:
            raise RegionGraphError(
                f"partition {node!r} of region {parents[0]!r} has no child region; a partition "
                "needs at least one child")
    if len(roots) > 1:
        raise RegionGraphError(
            f"region graph has {len(roots)} roots (regions without a parent): {roots!r}; it needs "
            "a single root region: connect them under one region or remove the extra ones")


def _assign_scopes(copy: nx.DiGraph, source: nx.DiGraph) -> None:
    """Parse, infer and check the scope of every node, children before parents."""
    for node in reversed(list(nx.topological_sort(copy))):
        data = source.nodes[node]
        if copy.nodes[node][KIND_KEY] is NodeKind.PARTITION:
            copy.nodes[node][SCOPE_KEY] = _partition_scope(copy, node)
            continue
        given = _parse_scope(node, data[SCOPE_KEY]) if data.get(SCOPE_KEY) is not None else None
        partitions = list(copy.successors(node))
        if not partitions:
            if given is None:
                raise RegionGraphError(
                    f"leaf region {node!r} has no {SCOPE_KEY!r} attribute; leaf regions must give "
                    "their variables, e.g. scope=frozenset({3})")
            copy.nodes[node][SCOPE_KEY] = given
            continue
        scope = given if given is not None else copy.nodes[partitions[0]][SCOPE_KEY]
        for partition in partitions:
            covered = copy.nodes[partition][SCOPE_KEY]
            if covered != scope:
                origin = ("the region's declared scope" if given is not None
                          else f"partition {partitions[0]!r} of the same region covers")
                diff = ", ".join(f"{label} {format_scope(part)}" for label, part in (
                    ("missing", scope - covered), ("extra", covered - scope)) if part)
                raise RegionGraphError(
                    f"partition {partition!r} of region {node!r}: its children cover "
                    f"{format_scope(covered)} but {origin} {format_scope(scope)} ({diff}); the "
                    "children of a partition must cover exactly the region's scope")
        copy.nodes[node][SCOPE_KEY] = scope
        source_partition_scopes = [source.nodes[p].get(SCOPE_KEY) for p in partitions]
        for partition, declared in zip(partitions, source_partition_scopes, strict=True):
            if declared is not None and _parse_scope(partition, declared, "partition") != scope:
                raise RegionGraphError(
                    f"partition {partition!r} declares scope {format_scope(declared)} but its "
                    f"region {node!r} has scope {format_scope(scope)}; drop the attribute or fix it")


def _partition_scope(graph: nx.DiGraph, partition: Hashable) -> Scope:
    """The union of the children's scopes, checking they are pairwise disjoint."""
    owner: dict[int, Hashable] = {}
    for child in graph.successors(partition):
        scope = graph.nodes[child][SCOPE_KEY]
        overlap = scope & owner.keys()
        if overlap:
            other = owner[min(overlap)]
            parent = next(iter(graph.predecessors(partition)))
            raise RegionGraphError(
                f"partition {partition!r} of region {parent!r}: children {other!r} (scope "
                f"{format_scope(graph.nodes[other][SCOPE_KEY])}) and {child!r} (scope "
                f"{format_scope(scope)}) overlap on {format_scope(overlap)}; the children of a "
                "partition must have disjoint scopes")
        owner.update(dict.fromkeys(scope, child))
    return frozenset(owner)


__all__ = ["KIND_KEY", "SCOPE_KEY", "NodeKind", "RegionGraph", "Scope", "format_scope"]
