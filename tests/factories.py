"""Random circuits for property tests, and an independent brute-force reference.

Two halves:

* **Generators.** :func:`random_circuit` builds a random smooth and decomposable circuit from a
  seed (random variable splits, DAG sharing, Hadamard and Kronecker products with 2-3 inputs, sum
  layers of arity > 1 over inputs of different widths, several input layers per variable,
  ``Softmax`` and unnormalised ``Exp`` parameters with exact zeros, integrated input layers).
  :func:`deterministic_circuit` builds circuits whose sum units have children with disjoint
  supports (exact MAP). :func:`template_circuit` and :func:`region_graph_circuit` cover the named
  architectures. Hypothesis strategies wrap them all.
* **Reference.** :func:`reference_values` evaluates the *symbolic* circuit in numpy, in linear
  space, one layer at a time. It shares no code with :mod:`circuits.compiled` (it reimplements
  the parameterisations, input units, sums and both product kinds); the only thing it takes from
  a compiled circuit is the raw parameter values, read through the public
  :meth:`~circuits.CompiledCircuit.parameter_specs`. :class:`Exact` enumerates every assignment.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import strategies as st

import circuits
from circuits import (
    Categorical,
    Circuit,
    CompiledCircuit,
    Exp,
    InputLayer,
    Layer,
    Parameterization,
    ProductKind,
    ProductLayer,
    Softmax,
    SumLayer,
    templates,
)

try:  # written in parallel by another engineer; included once it exists
    from circuits import region_graphs as _region_graphs
except ImportError:  # pragma: no cover - depends on the state of the tree
    _region_graphs = None

NEG_INF = -math.inf

# ---------------------------------------------------------------------------------------------
# Random smooth & decomposable circuits
# ---------------------------------------------------------------------------------------------


@dataclass
class _Builder:
    """Recursive random construction; every layer gets explicit float64 ``initial`` parameters."""

    rng: np.random.Generator
    num_variables: int
    num_categories: int
    exp_prob: float = 0.5
    zero_prob: float = 0.15
    integrated_prob: float = 0.15
    share_prob: float = 0.5
    out_of_scope_variable: bool = False
    cache: dict[tuple[tuple[int, ...], int], list[Layer]] = field(default_factory=dict)

    def parameterization(self) -> Parameterization:
        return Exp() if self.rng.random() < self.exp_prob else Softmax()

    def raw(self, shape: tuple[int, int], parameterization: Parameterization) -> torch.Tensor:
        """Random raw parameters; some entries are ``-inf`` (exact zeros), never a whole row."""
        scale = 1.0 if isinstance(parameterization, Softmax) else 0.6
        values = self.rng.normal(size=shape) * scale
        if isinstance(parameterization, Exp):
            values += self.rng.normal() * 0.5  # a layer-wide scale: Z is far from 1
        zeros = self.rng.random(shape) < self.zero_prob
        keep = self.rng.integers(0, shape[1], size=shape[0])
        zeros[np.arange(shape[0]), keep] = False
        values[zeros] = NEG_INF
        return torch.tensor(values, dtype=torch.float64)

    def input(self, variable: int, width: int, integrated: bool = False) -> InputLayer:
        parameterization = self.parameterization()
        return InputLayer(variable, width, Categorical(self.num_categories), parameterization,
                          initial=self.raw((width, self.num_categories), parameterization),
                          integrated=integrated)

    def sum(self, inputs: Sequence[Layer], width: int) -> SumLayer:
        parameterization = self.parameterization()
        total = sum(i.num_units for i in inputs)
        return SumLayer(inputs, width, parameterization,
                        initial=self.raw((width, total), parameterization))

    def integrated_input(self, width: int) -> InputLayer:
        variable = int(self.rng.integers(0, self.num_variables))
        if self.out_of_scope_variable and self.rng.random() < 0.5:
            variable = self.num_variables  # a column that no non-integrated layer covers
        return self.input(variable, width, integrated=True)

    def region(self, variables: tuple[int, ...], width: int) -> Layer:
        key = (variables, width)
        if key in self.cache and self.rng.random() < self.share_prob:
            options = self.cache[key]
            return options[int(self.rng.integers(0, len(options)))]
        layer = self._new_region(variables, width)
        self.cache.setdefault(key, []).append(layer)
        return layer

    def _new_region(self, variables: tuple[int, ...], width: int) -> Layer:
        if len(variables) == 1:
            (variable,) = variables
            if self.rng.random() < 0.5:
                return self.input(variable, width)
            arity = int(self.rng.integers(1, 4))  # several input layers for one variable
            inputs = [self.input(variable, int(self.rng.integers(1, 4))) for _ in range(arity)]
            return self.sum(inputs, width)
        if self.rng.random() < 0.25:
            return self.product(variables, width)
        max_arity = 3 if len(variables) <= 3 else 2
        arity = int(self.rng.integers(1, max_arity + 1))
        return self.sum([self.product(variables, None) for _ in range(arity)], width)

    def product(self, variables: tuple[int, ...], width: int | None) -> ProductLayer:
        """A decomposable product over a random split of ``variables`` into 2-3 parts."""
        parts_count = int(self.rng.integers(2, min(3, len(variables)) + 1))
        shuffled = [int(v) for v in self.rng.permutation(variables)]
        cuts = sorted(int(c) for c in self.rng.choice(np.arange(1, len(shuffled)),
                                                        parts_count - 1, replace=False))
        parts = [tuple(sorted(shuffled[a:b])) for a, b in
                 zip([0, *cuts], [*cuts, len(shuffled)], strict=True)]
        add_integrated = self.rng.random() < self.integrated_prob
        if self.rng.random() < 0.5:
            kind = ProductKind.HADAMARD
            unit = width if width is not None else int(self.rng.integers(1, 4))
            children: list[Layer] = [self.region(p, unit) for p in parts]
            if add_integrated:
                children.append(self.integrated_input(unit))
        else:
            kind = ProductKind.KRONECKER
            count = len(parts) + int(add_integrated)
            if width is None:
                widths = [int(w) for w in self.rng.integers(1, 3, size=count)]
            else:
                widths = [width] + [1] * (count - 1)
                self.rng.shuffle(widths)
            children = [self.region(p, w) for p, w in zip(parts, widths, strict=False)]
            if add_integrated:
                children.append(self.integrated_input(widths[-1]))
        order = self.rng.permutation(len(children))
        return ProductLayer([children[int(i)] for i in order], kind)


def random_circuit(seed: int, num_variables: int | None = None, num_categories: int | None = None,
                   *, exp_prob: float = 0.5, zero_prob: float = 0.15,
                   integrated_prob: float = 0.15, out_of_scope_variable: bool = False) -> Circuit:
    """A random smooth, decomposable circuit with one output unit (plain seeded function).

    Args:
        seed: everything (sizes left as None included) is derived from it.
        num_variables: 2..5 by default; num_categories: 2..3 by default.
        exp_prob: chance that a layer is unnormalised (``Exp``) rather than ``Softmax``.
        zero_prob: chance that a raw parameter is ``-inf`` (an exact zero).
        integrated_prob: chance that a product gets an extra integrated input layer.
        out_of_scope_variable: allow integrated layers over an extra column outside the scope.
    """
    rng = np.random.default_rng(seed)
    n = num_variables if num_variables is not None else int(rng.integers(2, 6))
    k = num_categories if num_categories is not None else int(rng.integers(2, 4))
    builder = _Builder(rng, n, k, exp_prob=exp_prob, zero_prob=zero_prob,
                       integrated_prob=integrated_prob, out_of_scope_variable=out_of_scope_variable)
    return Circuit(builder.region(tuple(range(n)), 1))


def deterministic_circuit(seed: int, num_variables: int | None = None,
                          num_categories: int | None = None) -> Circuit:
    """A random smooth, decomposable and *deterministic* circuit.

    Every sum layer reads 1-unit products ``[X_v in S_j] * rest_j`` whose selector sets ``S_j``
    partition (part of) the categories of ``X_v``: for any complete assignment at most one input of
    each sum unit is non-zero, so max-product computes the exact MAP value.
    """
    rng = np.random.default_rng(seed)
    n = num_variables if num_variables is not None else int(rng.integers(2, 6))
    k = num_categories if num_categories is not None else int(rng.integers(2, 4))
    builder = _Builder(rng, n, k, zero_prob=0.1, integrated_prob=0.0)

    def selector(variable: int, allowed: Sequence[int]) -> InputLayer:
        parameterization = builder.parameterization()
        raw = builder.raw((1, k), parameterization)
        raw[0, [c for c in range(k) if c not in allowed]] = NEG_INF
        raw[0, list(allowed)] = torch.tensor(rng.normal(size=len(allowed)), dtype=torch.float64)
        return InputLayer(variable, 1, Categorical(k), parameterization, initial=raw)

    def region(variables: tuple[int, ...], width: int) -> Layer:
        if len(variables) == 1:
            return builder.input(variables[0], width)
        order = [int(v) for v in rng.permutation(variables)]
        chosen, rest = order[0], tuple(sorted(order[1:]))
        labels = rng.integers(0, k, size=k)  # category c goes to group labels[c]
        groups = [tuple(c for c in range(k) if labels[c] == g) for g in range(k)]
        groups = [g for g in groups if g]
        if len(groups) > 1 and rng.random() < 0.3:
            groups = groups[1:]  # some categories of the selector get probability zero
        children: list[Layer] = []
        for group in groups:
            if len(rest) > 1 and rng.random() < 0.5:
                cut = int(rng.integers(1, len(rest)))
                parts = [rest[:cut], rest[cut:]]
            else:
                parts = [rest]
            factors = [selector(chosen, group), *(region(p, 1) for p in parts)]
            kind = ProductKind.HADAMARD if rng.random() < 0.5 else ProductKind.KRONECKER
            children.append(ProductLayer([factors[int(i)] for i in rng.permutation(len(factors))],
                                         kind))
        return builder.sum(children, width)

    return Circuit(region(tuple(range(n)), 1))


TEMPLATE_NAMES = ("ff", "cp", "hmm", "btree")


def template_circuit(name: str, num_variables: int, num_categories: int, rank: int) -> Circuit:
    """A named architecture from :func:`circuits.templates.build` (rank forced to 1 for ff)."""
    return templates.build(name, num_variables=num_variables, num_categories=num_categories,
                           rank=1 if name == "ff" else rank)


def region_graph_names() -> tuple[str, ...]:
    """The region-graph constructors available in this tree (empty while not written yet)."""
    if _region_graphs is None or not hasattr(_region_graphs, "build_circuit"):
        return ()
    names = ("fully_factorized", "linear", "balanced_binary_tree", "random_binary_tree",
             "quad_tree", "poon_domingos", "chow_liu")
    return tuple(n for n in names if hasattr(_region_graphs, n))


def region_graph_circuit(name: str, pattern: str, num_sum_units: int, num_input_units: int,
                         num_categories: int, seed: int, unnormalised: bool = False) -> Circuit:
    """A circuit from region graph ``name`` (over 4 variables, or a 2x2 image) built with
    ``SumProductPattern[pattern]``; ``unnormalised`` uses ``Exp`` parameters throughout."""
    assert _region_graphs is not None
    rg = _region_graphs
    constructor: Callable[..., object] = getattr(rg, name)
    if name == "quad_tree":
        graph = constructor(2, 2)
    elif name == "poon_domingos":
        graph = constructor((2, 2), delta=1)
    elif name == "chow_liu":
        data = np.random.default_rng(seed).integers(0, num_categories, size=(40, 4))
        data[:, 1] = data[:, 0]  # some dependence for the tree to find
        graph = constructor(data, num_categories)
    elif name == "random_binary_tree":
        graph = constructor(4, depth=2, num_repetitions=2, seed=seed)
    else:
        graph = constructor(4)
    parameterization = Exp() if unnormalised else None
    return rg.build_circuit(graph, rg.SumProductPattern[pattern], num_sum_units, num_input_units,
                            num_categories, input_parameterization=parameterization,
                            sum_parameterization=parameterization)


# ---------------------------------------------------------------------------------------------
# Hypothesis strategies
# ---------------------------------------------------------------------------------------------

seeds = st.integers(min_value=0, max_value=2**31 - 1)


@st.composite
def random_circuits(draw: st.DrawFn, max_variables: int = 5) -> Circuit:
    return random_circuit(draw(seeds), draw(st.integers(2, max_variables)), draw(st.integers(2, 3)),
                          out_of_scope_variable=draw(st.booleans()))


@st.composite
def deterministic_circuits(draw: st.DrawFn, max_variables: int = 5) -> Circuit:
    return deterministic_circuit(draw(seeds), draw(st.integers(2, max_variables)),
                                 draw(st.integers(2, 3)))


@st.composite
def template_circuits(draw: st.DrawFn, max_variables: int = 5) -> Circuit:
    return template_circuit(draw(st.sampled_from(TEMPLATE_NAMES)),
                            draw(st.integers(1, max_variables)), draw(st.integers(2, 3)),
                            draw(st.integers(1, 3)))


@st.composite
def region_graph_circuits(draw: st.DrawFn) -> Circuit:
    return region_graph_circuit(draw(st.sampled_from(region_graph_names())),
                                draw(st.sampled_from(["CP", "TUCKER"])), draw(st.integers(1, 2)),
                                draw(st.integers(1, 2)), draw(st.integers(2, 3)), draw(seeds),
                                draw(st.booleans()))


def any_circuits(max_variables: int = 5) -> st.SearchStrategy[Circuit]:
    """Random circuits most of the time, plus templates and (when present) region graphs."""
    options = [random_circuits(max_variables), random_circuits(max_variables),
               deterministic_circuits(max_variables), template_circuits(max_variables)]
    if region_graph_names():
        options.append(region_graph_circuits())
    return st.one_of(*options)


# ---------------------------------------------------------------------------------------------
# Independent numpy reference
# ---------------------------------------------------------------------------------------------

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


__all__ = [
    "TEMPLATE_NAMES", "Exact", "any_circuits", "compile64", "copy_parameters",
    "deterministic_circuit", "deterministic_circuits", "log", "random_circuit", "random_circuits",
    "raw_from_compiled", "raw_from_initial", "reference_values", "region_graph_circuit",
    "region_graph_circuits", "region_graph_names", "seeds", "set_row_parameters",
    "template_circuit", "template_circuits",
]
