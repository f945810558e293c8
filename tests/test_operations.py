"""Tests of circuits.operations: snapshot, integrate and multiply, checked by brute force.

Random circuits follow a random variable tree (vtree); two circuits drawn over the same vtree are
compatible but may differ in everything else (widths, Hadamard/Kronecker products, child order,
mixtures of several products, nested and unary layers, Softmax/Exp parameters).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import circuits
from circuits import templates
from circuits.compiled.circuit import Trace
from circuits.errors import InvalidInputError, StructureError
from circuits.operations import integrate, multiply, snapshot, square
from circuits.parameterizations import Exp, Softmax
from circuits.structure import check
from circuits.symbolic import (
    Categorical,
    Circuit,
    InputLayer,
    Layer,
    ProductKind,
    ProductLayer,
    SumLayer,
)

TOL = {"atol": 1e-10, "rtol": 0.0}
VTree = int | tuple["VTree", ...]


def random_vtree(rng: random.Random, variables: list[int]) -> VTree:
    """A random tree whose leaves are ``variables``; internal nodes have 2-3 children."""
    if len(variables) == 1:
        return variables[0]
    variables = variables[:]
    rng.shuffle(variables)
    parts = rng.randint(2, min(3, len(variables)))
    cuts = sorted(rng.sample(range(1, len(variables)), parts - 1))
    bounds = [0, *cuts, len(variables)]
    return tuple(random_vtree(rng, variables[lo:hi]) for lo, hi in itertools.pairwise(bounds))


class RandomCircuit:
    """Builds a random smooth, decomposable circuit over a vtree, with ``initial`` parameters."""

    def __init__(self, seed: int, categories: dict[int, int]) -> None:
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.categories = categories
        self.direct = self.rng.random()  # how often a region is a bare product (no sum above)

    def params(self, shape: tuple[int, int]) -> tuple[Softmax | Exp, torch.Tensor]:
        parameterization = self.rng.choice([Softmax(), Exp()])
        return parameterization, torch.randn(shape, generator=self.generator, dtype=torch.float64)

    def input(self, variable: int, width: int) -> InputLayer:
        size = self.categories[variable]
        parameterization, initial = self.params((width, size))
        return InputLayer(variable, width, Categorical(size), parameterization, initial)

    def sum(self, inputs: list[Layer], width: int) -> SumLayer:
        parameterization, initial = self.params((width, sum(i.num_units for i in inputs)))
        return SumLayer(inputs, width, parameterization, initial)

    def region(self, node: VTree, width: int | None) -> Layer:
        """A layer over the variables of ``node`` with ``width`` units (``None``: any width)."""
        roll = self.rng.random()
        if isinstance(node, int):
            width = width or self.rng.randint(1, 2)
            if roll < 0.5:
                return self.input(node, width)
            if roll < 0.8:
                return self.sum([self.input(node, self.rng.randint(1, 3)) for _ in range(2)], width)
            return ProductLayer([self.input(node, width)], ProductKind.KRONECKER)  # unary product
        products = [self.product(node) for _ in range(self.rng.choice([1, 1, 2]))]
        if len(products) == 1 and width in (None, products[0].num_units) and roll < self.direct:
            return products[0]
        layer = self.sum(products, width or self.rng.randint(1, 3))
        return self.sum([layer], layer.num_units) if roll > 0.9 else layer  # nested sums

    def product(self, node: tuple[VTree, ...]) -> ProductLayer:
        children = list(node)
        self.rng.shuffle(children)
        if self.rng.random() < 0.5:  # Hadamard: the first child picks the common width
            first = self.region(children[0], None)
            rest = [self.region(c, first.num_units) for c in children[1:]]
            return ProductLayer([first, *rest], ProductKind.HADAMARD)
        return ProductLayer([self.region(c, None) for c in children], ProductKind.KRONECKER)

    def circuit(self, vtree: VTree, width: int | None = 1) -> Circuit:
        return Circuit(self.region(vtree, width))


def all_states(categories: dict[int, int]) -> torch.Tensor:
    """Every joint state of variables ``0..V-1``: ``(prod C_v, V)``."""
    return torch.tensor(list(itertools.product(*(range(categories[v]) for v in sorted(categories)))))


def unit_values(circuit: Circuit, x: torch.Tensor) -> torch.Tensor:
    """``(B, K)`` log-values of every output unit, read from the trace of a wrapped circuit."""
    width = circuit.output.num_units
    wrapped = Circuit(SumLayer([circuit.output], 1, Exp(), torch.zeros(1, width, dtype=torch.float64)))
    compiled = circuits.compile(wrapped, dtype=torch.float64)
    x, observed = compiled.validate_data(x)
    trace = Trace()
    compiled.evaluate(x, observed, trace=trace)
    plan = next(plan for plan in compiled.plans if circuit.output in plan.layers)
    return trace.outputs[plan.fold_id][plan.layers.index(circuit.output)].detach()


problems = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1),
    "num_variables": st.integers(2, 4),
    "sizes": st.lists(st.integers(2, 3), min_size=4, max_size=4),
})


def prepared_case(problem: dict) -> tuple[VTree, dict[int, int], torch.Tensor]:
    variables = list(range(problem["num_variables"]))
    categories = {v: problem["sizes"][v] for v in variables}
    vtree = random_vtree(random.Random(problem["seed"]), variables)
    return vtree, categories, all_states(categories)


# ---------------------------------------------------------------------------------- multiply
@settings(max_examples=40, deadline=None)
@given(problem=problems, widths=st.tuples(*[st.sampled_from([None, 1, 2, 3])] * 2))
def test_multiply_matches_brute_force_unit_by_unit(problem: dict,
                                                 widths: tuple[int | None, int | None]) -> None:
    vtree, categories, x = prepared_case(problem)
    first = RandomCircuit(problem["seed"] + 1, categories).circuit(vtree, widths[0])
    second = RandomCircuit(problem["seed"] + 2, categories).circuit(vtree, widths[1])
    product = multiply(first, second)
    check(product)
    assert product.output.num_units == first.output.num_units * second.output.num_units
    assert all(isinstance(layer.parameterization, Exp)
               for layer in product.layers if isinstance(layer, (InputLayer, SumLayer)))
    expected = (unit_values(first, x)[:, :, None] + unit_values(second, x)[:, None, :]).flatten(1)
    torch.testing.assert_close(unit_values(product, x), expected, **TOL)


def test_multiply_reorders_kronecker_units() -> None:
    """Kronecker x Kronecker pairs come out as (i1 j1 i2 j2); the product must restore (i, j)
    order at a bare output and under a Hadamard parent whose inputs carry such orders."""
    categories = {v: 2 for v in range(4)}
    one, two = RandomCircuit(0, categories), RandomCircuit(1, categories)
    kron = ProductKind.KRONECKER

    def block(maker: RandomCircuit, a: int, b: int, widths: tuple[int, int]) -> ProductLayer:
        return ProductLayer([maker.input(a, widths[0]), maker.input(b, widths[1])], kron)

    first = Circuit(ProductLayer([block(one, 0, 1, (2, 2)), block(one, 2, 3, (1, 4))],
                                 ProductKind.HADAMARD))
    second = Circuit(ProductLayer([block(two, 3, 2, (3, 1)), block(two, 1, 0, (1, 3))],
                                  ProductKind.HADAMARD))
    for a, b in ((first, second), (Circuit(first.output.inputs[0]), Circuit(second.output.inputs[1]))):
        x = all_states({v: 2 for v in range(a.num_variables)})
        expected = (unit_values(a, x)[:, :, None] + unit_values(b, x)[:, None, :]).flatten(1)
        torch.testing.assert_close(unit_values(multiply(a, b), x), expected, **TOL)


@settings(max_examples=40, deadline=None)
@given(problem=problems)
def test_multiply_log_partition(problem: dict) -> None:
    vtree, categories, x = prepared_case(problem)
    first = RandomCircuit(problem["seed"] + 3, categories).circuit(vtree)
    second = RandomCircuit(problem["seed"] + 4, categories).circuit(vtree)
    compiled = circuits.compile(multiply(first, second), dtype=torch.float64)
    joint = (circuits.compile(first, dtype=torch.float64)(x)
             + circuits.compile(second, dtype=torch.float64)(x))
    torch.testing.assert_close(compiled(x), joint, **TOL)
    torch.testing.assert_close(compiled.log_partition(), torch.logsumexp(joint, 0), **TOL)


@settings(max_examples=30, deadline=None)
@given(problem=problems)
def test_square(problem: dict) -> None:
    vtree, categories, x = prepared_case(problem)
    circuit = RandomCircuit(problem["seed"], categories).circuit(vtree)
    log_c = circuits.compile(circuit, dtype=torch.float64)(x)
    squared = circuits.compile(square(circuit), dtype=torch.float64)
    torch.testing.assert_close(squared(x), 2 * log_c, **TOL)
    torch.testing.assert_close(squared.log_partition(), torch.logsumexp(2 * log_c, 0), **TOL)


@pytest.mark.parametrize(("name", "ranks"), [("btree", (2, 3)), ("hmm", (3, 2)), ("cp", (2, 2))])
def test_multiply_trained_templates(name: str, ranks: tuple[int, int]) -> None:
    categories = {v: 3 for v in range(4)}
    x = all_states(categories)
    compiled = [circuits.compile(templates.build(name, 4, 3, rank), dtype=torch.float64, seed=s)
                for s, rank in enumerate(ranks)]
    product = circuits.compile(multiply(snapshot(compiled[0]), snapshot(compiled[1])),
                               dtype=torch.float64)
    joint = compiled[0](x) + compiled[1](x)
    torch.testing.assert_close(product(x), joint, **TOL)
    torch.testing.assert_close(product.log_partition(), torch.logsumexp(joint, 0), **TOL)
    # sum_x p(x)^2 <= max_x p(x) for a distribution
    assert float(product.log_partition().detach()) <= float(compiled[0](x).detach().max()) + 1e-12


def test_multiply_then_integrate() -> None:
    categories = {v: 2 for v in range(3)}
    x = all_states(categories)
    first = RandomCircuit(5, categories).circuit((0, (1, 2)))
    second = RandomCircuit(6, categories).circuit((0, (2, 1)))
    marginal = circuits.compile(integrate(multiply(first, second), [1, 2]), dtype=torch.float64)
    joint = (circuits.compile(first, dtype=torch.float64)(x)
             + circuits.compile(second, dtype=torch.float64)(x)).view(2, 4)
    torch.testing.assert_close(marginal(x).view(2, 4)[:, 0], torch.logsumexp(joint, 1), **TOL)


def test_multiply_incompatible_circuits_raises() -> None:
    categories = {v: 2 for v in range(3)}
    first = RandomCircuit(0, categories).circuit(((0, 1), 2))
    second = RandomCircuit(1, categories).circuit((0, (1, 2)))
    with pytest.raises(StructureError, match="not compatible") as info:
        multiply(first, second)
    assert "is split as" in str(info.value)


def test_multiply_needs_parameters() -> None:
    circuit = templates.btree(3, rank=2, num_categories=2)
    with pytest.raises(InvalidInputError, match=r"snapshot\(compiled\)"):
        multiply(circuit, circuit)


def test_multiply_rejects_other_mismatches() -> None:
    two = RandomCircuit(0, {0: 2, 1: 2}).circuit((0, 1))
    three = RandomCircuit(0, {0: 2, 1: 3}).circuit((0, 1))
    wider = RandomCircuit(0, {0: 2, 1: 2, 2: 2}).circuit((0, 1, 2))
    with pytest.raises(StructureError, match="categories"):
        multiply(two, three)
    with pytest.raises(StructureError, match="same variables"):
        multiply(two, wider)
    with pytest.raises(StructureError, match="integrated"):
        multiply(integrate(two, [1]), two)
    with pytest.raises(InvalidInputError, match="must be a Circuit"):
        multiply(two, "circuit")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- integrate
@settings(max_examples=40, deadline=None)
@given(problem=problems, mask_seed=st.integers(0, 2**16))
def test_integrate_matches_marginal(problem: dict, mask_seed: int) -> None:
    vtree, categories, x = prepared_case(problem)
    circuit = RandomCircuit(problem["seed"], categories).circuit(vtree)
    variables = sorted(categories)
    chosen = random.Random(mask_seed).sample(variables, random.Random(mask_seed).randint(1, len(variables)))
    integrated = integrate(circuit, chosen)
    assert integrated.scope == frozenset(variables) - set(chosen)
    assert circuit.scope == frozenset(variables)  # the input circuit is left alone
    observed = torch.tensor([v not in chosen for v in variables])
    reference = circuits.compile(circuit, dtype=torch.float64)
    result = circuits.compile(integrated, dtype=torch.float64)(x)
    torch.testing.assert_close(result, reference.log_marginal(x, observed), **TOL)
    # brute force: sum the joint over the integrated variables
    joint = reference(x)
    key = [tuple(row[observed].tolist()) for row in x]
    for row, value in enumerate(result):
        same = torch.tensor([k == key[row] for k in key])
        torch.testing.assert_close(value, torch.logsumexp(joint[same], 0), **TOL)


def test_integrate_rejects_bad_variables() -> None:
    circuit = RandomCircuit(0, {0: 2, 1: 2}).circuit((0, 1))
    with pytest.raises(InvalidInputError, match="not in the circuit's scope"):
        integrate(circuit, [2])
    with pytest.raises(InvalidInputError, match="not in the circuit's scope"):
        integrate(integrate(circuit, [0]), [0])
    with pytest.raises(InvalidInputError, match="ints"):
        integrate(circuit, [0.5])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="iterable"):
        integrate(circuit, 1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- snapshot
@pytest.mark.parametrize("fold", [True, False])
def test_snapshot_reproduces_trained_module(fold: bool) -> None:
    circuit = templates.btree(4, rank=3, num_categories=3)
    compiled = circuits.compile(circuit, dtype=torch.float64, fold=fold, seed=7)
    with torch.no_grad():  # "training": move every parameter away from its initial value
        for parameter in compiled.parameters():
            parameter.add_(torch.randn_like(parameter))
    copy = snapshot(compiled)
    assert len(copy.layers) == len(circuit.layers)
    assert all(layer.initial is None for layer in circuit.layers if isinstance(layer, SumLayer))
    assert all(layer.initial is not None and layer.initial.dtype == torch.float64
               for layer in copy.layers if isinstance(layer, (InputLayer, SumLayer)))
    x = all_states({v: 3 for v in range(4)})
    again = circuits.compile(copy, dtype=torch.float64, seed=123)
    torch.testing.assert_close(again(x), compiled(x), **TOL)
    with torch.no_grad():  # the snapshot is a copy, not a view
        next(compiled.parameters()).add_(1.0)
    torch.testing.assert_close(circuits.compile(copy, dtype=torch.float64)(x), again(x), **TOL)


def test_snapshot_rejects_symbolic_circuit() -> None:
    with pytest.raises(InvalidInputError, match="CompiledCircuit"):
        snapshot(templates.cp(2, 2, 2))  # type: ignore[arg-type]
