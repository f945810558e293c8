"""Structural properties: every generated circuit is valid, and broken ones are named precisely.

A rejected circuit's message must name the offending layer (its ``describe()``) and the scopes
involved, so that a researcher can find the bug without reading library internals.
"""

from __future__ import annotations

import pytest
import torch
from factories import (
    TEMPLATE_NAMES,
    any_circuits,
    random_circuit,
    region_graph_circuit,
    region_graph_names,
    seeds,
    template_circuit,
)
from hypothesis import given, settings

import circuits
from circuits import (
    Categorical,
    Circuit,
    InputLayer,
    ProductKind,
    ProductLayer,
    StructureError,
    SumLayer,
    are_compatible,
    check,
    is_decomposable,
    is_smooth,
    is_structured_decomposable,
)
from circuits import templates as tpl
from circuits.structure import (
    compatibility_violations,
    decomposability_violations,
    smoothness_violations,
    structured_decomposability_violations,
)


def leaf(variable: int, units: int = 1, integrated: bool = False) -> InputLayer:
    return InputLayer(variable, units, Categorical(2), integrated=integrated)


def check_message(circuit: Circuit) -> str:
    with pytest.raises(StructureError) as info:
        check(circuit)
    return str(info.value)


# ------------------------------------------------------------------------ valid circuits


@settings(max_examples=60)
@given(circuit=any_circuits())
def test_generated_circuits_are_smooth_and_decomposable(circuit: Circuit) -> None:
    assert is_smooth(circuit)
    assert is_decomposable(circuit)
    assert smoothness_violations(circuit) == []
    assert decomposability_violations(circuit) == []
    check(circuit)
    # a circuit is compatible with itself exactly when it follows one vtree
    assert are_compatible(circuit, circuit) == is_structured_decomposable(circuit)


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
@pytest.mark.parametrize("num_variables", [1, 2, 5, 8])
def test_templates_are_structured_decomposable(name: str, num_variables: int) -> None:
    circuit = template_circuit(name, num_variables, 3, 2)
    assert is_structured_decomposable(circuit)
    assert circuit.scope == frozenset(range(num_variables))
    assert circuit.output.num_units == 1
    assert are_compatible(circuit, template_circuit(name, num_variables, 3, 4))


@pytest.mark.parametrize("name", region_graph_names())
@pytest.mark.parametrize("pattern", ["CP", "TUCKER"])
def test_region_graph_circuits_are_valid(name: str, pattern: str) -> None:
    circuit = region_graph_circuit(name, pattern, 2, 2, 3, seed=0)
    check(circuit)
    assert circuit.output.num_units == 1


# ------------------------------------------------------------------------ smoothness


def test_non_smooth_sum_is_named_with_its_scopes() -> None:
    a, b = leaf(0), leaf(1)
    bad = SumLayer([a, b], 1)
    circuit = Circuit(bad)
    assert not is_smooth(circuit)
    assert is_decomposable(circuit)
    message = check_message(circuit)
    for text in (bad.describe(), a.describe(), b.describe(), "{0}", "{1}", "not smooth"):
        assert text in message, (text, message)


@settings(max_examples=20)
@given(seed=seeds)
def test_non_smooth_sum_on_top_of_a_random_circuit(seed: int) -> None:
    circuit = random_circuit(seed)
    extra = InputLayer(0, 1, Categorical(circuit.num_categories[0]))
    bad = SumLayer([circuit.output, extra], 1)
    broken = Circuit(bad)
    assert not is_smooth(broken)
    message = check_message(broken)
    scope = "{" + ", ".join(map(str, sorted(circuit.scope))) + "}"
    for text in (bad.describe(), circuit.output.describe(), extra.describe(), scope, "{0}"):
        assert text in message, (text, message)
    with pytest.raises(StructureError, match="not smooth"):
        circuits.compile(broken)


# ------------------------------------------------------------------------ decomposability


def test_overlapping_product_is_named_with_the_shared_variable() -> None:
    a, b, c = leaf(0), leaf(1), leaf(1)
    inner = ProductLayer([a, b])
    bad = ProductLayer([inner, c])
    circuit = Circuit(SumLayer([bad], 1))
    assert is_smooth(circuit)
    assert not is_decomposable(circuit)
    assert not is_structured_decomposable(circuit)
    message = check_message(circuit)
    for text in (bad.describe(), inner.describe(), c.describe(), "variable 1",
                 "not decomposable"):
        assert text in message, (text, message)
    assert inner.describe() + " is not" not in message  # the valid inner product is not blamed


@settings(max_examples=20)
@given(seed=seeds)
def test_overlapping_product_on_top_of_a_random_circuit(seed: int) -> None:
    circuit = random_circuit(seed)
    variable = max(circuit.scope)
    extra = InputLayer(variable, 1, Categorical(circuit.num_categories[variable]))
    bad = ProductLayer([circuit.output, extra], ProductKind.KRONECKER)
    broken = Circuit(bad)
    assert not is_decomposable(broken)
    message = check_message(broken)
    for text in (bad.describe(), extra.describe(), f"variable {variable}"):
        assert text in message, (text, message)
    with pytest.raises(StructureError, match="not decomposable"):
        circuits.compile(broken)


def test_check_reports_every_problem_at_once() -> None:
    non_smooth = SumLayer([leaf(0), leaf(1)], 1)
    overlapping = ProductLayer([leaf(2), leaf(2)])
    circuit = Circuit(ProductLayer([non_smooth, overlapping], ProductKind.KRONECKER))
    message = check_message(circuit)
    assert non_smooth.describe() in message and overlapping.describe() in message
    assert message.count("\n- ") == 2


def test_compile_without_validation_skips_the_check() -> None:
    circuit = Circuit(SumLayer([leaf(0), leaf(1)], 1))
    with pytest.raises(StructureError):
        circuits.compile(circuit)
    compiled = circuits.compile(circuit, validate=False)  # the caller takes responsibility
    assert compiled.log_likelihood(torch.zeros(1, 2, dtype=torch.long)).shape == (1,)


# ------------------------------------------------------------------------ structured decomposability


def _two_splits() -> tuple[Circuit, ProductLayer, ProductLayer]:
    left = ProductLayer([leaf(0), SumLayer([ProductLayer([leaf(1), leaf(2)])], 1)])
    right = ProductLayer([SumLayer([ProductLayer([leaf(0), leaf(1)])], 1), leaf(2)])
    return Circuit(SumLayer([left, right], 1)), left, right


def test_differently_split_scopes_are_not_structured_decomposable() -> None:
    circuit, left, right = _two_splits()
    check(circuit)  # smooth and decomposable: fine for inference
    assert not is_structured_decomposable(circuit)
    (problem,) = structured_decomposability_violations(circuit)
    for text in (left.describe(), right.describe(), "{0} | {1, 2}", "{0, 1} | {2}",
                 "scope {0, 1, 2}"):
        assert text in problem, (text, problem)


def test_integrated_inputs_do_not_change_a_split() -> None:
    plain = ProductLayer([leaf(0), leaf(1)])
    padded = ProductLayer([leaf(1), leaf(0), leaf(0, integrated=True)])
    circuit = Circuit(SumLayer([plain, padded], 1))
    check(circuit)
    assert is_structured_decomposable(circuit)


# ------------------------------------------------------------------------ compatibility


def test_same_vtree_circuits_are_compatible() -> None:
    assert are_compatible(tpl.btree(6, 2, 2), tpl.btree(6, 3, 2))
    assert are_compatible(tpl.cp(5, 2, 2), tpl.fully_factorized(5, 2))
    assert are_compatible(tpl.hmm(4, 2, 2), tpl.hmm(4, 1, 3))


def test_differently_split_circuits_are_incompatible_and_named() -> None:
    first, second = tpl.btree(4, 2, 2), tpl.hmm(4, 2, 2)
    assert not are_compatible(first, second)
    problems = compatibility_violations(first, second)
    assert problems
    root_a = next(p for p in first.product_layers if p.scope == frozenset(range(4)))
    root_b = next(p for p in second.product_layers if p.scope == frozenset(range(4)))
    joined = "\n".join(problems)
    for text in (root_a.describe(), root_b.describe(), "{0, 1} | {2, 3}", "{0} | {1, 2, 3}",
                 "scope {0, 1, 2, 3}"):
        assert text in joined, (text, joined)


def test_compatibility_needs_valid_circuits() -> None:
    valid = tpl.cp(2, 2, 2)
    bad = SumLayer([leaf(0), leaf(1)], 1)
    assert not are_compatible(valid, Circuit(bad))
    (problem,) = compatibility_violations(valid, Circuit(bad))
    assert problem.startswith("second circuit:") and bad.describe() in problem
    assert not are_compatible(Circuit(bad), valid)
    assert compatibility_violations(Circuit(bad), valid)[0].startswith("first circuit:")


def test_circuits_over_disjoint_splits_are_compatible_only_where_they_agree() -> None:
    circuit, _, _ = _two_splits()
    left_only = Circuit(SumLayer([ProductLayer([leaf(0), SumLayer([ProductLayer(
        [leaf(1), leaf(2)])], 1)])], 1))
    assert not are_compatible(circuit, left_only)
    assert are_compatible(left_only, left_only)


# ------------------------------------------------------------------------ IR bookkeeping


@settings(max_examples=30)
@given(circuit=any_circuits())
def test_layers_are_topologically_ordered_and_scopes_are_unions(circuit: Circuit) -> None:
    position = {layer.uid: i for i, layer in enumerate(circuit.layers)}
    assert circuit.layers[-1] is circuit.output
    assert len(position) == len(circuit.layers)
    for layer in circuit.layers:
        for child in layer.inputs:
            assert position[child.uid] < position[layer.uid]
        if layer.inputs:
            assert layer.scope == frozenset().union(*(c.scope for c in layer.inputs))
    assert circuit.depth() >= 0
    assert circuit.num_parameters() == sum(
        layer.parameter_shape[0] * layer.parameter_shape[1]
        for layer in circuit.layers if isinstance(layer, (InputLayer, SumLayer)))


def _rebuilt(circuit: Circuit, reverse: bool) -> Circuit:
    """A structural copy of ``circuit`` whose layers are created in (reverse) topological order."""
    new: dict[int, object] = {}
    pending = list(circuit.layers)
    if reverse:  # create every layer only once its inputs exist, from the last ready one
        pending.reverse()
    while pending:
        layer = next(la for la in pending if all(i.uid in new for i in la.inputs))
        pending.remove(layer)
        inputs = [new[i.uid] for i in layer.inputs]
        if isinstance(layer, InputLayer):
            new[layer.uid] = InputLayer(layer.variable, layer.num_units, layer.distribution,
                                        layer.parameterization, integrated=layer.integrated)
        elif isinstance(layer, SumLayer):
            new[layer.uid] = SumLayer(inputs, layer.num_units, layer.parameterization)  # type: ignore[arg-type]
        else:
            assert isinstance(layer, ProductLayer)
            new[layer.uid] = ProductLayer(inputs, layer.kind)  # type: ignore[arg-type]
    return Circuit(new[circuit.output.uid])  # type: ignore[arg-type]


@settings(max_examples=20)
@given(circuit=any_circuits(4))
def test_fold_order_depends_on_the_structure_alone(circuit: Circuit) -> None:
    """Structurally equal circuits built in different creation orders fold identically: the same
    fold names, shapes and slot order (no canonical copy needed to get stable parameter names)."""
    plans = [circuits.compile(_rebuilt(circuit, reverse), validate=False).plans
             for reverse in (False, True)]
    position = [{layer: i for i, layer in enumerate(Circuit(p[-1].layers[0]).layers)}
                for p in plans]
    for fold_a, fold_b in zip(*plans, strict=True):
        assert (fold_a.name, fold_a.num_folded, fold_a.inputs) == \
            (fold_b.name, fold_b.num_folded, fold_b.inputs)
        assert [position[0][la] for la in fold_a.layers] == [position[1][la] for la in fold_b.layers]
