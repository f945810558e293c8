"""Nothing lost, nothing silent: invalid parameters, impossible evidence and gapped variable ids.

* NaN, +inf and rows without mass (all -inf) are one :class:`InvalidParameterError` naming the
  tensor, the layer and the first offending index: at compile time, at load time and from every
  query, for the module's own and for external parameters; each query checks once.
* A single -inf is an exact zero: valid, and every query stays exact (brute force, float64).
* Conditional sampling and MAP given evidence of probability zero raise
  :class:`ZeroProbabilityEvidenceError` naming exactly the rows that brute force finds impossible.
* Variable ids with a gap are a structural error naming the missing ids.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import (
    Exact,
    any_circuits,
    compile64,
    random_circuit,
    seeds,
    template_circuit,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import circuits
from circuits import (
    Categorical,
    Circuit,
    CompiledCircuit,
    Exp,
    InputLayer,
    ProductLayer,
    SumLayer,
    check,
    circuit_to_dict,
    load_circuit,
    save_circuit,
)
from circuits.compiled import core as circuit_module
from circuits.compiled.validity import check_parameters
from circuits.errors import (
    CircuitError,
    InvalidInputError,
    InvalidParameterError,
    ParameterProblem,
    SerializationError,
    StructureError,
    ZeroProbabilityEvidenceError,
)
from circuits.structure import variable_id_violations

Query = Callable[[CompiledCircuit], object]

V, K = 4, 3


def queries(params: dict[str, Tensor] | None = None, rows: int = 2) -> dict[str, Query]:
    """Every public query, on ``rows`` rows of zeros (``params`` external, or the module's own)."""
    x = torch.zeros(rows, V, dtype=torch.long)
    half = torch.tensor([True, False, True, False])
    return {
        "log_likelihood": lambda c: c.log_likelihood(x, params),
        "log_marginal": lambda c: c.log_marginal(x, half, params),
        "log_partition": lambda c: c.log_partition(params),
        "log_conditional": lambda c: c.log_conditional(x, half, None, params),
        "log_prefix_marginals": lambda c: c.log_prefix_marginals(x, None, params),
        "log_prefix_conditionals": lambda c: c.log_prefix_conditionals(x, None, params),
        "sample": lambda c: c.sample(None if params else rows, None, params),
        "conditional_sample": lambda c: c.conditional_sample(x, half, None, params),
        "map_state": lambda c: c.map_state(x, half, params),
        "map_state_no_evidence": lambda c: c.map_state(params=params),
        "log_parameters": lambda c: c.log_parameters(params),
    }


def btree() -> CompiledCircuit:
    """A float64 BTree over V variables: input folds and sum folds, Softmax throughout."""
    return compile64(template_circuit("btree", V, K, 2))


def fold_names(compiled: CompiledCircuit, kind: str) -> list[str]:
    return [name for name, spec in compiled.parameter_specs().items() if spec.kind.value == kind]


def own_raw(compiled: CompiledCircuit, name: str) -> torch.nn.Parameter:
    (module,) = [m for plan, m in zip(compiled.plans, compiled.folds, strict=True)
                 if plan.name == name]
    return module.raw


def poison(table: Tensor, index: tuple[int, ...], problem: ParameterProblem) -> None:
    """Make ``table`` invalid at ``index`` (for NO_MASS, index names a row: all of it -inf)."""
    with torch.no_grad():
        if problem is ParameterProblem.NO_MASS:
            table[index] = -math.inf
        else:
            table[index] = math.nan if problem is ParameterProblem.NAN else math.inf


PROBLEMS = list(ParameterProblem)


# ------------------------------------------------------------------------ the module's own parameters
@pytest.mark.parametrize("kind", ["input", "sum"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.name for p in PROBLEMS])
def test_every_query_rejects_invalid_own_parameters(kind: str, problem: ParameterProblem) -> None:
    compiled = btree()
    name = fold_names(compiled, kind)[-1]
    raw = own_raw(compiled, name)
    folds, units, width = raw.shape
    row = (folds - 1, units - 1)
    index = row if problem is ParameterProblem.NO_MASS else (*row, width - 1)
    poison(raw, index, problem)
    layer = compiled.parameter_specs()[name].layers[folds - 1].describe()
    where = f"'{name}' (the circuit's own parameters, raw)"
    text = ", ".join(map(str, index))
    expected = (f"{where}[{text}, :] is -inf everywhere" if problem is ParameterProblem.NO_MASS
                else f"{where}[{text}] is {problem.value}")
    for query_name, query in queries().items():
        with pytest.raises(InvalidParameterError) as info:
            query(compiled)
        message = str(info.value)
        assert expected in message and layer in message, (query_name, message)
        assert "finite numbers or -inf" in message
        error = info.value
        assert (error.where, error.layer, error.index, error.problem) == (where, layer, index,
                                                                          problem)


def test_log_partition_no_longer_hides_a_nan_parameter() -> None:
    """The issue's example: NaN used to give -inf likelihoods and a plausible log Z."""
    compiled = btree()
    before = compiled.log_partition().detach()
    assert abs(float(before)) < 1e-9  # normalised
    poison(own_raw(compiled, fold_names(compiled, "sum")[0]), (0, 0, 0), ParameterProblem.NAN)
    with pytest.raises(InvalidParameterError, match="is NaN"):
        compiled.log_partition()
    with torch.no_grad():  # repaired: valid again
        own_raw(compiled, fold_names(compiled, "sum")[0])[0, 0, 0] = 0.0
    assert torch.isfinite(compiled.log_likelihood(torch.zeros(1, V, dtype=torch.long))).all()


# ------------------------------------------------------------------------ compile time
@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.name for p in PROBLEMS])
def test_compile_rejects_invalid_initial_parameters(problem: ParameterProblem) -> None:
    initial = torch.zeros(2, 3, dtype=torch.float64)
    poison(initial, (1,) if problem is ParameterProblem.NO_MASS else (1, 2), problem)
    bad = InputLayer(1, 2, Categorical(3), Exp(), initial=initial)
    circuit = Circuit(SumLayer([ProductLayer([InputLayer(0, 2, Categorical(3)), bad])], 1))
    with pytest.raises(InvalidParameterError) as info:
        circuits.compile(circuit, dtype=torch.float64)
    assert bad.describe() in str(info.value)
    assert info.value.problem is problem
    expected = (1,) if problem is ParameterProblem.NO_MASS else (1, 2)
    assert info.value.index[-len(expected):] == expected


def test_float32_overflow_of_initial_parameters_is_caught_at_compile_time() -> None:
    initial = torch.tensor([[1e300, 0.0]], dtype=torch.float64)  # finite in float64 only
    layer = InputLayer(0, 1, Categorical(2), Exp(), initial=initial)
    circuits.compile(Circuit(layer), dtype=torch.float64)
    with pytest.raises(InvalidParameterError, match=r"\[0, 0, 0\] is \+inf") as info:
        circuits.compile(Circuit(layer), dtype=torch.float32)
    assert layer.describe() in str(info.value)


# ------------------------------------------------------------------------ external parameters
@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.name for p in PROBLEMS])
def test_external_parameters_are_named_with_the_first_offending_index(
        problem: ParameterProblem) -> None:
    compiled = btree()
    name = fold_names(compiled, "input")[0]
    params = {k: v.clone() for k, v in compiled.internal_parameters(2).items()}
    table = params[name]
    row = (1, table.shape[1] - 1, 0)
    poison(table, row if problem is ParameterProblem.NO_MASS else (*row, 1), problem)
    layer = compiled.parameter_specs()[name].layers[row[1]].describe()
    for query_name, query in queries(params).items():
        with pytest.raises(InvalidParameterError) as info:
            query(compiled)
        assert info.value.where == f"params['{name}']", query_name
        assert info.value.layer == layer and layer in str(info.value)
        assert info.value.index[:3] == row and info.value.problem is problem


def test_the_first_offending_entry_is_reported() -> None:
    """Row-major order inside a tensor, the first offending entry inside a row, folds in order."""
    compiled = btree()
    first, *_, last = fold_names(compiled, "input") + fold_names(compiled, "sum")
    params = {k: v.clone() for k, v in compiled.internal_parameters(3).items()}
    params[last][0, 0, 0, 0] = math.nan  # a later fold: not reported
    params[first][2, 0, 0, 0] = math.nan
    params[first][1, 0, 0, 2] = math.nan
    params[first][1, 0, 0, 1] = math.inf  # the first bad entry of the first bad row
    with pytest.raises(InvalidParameterError) as info:
        compiled.log_likelihood(torch.zeros(3, V, dtype=torch.long), params)
    assert info.value.where == f"params['{first}']"
    assert info.value.index == (1, 0, 0, 1)
    assert info.value.problem is ParameterProblem.POSITIVE_INFINITY


def test_gradients_flow_through_checked_parameters() -> None:
    compiled = btree()
    params = {k: v.detach().clone().requires_grad_(True)
              for k, v in compiled.internal_parameters(2).items()}
    compiled.log_likelihood(torch.zeros(2, V, dtype=torch.long), params).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params.values())


def test_each_query_checks_the_values_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One reduction (and one host synchronisation) per call: no query checks twice."""
    compiled = btree()
    calls: list[int] = []

    def counting(tables: object) -> None:
        calls.append(1)
        check_parameters(tables)  # type: ignore[arg-type]

    monkeypatch.setattr(circuit_module, "check_parameters", counting)
    params = compiled.internal_parameters(2)
    for query_name, query in [*queries().items(), *queries(params).items()]:
        calls.clear()
        query(compiled)
        assert len(calls) == 1, query_name
    prepared = compiled.log_parameters(params)
    for query_name, query in queries(prepared).items():  # type: ignore[arg-type]
        calls.clear()
        query(compiled)
        assert not calls, query_name  # checked when it was made


# ------------------------------------------------------------------------ single -inf: valid and exact
@settings(max_examples=30)
@given(circuit=any_circuits(4), seed=seeds)
def test_one_more_exact_zero_stays_valid_and_exact(circuit: Circuit, seed: int) -> None:
    """Valid random circuits never raise; setting one more entry (of a row that keeps some mass)
    to -inf keeps every query valid and exact against brute force."""
    compiled = compile64(circuit)
    rng = np.random.default_rng(seed)
    names = list(compiled.parameter_specs())
    raw = own_raw(compiled, names[int(rng.integers(len(names)))])
    alive = torch.isfinite(raw.detach()).sum(-1) >= 2  # rows that keep mass after one zero
    if bool(alive.any()):
        fold, unit = (int(i) for i in alive.nonzero()[int(rng.integers(int(alive.sum())))])
        columns = torch.isfinite(raw.detach()[fold, unit]).nonzero()[:, 0]
        with torch.no_grad():
            raw[fold, unit, int(columns[int(rng.integers(len(columns)))])] = -math.inf
    ex = Exact.of(compiled)
    x = torch.tensor(ex.states)
    got = compiled.log_likelihood(x).detach().numpy()
    with np.errstate(divide="ignore"):
        want = np.log(ex.values)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-10, atol=1e-10)
    assert float(compiled.log_partition().detach()) == pytest.approx(math.log(ex.partition),
                                                              abs=1e-10)
    assert compiled.sample(3, torch.Generator().manual_seed(seed)).shape == (3, compiled.num_variables)
    compiled.map_state()
    positive = torch.tensor(ex.values > 0)
    nothing = torch.zeros(compiled.num_variables, dtype=torch.bool)
    compiled.conditional_sample(x[positive][:4], ~nothing)  # complete, possible evidence
    compiled.conditional_sample(x[:4], nothing)  # no evidence: always possible


# ------------------------------------------------------------------------ zero-probability evidence
@settings(max_examples=30)
@given(seed=seeds, fraction=st.floats(0.3, 1.0))
def test_zero_probability_evidence_raises_naming_exactly_the_impossible_rows(
        seed: int, fraction: float) -> None:
    compiled = compile64(random_circuit(seed, zero_prob=0.4))
    ex = Exact.of(compiled)
    rng = np.random.default_rng(seed)
    x = ex.states[rng.integers(0, len(ex.states), size=8)]
    mask = rng.random(x.shape) < fraction
    impossible = tuple(b for b in range(len(x)) if ex.marginal(x[b], mask[b]) == 0)
    xt, maskt = torch.tensor(x), torch.tensor(mask)
    for query_name, query in {
            "conditional_sample": lambda: compiled.conditional_sample(xt, maskt),
            "map_state": lambda: compiled.map_state(xt, maskt)}.items():
        if not impossible:
            query()
            continue
        with pytest.raises(ZeroProbabilityEvidenceError) as info:
            query()
        assert info.value.rows == impossible
        assert info.value.log_probability == -math.inf
        assert str(info.value).startswith(f"{query_name}: the evidence of row")
        assert "probability zero (log-probability -inf)" in str(info.value)
    keep = [b for b in range(len(x)) if b not in impossible]
    samples = compiled.conditional_sample(xt[keep], maskt[keep])
    assert all(ex.values[ex.index(samples[i: i + 1].numpy())[0]] > 0 for i in range(len(keep)))


def test_zero_probability_evidence_with_external_parameters() -> None:
    """``p(x0 = 1) = 0`` for parameter set 1 only: only row 1 is impossible."""
    x0 = InputLayer(0, 1, Categorical(3), Exp(), initial=torch.zeros(1, 3, dtype=torch.float64))
    x1 = InputLayer(1, 1, Categorical(2), initial=torch.zeros(1, 2, dtype=torch.float64))
    compiled = compile64(Circuit(ProductLayer([x0, x1])))
    params = {k: v.clone() for k, v in compiled.internal_parameters(3).items()}
    name = next(n for n, s in compiled.parameter_specs().items() if 0 in s.variables)
    params[name][1, :, :, 1] = -math.inf  # a zero, not an invalid row
    x = torch.tensor([[1, 0], [1, 1], [1, 0]])
    observed = torch.tensor([True, False])
    for query in (lambda: compiled.conditional_sample(x, observed, params=params),
                  lambda: compiled.map_state(x, observed, params)):
        with pytest.raises(ZeroProbabilityEvidenceError, match=r"row 1 has probability zero"):
            query()
    assert torch.isneginf(compiled.log_marginal(x, observed, params)[1])  # a value, not an error


def test_errors_are_typed_and_picklable() -> None:
    for error_type in (InvalidParameterError, ZeroProbabilityEvidenceError):
        assert issubclass(error_type, InvalidInputError)
        assert issubclass(error_type, ValueError) and issubclass(error_type, CircuitError)
    error = InvalidParameterError("m", where="params['a']", layer="L", index=(1, 2),
                                  problem=ParameterProblem.NAN)
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.where, copy.index, copy.problem) == ("m", "params['a']", (1, 2),
                                                                 ParameterProblem.NAN)
    evidence = pickle.loads(pickle.dumps(ZeroProbabilityEvidenceError("e", rows=(3,))))
    assert evidence.rows == (3,) and evidence.log_probability == -math.inf


# ------------------------------------------------------------------------ circuit files
def _file_with(tmp_path: Path, layer: int, initial: list[list[object]]) -> Path:
    data = circuit_to_dict(template_circuit("cp", 2, 3, 2))
    (entry,) = [e for e in data["layers"] if e["type"] == "input"][layer:layer + 1]
    entry["initial"] = initial
    path = tmp_path / "circuit.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("row", "message"), [
    (["nan", 0.0, 0.0], r"initial\[1\]\[0\] is NaN"),
    ([0.0, 0.0, "inf"], r"initial\[1\]\[2\] is \+inf"),
    (["-inf", "-inf", "-inf"], r"initial\[1\] is -inf everywhere \(unit 1 has no mass\)"),
])
def test_loading_invalid_parameters_names_the_layer_entry(tmp_path: Path, row: list[object],
                                                          message: str) -> None:
    path = _file_with(tmp_path, 1, [[0.0, 1.0, 2.0], row])
    with pytest.raises(SerializationError, match=rf"circuit.json: layers\[\d+\]\.{message}; a "
                                                 r"parameter must be a number or -inf"):
        load_circuit(path)


def test_a_single_minus_inf_in_a_file_is_an_exact_zero(tmp_path: Path) -> None:
    path = _file_with(tmp_path, 0, [[0.0, "-inf", 1.0], [0.5, 0.5, "-inf"]])
    compiled = circuits.compile(load_circuit(path), dtype=torch.float64)
    ll = compiled.log_likelihood(torch.tensor([[1, 0], [0, 0]])).detach()
    assert torch.isfinite(ll[1]) and float(ll[0]) < float(ll[1])


def test_saving_invalid_parameters_is_refused_and_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "circuit.json"
    good = template_circuit("cp", 2, 3, 2)
    save_circuit(good, path)
    before = path.read_text()
    layer = InputLayer(0, 1, Categorical(2), initial=torch.tensor([[0.0, math.nan]]))
    with pytest.raises(SerializationError, match=re.escape(f"cannot serialise {layer.describe()}: "
                                                           "its initial parameters[0][1] is NaN")):
        save_circuit(Circuit(layer), path)
    assert path.read_text() == before


# ------------------------------------------------------------------------ variable ids
def leaf(variable: int, integrated: bool = False) -> InputLayer:
    return InputLayer(variable, 1, Categorical(2), integrated=integrated)


@pytest.mark.parametrize(("variables", "missing"), [((0, 2), [1]), ((1, 2), [0]),
                                                    ((0, 2, 4, 5), [1, 3])])
def test_a_gap_in_variable_ids_is_a_structure_error(variables: tuple[int, ...],
                                                    missing: list[int]) -> None:
    circuit = Circuit(ProductLayer([leaf(v) for v in variables]))
    (problem,) = variable_id_violations(circuit)
    assert f"variable ids {missing} are missing" in problem
    for build in (check, circuits.compile):
        with pytest.raises(StructureError, match=re.escape(f"variable ids {missing} are missing")):
            build(circuit)


def test_an_integrated_variable_is_not_a_gap() -> None:
    """``integrate`` leaves a variable that only integrated layers use: a column, not a gap."""
    circuit = Circuit(ProductLayer([leaf(0), leaf(1, integrated=True), leaf(2)]))
    assert not variable_id_violations(circuit)
    check(circuit)
    integrated = circuits.integrate(template_circuit("cp", 3, 2, 2), [1])
    check(integrated)
    assert sorted(integrated.scope) == [0, 2]

