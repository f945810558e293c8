"""Tests of circuits.serialization: lossless round trips and clear errors on malformed files."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import circuits
from circuits import templates
from circuits.errors import CircuitError, SerializationError
from circuits.operations import integrate, multiply, snapshot
from circuits.parameterizations import Softmax
from circuits.serialization import (
    VERSION,
    circuit_from_dict,
    circuit_to_dict,
    load_circuit,
    save_circuit,
)
from circuits.symbolic import Circuit, InputLayer, Layer, ProductLayer, SumLayer

TOL = {"atol": 1e-10, "rtol": 0.0}


def describe(circuit: Circuit) -> list[tuple[object, ...]]:
    """Everything structural about each layer, with inputs as positions in topological order."""
    position = {layer: i for i, layer in enumerate(circuit.layers)}
    rows: list[tuple[object, ...]] = []
    for layer in circuit.layers:
        inputs = tuple(position[i] for i in layer.inputs)
        if isinstance(layer, InputLayer):
            rows.append(("input", layer.variable, layer.num_units, layer.num_categories,
                         layer.parameterization, layer.integrated))
        elif isinstance(layer, SumLayer):
            rows.append(("sum", inputs, layer.num_units, layer.parameterization))
        else:
            assert isinstance(layer, ProductLayer)
            rows.append(("product", inputs, layer.kind, layer.num_units))
    return rows


def parameters(circuit: Circuit) -> list[torch.Tensor | None]:
    return [layer.initial for layer in circuit.layers if isinstance(layer, (InputLayer, SumLayer))]


def all_states(circuit: Circuit) -> torch.Tensor:
    sizes = [circuit.num_categories.get(v, 1) for v in range(circuit.num_variables)]
    return torch.tensor(list(itertools.product(*(range(s) for s in sizes))))


def assert_same(original: Circuit, loaded: Circuit, with_parameters: bool) -> None:
    assert describe(loaded) == describe(original)
    for before, after in zip(parameters(original), parameters(loaded), strict=True):
        if with_parameters and before is not None:
            assert after is not None and after.dtype == torch.float64
            assert torch.equal(after, before.to(torch.float64))  # bit-exact, -inf included
        else:
            assert after is None
    if not with_parameters and any(p is not None for p in parameters(original)):
        return  # dropped parameters: the loaded circuit is freshly initialised, as intended
    x = all_states(original)
    expected = circuits.compile(original, dtype=torch.float64, seed=3)(x)
    torch.testing.assert_close(circuits.compile(loaded, dtype=torch.float64, seed=3)(x), expected, **TOL)


@dataclass
class Case:
    name: str
    num_variables: int
    rank: int
    num_categories: int
    trained: bool  # parameters from a compiled module (snapshot) instead of none
    squared: bool  # multiply with itself: Exp parameters with -inf entries, wide layers
    integrated: tuple[int, ...]

    def build(self) -> Circuit:
        rank = 1 if self.name == "ff" else self.rank
        circuit = templates.build(self.name, self.num_variables, self.num_categories, rank)
        if self.trained or self.squared:
            circuit = snapshot(circuits.compile(circuit, dtype=torch.float64, seed=self.rank))
        if self.squared:
            circuit = multiply(circuit, circuit)
        usable = [v for v in self.integrated if v < self.num_variables]
        return integrate(circuit, sorted(set(usable))) if usable else circuit


cases = st.builds(Case, st.sampled_from(["ff", "cp", "hmm", "btree"]), st.integers(2, 4),
                  st.integers(1, 3), st.integers(2, 3), st.booleans(), st.booleans(),
                  st.lists(st.integers(0, 3), max_size=2).map(tuple))


@settings(max_examples=30, deadline=None)
@given(case=cases, include=st.booleans())
def test_dict_round_trip(case: Case, include: bool) -> None:
    circuit = case.build()
    data = circuit_to_dict(circuit, include_parameters=include)
    assert data["version"] == VERSION
    json.dumps(data, allow_nan=False)  # strict JSON: no NaN/Infinity tokens
    assert_same(circuit, circuit_from_dict(json.loads(json.dumps(data))), include)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_file_round_trip(case: Case, tmp_path: Path) -> None:
    circuit = case.build()
    path = tmp_path / "head.circuit.json"
    save_circuit(circuit, path)
    save_circuit(circuit, path)  # overwriting is fine
    assert_same(circuit, load_circuit(path), True)
    assert [p.name for p in tmp_path.iterdir()] == ["head.circuit.json"]  # no temporary left


def test_product_circuit_keeps_exact_zeros(tmp_path: Path) -> None:
    tree = snapshot(circuits.compile(templates.btree(3, 2, 3), dtype=torch.float64))
    chain = snapshot(circuits.compile(templates.hmm(3, 2, 3), dtype=torch.float64))
    squared = multiply(tree, chain)  # input x sum over x2: identity weights with exact zeros
    assert any(bool(torch.isneginf(p).any()) for p in parameters(squared) if p is not None)
    save_circuit(squared, tmp_path / "sq.json")
    assert "Infinity" not in (tmp_path / "sq.json").read_text()
    loaded = circuits.compile(load_circuit(tmp_path / "sq.json"), dtype=torch.float64)
    torch.testing.assert_close(loaded.log_partition(),
                               circuits.compile(squared, dtype=torch.float64).log_partition(), **TOL)


def valid() -> dict:
    return circuit_to_dict(snapshot(circuits.compile(templates.btree(2, 2, 2))))


def set_at(path: tuple[object, ...], value: object) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


def drop(path: tuple[object, ...]) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        target = data
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return edit


MALFORMED = [
    (set_at(("version",), 99), "version 99"),
    (set_at(("version",), True), "version True"),
    (set_at(("format",), "other"), "not a circuit"),
    (set_at(("extra",), 1), "unknown top-level fields"),
    (set_at(("layers",), []), "non-empty list"),
    (set_at(("layers", 0, "type"), "mystery"), r"layers\[0\].type"),
    (set_at(("layers", 0, "type"), ["input"]), r"layers\[0\].type"),
    (set_at(("layers", 0, "variable"), -1), r"layers\[0\].variable"),
    (set_at(("layers", 0, "num_units"), True), r"layers\[0\].num_units"),
    (set_at(("layers", 0, "distribution"), {"type": "gaussian"}), r"layers\[0\].distribution"),
    (set_at(("layers", 0, "integrated"), "no"), r"layers\[0\].integrated"),
    (set_at(("layers", 0, "parameterization"), "sigmoid"), r"layers\[0\].parameterization"),
    (set_at(("layers", 0, "initial"), [[1.0], [2.0, 3.0]]), r"layers\[0\].initial"),
    (set_at(("layers", 0, "initial"), [["x", 1.0], [0.0, 1.0]]), r"layers\[0\].initial"),
    (set_at(("layers", 0, "initial"), [[1.0, 2.0, 3.0]] * 2), r"layers\[0\]: .*shape"),
    (set_at(("layers", 0, "colour"), "red"), r"layers\[0\]: unknown fields \['colour'\]"),
    (set_at(("layers", 2, "inputs"), [0, 7]), r"layers\[2\].inputs: 7"),
    (set_at(("layers", 2, "inputs"), []), r"layers\[2\].inputs"),
    (set_at(("layers", 2, "kind"), "outer"), r"layers\[2\].kind"),
    (drop(("layers", 3, "num_units")), r"layers\[3\].num_units"),
    (lambda d: d["layers"].append(copy.deepcopy(d["layers"][0])), "not used by the output"),
]


@pytest.mark.parametrize(("edit", "message"), MALFORMED)
def test_malformed_dict_raises(edit: Callable[[dict], None], message: str) -> None:
    data = valid()
    circuit_from_dict(copy.deepcopy(data))  # the unedited dictionary is fine
    edit(data)
    with pytest.raises(SerializationError, match=message):
        circuit_from_dict(data)


def test_hadamard_width_mismatch_is_reported_as_serialization_error() -> None:
    data = valid()
    data["layers"][0]["num_units"] = 3
    del data["layers"][0]["initial"]
    with pytest.raises(SerializationError, match=r"layers\[2\]: ProductLayer\(HADAMARD\)"):
        circuit_from_dict(data)


def test_bad_files_raise(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(SerializationError, match="not a JSON circuit file"):
        load_circuit(path)
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SerializationError, match="not a JSON circuit file"):
        load_circuit(path)
    path.write_text(json.dumps({**valid(), "version": VERSION + 1}))
    with pytest.raises(SerializationError, match=rf"bad.json: unsupported .* version {VERSION + 1}"):
        load_circuit(path)
    path.write_text("[1, 2]")
    with pytest.raises(CircuitError, match="must be an object"):
        load_circuit(path)


def test_unserialisable_inputs_leave_existing_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "head.json"
    good = templates.cp(2, 2, 2)
    save_circuit(good, path)
    before = path.read_text()

    @dataclass(frozen=True)
    class Sharpened(Softmax):
        temperature: float = 0.5

    layer: Layer = InputLayer(0, 1, good.input_layers[0].distribution, Sharpened())
    with pytest.raises(SerializationError, match="parameterisation"):
        save_circuit(Circuit(layer), path)
    with pytest.raises(SerializationError, match="snapshot"):
        save_circuit(circuits.compile(good), path)  # type: ignore[arg-type]
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["head.json"]
