"""Random circuits for property tests, and (re-exported) the independent reference to check them.

* **Generators.** :func:`random_circuit` builds a random smooth and decomposable circuit from a
  seed (random variable splits, DAG sharing, Hadamard and Kronecker products with 2-3 inputs, sum
  layers of arity > 1 over inputs of different widths, several input layers per variable,
  ``Softmax`` and unnormalised ``Exp`` parameters with exact zeros, integrated input layers).
  :func:`deterministic_circuit` builds circuits whose sum units have children with disjoint
  supports (exact MAP). :func:`template_circuit` and :func:`region_graph_circuit` cover the named
  architectures. Hypothesis strategies wrap them all.
* **Reference.** :func:`reference_values` and :class:`Exact`, the numpy reference of
  ``tests/reference.py`` (it shares no code with :mod:`circuits.compiled`), re-exported here so
  that a property test imports everything from one place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import strategies as st
from reference import (  # re-exported: see the module docstring
    Exact,
    compile64,
    copy_parameters,
    log,
    raw_from_compiled,
    raw_from_initial,
    reference_values,
    set_row_parameters,
)

from circuits import (
    Categorical,
    Circuit,
    Exp,
    InputLayer,
    Layer,
    Parameterization,
    ProductKind,
    ProductLayer,
    Softmax,
    SumLayer,
    region_graphs,
    templates,
)

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
    """The region-graph constructors of :mod:`circuits.region_graphs` the generators draw from."""
    return ("fully_factorized", "linear", "balanced_binary_tree", "random_binary_tree",
            "quad_tree", "poon_domingos", "chow_liu")


def region_graph_circuit(name: str, pattern: str, num_sum_units: int, num_input_units: int,
                         num_categories: int, seed: int, unnormalised: bool = False) -> Circuit:
    """A circuit from region graph ``name`` (over 4 variables, or a 2x2 image) built with
    ``SumProductPattern[pattern]``; ``unnormalised`` uses ``Exp`` parameters throughout."""
    rg = region_graphs
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


__all__ = [
    "TEMPLATE_NAMES", "Exact", "any_circuits", "compile64", "copy_parameters",
    "deterministic_circuit", "deterministic_circuits", "log", "random_circuit", "random_circuits",
    "raw_from_compiled", "raw_from_initial", "reference_values", "region_graph_circuit",
    "region_graph_circuits", "region_graph_names", "seeds", "set_row_parameters",
    "template_circuit", "template_circuits",
]
