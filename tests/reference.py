"""An independent brute-force reference for circuits, in numpy.

:func:`reference_values` evaluates the *symbolic* circuit in numpy, in linear space, one layer at a
time. It shares no code with :mod:`circuits.compiled` (it reimplements the parameterisations,
input units, sums and both product kinds); the only thing it takes from a compiled circuit is the
raw parameter values, read through the public :meth:`~circuits.CompiledCircuit.parameter_specs`.
:class:`Exact` enumerates every assignment. :func:`compile64`, :func:`copy_parameters` and
:func:`set_row_parameters` put the same parameters into compiled circuits to compare against it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

import circuits
from circuits import (
    Circuit,
    CompiledCircuit,
    Exp,
    InputLayer,
    Parameterization,
    ProductKind,
    ProductLayer,
    Softmax,
    SumLayer,
)

RawParams = Mapping[int, np.ndarray]  # layer uid -> raw (K, D), or (N, K, D) per row


def raw_from_initial(circuit: Circuit) -> dict[int, np.ndarray]:
    """Raw parameters taken from the layers' ``initial`` tensors (all must be set)."""
    out: dict[int, np.ndarray] = {}
    for layer in circuit.layers:
        if isinstance(layer, (InputLayer, SumLayer)):
            assert layer.initial is not None
            out[layer.uid] = layer.initial.detach().double().numpy()
    return out


def raw_from_compiled(compiled: CompiledCircuit,
                      params: Mapping[str, torch.Tensor] | None = None) -> dict[int, np.ndarray]:
    """Raw parameters per symbolic layer, read from a compiled circuit (or external params).

    With external params ``{name: (B, F, K, D)}`` each layer gets a per-row ``(B, K, D)`` array.
    """
    out: dict[int, np.ndarray] = {}
    specs = compiled.parameter_specs()
    for plan, module in zip(compiled.plans, compiled.folds, strict=True):
        spec = specs.get(plan.name)
        if spec is None:
            continue
        if params is not None and plan.name in params:
            table = params[plan.name].detach().double().numpy()
            for slot, layer in enumerate(spec.layers):
                out[layer.uid] = table[:, slot]
        else:
            table = module.raw.detach().double().numpy()
            for slot, layer in enumerate(spec.layers):
                out[layer.uid] = table[slot]
    return out


def _weights(parameterization: Parameterization, raw: np.ndarray) -> np.ndarray:
    """Linear weights from raw values, reimplemented (last axis = alternatives)."""
    if isinstance(parameterization, Softmax):
        top = raw.max(axis=-1, keepdims=True)
        e = np.exp(raw - top)
        return e / e.sum(axis=-1, keepdims=True)
    if isinstance(parameterization, Exp):
        return np.exp(raw)
    raise TypeError(f"reference does not know {parameterization!r}")


def reference_values(circuit: Circuit, raw: RawParams, x: np.ndarray, observed: np.ndarray,
                     semiring: str = "sum",
                     every_layer: dict[int, np.ndarray] | None = None) -> np.ndarray:
    """Output values (linear space, float64) of ``circuit`` on rows ``x`` with mask ``observed``.

    ``semiring="sum"`` gives probabilities (unobserved variables summed out), ``"max"`` the
    max-product value (unobserved variables maxed out; integrated layers always summed).
    ``every_layer``, when given, receives each layer's ``(N, units)`` values by uid.
    """
    x = np.asarray(x, dtype=np.int64)
    observed = np.broadcast_to(np.asarray(observed, dtype=bool), x.shape)
    n = x.shape[0]
    values: dict[int, np.ndarray] = {}
    for layer in circuit.layers:
        if isinstance(layer, InputLayer):
            w = np.broadcast_to(_weights(layer.parameterization, raw[layer.uid]),
                                (n, layer.num_units, layer.num_categories))
            if layer.integrated:
                values[layer.uid] = w.sum(-1)
                continue
            free = w.sum(-1) if semiring == "sum" else w.max(-1)
            column = np.clip(x[:, layer.variable], 0, layer.num_categories - 1)
            picked = w[np.arange(n), :, column]
            values[layer.uid] = np.where(observed[:, layer.variable, None], picked, free)
        elif isinstance(layer, SumLayer):
            w = np.broadcast_to(_weights(layer.parameterization, raw[layer.uid]),
                                (n, *layer.parameter_shape))
            joined = np.concatenate([values[i.uid] for i in layer.inputs], axis=1)
            terms = w * joined[:, None, :]
            values[layer.uid] = terms.sum(-1) if semiring == "sum" else terms.max(-1)
        else:
            assert isinstance(layer, ProductLayer)
            result = values[layer.inputs[0].uid]
            for child in layer.inputs[1:]:
                other = values[child.uid]
                if layer.kind is ProductKind.HADAMARD:
                    result = result * other
                else:
                    result = (result[:, :, None] * other[:, None, :]).reshape(n, -1)
            values[layer.uid] = result
    if every_layer is not None:
        every_layer.update(values)
    out = values[circuit.output.uid]
    assert out.shape == (n, 1)
    return out[:, 0]


def log(values: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(values)


@dataclass
class Exact:
    """The exact distribution of a compiled circuit by enumeration of its scope.

    Attributes:
        states: (S, V) every assignment of the scope (columns outside the scope are 0).
        values: (S,) unnormalised values ``c(x)`` from the independent reference.
        probs: (S,) ``values / Z``.
    """

    circuit: Circuit
    raw: dict[int, np.ndarray]
    states: np.ndarray
    values: np.ndarray
    scope: tuple[int, ...]

    @classmethod
    def of(cls, compiled: CompiledCircuit,
           params: Mapping[str, torch.Tensor] | None = None, row: int | None = None) -> Exact:
        raw = raw_from_compiled(compiled, params)
        if row is not None:
            raw = {k: (v[row] if v.ndim == 3 else v) for k, v in raw.items()}
        circuit = compiled.circuit
        scope = tuple(sorted(circuit.scope))
        grids = [range(circuit.num_categories[v]) for v in scope]
        combos = np.array(list(itertools.product(*grids)), dtype=np.int64).reshape(-1, len(scope))
        states = np.zeros((combos.shape[0], circuit.num_variables), dtype=np.int64)
        states[:, list(scope)] = combos
        values = reference_values(circuit, raw, states, np.ones_like(states, dtype=bool))
        return cls(circuit, raw, states, values, scope)

    @property
    def partition(self) -> float:
        return float(self.values.sum())

    @property
    def probs(self) -> np.ndarray:
        return self.values / self.partition

    def consistent(self, x: np.ndarray, observed: np.ndarray) -> np.ndarray:
        """(S,) bool: states agreeing with ``x`` on the observed variables (one row)."""
        mask = np.asarray(observed, dtype=bool)
        return np.all((self.states == x[None, :]) | ~mask[None, :], axis=1)

    def marginal(self, x: np.ndarray, observed: np.ndarray) -> float:
        """Unnormalised marginal ``sum_{unobserved} c(x)`` of one row, by enumeration."""
        return float(self.values[self.consistent(x, observed)].sum())

    def conditional(self, x: np.ndarray, observed: np.ndarray, variable: int) -> np.ndarray:
        """(C,) ``p(X_variable = c | x_observed)`` by enumeration."""
        keep = self.consistent(x, observed)
        size = self.circuit.num_categories[variable]
        mass = np.array([self.values[keep & (self.states[:, variable] == c)].sum()
                         for c in range(size)])
        return mass / mass.sum()

    def index(self, samples: np.ndarray) -> np.ndarray:
        """Index into :attr:`states` of each sample row (``-1`` where it matches none)."""
        scope = list(self.scope)
        radix = np.array([self.circuit.num_categories[v] for v in scope])
        places = np.cumprod(np.concatenate([radix[1:], [1]])[::-1])[::-1]
        digits = samples[:, scope]
        valid = np.all((digits >= 0) & (digits < radix[None, :]), axis=1)
        return np.where(valid, (np.clip(digits, 0, None) * places[None, :]).sum(1), -1)


def compile64(circuit: Circuit, fold: bool = True, seed: int = 0) -> CompiledCircuit:
    return circuits.compile(circuit, fold=fold, dtype=torch.float64, seed=seed)


def copy_parameters(source: CompiledCircuit, target: CompiledCircuit) -> None:
    """Give ``target`` (same symbolic circuit, any folding) the parameters of ``source``."""
    raw = raw_from_compiled(source)
    specs = target.parameter_specs()
    with torch.no_grad():
        for plan, module in zip(target.plans, target.folds, strict=True):
            if plan.name in specs:
                table = torch.stack([torch.as_tensor(raw[layer.uid]) for layer in plan.layers])
                module.raw.copy_(table.to(module.raw.dtype))


def set_row_parameters(compiled: CompiledCircuit, params: Mapping[str, torch.Tensor],
                       row: int) -> None:
    """Overwrite the internal parameters of ``compiled`` by row ``row`` of external params."""
    with torch.no_grad():
        for plan, module in zip(compiled.plans, compiled.folds, strict=True):
            if plan.name in params:
                module.raw.copy_(params[plan.name][row])
