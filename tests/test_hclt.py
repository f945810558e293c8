"""Tests of circuits.templates.hclt: hidden Chow-Liu trees learned from data.

* a valid distribution: the compiled circuit sums to 1 over every assignment (brute force,
  float64) and agrees with the independent numpy reference, for random data and sizes;
* its structure is the Chow-Liu tree of the data: checked against a mutual information computed
  here by counting and a maximum spanning tree found by enumerating every labelled tree (Pruefer
  sequences), on data with a known dependency tree;
* pyjuice's construction: one input layer per variable, the node's own input layer first in its
  product, leaf children entering as bare input layers, ``K x K`` transitions, a one-unit root;
* deterministic: the structure is a function of the data (not of row order), and the parameters
  a function of the compile seed.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Hashable

import networkx as nx
import numpy as np
import pytest
import torch
from factories import raw_from_compiled, reference_values
from hypothesis import given
from hypothesis import strategies as st

import circuits
from circuits import (
    Bernoulli,
    Binomial,
    Categorical,
    Gaussian,
    InputLayer,
    Layer,
    ProductKind,
    ProductLayer,
    RegionGraphError,
    StructureError,
    SumLayer,
    UnknownArchitectureError,
    templates,
)
from circuits.region_graphs import SumProductPattern, build_circuit, chow_liu
from circuits.region_graphs.chow_liu import discretize, tree_center

# A known dependency tree over 6 ternary variables, deliberately not in index order.
TRUE_TREE = {(0, 3), (3, 1), (1, 5), (3, 4), (4, 2)}


def sample_tree(num_samples: int, edges: set[tuple[int, int]], num_variables: int,
                categories: int, seed: int, keep: float = 0.85) -> np.ndarray:
    """Rows of a tree Bayesian network: each child copies its parent w.p. ``keep``, else uniform."""
    rng = np.random.default_rng(seed)
    tree = nx.Graph(list(edges))
    tree.add_nodes_from(range(num_variables))
    data = np.zeros((num_samples, num_variables), dtype=np.int64)
    data[:, 0] = rng.integers(0, categories, num_samples)
    for parent, child in nx.bfs_edges(tree, 0):
        copy = rng.random(num_samples) < keep
        data[:, child] = np.where(copy, data[:, parent], rng.integers(0, categories, num_samples))
    return data


# ------------------------------------------------------------------ independent references
def counted_mutual_information(data: np.ndarray, i: int, j: int) -> float:
    """Plug-in mutual information (nats) of columns i and j, by counting pairs."""
    n = data.shape[0]
    joint = Counter(zip(data[:, i].tolist(), data[:, j].tolist(), strict=True))
    left, right = Counter(data[:, i].tolist()), Counter(data[:, j].tolist())
    return sum(c / n * math.log(c * n / (left[a] * right[b])) for (a, b), c in joint.items())


def pruefer_tree(sequence: tuple[int, ...], n: int) -> frozenset[tuple[int, int]]:
    """The labelled tree on ``0..n-1`` with this Pruefer sequence, as sorted edges."""
    degree = [1] * n
    for v in sequence:
        degree[v] += 1
    edges = []
    for v in sequence:
        leaf = min(u for u in range(n) if degree[u] == 1)
        edges.append(tuple(sorted((leaf, v))))
        degree[leaf] -= 1
        degree[v] -= 1
    last = [u for u in range(n) if degree[u] == 1]
    edges.append(tuple(sorted(last)))
    return frozenset(edges)


def best_spanning_tree(data: np.ndarray) -> frozenset[tuple[int, int]]:
    """The maximum-MI spanning tree found by enumerating all n^(n-2) labelled trees."""
    n = data.shape[1]
    info = {(i, j): counted_mutual_information(data, i, j) for i, j in itertools.combinations(range(n), 2)}
    trees = [pruefer_tree(seq, n) for seq in itertools.product(range(n), repeat=n - 2)]
    assert len(set(trees)) == n ** (n - 2)
    scores = sorted((sum(info[e] for e in tree), tree) for tree in trees)
    (best, tree), (runner_up, _) = scores[-1], scores[-2]
    assert best - runner_up > 1e-3, "the test data must have a unique best tree"
    return tree


# ------------------------------------------------------------------ reading the circuit
def own_variable(layer: Layer) -> int:
    """The tree node a message layer belongs to: an input layer's variable, or (for a sum over
    one product) the variable of the product's first input, the node's own input layer."""
    if isinstance(layer, InputLayer):
        return layer.variable
    assert isinstance(layer, SumLayer) and len(layer.inputs) == 1
    product = layer.inputs[0]
    assert isinstance(product, ProductLayer) and isinstance(product.inputs[0], InputLayer)
    return product.inputs[0].variable


def tree_of(circuit: circuits.Circuit, num_units: int) -> tuple[int, set[tuple[int, int]]]:
    """(root variable, undirected edges) of an HCLT, checking pyjuice's construction on the way."""
    edges: set[tuple[int, int]] = set()
    output = circuit.output
    assert isinstance(output, SumLayer) and output.num_units == 1
    for layer in circuit.layers:
        if isinstance(layer, SumLayer):
            assert len(layer.inputs) == 1 and isinstance(layer.inputs[0], ProductLayer)
            assert layer.num_units == (1 if layer is output else num_units)
            assert layer.parameter_shape == (layer.num_units, num_units)
        elif isinstance(layer, ProductLayer):
            assert layer.kind is ProductKind.HADAMARD and len(layer.inputs) >= 2
            own, *children = layer.inputs
            assert isinstance(own, InputLayer)
            child_vars = [own_variable(c) for c in children]
            assert child_vars == sorted(child_vars)  # children in increasing variable order
            edges.update(tuple(sorted((own.variable, c))) for c in child_vars)
        else:
            assert isinstance(layer, InputLayer) and layer.num_units == num_units
    variables = [layer.variable for layer in circuit.input_layers]
    assert sorted(variables) == list(range(len(variables)))  # one input layer per variable
    return own_variable(output), edges


def signature(circuit: circuits.Circuit) -> tuple[Hashable, ...]:
    """A canonical description of the structure (no uids, no parameters)."""
    memo: dict[int, Hashable] = {}
    for layer in circuit.layers:
        if isinstance(layer, InputLayer):
            memo[layer.uid] = ("in", layer.variable, layer.num_units, layer.distribution)
        elif isinstance(layer, SumLayer):
            memo[layer.uid] = ("sum", layer.num_units, tuple(memo[i.uid] for i in layer.inputs))
        else:
            assert isinstance(layer, ProductLayer)
            memo[layer.uid] = ("prod", layer.kind, tuple(memo[i.uid] for i in layer.inputs))
    return (memo[circuit.output.uid],)


def assignments(num_variables: int, num_values: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(num_values), repeat=num_variables)))


# ------------------------------------------------------------------ a valid distribution
@given(num_variables=st.integers(1, 4), categories=st.integers(2, 3), units=st.integers(1, 3),
       seed=st.integers(0, 10_000), pick_root=st.booleans())
def test_hclt_is_a_normalised_distribution(num_variables: int, categories: int, units: int,
                                           seed: int, pick_root: bool) -> None:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, categories, size=(40, num_variables))
    root = int(rng.integers(0, num_variables)) if pick_root else None
    circuit = templates.hclt(data, units, categories, root=root)
    circuits.check(circuit)
    assert circuits.is_smooth(circuit) and circuits.is_decomposable(circuit)
    assert circuits.is_structured_decomposable(circuit)
    model = circuits.compile(circuit, dtype=torch.float64, seed=seed)
    x = assignments(num_variables, categories)
    log_p = model.log_likelihood(x).detach()
    assert abs(float(torch.logsumexp(log_p, 0))) < 1e-12
    expected = reference_values(circuit, raw_from_compiled(model), x.numpy(),
                                np.ones(x.shape, dtype=bool))
    np.testing.assert_allclose(log_p.exp().numpy(), expected, rtol=1e-12, atol=0)
    assert abs(float(model.log_partition().detach())) < 1e-12


@pytest.mark.parametrize(("family", "values"), [(Bernoulli(), 2), (Binomial(2), 3)])
def test_hclt_with_other_discrete_families_sums_to_one(family: circuits.InputDistribution,
                                                       values: int) -> None:
    data = sample_tree(200, {(0, 1), (1, 2), (1, 3)}, 4, values, seed=3)
    circuit = templates.hclt(data, 2, input_distribution=family)
    assert {layer.distribution for layer in circuit.input_layers} == {family}
    model = circuits.compile(circuit, dtype=torch.float64, seed=1)
    log_p = model.log_likelihood(assignments(4, values)).detach()
    assert abs(float(torch.logsumexp(log_p, 0))) < 1e-12


# ------------------------------------------------------------------ the Chow-Liu tree of the data
def test_hclt_structure_is_the_chow_liu_tree_of_the_data() -> None:
    data = sample_tree(3000, TRUE_TREE, 6, 3, seed=0)
    expected = best_spanning_tree(data)
    assert expected == frozenset(tuple(sorted(e)) for e in TRUE_TREE)  # the dependency is found
    circuit = templates.hclt(data, 4, 3)
    root, edges = tree_of(circuit, 4)
    assert edges == set(expected)
    tree = nx.Graph(sorted(edges))
    assert root in nx.center(tree) and root == min(nx.center(tree))  # rooted at a center (3)
    inner = {v for v in tree if v == root or tree.degree(v) > 1}
    assert len(circuit.sum_layers) == len(inner) == len(circuit.product_layers)
    assert circuit.num_parameters() == 6 * 4 * 3 + (len(inner) - 1) * 4 * 4 + 4
    # exactly the region-graph route, root at the center
    same = build_circuit(chow_liu(data, 3, root=root), SumProductPattern.CP, 4, 4, num_categories=3)
    assert signature(same) == signature(circuit)


def test_hclt_root_can_be_chosen() -> None:
    data = sample_tree(1000, TRUE_TREE, 6, 3, seed=1)
    for root in range(6):
        circuit = templates.hclt(data, 2, 3, root=root)
        found, edges = tree_of(circuit, 2)
        assert found == root and edges == {tuple(sorted(e)) for e in TRUE_TREE}
    with pytest.raises(RegionGraphError, match=r"root must be a variable 0 \.\. 5"):
        templates.hclt(data, 2, 3, root=6)
    with pytest.raises(RegionGraphError, match="root must be a variable"):
        templates.hclt(data, 2, 3, root=True)  # type: ignore[arg-type]


def test_hclt_on_real_values_bins_them_to_find_the_tree() -> None:
    rng = np.random.default_rng(0)
    x0 = rng.normal(size=2000)
    x2 = x0 + 0.3 * rng.normal(size=2000)
    x1 = x2 + 0.3 * rng.normal(size=2000)
    x3 = rng.normal(size=2000)
    x4 = x3 + 0.3 * rng.normal(size=2000)
    data = torch.tensor(np.stack([x0, x1, x2, x3, x4], axis=1))
    circuit = templates.hclt(data, 3, input_distribution=Gaussian(), num_bins=8)
    _, edges = tree_of(circuit, 3)
    assert {(0, 2), (1, 2), (3, 4)} <= edges and len(edges) == 4
    assert all(isinstance(layer.distribution, Gaussian) for layer in circuit.input_layers)
    model = circuits.compile(circuit, dtype=torch.float64)
    assert torch.isfinite(model.log_likelihood(data[:10])).all()
    # a table mixing families: column 1 as categories 0..3 of a real value
    mixed = data.clone()
    mixed[:, 1] = torch.bucketize(data[:, 1].contiguous(), torch.tensor([-1.0, 0.0, 1.0]))
    families = {0: Gaussian(), 1: Categorical(4), 2: Gaussian(), 3: Gaussian(), 4: Gaussian()}
    mixed_circuit = templates.hclt(mixed, 2, input_distribution=families, num_bins=8)
    assert {(0, 2), (1, 2), (3, 4)} <= tree_of(mixed_circuit, 2)[1]


# ------------------------------------------------------------------ determinism
def test_hclt_is_deterministic() -> None:
    data = sample_tree(500, TRUE_TREE, 6, 3, seed=2)
    first, second = templates.hclt(data, 3, 3), templates.hclt(data.copy(), 3, 3)
    shuffled = templates.hclt(data[np.random.default_rng(5).permutation(500)], 3, 3)
    assert signature(first) == signature(second) == signature(shuffled)
    tensor = templates.hclt(torch.from_numpy(data), 3, 3)
    assert signature(tensor) == signature(first)
    a, b = (circuits.compile(c, seed=7) for c in (first, second))
    other = circuits.compile(first, seed=8)
    for key, value in a.state_dict().items():
        torch.testing.assert_close(value, b.state_dict()[key], rtol=0, atol=0)
    assert any(not torch.equal(v, other.state_dict()[k]) for k, v in a.state_dict().items())


# ------------------------------------------------------------------ errors
def test_hclt_rejects_bad_input() -> None:
    data = sample_tree(50, TRUE_TREE, 6, 3, seed=4)
    with pytest.raises(StructureError, match="num_units must be an int >= 1, got 0"):
        templates.hclt(data, 0, 3)
    with pytest.raises(StructureError, match="exactly one of them"):
        templates.hclt(data, 2)
    with pytest.raises(StructureError, match="exactly one of them"):
        templates.hclt(data, 2, 3, input_distribution=Categorical(3))
    with pytest.raises(StructureError, match="lists 2 sizes but data has 6 columns"):
        templates.hclt(data, 2, [3, 3])
    with pytest.raises(StructureError, match=r"must map every column 0 \.\. 5"):
        templates.hclt(data, 2, input_distribution={0: Categorical(3)})
    families = {v: Categorical(3) for v in range(6)} | {5: Categorical}
    with pytest.raises(StructureError, match=r"input_distribution\[5\] must be an InputDistribution"):
        templates.hclt(data, 2, input_distribution=families)  # type: ignore[arg-type]
    with pytest.raises(StructureError, match=r"must be an InputDistribution .* or \{variable: family\}"):
        templates.hclt(data, 2, input_distribution="categorical")  # type: ignore[arg-type]
    with pytest.raises(StructureError, match="2-D numpy array or torch tensor"):
        templates.hclt(data[0], 2, 3)
    with pytest.raises(StructureError, match="2-D numpy array or torch tensor"):
        templates.hclt(data.tolist(), 2, 3)
    bad = data.copy()
    bad[7, 4] = 3
    with pytest.raises(RegionGraphError, match=r"variable 4 takes the value 3 in row 7, but it is "
                                               r"discrete with values 0 \.\. 2"):
        templates.hclt(bad, 2, 3)
    real = np.random.default_rng(0).normal(size=(20, 3))
    real[3, 1] = np.nan
    with pytest.raises(RegionGraphError, match="variable 1 has the non-finite value nan in row 3"):
        templates.hclt(real, 2, input_distribution=Gaussian())
    with pytest.raises(RegionGraphError, match="variable 0 takes the value"):
        templates.hclt(np.abs(real[:, :1]) + 0.5, 2, input_distribution=Bernoulli())


def test_hclt_is_not_a_named_template() -> None:
    with pytest.raises(UnknownArchitectureError,
                       match=r"unknown architecture 'hclt'; choose one of: ff, cp, hmm, btree\. HCLT "
                             r"is learned from data.*templates\.hclt\(data, num_units"):
        templates.build("hclt", num_variables=4, num_categories=3)


def test_discretize_and_tree_center() -> None:
    real = np.array([[0.1, 0], [0.5, 1], [0.9, 1], [0.3, 0]])
    codes, sizes = discretize(real, [None, 2], num_bins=2)
    assert sizes == [2, 2] and codes.dtype == np.int64
    assert codes[:, 0].tolist() == [0, 1, 1, 0] and codes[:, 1].tolist() == [0, 1, 1, 0]
    with pytest.raises(RegionGraphError, match="2 variables described but data has 3 columns"):
        discretize(np.zeros((2, 3)), [None, None])
    with pytest.raises(RegionGraphError, match="data must hold numbers"):
        discretize(np.array([["a"]]), [None])
    with pytest.raises(RegionGraphError, match="num_bins must be an int >= 1"):
        discretize(real, [None, 2], num_bins=0)
    assert tree_center(nx.path_graph(5)) == 2 and tree_center(nx.path_graph(4)) == 1
    with pytest.raises(RegionGraphError, match="non-empty tree"):
        tree_center(nx.cycle_graph(4))
