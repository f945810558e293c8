"""Bad inputs get one clear error each, of a documented type, that says what to fix."""

from __future__ import annotations

import re

import pytest
import torch
from factories import compile64, random_circuit

import circuits
from circuits import (
    Categorical,
    Circuit,
    CircuitError,
    CompiledCircuit,
    Exp,
    InputLayer,
    InvalidInputError,
    ProductKind,
    ProductLayer,
    StructureError,
    SumLayer,
    UnknownArchitectureError,
)
from circuits import templates as tpl

V = 4  # variables of the test circuit
K = 3  # categories


@pytest.fixture(scope="module")
def compiled() -> CompiledCircuit:
    return compile64(random_circuit(0, V, K))


def data(batch: int = 2) -> torch.Tensor:
    return torch.zeros(batch, V, dtype=torch.long)


# ------------------------------------------------------------------------ data x


@pytest.mark.parametrize("x", [torch.zeros(V, dtype=torch.long), torch.zeros(2, V, 1, dtype=torch.long)])
def test_x_with_the_wrong_number_of_dimensions(compiled: CompiledCircuit, x: torch.Tensor) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(f"x must have shape (batch, {V}), got "
                                                          f"{tuple(x.shape)}")):
        compiled.log_likelihood(x)


@pytest.mark.parametrize("columns", [V - 1, V + 1])
def test_x_with_the_wrong_number_of_columns(compiled: CompiledCircuit, columns: int) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(f"(batch, {V}), got (2, {columns})")):
        compiled.log_likelihood(torch.zeros(2, columns, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_x_with_a_non_integer_dtype(compiled: CompiledCircuit, dtype: torch.dtype) -> None:
    with pytest.raises(InvalidInputError, match=f"integer category indices.*{dtype}"):
        compiled.log_likelihood(torch.zeros(2, V, dtype=dtype))


def test_x_that_is_not_a_tensor(compiled: CompiledCircuit) -> None:
    with pytest.raises(InvalidInputError, match=r"x must be a torch\.Tensor, got list"):
        compiled.log_likelihood([[0] * V])  # type: ignore[arg-type]


def test_smaller_integer_dtypes_are_accepted(compiled: CompiledCircuit) -> None:
    for dtype in (torch.int8, torch.int32, torch.uint8):
        out = compiled.log_likelihood(torch.zeros(2, V, dtype=dtype))
        assert torch.equal(out, compiled.log_likelihood(data()))


@pytest.mark.parametrize("value", [-1, K, K + 7])
def test_category_out_of_range_names_row_column_and_range(compiled: CompiledCircuit,
                                                          value: int) -> None:
    x = data(3)
    x[2, 1] = value
    message = f"x[2, 1] = {value} is out of range for variable 1 with {K} categories (valid: 0..{K - 1})"
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        compiled.log_likelihood(x)
    observed = torch.ones(V, dtype=torch.bool)
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        compiled.log_marginal(x, observed)
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        compiled.log_prefix_marginals(x)
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        compiled.conditional_sample(x, observed)
    observed[1] = False  # an unobserved entry is never read: no error
    assert torch.isfinite(compiled.log_marginal(x, observed)).all()


# ------------------------------------------------------------------------ masks


@pytest.mark.parametrize("shape", [(V + 1,), (2, V + 1), (3, V), (2, V, 1)])
def test_mask_of_the_wrong_shape(compiled: CompiledCircuit, shape: tuple[int, ...]) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(f"observed must have shape ({V},) or "
                                                          f"(2, {V}), got {shape}")):
        compiled.log_marginal(data(), torch.ones(shape, dtype=torch.bool))


@pytest.mark.parametrize("mask", [torch.ones(V, dtype=torch.long), torch.ones(V), [True] * V])
def test_mask_of_the_wrong_dtype(compiled: CompiledCircuit, mask: object) -> None:
    with pytest.raises(InvalidInputError, match=re.escape("observed must be a bool tensor")):
        compiled.log_marginal(data(), mask)  # type: ignore[arg-type]


# ------------------------------------------------------------------------ external parameters


def test_unknown_parameter_name(compiled: CompiledCircuit) -> None:
    params = {"sum_999": torch.zeros(2, 1, 1, 1, dtype=torch.float64)}
    with pytest.raises(InvalidInputError, match=r"unknown parameter 'sum_999'.*parameter_shapes"):
        compiled.log_likelihood(data(), params=params)


def test_parameter_of_the_wrong_shape(compiled: CompiledCircuit) -> None:
    name, shape = next(iter(compiled.parameter_shapes().items()))
    wrong = torch.zeros(2, shape[0], shape[1], shape[2] + 1, dtype=torch.float64)
    expected = f"params['{name}'] must have shape (batch, {', '.join(map(str, shape))})"
    with pytest.raises(InvalidInputError, match=re.escape(expected)):
        compiled.log_likelihood(data(), params={name: wrong})
    with pytest.raises(InvalidInputError, match=re.escape(expected)):  # no batch dimension
        compiled.log_likelihood(data(), params={name: torch.zeros(shape, dtype=torch.float64)})


def test_parameter_batch_mismatch(compiled: CompiledCircuit) -> None:
    params = compiled.internal_parameters(3)
    name = next(iter(params))
    with pytest.raises(InvalidInputError, match=re.escape(f"params['{name}'] has 3 rows but the "
                                                          "data has 2")):
        compiled.log_likelihood(data(2), params=params)
    uneven = dict(compiled.internal_parameters(2))
    if len(uneven) > 1:
        other = list(uneven)[1]
        uneven[other] = compiled.internal_parameters(5)[other]
        with pytest.raises(InvalidInputError, match=r"disagree on the batch size: \[2, 5\]"):
            compiled.log_partition(uneven)


def test_parameter_that_is_not_floating_point(compiled: CompiledCircuit) -> None:
    name, shape = next(iter(compiled.parameter_shapes().items()))
    with pytest.raises(InvalidInputError, match="must be a floating-point tensor"):
        compiled.log_likelihood(data(), params={name: torch.zeros(2, *shape, dtype=torch.long)})
    with pytest.raises(InvalidInputError, match="params must be a mapping"):
        compiled.log_likelihood(data(), params=[1, 2])  # type: ignore[arg-type]


def test_sample_count_errors(compiled: CompiledCircuit) -> None:
    for bad in (None, 0, -3, 2.5):
        with pytest.raises(InvalidInputError, match="num_samples must be a positive int"):
            compiled.sample(bad)  # type: ignore[arg-type]
    params = compiled.internal_parameters(4)
    with pytest.raises(InvalidInputError, match=r"hold 4 parameter sets.*num_samples=7"):
        compiled.sample(7, params=params)
    assert compiled.sample(params=params).shape == (4, V)


# ------------------------------------------------------------------------ query arguments


def test_conditional_query_errors(compiled: CompiledCircuit) -> None:
    observed = torch.tensor([True, False, False, False])
    with pytest.raises(InvalidInputError, match="variable 0 is observed in some rows"):
        compiled.log_conditional(data(), observed, [0])
    with pytest.raises(InvalidInputError, match=re.escape("variable 9 is not in the circuit's scope")):
        compiled.log_conditional(data(), observed, [9])
    with pytest.raises(InvalidInputError, match="no variable to query"):
        compiled.log_conditional(data(), torch.ones(V, dtype=torch.bool))


def test_conditionals_over_different_category_counts() -> None:
    a = InputLayer(0, 1, Categorical(2))
    b = InputLayer(1, 1, Categorical(3))
    compiled = circuits.compile(Circuit(ProductLayer([a, b])))
    x = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(InvalidInputError, match=r"share a number of categories; got sizes \[2, 3\]"):
        compiled.log_conditional(x, torch.zeros(2, dtype=torch.bool), [0, 1])
    with pytest.raises(InvalidInputError, match=r"share a number of categories"):
        compiled.log_prefix_conditionals(x)
    assert compiled.log_conditional(x, torch.zeros(2, dtype=torch.bool), [1]).shape == (1, 1, 3)


@pytest.mark.parametrize("order", [[0, 0, 1, 2], [0, 1, 2, 7], [-1, 0, 1, 2]])
def test_prefix_order_errors(compiled: CompiledCircuit, order: list[int]) -> None:
    with pytest.raises(InvalidInputError, match="order must list distinct variables"):
        compiled.log_prefix_marginals(data(), order)
    with pytest.raises(InvalidInputError, match="order must list distinct variables"):
        compiled.log_prefix_conditionals(data(), order)


# ------------------------------------------------------------------------ building and compiling


def test_unknown_template_name() -> None:
    with pytest.raises(UnknownArchitectureError, match="unknown architecture 'mixture'; choose one "
                                                        "of: ff, cp, hmm, btree"):
        tpl.build("mixture", num_variables=3, num_categories=2)
    assert issubclass(UnknownArchitectureError, KeyError)
    assert issubclass(UnknownArchitectureError, CircuitError)
    assert tpl.build("BTREE", num_variables=3, num_categories=2, rank=2).output.num_units == 1


@pytest.mark.parametrize("name", ["ff", "cp", "hmm", "btree"])
def test_template_size_errors(name: str) -> None:
    with pytest.raises(StructureError, match="num_variables must be an int >= 1, got 0"):
        tpl.build(name, num_variables=0, num_categories=2)
    with pytest.raises(StructureError, match="num_categories must be an int >= 1"):
        tpl.build(name, num_variables=2, num_categories=0)


def test_hadamard_of_unequal_widths_names_both_inputs() -> None:
    a = InputLayer(0, 2, Categorical(2))
    b = InputLayer(1, 3, Categorical(2))
    with pytest.raises(StructureError, match="HADAMARD") as info:
        ProductLayer([a, b], ProductKind.HADAMARD)
    assert a.describe() in str(info.value) and b.describe() in str(info.value)
    assert "KRONECKER" in str(info.value)
    assert ProductLayer([a, b], ProductKind.KRONECKER).num_units == 6


def test_output_with_more_than_one_unit_is_rejected_at_compile_time() -> None:
    wide = SumLayer([ProductLayer([InputLayer(0, 2, Categorical(2)),
                                   InputLayer(1, 2, Categorical(2))])], 3)
    with pytest.raises(InvalidInputError, match=re.escape(f"{wide.describe()} has 3 units")):
        circuits.compile(Circuit(wide))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.complex64])
def test_unsupported_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(f"dtype must be torch.float32 or "
                                                          f"torch.float64, got {dtype}")):
        circuits.compile(tpl.cp(2, 2, 2), dtype=dtype)


def test_initial_parameters_of_the_wrong_shape() -> None:
    with pytest.raises(StructureError, match=re.escape("must have shape (2, 3), got (3, 2)")):
        InputLayer(0, 2, Categorical(3), initial=torch.zeros(3, 2))
    child = InputLayer(0, 2, Categorical(3))
    with pytest.raises(StructureError, match=re.escape("SumLayer: initial parameters must have "
                                                       "shape (1, 4), got (1, 2)")):
        SumLayer([child, child], 1, Exp(), initial=torch.zeros(1, 2))


def test_invalid_layer_arguments() -> None:
    with pytest.raises(StructureError, match="variable must be an int >= 0"):
        InputLayer(-1, 1, Categorical(2))
    with pytest.raises(StructureError, match="num_units must be an int >= 1"):
        InputLayer(0, 0, Categorical(2))
    with pytest.raises(StructureError, match="num_categories >= 1"):
        Categorical(0)
    with pytest.raises(StructureError, match="non-empty sequence of layers"):
        SumLayer([], 1)
    with pytest.raises(StructureError, match="non-empty sequence of layers"):
        ProductLayer([])
    with pytest.raises(StructureError, match="kind must be a ProductKind"):
        ProductLayer([InputLayer(0, 1, Categorical(2))], "hadamard")  # type: ignore[arg-type]
    with pytest.raises(StructureError, match="Circuit needs an output Layer"):
        Circuit("root")  # type: ignore[arg-type]


def test_one_variable_with_two_category_counts() -> None:
    a = InputLayer(0, 1, Categorical(2))
    b = InputLayer(0, 1, Categorical(3))
    with pytest.raises(StructureError, match=r"variable 0 has input layers with \d and \d categories"):
        Circuit(SumLayer([a, b], 1))


def test_errors_are_value_errors_and_circuit_errors() -> None:
    for error in (InvalidInputError, StructureError):
        assert issubclass(error, ValueError) and issubclass(error, CircuitError)
