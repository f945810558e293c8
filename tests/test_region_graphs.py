"""Tests of circuits.region_graphs: validation, constructors, Chow-Liu, and the circuits built."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import networkx as nx
import numpy as np
import pytest
import torch

import circuits
from circuits import RegionGraphError, templates
from circuits.parameterizations import Exp
from circuits.region_graphs import (
    KIND_KEY,
    SCOPE_KEY,
    NodeKind,
    RegionGraph,
    SumProductPattern,
    balanced_binary_tree,
    build_circuit,
    chow_liu,
    chow_liu_tree,
    fully_factorized,
    linear,
    mutual_information,
    poon_domingos,
    quad_tree,
    random_binary_tree,
)
from circuits.symbolic import InputLayer, Layer, ProductLayer, SumLayer

torch.set_num_threads(1)

PATTERNS = list(SumProductPattern)
R, P = NodeKind.REGION, NodeKind.PARTITION

# A tree-shaped distribution over 7 ternary variables, sampled for the Chow-Liu tests.
TRUE_TREE = [(0, 1), (0, 2), (1, 3), (1, 4), (2, 5), (5, 6)]


def sample_tree_data(num_samples: int, seed: int = 0) -> np.ndarray:
    """Samples where each child copies its parent w.p. 0.8, else takes a uniform value."""
    rng = np.random.default_rng(seed)
    data = np.zeros((num_samples, 7), dtype=np.int64)
    data[:, 0] = rng.integers(0, 3, num_samples)
    for parent, child in TRUE_TREE:  # parents are listed before their children
        copy = rng.random(num_samples) < 0.8
        data[:, child] = np.where(copy, data[:, parent], rng.integers(0, 3, num_samples))
    return data


TINY: dict[str, Callable[[], RegionGraph]] = {
    "fully_factorized": lambda: fully_factorized(4),
    "linear": lambda: linear(4),
    "btree": lambda: balanced_binary_tree(5),
    "random": lambda: random_binary_tree(6, depth=2, num_repetitions=3, seed=1),
    "quad_2x2": lambda: quad_tree(2, 2),
    "quad_2x3": lambda: quad_tree(2, 3),
    "pd_2x3": lambda: poon_domingos((2, 3), 1),
    "pd_3x2_steps": lambda: poon_domingos((3, 2), (2, 1)),
    "chow_liu": lambda: chow_liu(sample_tree_data(300)[:, :5] % 2),
    "single": lambda: linear(1),
}

LARGER: dict[str, Callable[[], RegionGraph]] = {
    "linear": lambda: linear(12),
    "btree": lambda: balanced_binary_tree(13),
    "random": lambda: random_binary_tree(16, depth=3, num_repetitions=4, seed=0),
    "quad": lambda: quad_tree(4, 5),
    "pd": lambda: poon_domingos((4, 4), 1),
    "pd_coarse": lambda: poon_domingos((6, 5), 2),
    "chow_liu": lambda: chow_liu(sample_tree_data(500)),
}


def all_assignments(num_variables: int, num_categories: int) -> torch.Tensor:
    values = itertools.product(range(num_categories), repeat=num_variables)
    return torch.tensor(list(values), dtype=torch.long)


def signature(layer: Layer, memo: dict[int, tuple]) -> tuple:
    """A layer's structure, recursively: type, units, scope, product kind and inputs in order."""
    if layer.uid not in memo:
        kind = layer.kind.value if isinstance(layer, ProductLayer) else None
        memo[layer.uid] = (type(layer).__name__, layer.num_units, tuple(sorted(layer.scope)), kind,
                           tuple(signature(i, memo) for i in layer.inputs))
    return memo[layer.uid]


def edges_and_scopes(rg: RegionGraph) -> tuple[list, dict]:
    return list(rg.graph.edges()), {n: rg.scope_of(n) for n in rg.graph}


# ---------------------------------------------------------------- circuits from every constructor
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("units", [(2, 2), (3, 2)])
def test_tiny_circuits_are_valid_and_normalised(name: str, pattern: SumProductPattern,
                                                units: tuple[int, int]) -> None:
    rg = TINY[name]()
    num_input_units, num_sum_units = units
    circuit = build_circuit(rg, pattern, num_sum_units=num_sum_units,
                            num_input_units=num_input_units, num_categories=2)
    circuits.check(circuit)
    assert circuit.output.num_units == 1
    assert circuit.scope == rg.scope
    assert circuits.is_structured_decomposable(circuit) == rg.is_structured_decomposable()
    assert all(layer.num_units == num_input_units for layer in circuit.input_layers)
    compiled = circuits.compile(circuit, dtype=torch.float64, seed=3)
    x = all_assignments(circuit.num_variables, 2)
    total = torch.logsumexp(compiled.log_likelihood(x), dim=0)
    assert abs(total.item()) < 1e-10


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("name", list(LARGER))
def test_larger_circuits_have_unit_partition_function(name: str, pattern: SumProductPattern) -> None:
    rg = LARGER[name]()
    circuit = build_circuit(rg, pattern, num_sum_units=2, num_input_units=3, num_categories=3)
    circuits.check(circuit)
    assert circuits.is_structured_decomposable(circuit) == rg.is_structured_decomposable()
    compiled = circuits.compile(circuit, dtype=torch.float64)
    assert abs(compiled.log_partition().item()) < 1e-10


def test_unnormalised_parameterisations_are_used() -> None:
    rg = poon_domingos((2, 2), 1)
    circuit = build_circuit(rg, SumProductPattern.CP, 2, 2, 2, input_parameterization=Exp(),
                            sum_parameterization=Exp())
    assert all(isinstance(layer.parameterization, Exp)
               for layer in circuit.input_layers + circuit.sum_layers)
    compiled = circuits.compile(circuit, dtype=torch.float64, seed=1)
    brute = torch.logsumexp(compiled.log_likelihood(all_assignments(4, 2)), dim=0)
    assert abs(compiled.log_partition().item()) > 1e-3  # genuinely unnormalised
    assert torch.allclose(brute, compiled.log_partition(), atol=1e-10)


def test_per_variable_categories() -> None:
    circuit = build_circuit(linear(3), "cp", 2, 2, {0: 2, 1: 3, 2: 4})
    assert circuit.num_categories == {0: 2, 1: 3, 2: 4}
    x = torch.tensor(list(itertools.product(range(2), range(3), range(4))))
    compiled = circuits.compile(circuit, dtype=torch.float64)
    assert abs(torch.logsumexp(compiled.log_likelihood(x), 0).item()) < 1e-10


@pytest.mark.parametrize("num_variables", range(1, 10))
def test_btree_region_graph_matches_template(num_variables: int) -> None:
    built = build_circuit(balanced_binary_tree(num_variables), SumProductPattern.CP,
                          num_sum_units=3, num_input_units=3, num_categories=5)
    template = templates.btree(num_variables, 3, 5)
    assert signature(built.output, {}) == signature(template.output, {})
    assert len(built.layers) == len(template.layers)
    shapes = sorted(circuits.compile(built).parameter_shapes().values())
    assert shapes == sorted(circuits.compile(template).parameter_shapes().values())


def test_cp_resizes_leaves_only_where_widths_differ() -> None:
    # linear(3): root = {0} x {1,2}, {1,2} = {1} x {2}. Only {0} meets an inner region.
    circuit = build_circuit(linear(3), SumProductPattern.CP, num_sum_units=2, num_input_units=5,
                            num_categories=2)
    resizers = [s for s in circuit.sum_layers if isinstance(s.inputs[0], InputLayer)]
    assert [(s.scope, s.num_units) for s in resizers] == [(frozenset({0}), 2)]
    same = build_circuit(linear(3), SumProductPattern.CP, 2, 2, 2)
    assert not any(isinstance(s.inputs[0], InputLayer) for s in same.sum_layers)
    tucker = build_circuit(linear(3), SumProductPattern.TUCKER, 2, 5, 2)
    assert not any(isinstance(s.inputs[0], InputLayer) for s in tucker.sum_layers)
    assert sorted(p.num_units for p in tucker.product_layers) == [10, 25]


def test_multi_variable_leaves_are_fully_factorised() -> None:
    rg = random_binary_tree(8, depth=1, num_repetitions=2, seed=0)
    circuit = build_circuit(rg, SumProductPattern.TUCKER, 2, 2, 2)
    leaf_products = [p for p in circuit.product_layers
                     if all(isinstance(i, InputLayer) for i in p.inputs)]
    assert len(leaf_products) == 4 and all(len(p.inputs) == 4 for p in leaf_products)
    assert all(p.kind is circuits.ProductKind.HADAMARD for p in leaf_products)
    root_sum = circuit.output
    assert isinstance(root_sum, SumLayer) and len(root_sum.inputs) == 2


def test_single_region_graph_gives_a_one_unit_sum() -> None:
    circuit = build_circuit(fully_factorized(1), SumProductPattern.CP, 4, 3, 6)
    assert isinstance(circuit.output, SumLayer) and circuit.output.num_units == 1
    assert isinstance(circuit.output.inputs[0], InputLayer)


# ---------------------------------------------------------------- constructor structure
def test_fully_factorized_structure() -> None:
    rg = fully_factorized(5)
    (partition,) = rg.partitions_of(rg.root)
    assert [rg.scope_of(c) for c in rg.children_of(partition)] == [frozenset({v}) for v in range(5)]
    assert len(rg.leaves()) == 5 and rg.num_variables == 5 and rg.is_tree()


def test_linear_structure() -> None:
    rg = linear(5)
    assert len(rg.regions()) == 9 and len(rg.partitions()) == 4
    for partition in rg.partitions():
        head, tail = (rg.scope_of(c) for c in rg.children_of(partition))
        (i,) = head
        assert tail == frozenset(range(i + 1, 5))
        assert rg.scope_of(partition) == frozenset(range(i, 5))
    assert rg.is_tree() and rg.is_structured_decomposable()


def test_balanced_binary_tree_splits_at_floor_half() -> None:
    rg = balanced_binary_tree(7)
    (partition,) = rg.partitions_of(rg.root)
    left, right = (rg.scope_of(c) for c in rg.children_of(partition))
    assert left == frozenset({0, 1, 2}) and right == frozenset({3, 4, 5, 6})
    assert all(len(rg.scope_of(leaf)) == 1 for leaf in rg.leaves()) and len(rg.leaves()) == 7


def test_random_binary_tree_structure_and_determinism() -> None:
    rg = random_binary_tree(10, depth=2, num_repetitions=3, seed=7)
    assert len(rg.partitions_of(rg.root)) == 3
    assert rg.is_tree() and not rg.is_structured_decomposable()
    assert sorted(len(rg.scope_of(leaf)) for leaf in rg.leaves()) == [2] * 6 + [3] * 6
    for partition in rg.partitions():
        sizes = sorted(len(rg.scope_of(c)) for c in rg.children_of(partition))
        assert sizes[1] - sizes[0] <= 1
    again = random_binary_tree(10, depth=2, num_repetitions=3, seed=7)
    assert edges_and_scopes(rg) == edges_and_scopes(again)
    others = [edges_and_scopes(random_binary_tree(10, 2, 3, seed)) for seed in range(8, 12)]
    assert any(other != edges_and_scopes(rg) for other in others)
    deep = random_binary_tree(5, depth=10, num_repetitions=1, seed=0)
    assert sorted(v for leaf in deep.leaves() for v in deep.scope_of(leaf)) == [0, 1, 2, 3, 4]
    assert random_binary_tree(4, depth=0, num_repetitions=2).leaves() == (0,)


def test_quad_tree_structure() -> None:
    rg = quad_tree(2, 2)
    (partition,) = rg.partitions_of(rg.root)
    assert [rg.scope_of(c) for c in rg.children_of(partition)] == [frozenset({v}) for v in range(4)]
    strip = quad_tree(1, 4)
    (partition,) = strip.partitions_of(strip.root)
    assert [strip.scope_of(c) for c in strip.children_of(partition)] == [{0, 1}, {2, 3}]
    rg = quad_tree(4, 4)
    (partition,) = rg.partitions_of(rg.root)
    assert [sorted(rg.scope_of(c)) for c in rg.children_of(partition)] == [
        [0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    assert rg.is_tree() and len(rg.leaves()) == 16 and len(rg.regions()) == 21


def test_poon_domingos_structure() -> None:
    height, width = 3, 4
    rg = poon_domingos((height, width), 1)
    assert len(rg.regions()) == math.comb(height + 1, 2) * math.comb(width + 1, 2)
    assert not rg.is_tree() and not rg.is_structured_decomposable()
    for region in rg.regions():
        pixels = rg.scope_of(region)
        rows = {p // width for p in pixels}
        cols = {p % width for p in pixels}
        assert len(pixels) == len(rows) * len(cols)  # a rectangle
        assert len(rg.partitions_of(region)) == len(rows) - 1 + len(cols) - 1
        for partition in rg.partitions_of(region):
            assert len(rg.children_of(partition)) == 2
    scopes = [rg.scope_of(r) for r in rg.regions()]
    assert len(set(scopes)) == len(scopes)  # shared, not duplicated
    coarse = poon_domingos((5, 4), 2)
    leaf_shapes = sorted((len({p // 4 for p in coarse.scope_of(leaf)}),
                          len({p % 4 for p in coarse.scope_of(leaf)})) for leaf in coarse.leaves())
    assert leaf_shapes == [(1, 2), (1, 2), (2, 2), (2, 2), (2, 2), (2, 2)]
    per_axis = poon_domingos((2, 4), (1, 4))
    assert len(per_axis.partitions_of(per_axis.root)) == 1


# ---------------------------------------------------------------- Chow-Liu
def test_chow_liu_recovers_the_true_tree() -> None:
    data = sample_tree_data(4000)
    tree = chow_liu_tree(data)
    assert set(tree.edges()) == set(TRUE_TREE) and set(tree.nodes()) == set(range(7))
    assert chow_liu_tree(torch.from_numpy(data)).edges() == tree.edges()
    rg = chow_liu(data, num_categories=3)
    (partition,) = rg.partitions_of(rg.root)
    assert [rg.scope_of(c) for c in rg.children_of(partition)] == [
        {0}, {1, 3, 4}, {2, 5, 6}]
    assert rg.is_tree() and rg.is_structured_decomposable()
    assert len(rg.leaves()) == 7 and len(rg.partitions()) == 4  # inner: 0, 1, 2, 5


def test_mutual_information_properties() -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 2, size=(5000, 3))
    data[:, 2] = data[:, 0]
    info = mutual_information(data)
    assert np.allclose(info, info.T) and np.all(np.diag(info) == 0) and np.all(info >= -1e-12)
    assert info[0, 1] < 1e-3 and abs(info[0, 2] - math.log(2)) < 1e-2


def test_chow_liu_rejects_bad_data() -> None:
    with pytest.raises(RegionGraphError, match="integer"):
        chow_liu(np.zeros((4, 3)))
    with pytest.raises(RegionGraphError, match=r"shape \(N, n\)"):
        chow_liu(np.zeros(4, dtype=np.int64))
    with pytest.raises(RegionGraphError, match="negative"):
        chow_liu(-np.ones((4, 3), dtype=np.int64))
    with pytest.raises(RegionGraphError, match="takes value 2"):
        chow_liu(np.full((4, 3), 2), num_categories=2)
    with pytest.raises(RegionGraphError, match="numpy array or torch tensor"):
        chow_liu([[0, 1]])


# ---------------------------------------------------------------- user graphs
def user_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_node("root", kind="region")  # inner scope inferred
    graph.add_node("split", kind=NodeKind.PARTITION)
    graph.add_node("alt", kind=NodeKind.PARTITION)
    graph.add_node("a", kind=R, scope=[0])
    graph.add_node("bc", kind=R, scope={1, 2})
    graph.add_node("ab", kind=R)
    graph.add_node("c", kind=R, scope=(2,))
    graph.add_node("only", kind=P)
    graph.add_edges_from([("root", "split"), ("split", "a"), ("split", "bc"),
                          ("root", "alt"), ("alt", "ab"), ("alt", "c"),
                          ("ab", "only"), ("only", "a_b")])
    graph.add_node("a_b", kind=R, scope=[np.int64(0), 1])
    return graph


def test_user_networkx_graphs_are_accepted() -> None:
    graph = user_graph()
    rg = RegionGraph.from_networkx(graph)
    assert rg.root == "root" and rg.scope == {0, 1, 2}
    assert rg.scope_of("ab") == {0, 1} and rg.scope_of("alt") == {0, 1, 2}
    assert set(rg.leaves()) == {"a", "bc", "c", "a_b"}
    assert rg.kind("split") is NodeKind.PARTITION and rg.kind("root") is NodeKind.REGION
    assert "scope" not in graph.nodes["root"]  # the input is not modified
    with pytest.raises(nx.NetworkXError):
        rg.graph.add_node("x")  # frozen
    copy = RegionGraph.from_networkx(rg.graph)
    assert edges_and_scopes(copy) == edges_and_scopes(rg)
    circuit = build_circuit(rg, SumProductPattern.CP, 2, 2, 2)
    compiled = circuits.compile(circuit, dtype=torch.float64)
    assert abs(torch.logsumexp(compiled.log_likelihood(all_assignments(3, 2)), 0).item()) < 1e-10
    order = rg.topological_order()
    assert order[0] == "root" and order.index("ab") < order.index("only") < order.index("a_b")


def graph_of(nodes: dict, edges: list) -> nx.DiGraph:
    graph = nx.DiGraph()
    for name, attrs in nodes.items():
        graph.add_node(name, **attrs)
    graph.add_edges_from(edges)
    return graph


def chain(*scopes: object) -> dict:
    return {f"r{i}": {KIND_KEY: R, SCOPE_KEY: s} for i, s in enumerate(scopes)}


INVALID: dict[str, tuple[nx.DiGraph, str]] = {
    "cycle": (graph_of({"r0": {KIND_KEY: R}, "p0": {KIND_KEY: P}, "r1": {KIND_KEY: R},
                        "p1": {KIND_KEY: P}, "top": {KIND_KEY: R}, "pt": {KIND_KEY: P}},
                       [("top", "pt"), ("pt", "r0"), ("r0", "p0"), ("p0", "r1"), ("r1", "p1"),
                        ("p1", "r0")]),
              r"cyclic: '(r0|p0|r1|p1)' -> .* -> .* -> .* -> '(r0|p0|r1|p1)'"),
    "two_roots": (graph_of(chain({0}, {1}), []), r"2 roots .*'r0', 'r1'"),
    "overlap": (graph_of({**chain({0, 1}, {1, 2}), "top": {KIND_KEY: R}, "p": {KIND_KEY: P}},
                         [("top", "p"), ("p", "r0"), ("p", "r1")]),
                r"children 'r0' \(scope \{0, 1\}\) and 'r1' \(scope \{1, 2\}\) overlap on \{1\}"),
    "not_covering": (graph_of({**chain({0}, {1}), "top": {KIND_KEY: R, SCOPE_KEY: {0, 1, 2}},
                               "p": {KIND_KEY: P}}, [("top", "p"), ("p", "r0"), ("p", "r1")]),
                     r"children cover \{0, 1\} but the region's declared scope \{0, 1, 2\} "
                     r"\(missing \{2\}\)"),
    "partitions_disagree": (graph_of({**chain({0}, {1}, {2}), "top": {KIND_KEY: R},
                                      "p": {KIND_KEY: P}, "q": {KIND_KEY: P}},
                                     [("top", "p"), ("p", "r0"), ("p", "r1"), ("top", "q"),
                                      ("q", "r0"), ("q", "r2")]),
                            r"partition 'q' of region 'top': its children cover \{0, 2\} but "
                            r"partition 'p' of the same region covers \{0, 1\} "
                            r"\(missing \{1\}, extra \{2\}\)"),
    "childless_partition": (graph_of({**chain({0}), "p": {KIND_KEY: P}}, [("r0", "p")]),
                            "partition 'p' of region 'r0' has no child region"),
    "region_region": (graph_of(chain({0, 1}, {0}), [("r0", "r1")]),
                      "edge 'r0' -> 'r1' joins two region nodes"),
    "partition_partition": (graph_of({**chain({0}), "p": {KIND_KEY: P}, "q": {KIND_KEY: P}},
                                     [("r0", "p"), ("p", "q")]),
                            "edge 'p' -> 'q' joins two partition nodes"),
    "empty_scope": (graph_of(chain(set()), []), "'r0' has an empty scope"),
    "float_variable": (graph_of(chain([0, 1.5]), []), "non-integer variable 1.5"),
    "string_variable": (graph_of(chain(["a"]), []), "non-integer variable 'a'"),
    "bool_variable": (graph_of(chain([True]), []), "non-integer variable True"),
    "string_scope": (graph_of(chain("01"), []), "a scope must be a collection"),
    "int_scope": (graph_of(chain(3), []), "a scope must be a collection"),
    "negative_variable": (graph_of(chain([-1]), []), "negative variable -1"),
    "repeated_variable": (graph_of(chain([1, 1]), []), "lists a variable twice"),
    "missing_kind": (graph_of({"r0": {SCOPE_KEY: {0}}}, []), "'r0' has no 'kind' attribute"),
    "bad_kind": (graph_of({"r0": {KIND_KEY: "leaf", SCOPE_KEY: {0}}}, []), "kind='leaf'"),
    "leaf_without_scope": (graph_of({"r0": {KIND_KEY: R}}, []), "leaf region 'r0' has no 'scope'"),
    "orphan_partition": (graph_of({**chain({0}), "p": {KIND_KEY: P}}, [("p", "r0")]),
                         "partition 'p' has no parent region"),
    "shared_partition": (graph_of({**chain({0}, {0}, {0}), "p": {KIND_KEY: P}},
                                  [("r0", "p"), ("r1", "p"), ("p", "r2")]),
                         r"partition 'p' has 2 parent regions"),
    "self_loop": (graph_of(chain({0}), [("r0", "r0")]), "cyclic: 'r0' -> 'r0'"),
    "partition_scope": (graph_of({**chain({0}, {0, 1}), "p": {KIND_KEY: P, SCOPE_KEY: {0, 1}}},
                                 [("r1", "p"), ("p", "r0")]),
                        r"children cover \{0\} but the region's declared scope \{0, 1\}"),
    "empty": (nx.DiGraph(), "the region graph is empty"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_graphs_raise_one_clear_error(case: str) -> None:
    graph, message = INVALID[case]
    with pytest.raises(RegionGraphError, match=message):
        RegionGraph.from_networkx(graph)


def test_declared_partition_scope_is_checked_and_multigraphs_rejected() -> None:
    graph = graph_of({**chain({0}, {1}), "top": {KIND_KEY: R}, "p": {KIND_KEY: P, SCOPE_KEY: {0}}},
                     [("top", "p"), ("p", "r0"), ("p", "r1")])
    with pytest.raises(RegionGraphError, match=r"partition 'p' declares scope \{0\}"):
        RegionGraph.from_networkx(graph)
    with pytest.raises(RegionGraphError, match="not a multigraph"):
        RegionGraph.from_networkx(nx.MultiDiGraph())
    with pytest.raises(RegionGraphError, match=r"networkx\.DiGraph"):
        RegionGraph.from_networkx(nx.Graph())


def test_bad_arguments_raise_clear_errors() -> None:
    for call, message in [
        (lambda: linear(0), "num_variables must be an int >= 1, got 0"),
        (lambda: fully_factorized(True), "num_variables must be an int >= 1, got True"),
        (lambda: balanced_binary_tree(2.0), "num_variables must be an int >= 1"),
        (lambda: random_binary_tree(4, -1, 1), "depth must be an int >= 0"),
        (lambda: random_binary_tree(4, 1, 0), "num_repetitions must be an int >= 1"),
        (lambda: random_binary_tree(4, 1, 1, seed="x"), "seed must be an int"),
        (lambda: quad_tree(0, 3), "height must be an int >= 1"),
        (lambda: poon_domingos((2, 2, 2)), r"shape must be a pair"),
        (lambda: poon_domingos((2, 2), (1, 0)), r"delta\[1\] \(column step\) must be"),
        (lambda: poon_domingos((2, 2), "1"), "delta must be an int >= 1 or a pair"),
        (lambda: build_circuit(linear(2), "svd", 2, 2, 2), "unknown sum-product pattern 'svd'"),
        (lambda: build_circuit(linear(2), "cp", 0, 2, 2), "num_sum_units must be an int >= 1"),
        (lambda: build_circuit(linear(2), "cp", 2, 2, {0: 2}), r"no entry for variables \{1\}"),
        (lambda: build_circuit(nx.DiGraph(), "cp", 2, 2, 2), "needs a RegionGraph"),
        (lambda: build_circuit(linear(2), "cp", 2, 2, 2, sum_parameterization="exp"),
         "sum_parameterization must be a Parameterization"),
    ]:
        with pytest.raises(RegionGraphError, match=message):
            call()
