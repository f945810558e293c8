"""Saving and loading symbolic circuits as JSON.

A circuit file stores the *structure* (layers, their inputs, widths, product kinds, variables,
categories, parameterisations, integrated flags) and, optionally, each input and sum layer's
``initial`` raw parameters as nested lists. This is how a circuit designed (or trained, via
:func:`circuits.operations.snapshot`) in one place becomes e.g. an LLM head elsewhere.

Format (version 1)::

    {"format": "circuits.circuit", "version": 1,
     "layers": [                                  # topological order, the output layer last
        {"type": "input", "variable": 0, "num_units": 2,
         "distribution": {"type": "categorical", "num_categories": 3},
         "parameterization": "softmax", "integrated": false, "initial": [[...], [...]]},
        {"type": "product", "kind": "hadamard", "inputs": [0, 1]},
        {"type": "sum", "num_units": 1, "parameterization": "exp", "inputs": [2], "initial": [[...]]}
     ]}

The other input families write their distribution as ``{"type": "bernoulli"}``,
``{"type": "binomial", "total_count": n}`` or ``{"type": "gaussian", "min_variance": v}``, with
``"parameterization": "native"`` (their own raw parameters: a success logit, or a mean and a
log-standard-deviation, per unit).

``inputs`` index earlier entries of ``layers``. Floats are written with full (round-trip) precision;
``-inf`` (an exact zero) is written as the string ``"-inf"`` so that files are strict JSON.
Parameters must be valid (:mod:`circuits.compiled.validity`): no NaN, no ``+inf`` and at least one
entry above ``-inf`` per row (success logits: any number but NaN; Gaussian parameters: finite); a
circuit with others is refused on writing, and a file holding them (``"nan"``, ``"inf"``, or a row
of ``"-inf"``) on reading, naming the layer and the first bad index.
Loaded parameters are float64 tensors. Every malformed input raises
:class:`~circuits.errors.SerializationError` naming the offending entry.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits.compiled.input_families import ValueRule
from circuits.compiled.validity import first_problem, problem_text
from circuits.errors import CircuitError, ParameterProblem, SerializationError
from circuits.files import atomic_write_text
from circuits.parameterizations import Exp, Native, Parameterization, Softmax
from circuits.symbolic import (
    Bernoulli,
    Binomial,
    Categorical,
    Circuit,
    Gaussian,
    InputDistribution,
    InputLayer,
    Layer,
    ProductKind,
    ProductLayer,
    SumLayer,
)

FORMAT = "circuits.circuit"
VERSION = 1
_PARAMETERIZATIONS: dict[str, Parameterization] = {"softmax": Softmax(), "exp": Exp(),
                                                   "native": Native()}
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_INPUT_KEYS = {"type", "variable", "num_units", "distribution", "parameterization", "integrated",
               "initial"}
_SUM_KEYS = {"type", "inputs", "num_units", "parameterization", "initial"}
_PRODUCT_KEYS = {"type", "inputs", "kind"}


# ---------------------------------------------------------------------------------- writing
def _parameterization_name(layer: InputLayer | SumLayer) -> str:
    for name, known in _PARAMETERIZATIONS.items():
        if layer.parameterization == known:
            return name
    raise SerializationError(
        f"cannot serialise {layer.describe()}: its parameterisation {layer.parameterization!r} is "
        f"not one of {sorted(_PARAMETERIZATIONS)}")


def _encode(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _tensor_to_lists(value: Tensor) -> list[list[float | str]]:
    rows = value.detach().to(device="cpu", dtype=torch.float64).tolist()
    return [[_encode(x) for x in row] for row in rows]


def _invalid_values(values: Tensor, rule: ValueRule) -> str | None:
    """Where and how the ``(K, D)`` parameters ``values`` are invalid, e.g. ``"[1][2] is NaN"``."""
    found = first_problem(values, rule)
    if found is None:
        return None
    index, problem = found
    where = "".join(f"[{i}]" for i in index)
    if problem is ParameterProblem.NO_MASS:
        return f"{where} is -inf everywhere (unit {index[0]} has no mass)"
    return f"{where} is {problem_text(problem)}"


#: what a parameter may hold, appended to the errors about parameter values
_VALID = {
    ValueRule.ROWS: ("a parameter must be a number or -inf (an exact zero), with at least one entry "
                     "above -inf in every row"),
    ValueRule.NOT_NAN: "a success logit must be a number, -inf and inf included, not NaN",
    ValueRule.FINITE: "a Gaussian's mean and log-standard-deviation must be finite numbers",
}


def _rule(distribution: InputDistribution | None) -> ValueRule:
    """Which raw values are valid for an input layer of ``distribution`` (None: a sum layer), see
    :mod:`circuits.compiled.validity`."""
    if distribution is None or isinstance(distribution, Categorical):
        return ValueRule.ROWS
    return ValueRule.FINITE if isinstance(distribution, Gaussian) else ValueRule.NOT_NAN


def _distribution_to_dict(distribution: InputDistribution) -> dict[str, Any]:
    if isinstance(distribution, Categorical):
        return {"type": "categorical", "num_categories": distribution.num_categories}
    if isinstance(distribution, Bernoulli):
        return {"type": "bernoulli"}
    if isinstance(distribution, Binomial):
        return {"type": "binomial", "total_count": distribution.total_count}
    if isinstance(distribution, Gaussian):
        return {"type": "gaussian", "min_variance": distribution.min_variance}
    raise SerializationError(f"cannot serialise the input distribution {distribution!r}")


def circuit_to_dict(circuit: Circuit, include_parameters: bool = True) -> dict[str, Any]:
    """A JSON-ready dictionary describing ``circuit`` (see the module docstring for the format).

    Args:
        circuit: the symbolic circuit.
        include_parameters: store the ``initial`` raw parameters of layers that have them.
    """
    if not isinstance(circuit, Circuit):
        raise SerializationError(
            f"expected a Circuit, got {type(circuit).__name__} (for a compiled circuit, save "
            "circuits.operations.snapshot(compiled))")
    index: dict[Layer, int] = {}
    entries: list[dict[str, Any]] = []
    for layer in circuit.layers:
        entry: dict[str, Any]
        if isinstance(layer, InputLayer):
            entry = {"type": "input", "variable": layer.variable, "num_units": layer.num_units,
                     "distribution": _distribution_to_dict(layer.distribution),
                     "parameterization": _parameterization_name(layer),
                     "integrated": layer.integrated}
        elif isinstance(layer, SumLayer):
            entry = {"type": "sum", "inputs": [index[i] for i in layer.inputs],
                     "num_units": layer.num_units,
                     "parameterization": _parameterization_name(layer)}
        elif isinstance(layer, ProductLayer):
            entry = {"type": "product", "inputs": [index[i] for i in layer.inputs],
                     "kind": layer.kind.value}
        else:
            raise SerializationError(f"cannot serialise {layer.describe()}: unknown layer type")
        if include_parameters and isinstance(layer, (InputLayer, SumLayer)) and \
                layer.initial is not None:
            rule = _rule(layer.distribution if isinstance(layer, InputLayer) else None)
            problem = _invalid_values(layer.initial, rule)
            if problem is not None:
                raise SerializationError(f"cannot serialise {layer.describe()}: its initial "
                                         f"parameters{problem}; {_VALID[rule]}")
            entry["initial"] = _tensor_to_lists(layer.initial)
        index[layer] = len(entries)
        entries.append(entry)
    return {"format": FORMAT, "version": VERSION, "layers": entries}


def save_circuit(circuit: Circuit, path: str | os.PathLike[str], include_parameters: bool = True) -> None:
    """Write ``circuit`` as JSON to ``path`` atomically (a temporary file, then ``os.replace``),
    so a reader never sees a half-written file."""
    text = json.dumps(circuit_to_dict(circuit, include_parameters), allow_nan=False)
    atomic_write_text(path, text)


# ---------------------------------------------------------------------------------- reading
def _int(entry: dict[str, Any], key: str, where: str, minimum: int) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SerializationError(f"{where}.{key} must be an int >= {minimum}, got {value!r}")
    return value


def _parameterization(entry: dict[str, Any], where: str) -> Parameterization:
    name = entry.get("parameterization")
    if not isinstance(name, str) or name not in _PARAMETERIZATIONS:
        raise SerializationError(f"{where}.parameterization must be one of "
                                 f"{sorted(_PARAMETERIZATIONS)}, got {name!r}")
    return _PARAMETERIZATIONS[name]


def _decode(value: object, where: str) -> float:
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise SerializationError(f"{where} must hold numbers (or 'inf', '-inf', 'nan'), got {value!r}")


def _initial(entry: dict[str, Any], where: str, rule: ValueRule) -> Tensor | None:
    rows = entry.get("initial")
    if rows is None:
        return None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows) or \
            len({len(r) for r in rows}) != 1:
        raise SerializationError(f"{where}.initial must be a non-empty list of equally long lists")
    values = torch.tensor([[_decode(x, f"{where}.initial") for x in row] for row in rows],
                          dtype=torch.float64)
    problem = _invalid_values(values, rule)
    if problem is not None:
        raise SerializationError(f"{where}.initial{problem}; {_VALID[rule]}")
    return values


def _inputs(entry: dict[str, Any], where: str, built: list[Layer]) -> list[Layer]:
    ids = entry.get("inputs")
    if not isinstance(ids, list) or not ids:
        raise SerializationError(f"{where}.inputs must be a non-empty list of layer indices")
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(built):
            raise SerializationError(
                f"{where}.inputs: {i!r} is not the index of an earlier layer (0..{len(built) - 1}); "
                "layers must be listed inputs first")
    return [built[i] for i in ids]


#: the fields of each serialised distribution type, besides "type"
_DISTRIBUTION_FIELDS = {"categorical": {"num_categories"}, "bernoulli": set(),
                        "binomial": {"total_count"}, "gaussian": {"min_variance"}}


def _distribution(value: object, where: str) -> InputDistribution:
    kind = value.get("type") if isinstance(value, dict) else None
    fields = _DISTRIBUTION_FIELDS.get(kind) if isinstance(kind, str) else None
    if not isinstance(value, dict) or fields is None or set(value) != {"type", *fields}:
        raise SerializationError(
            f"{where} must be {{'type': 'categorical', 'num_categories': C}}, {{'type': 'bernoulli'}}, "
            f"{{'type': 'binomial', 'total_count': n}} or {{'type': 'gaussian', 'min_variance': v}}, "
            f"got {value!r}")
    if kind == "categorical":
        return Categorical(_int(value, "num_categories", where, 1))
    if kind == "bernoulli":
        return Bernoulli()
    if kind == "binomial":
        return Binomial(_int(value, "total_count", where, 1))
    floor = value["min_variance"]
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not math.isfinite(floor) \
            or floor <= 0:
        raise SerializationError(f"{where}.min_variance must be a finite number > 0, got {floor!r}")
    return Gaussian(float(floor))


def _layer(entry: object, where: str, built: list[Layer]) -> Layer:
    if not isinstance(entry, dict):
        raise SerializationError(f"{where} must be an object, got {type(entry).__name__}")
    kind = entry.get("type")
    kinds = {"input": _INPUT_KEYS, "sum": _SUM_KEYS, "product": _PRODUCT_KEYS}
    allowed = kinds.get(kind) if isinstance(kind, str) else None
    if allowed is None:
        raise SerializationError(f"{where}.type must be 'input', 'sum' or 'product', got {kind!r}")
    unknown = set(entry) - allowed
    if unknown:
        raise SerializationError(f"{where}: unknown fields {sorted(unknown)} for a {kind} layer")
    if kind == "input":
        distribution = _distribution(entry.get("distribution"), f"{where}.distribution")
        integrated = entry.get("integrated", False)
        if not isinstance(integrated, bool):
            raise SerializationError(f"{where}.integrated must be true or false, got {integrated!r}")
        return InputLayer(_int(entry, "variable", where, 0), _int(entry, "num_units", where, 1),
                          distribution, _parameterization(entry, where),
                          _initial(entry, where, _rule(distribution)), integrated)
    inputs = _inputs(entry, where, built)
    if kind == "sum":
        return SumLayer(inputs, _int(entry, "num_units", where, 1), _parameterization(entry, where),
                        _initial(entry, where, _rule(None)))
    try:
        product_kind = ProductKind(entry.get("kind"))
    except ValueError:
        raise SerializationError(f"{where}.kind must be one of "
                                 f"{[k.value for k in ProductKind]}, got {entry.get('kind')!r}") from None
    return ProductLayer(inputs, product_kind)


def circuit_from_dict(data: object) -> Circuit:
    """Rebuild a circuit from :func:`circuit_to_dict`'s output; parameters become float64.

    Raises:
        SerializationError: wrong format or version, a missing or ill-typed field, an input index
            that does not point to an earlier layer, layers the output does not use, or a layer
            the IR rejects (e.g. parameters of the wrong shape).
    """
    if not isinstance(data, dict):
        raise SerializationError(f"a serialised circuit must be an object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise SerializationError(f"not a circuit: 'format' is {data.get('format')!r}, expected {FORMAT!r}")
    version = data.get("version")
    if version != VERSION or isinstance(version, bool):
        raise SerializationError(
            f"unsupported circuit file version {version!r}; this library reads version {VERSION}")
    unknown = set(data) - {"format", "version", "layers"}
    if unknown:
        raise SerializationError(f"unknown top-level fields {sorted(unknown)}")
    entries = data.get("layers")
    if not isinstance(entries, list) or not entries:
        raise SerializationError("'layers' must be a non-empty list")
    built: list[Layer] = []
    for position, entry in enumerate(entries):
        where = f"layers[{position}]"
        try:
            built.append(_layer(entry, where, built))
        except SerializationError:
            raise
        except CircuitError as error:
            raise SerializationError(f"{where}: {error}") from error
    try:
        circuit = Circuit(built[-1])
    except CircuitError as error:
        raise SerializationError(f"invalid circuit: {error}") from error
    used = set(circuit.layers)
    unused = [i for i, layer in enumerate(built) if layer not in used]
    if unused:
        raise SerializationError(f"layers {unused} are not used by the output layer (the last one)")
    return circuit


def load_circuit(path: str | os.PathLike[str]) -> Circuit:
    """Read a circuit written by :func:`save_circuit`.

    Raises:
        SerializationError: the file is not valid UTF-8 JSON or not a valid circuit (the message
            starts with the path). A missing file raises ``FileNotFoundError`` as usual.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SerializationError(f"{path}: not a JSON circuit file ({error})") from error
    try:
        return circuit_from_dict(data)
    except SerializationError as error:
        raise SerializationError(f"{path}: {error}") from error


__all__ = ["FORMAT", "VERSION", "circuit_from_dict", "circuit_to_dict", "load_circuit", "save_circuit"]
