"""The Bernoulli, Binomial and Gaussian input families, against independent references (float64).

* **Reference.** :func:`reference` evaluates the *symbolic* circuit in numpy, in linear space, with
  the families' textbook formulas (``p^x (1-p)^(n-x) C(n, x)``, the normal density): it shares no
  code with :mod:`circuits.compiled.input_families`. Discrete circuits are then enumerated; a
  Gaussian variable is checked by closed forms (mixtures of products of Gaussians: a marginal is
  the sub-mixture) and by numeric integration over a grid.
* **Queries.** Likelihoods, marginals of any subset, the partition function, conditionals,
  max-product values and MAP (exact on deterministic circuits, and a Binomial's mode with its
  ties), on random smooth and decomposable circuits mixing every family (hypothesis).
* **Samplers.** A G-test against enumeration and a moment z-test for real values, each with a
  negative control that the same test must reject; conditional sampling likewise.
* **EM.** :meth:`FoldedInput.em_estimate` against a closed-form weighted maximum-likelihood
  estimate computed here, with missing values, pseudocounts and units without flow.
* **Plumbing.** Data checks (float data, integral discrete columns), parameter checks, folding,
  serialisation, per-call parameters, gradients and ``build_circuit(input_distribution=...)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import compile64, raw_from_compiled, seeds
from hypothesis import given, settings
from hypothesis import strategies as st

import circuits
from circuits import (
    Bernoulli,
    Binomial,
    Categorical,
    Circuit,
    CompiledCircuit,
    Exp,
    Gaussian,
    InputDistribution,
    InputLayer,
    InvalidInputError,
    InvalidParameterError,
    Layer,
    Native,
    ParameterProblem,
    ProductKind,
    ProductLayer,
    RegionGraphError,
    SerializationError,
    Softmax,
    StructureError,
    SumLayer,
    region_graphs,
    templates,
)
from circuits.compiled.layers import FoldedInput
from circuits.errors import ZeroProbabilityEvidenceError

INF = math.inf
NUM_SAMPLES = 20_000
ALPHA = 1e-4  # G-test: reject below this p-value
Z_LIMIT = 5.0  # moment tests: reject beyond this many standard errors

# ---------------------------------------------------------------------------------------------
# The independent reference (numpy, linear space)
# ---------------------------------------------------------------------------------------------


def _probability(logit: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-logit))  # exact 0 and 1 at -inf and +inf


def unit_table(layer: InputLayer, raw: np.ndarray) -> np.ndarray:
    """(K, C) linear values of every value of a discrete input layer, from textbook formulas."""
    dist = layer.distribution
    if isinstance(dist, Categorical):
        if isinstance(layer.parameterization, Softmax):
            e = np.exp(raw - raw.max(-1, keepdims=True))
            return e / e.sum(-1, keepdims=True)
        return np.exp(raw)
    n = dist.total_count if isinstance(dist, Binomial) else 1
    p = _probability(raw[:, 0])[:, None]
    k = np.arange(n + 1)[None, :]
    comb = np.array([math.comb(n, int(i)) for i in range(n + 1)], dtype=np.float64)[None, :]
    return comb * np.power(p, k) * np.power(1.0 - p, n - k)  # numpy: 0 ** 0 == 1


def gaussian_density(raw: np.ndarray, points: np.ndarray) -> np.ndarray:
    """(N, K) normal densities of units with raw ``(mean, log_std)`` rows at ``points`` (N,)."""
    mean, std = raw[:, 0][None, :], np.exp(raw[:, 1])[None, :]
    return np.exp(-0.5 * ((points[:, None] - mean) / std) ** 2) / (std * math.sqrt(2 * math.pi))


#: per-unit values (K,) that replace an unobserved variable's input layers: E_u[f(X)]
Override = Callable[[InputLayer, np.ndarray], np.ndarray]


def reference(circuit: Circuit, raw: dict[int, np.ndarray], x: np.ndarray, observed: np.ndarray,
              semiring: str = "sum", override: dict[int, Override] | None = None) -> np.ndarray:
    """(N,) values of ``circuit`` on rows ``x`` (float) with mask ``observed``.

    An unobserved variable contributes each unit's total mass (SUM) or highest value (MAX);
    ``override[v]`` replaces the units of variable ``v`` by given values (moments: the circuit is
    linear in them, so this computes ``E[f(X_v)]`` times the rest).
    """
    n = x.shape[0]
    observed = np.broadcast_to(observed, x.shape)
    values: dict[int, np.ndarray] = {}
    for layer in circuit.layers:
        if isinstance(layer, InputLayer):
            r = raw[layer.uid]
            v = layer.variable
            if isinstance(layer.distribution, Gaussian):
                mass = np.ones(layer.num_units)
                best = 1.0 / (np.exp(r[:, 1]) * math.sqrt(2 * math.pi))
                picked = gaussian_density(r, np.where(observed[:, v], x[:, v], 0.0))
            else:
                table = unit_table(layer, r)
                mass, best = table.sum(-1), table.max(-1)
                column = np.clip(np.where(observed[:, v], x[:, v], 0), 0, table.shape[1] - 1)
                picked = table[:, column.astype(np.int64)].T
            if layer.integrated:
                values[layer.uid] = np.broadcast_to(mass, (n, layer.num_units))
                continue
            free = mass if semiring == "sum" else best
            if override is not None and v in override:
                free = override[v](layer, r)
            values[layer.uid] = np.where(observed[:, v, None], picked, free[None, :])
        elif isinstance(layer, SumLayer):
            r = raw[layer.uid]
            if isinstance(layer.parameterization, Softmax):
                e = np.exp(r - r.max(-1, keepdims=True))
                w = e / e.sum(-1, keepdims=True)
            else:
                w = np.exp(r)
            joined = np.concatenate([values[i.uid] for i in layer.inputs], axis=1)
            terms = w[None, :, :] * joined[:, None, :]
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
    return values[circuit.output.uid][:, 0]


def discrete_states(circuit: Circuit) -> np.ndarray:
    """(S, V) float: every assignment of the circuit's (discrete) scope; other columns 0."""
    scope = sorted(circuit.scope)
    grids = [range(circuit.num_categories[v]) for v in scope]
    combos = np.array(list(itertools.product(*grids)), dtype=np.float64).reshape(-1, len(scope))
    states = np.zeros((combos.shape[0], circuit.num_variables))
    states[:, scope] = combos
    return states


def mean_override(power: int) -> Override:
    """``E_u[X^power]`` of every unit (power 1, 2 or 4), from the families' closed forms."""
    def values(layer: InputLayer, raw: np.ndarray) -> np.ndarray:
        if isinstance(layer.distribution, Gaussian):
            m, s2 = raw[:, 0], np.exp(2 * raw[:, 1])
            return {1: m, 2: m * m + s2, 4: m ** 4 + 6 * m * m * s2 + 3 * s2 * s2}[power]
        table = unit_table(layer, raw)
        support = np.arange(table.shape[1], dtype=np.float64) ** power
        return table @ support
    return values


# ---------------------------------------------------------------------------------------------
# Random circuits mixing the families
# ---------------------------------------------------------------------------------------------


def random_family(rng: np.random.Generator, gaussian: bool = True) -> InputDistribution:
    options: list[InputDistribution] = [Bernoulli(), Binomial(int(rng.integers(1, 4))),
                                        Categorical(int(rng.integers(2, 4)))]
    if gaussian:
        options.append(Gaussian())
    return options[int(rng.integers(0, len(options)))]


@dataclass
class MixedBuilder:
    """Random smooth, decomposable circuits over variables of given families; every layer has
    explicit float64 ``initial`` parameters (some exact zeros: ``-inf`` categorical logits,
    ``+-inf`` success logits)."""

    rng: np.random.Generator
    families: dict[int, InputDistribution]
    exp_prob: float = 0.3
    integrated_prob: float = 0.15
    cache: dict[tuple[tuple[int, ...], int], list[Layer]] = field(default_factory=dict)

    def raw(self, dist: InputDistribution, units: int) -> tuple[torch.Tensor, object]:
        rng = self.rng
        if isinstance(dist, Gaussian):
            values = np.stack([rng.normal(size=units) * 1.5, rng.uniform(-0.8, 0.4, size=units)], 1)
            return torch.tensor(values), None
        if isinstance(dist, Categorical):
            parameterization = Exp() if rng.random() < self.exp_prob else Softmax()
            values = rng.normal(size=(units, dist.num_categories))
            zeros = rng.random(values.shape) < 0.15
            zeros[np.arange(units), rng.integers(0, dist.num_categories, size=units)] = False
            values[zeros] = -INF
            return torch.tensor(values), parameterization
        values = rng.normal(size=(units, 1)) * 1.5
        exact = rng.random(units) < 0.15
        values[exact, 0] = np.where(rng.random(int(exact.sum())) < 0.5, -INF, INF)
        return torch.tensor(values), None

    def input(self, variable: int, width: int, integrated: bool = False) -> InputLayer:
        dist = self.families[variable]
        raw, parameterization = self.raw(dist, width)
        return InputLayer(variable, width, dist, parameterization, initial=raw,  # type: ignore[arg-type]
                          integrated=integrated)

    def sum(self, inputs: list[Layer], width: int) -> SumLayer:
        parameterization = Exp() if self.rng.random() < self.exp_prob else Softmax()
        total = sum(i.num_units for i in inputs)
        scale = 0.6 if isinstance(parameterization, Exp) else 1.0
        raw = torch.tensor(self.rng.normal(size=(width, total)) * scale)
        return SumLayer(inputs, width, parameterization, initial=raw)

    def region(self, variables: tuple[int, ...], width: int) -> Layer:
        key = (variables, width)
        if key in self.cache and self.rng.random() < 0.5:
            options = self.cache[key]
            return options[int(self.rng.integers(0, len(options)))]
        layer = self._new(variables, width)
        self.cache.setdefault(key, []).append(layer)
        return layer

    def _new(self, variables: tuple[int, ...], width: int) -> Layer:
        rng = self.rng
        if len(variables) == 1:
            if rng.random() < 0.5:
                return self.input(variables[0], width)
            inputs: list[Layer] = [self.input(variables[0], int(rng.integers(1, 4)))
                                   for _ in range(int(rng.integers(1, 4)))]
            return self.sum(inputs, width)
        arity = int(rng.integers(1, 3))
        return self.sum([self.product(variables) for _ in range(arity)], width)

    def product(self, variables: tuple[int, ...]) -> ProductLayer:
        rng = self.rng
        shuffled = [int(v) for v in rng.permutation(variables)]
        cut = int(rng.integers(1, len(shuffled)))
        parts = [tuple(sorted(shuffled[:cut])), tuple(sorted(shuffled[cut:]))]
        if rng.random() < 0.5:
            unit = int(rng.integers(1, 4))
            children: list[Layer] = [self.region(p, unit) for p in parts]
            if rng.random() < self.integrated_prob:
                children.append(self.input(int(rng.integers(0, len(self.families))), unit, True))
            return ProductLayer(children, ProductKind.HADAMARD)
        children = [self.region(p, int(rng.integers(1, 3))) for p in parts]
        return ProductLayer(children, ProductKind.KRONECKER)


def mixed_circuit(seed: int, num_variables: int, gaussian: bool = True,
                  families: dict[int, InputDistribution] | None = None, exp_prob: float = 0.3
                  ) -> Circuit:
    rng = np.random.default_rng(seed)
    if families is None:
        families = {v: random_family(rng, gaussian) for v in range(num_variables)}
    builder = MixedBuilder(rng, families, exp_prob=exp_prob)
    return Circuit(builder.region(tuple(range(num_variables)), 1))


def deterministic_circuit(seed: int, families: dict[int, InputDistribution]) -> Circuit:
    """Sums over ``[X_s = c] * rest_c`` with ``[X_s = c]`` a Bernoulli unit of logit ``-+inf``
    (an exact indicator); below the selectors, products of one-unit layers: deterministic, so
    max-product is the exact MAP."""
    rng = np.random.default_rng(seed)
    builder = MixedBuilder(rng, families, exp_prob=0.0)
    selectors = [v for v, d in families.items() if isinstance(d, Bernoulli)]

    def region(variables: tuple[int, ...]) -> Layer:
        usable = [v for v in selectors if v in variables]
        if len(variables) > 1 and usable:
            chosen = usable[int(rng.integers(0, len(usable)))]
            rest = tuple(v for v in variables if v != chosen)
            children: list[Layer] = []
            for logit in (-INF, INF):
                indicator = InputLayer(chosen, 1, Bernoulli(), initial=torch.tensor([[logit]]))
                children.append(ProductLayer([indicator, region(rest)], ProductKind.HADAMARD))
            return builder.sum(children, 1)
        leaves = [builder.input(v, 1) for v in variables]
        return leaves[0] if len(leaves) == 1 else ProductLayer(leaves, ProductKind.HADAMARD)

    return Circuit(SumLayer([region(tuple(families))], 1, initial=torch.zeros(1, 1)))


def compiled_and_raw(circuit: Circuit) -> tuple[CompiledCircuit, dict[int, np.ndarray]]:
    compiled = compile64(circuit)
    return compiled, raw_from_compiled(compiled)


def log(values: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(values)


# ---------------------------------------------------------------------------------------------
# Discrete families: enumeration
# ---------------------------------------------------------------------------------------------


@settings(max_examples=30)
@given(seed=seeds, num_variables=st.integers(1, 4))
def test_discrete_families_likelihood_marginals_and_partition(seed: int, num_variables: int) -> None:
    circuit = mixed_circuit(seed, num_variables, gaussian=False)
    compiled, raw = compiled_and_raw(circuit)
    states = discrete_states(circuit)
    joint = reference(circuit, raw, states, np.ones_like(states, dtype=bool))
    got = compiled.log_likelihood(torch.tensor(states, dtype=torch.long)).detach().numpy()
    np.testing.assert_allclose(got, log(joint), rtol=1e-10, atol=1e-10)
    z = joint.sum()
    assert float(compiled.log_partition()) == pytest.approx(math.log(z), abs=1e-10)
    if compiled.normalized:
        assert z == pytest.approx(1.0, abs=1e-10)  # the new families are normalised densities
    # marginals of random subsets: the sums of the joint over the states that agree
    rng = np.random.default_rng(seed)
    rows = states[rng.integers(0, len(states), size=6)]
    masks = rng.random(rows.shape) < 0.5
    expected = [joint[np.all((states == row) | ~mask, axis=1)].sum()
                for row, mask in zip(rows, masks, strict=True)]
    marginal = compiled.log_marginal(torch.tensor(rows, dtype=torch.long), torch.tensor(masks))
    np.testing.assert_allclose(marginal.detach().numpy(), log(np.array(expected)), rtol=1e-10,
                               atol=1e-10)
    np.testing.assert_allclose(
        marginal.detach().numpy(), log(reference(circuit, raw, rows, masks)), rtol=1e-10, atol=1e-10)


@settings(max_examples=30)
@given(seed=seeds, num_variables=st.integers(2, 4))
def test_discrete_families_conditionals(seed: int, num_variables: int) -> None:
    circuit = mixed_circuit(seed, num_variables, gaussian=False)
    compiled, raw = compiled_and_raw(circuit)
    states = discrete_states(circuit)
    joint = reference(circuit, raw, states, np.ones_like(states, dtype=bool))
    rng = np.random.default_rng(seed)
    query = int(rng.integers(0, num_variables))
    observed = rng.random(num_variables) < 0.6
    observed[query] = False
    evidence = states[rng.choice(np.flatnonzero(joint > 0), size=3)]
    got = compiled.log_conditional(torch.tensor(evidence, dtype=torch.long),
                                   torch.tensor(observed), [query])
    size = circuit.num_categories[query]
    for b, row in enumerate(evidence):
        agree = np.all((states == row) | ~observed, axis=1)
        mass = np.array([joint[agree & (states[:, query] == c)].sum() for c in range(size)])
        np.testing.assert_allclose(got[b, 0].exp().numpy(), mass / mass.sum(), atol=1e-10)
    # prefix conditionals: every position of one order at once
    order = [int(v) for v in rng.permutation(num_variables)]
    if len({circuit.num_categories[v] for v in order}) == 1:
        prefix = compiled.log_prefix_conditionals(torch.tensor(evidence, dtype=torch.long), order)
        for b, row in enumerate(evidence):
            for i, v in enumerate(order):
                agree = np.all(states[:, order[:i]] == row[order[:i]], axis=1)
                mass = np.array([joint[agree & (states[:, v] == c)].sum()
                                 for c in range(circuit.num_categories[v])])
                np.testing.assert_allclose(prefix[b, i].exp().numpy(), mass / mass.sum(), atol=1e-10)


@settings(max_examples=30)
@given(seed=seeds, num_variables=st.integers(1, 4))
def test_max_product_value_matches_the_reference(seed: int, num_variables: int) -> None:
    """Every family (Gaussian included): the max-product value, free variables maxed out; the
    state's max-product value is what map_state reports."""
    circuit = mixed_circuit(seed, num_variables, gaussian=True, exp_prob=0.0)
    compiled, raw = compiled_and_raw(circuit)
    rng = np.random.default_rng(seed)
    x = np.zeros((4, num_variables))
    for v in range(num_variables):
        size = circuit.num_categories.get(v)
        x[:, v] = rng.normal(size=4) if size is None else rng.integers(0, size, size=4)
    observed = rng.random(x.shape) < 0.5
    best = reference(circuit, raw, x, observed, semiring="max")
    possible = best > 0
    dtype = torch.float64 if circuit.continuous_variables else torch.long
    if not possible.all():
        with pytest.raises(ZeroProbabilityEvidenceError):
            compiled.map_state(torch.tensor(x, dtype=dtype), torch.tensor(observed))
        x, observed, best = x[possible], observed[possible], best[possible]
        if not len(x):
            return
    state, value = compiled.map_state(torch.tensor(x, dtype=dtype), torch.tensor(observed))
    np.testing.assert_allclose(value.numpy(), np.log(best), rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(state.double().numpy()[observed], x[observed])
    # the returned state reaches that value: its own max-product value (all observed) is the same
    full = reference(circuit, raw, state.double().numpy(), np.ones_like(observed), semiring="max")
    np.testing.assert_allclose(np.log(full), value.numpy(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_map_state_is_the_argmax_of_deterministic_circuits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    families: dict[int, InputDistribution] = {0: Bernoulli(), 1: Binomial(3)}
    families[2] = Bernoulli() if seed % 2 else Categorical(3)
    families[3] = Binomial(int(rng.integers(1, 5)))
    circuit = deterministic_circuit(seed, families)
    compiled, raw = compiled_and_raw(circuit)
    states = discrete_states(circuit)
    joint = reference(circuit, raw, states, np.ones_like(states, dtype=bool))
    state, value = compiled.map_state()
    got = reference(circuit, raw, state.double().numpy(), np.ones((1, 4), dtype=bool))[0]
    assert got == pytest.approx(joint.max(), rel=1e-12)
    assert float(value[0]) == pytest.approx(math.log(joint.max()), abs=1e-10)
    observed = np.zeros(4, dtype=bool)
    observed[int(rng.integers(0, 4))] = True
    evidence = states[joint > 0][:5]
    state, _ = compiled.map_state(torch.tensor(evidence, dtype=torch.long), torch.tensor(observed))
    for b, row in enumerate(evidence):
        agree = np.all((states == row) | ~observed, axis=1)
        value_b = reference(circuit, raw, state[b: b + 1].double().numpy(), np.ones((1, 4), dtype=bool))
        assert value_b[0] == pytest.approx(joint[agree].max(), rel=1e-12)


@settings(max_examples=60)
@given(n=st.integers(1, 12), logit=st.floats(-6, 6))
def test_binomial_mode_is_the_argmax_of_its_pmf(n: int, logit: float) -> None:
    layer = InputLayer(0, 1, Binomial(n), initial=torch.tensor([[logit]], dtype=torch.float64))
    compiled = compile64(Circuit(layer))
    state, value = compiled.map_state()
    p = 1.0 / (1.0 + math.exp(-logit))
    pmf = np.array([math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1)])
    top = np.sort(pmf)[-2:]
    if top[1] - top[0] > 1e-9 * top[1]:  # away from a tie: the unique argmax, floor((n + 1) p)
        assert int(state[0, 0]) == int(np.argmax(pmf)) == math.floor((n + 1) * p)
    assert float(value[0]) == pytest.approx(math.log(pmf[int(state[0, 0])]), abs=1e-10)
    assert pmf[int(state[0, 0])] == pytest.approx(pmf.max(), rel=1e-8)


@pytest.mark.parametrize("n", [1, 3, 5, 9])
def test_binomial_mode_ties_go_to_the_smaller_value(n: int) -> None:
    """p = 1/2 and odd n: (n + 1) p is an integer and the two middle values are both modes."""
    raw = torch.tensor([[0.0], [-INF], [INF], [math.log(2.0)]], dtype=torch.float64)
    compiled = compile64(Circuit(SumLayer([InputLayer(0, 4, Binomial(n), initial=raw)], 1)))
    module = next(m for m in compiled.folds if isinstance(m, FoldedInput))
    # p = 2/3 ties too where (n + 1) * 2/3 is an integer (n = 5: 3 and 4): the smaller value
    assert module.family.mode(raw).tolist() == [(n - 1) // 2, 0, n, math.ceil((n + 1) * 2 / 3) - 1]
    p = 0.5
    pmf = np.array([math.comb(n, k) * p ** n for k in range(n + 1)])
    assert pmf[(n - 1) // 2] == pmf[(n + 1) // 2]  # the tie is exact
    # the max-product value of a free variable is the unit's value at that mode, exactly
    best = module.family.max_log_value(raw)
    assert float(best[0]) == pytest.approx(math.log(pmf.max()), abs=1e-12)
    assert best[1:3].tolist() == [0.0, 0.0]  # p = 0 and 1: point masses, log 1 exactly


# ---------------------------------------------------------------------------------------------
# Gaussian: closed forms and integration
# ---------------------------------------------------------------------------------------------


def gaussian_mixture(seed: int, num_variables: int, components: int) -> tuple[Circuit, np.ndarray,
                                                                                 np.ndarray]:
    """``sum_k w_k prod_v N(x_v; mu_kv, sigma_kv)`` as a circuit, with its weights (K,) and raw
    parameters (V, K, 2)."""
    rng = np.random.default_rng(seed)
    params = np.stack([rng.normal(size=(num_variables, components)) * 2,
                       rng.uniform(-1, 0.5, size=(num_variables, components))], -1)
    logits = rng.normal(size=(1, components))
    leaves = [InputLayer(v, components, Gaussian(), initial=torch.tensor(params[v]))
              for v in range(num_variables)]
    body = leaves[0] if num_variables == 1 else ProductLayer(leaves, ProductKind.HADAMARD)
    circuit = Circuit(SumLayer([body], 1, initial=torch.tensor(logits)))
    weights = np.exp(logits[0]) / np.exp(logits[0]).sum()
    return circuit, weights, params


@settings(max_examples=25)
@given(seed=seeds, num_variables=st.integers(1, 4), components=st.integers(1, 4))
def test_gaussian_mixture_likelihood_and_marginals_in_closed_form(seed: int, num_variables: int,
                                                                   components: int) -> None:
    circuit, weights, params = gaussian_mixture(seed, num_variables, components)
    compiled = compile64(circuit)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(5, num_variables)) * 2
    observed = rng.random(x.shape) < 0.6
    x_missing = np.where(observed, x, np.nan)  # unobserved entries may hold NaN
    # a marginal of a mixture of products is the mixture of the observed variables' factors
    terms = np.tile(weights, (5, 1))
    for v in range(num_variables):
        density = gaussian_density(params[v], np.nan_to_num(x[:, v]))
        terms = terms * np.where(observed[:, v, None], density, 1.0)
    got = compiled.log_marginal(torch.tensor(x_missing), torch.tensor(observed))
    np.testing.assert_allclose(got.detach().numpy(), np.log(terms.sum(1)), rtol=1e-10, atol=1e-10)
    full = compiled.log_likelihood(torch.tensor(x))
    closed = np.tile(weights, (5, 1))
    for v in range(num_variables):
        closed = closed * gaussian_density(params[v], x[:, v])
    np.testing.assert_allclose(full.detach().numpy(), np.log(closed.sum(1)), rtol=1e-10, atol=1e-10)
    assert float(compiled.log_partition()) == pytest.approx(0.0, abs=1e-12)


def integrate_variable(compiled: CompiledCircuit, rows: np.ndarray, observed: np.ndarray,
                       variable: int) -> np.ndarray:
    """``int c(x) dx_variable`` per row by the trapezoid rule on a wide, fine grid (float64)."""
    grid = np.linspace(-30.0, 30.0, 24_001)
    values = []
    for row, mask in zip(rows, observed, strict=True):
        batch = np.repeat(row[None, :], len(grid), 0)
        batch[:, variable] = grid
        mask = mask.copy()
        mask[variable] = True
        density = compiled.log_marginal(torch.tensor(batch), torch.tensor(mask)).exp().detach().numpy()
        values.append(float(np.sum((density[1:] + density[:-1]) * 0.5 * np.diff(grid))))
    return np.array(values)


@settings(max_examples=12)
@given(seed=seeds, num_variables=st.integers(2, 3))
def test_a_gaussian_variable_integrates_to_its_marginal(seed: int, num_variables: int) -> None:
    """Random circuits mixing every family: integrating a Gaussian variable out numerically gives
    the marginal with it unobserved (normalisation over the real line)."""
    rng = np.random.default_rng(seed)
    families = {v: random_family(rng) for v in range(num_variables)}
    families[0] = Gaussian()
    circuit = mixed_circuit(seed, num_variables, families=families)
    compiled, raw = compiled_and_raw(circuit)
    x = np.zeros((2, num_variables))
    for v in range(num_variables):
        size = circuit.num_categories.get(v)
        x[:, v] = rng.normal(size=2) if size is None else rng.integers(0, size, size=2)
    observed = rng.random(x.shape) < 0.5
    observed[:, 0] = False
    marginal = compiled.log_marginal(torch.tensor(x), torch.tensor(observed)).exp().detach().numpy()
    np.testing.assert_allclose(marginal, reference(circuit, raw, x, observed), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(integrate_variable(compiled, x, observed, 0), marginal, rtol=1e-7,
                               atol=1e-12)


@settings(max_examples=25)
@given(seed=seeds, num_variables=st.integers(1, 4))
def test_mixed_circuits_match_the_reference(seed: int, num_variables: int) -> None:
    circuit = mixed_circuit(seed, num_variables)
    compiled, raw = compiled_and_raw(circuit)
    rng = np.random.default_rng(seed)
    x = np.zeros((6, num_variables))
    for v in range(num_variables):
        size = circuit.num_categories.get(v)
        x[:, v] = rng.normal(size=6) if size is None else rng.integers(0, size, size=6)
    observed = rng.random(x.shape) < 0.6
    dtype = torch.float64 if circuit.continuous_variables else torch.long
    got = compiled.log_marginal(torch.tensor(x, dtype=dtype), torch.tensor(observed)).detach()
    np.testing.assert_allclose(got.numpy(), log(reference(circuit, raw, x, observed)), rtol=1e-10,
                               atol=1e-10)
    unfolded = circuits.compile(circuit, dtype=torch.float64, fold=False)
    np.testing.assert_allclose(unfolded.log_marginal(torch.tensor(x, dtype=dtype),
                                                     torch.tensor(observed)).detach().numpy(),
                               got.numpy(), rtol=1e-12, atol=1e-12)
    none = np.zeros((1, num_variables), dtype=bool)
    assert float(compiled.log_partition()) == pytest.approx(
        math.log(reference(circuit, raw, x[:1], none)[0]), abs=1e-10)


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def g_test(samples: np.ndarray, states: np.ndarray, probs: np.ndarray) -> float:
    """p-value of a G-test of discrete samples ``(N, V)`` against ``probs`` over ``states``
    (cells expecting fewer than 5 pooled); 0 for a sample off the support."""
    lookup = {tuple(s): i for i, s in enumerate(states)}
    index = np.array([lookup.get(tuple(s), -1) for s in samples])
    if (index < 0).any():
        return 0.0
    counts = np.bincount(index, minlength=len(probs)).astype(np.float64)
    if counts[probs == 0].any():
        return 0.0
    expected = probs * len(index)
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if len(obs) < 2:
        return 1.0
    positive = obs > 0
    g = 2.0 * float((obs[positive] * np.log(obs[positive] / exp[positive])).sum())
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0, dtype=torch.float64),
                                         torch.tensor(max(g, 0.0) / 2.0, dtype=torch.float64)))


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@settings(max_examples=10)
@given(seed=seeds, num_variables=st.integers(1, 3))
def test_sampling_discrete_families_matches_enumeration(seed: int, num_variables: int) -> None:
    circuit = mixed_circuit(seed, num_variables, gaussian=False)
    compiled, raw = compiled_and_raw(circuit)
    states = discrete_states(circuit)
    joint = reference(circuit, raw, states, np.ones_like(states, dtype=bool))
    probs = joint / joint.sum()
    samples = compiled.sample(NUM_SAMPLES, generator=generator(seed))
    assert samples.dtype == torch.long
    assert g_test(samples.numpy(), states.astype(np.int64), probs) > ALPHA
    # negative control: the same test, the same samples, against a distribution 0.05 away
    support = np.flatnonzero(probs > 0)
    if len(support) > 1:
        shifted = probs.copy()
        donor, receiver = support[np.argmax(probs[support])], support[np.argmin(probs[support])]
        moved = min(0.05, probs[donor])
        shifted[donor] -= moved
        shifted[receiver] += moved
        assert g_test(samples.numpy(), states.astype(np.int64), shifted) < ALPHA
    # conditional sampling: the exact posterior given evidence on one variable
    rng = np.random.default_rng(seed)
    evidence = states[rng.choice(np.flatnonzero(joint > 0))]
    observed = np.zeros(num_variables, dtype=bool)
    observed[int(rng.integers(0, num_variables))] = True
    x = torch.tensor(np.repeat(evidence[None, :], NUM_SAMPLES, 0), dtype=torch.long)
    drawn = compiled.conditional_sample(x, torch.tensor(observed), generator=generator(seed + 1))
    posterior = np.where(np.all((states == evidence) | ~observed, axis=1), joint, 0.0)
    assert g_test(drawn.numpy(), states.astype(np.int64), posterior / posterior.sum()) > ALPHA


def z_scores(samples: np.ndarray, circuit: Circuit, raw: dict[int, np.ndarray], variable: int,
             x: np.ndarray, observed: np.ndarray) -> tuple[float, float]:
    """z-statistics of the sample mean and second moment of ``variable`` against their exact
    values given the evidence (the circuit is linear in the variable's units: see reference)."""
    evidence = reference(circuit, raw, x[None, :], observed[None, :])[0]

    def moment(power: int) -> float:
        return reference(circuit, raw, x[None, :], observed[None, :],
                         override={variable: mean_override(power)})[0] / evidence

    m1, m2, m4 = moment(1), moment(2), moment(4)
    n = len(samples)
    if m2 - m1 * m1 < 1e-12 * max(1.0, m2):  # a point mass: every sample must be that value
        return (0.0, 0.0) if np.allclose(samples, m1, rtol=1e-9, atol=1e-9) else (math.inf, math.inf)
    z1 = (samples.mean() - m1) / math.sqrt((m2 - m1 * m1) / n)
    z2 = (np.mean(samples ** 2) - m2) / math.sqrt(max(m4 - m2 * m2, 1e-300) / n)
    return float(z1), float(z2)


@settings(max_examples=10)
@given(seed=seeds, num_variables=st.integers(1, 3))
def test_sampling_gaussian_moments_with_a_negative_control(seed: int, num_variables: int) -> None:
    rng = np.random.default_rng(seed)
    families = {v: random_family(rng) for v in range(num_variables)}
    families[0] = Gaussian()
    circuit = mixed_circuit(seed, num_variables, families=families)
    compiled, raw = compiled_and_raw(circuit)
    samples = compiled.sample(NUM_SAMPLES, generator=generator(seed)).numpy()
    assert samples.dtype == np.float64
    free = np.zeros(num_variables, dtype=bool)
    blank = np.zeros(num_variables)
    for v in range(num_variables):
        z1, z2 = z_scores(samples[:, v], circuit, raw, v, blank, free)
        assert abs(z1) < Z_LIMIT and abs(z2) < Z_LIMIT, (v, z1, z2)
        if v in circuit.num_categories:
            assert np.all(samples[:, v] == np.round(samples[:, v]))
    # negative control: samples shifted by a tenth of a standard deviation are rejected
    spread = float(samples[:, 0].std())
    z1, _ = z_scores(samples[:, 0] + 0.1 * spread, circuit, raw, 0, blank, free)
    assert abs(z1) > Z_LIMIT
    # conditional sampling given the other variables: the posterior's moments
    if num_variables > 1:
        row = samples[int(rng.integers(0, NUM_SAMPLES))]
        observed = np.ones(num_variables, dtype=bool)
        observed[0] = False
        x = np.repeat(row[None, :], NUM_SAMPLES, 0)
        x[:, 0] = np.nan  # unobserved real values may be NaN
        drawn = compiled.conditional_sample(torch.tensor(x), torch.tensor(observed),
                                            generator=generator(seed + 1)).numpy()
        np.testing.assert_array_equal(drawn[:, 1:], x[:, 1:])
        z1, z2 = z_scores(drawn[:, 0], circuit, raw, 0, np.nan_to_num(row), observed)
        assert abs(z1) < Z_LIMIT and abs(z2) < Z_LIMIT, (z1, z2)


def test_sampling_is_reproducible_and_out_of_scope_columns_are_nan() -> None:
    families: dict[int, InputDistribution] = {0: Gaussian(), 1: Binomial(2), 2: Bernoulli()}
    circuit = mixed_circuit(3, 3, families=families)
    extra = InputLayer(3, circuit.output.num_units, Gaussian(), integrated=True)
    wider = Circuit(SumLayer([ProductLayer([circuit.output, extra])], 1))
    compiled = compile64(wider)
    first = compiled.sample(50, generator=generator(7))
    assert torch.equal(first[:, :3], compiled.sample(50, generator=generator(7))[:, :3])
    assert torch.isnan(first[:, 3]).all()
    assert not torch.isnan(first[:, :3]).any()


# ---------------------------------------------------------------------------------------------
# EM estimates against closed forms
# ---------------------------------------------------------------------------------------------


def em_case(seed: int, dist: InputDistribution, units: int = 3, folds: int = 2, batch: int = 9
            ) -> tuple[FoldedInput, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    layers = [InputLayer(v, units, dist) for v in range(folds)]
    circuit = Circuit(SumLayer([ProductLayer(layers, ProductKind.HADAMARD)], 1))
    compiled = circuits.compile(circuit, dtype=torch.float64, seed=seed)
    module = next(m for m in compiled.folds if isinstance(m, FoldedInput))
    size = dist.support_size
    values = rng.normal(size=(batch, folds)) * 2 if size is None else \
        rng.integers(0, size, size=(batch, folds)).astype(np.float64)
    observed = rng.random((batch, folds)) < 0.7
    flows = rng.random((batch, folds, units)) * (rng.random((batch, folds, units)) < 0.8)
    flows[:, 0, 0] = 0.0  # a unit without flow
    return module, values, observed, flows


def estimate(module: FoldedInput, values: np.ndarray, observed: np.ndarray, flows: np.ndarray,
             pseudocount: float, integer: bool) -> np.ndarray:
    data = torch.tensor(values, dtype=torch.long if integer else torch.float64)
    data = torch.where(torch.tensor(observed), data, -7 if integer else torch.nan)  # never read
    return module.em_estimate(data, torch.tensor(observed), torch.tensor(flows), pseudocount).numpy()


@pytest.mark.parametrize("pseudocount", [0.0, 0.5])
@pytest.mark.parametrize("dist", [Categorical(3), Bernoulli(), Binomial(4)],
                         ids=["categorical", "bernoulli", "binomial"])
@pytest.mark.parametrize("seed", range(3))
def test_em_estimate_discrete_families(seed: int, dist: InputDistribution, pseudocount: float) -> None:
    module, values, observed, flows = em_case(seed, dist)
    raw = module.raw.detach().numpy()
    got = estimate(module, values, observed, flows, pseudocount, integer=True)
    assert got.shape == raw.shape
    size = dist.support_size
    assert size is not None
    for f in range(raw.shape[0]):
        for k in range(raw.shape[1]):
            # expected counts of every value: the data where observed, the unit's own pmf where not
            current = unit_table(module.plan.layers[f], raw[f])[k]  # type: ignore[arg-type]
            counts = np.zeros(size)
            for b in range(len(values)):
                if observed[b, f]:
                    counts[int(values[b, f])] += flows[b, f, k]
                else:
                    counts += flows[b, f, k] * current
            if counts.sum() == 0 and pseudocount == 0:
                np.testing.assert_array_equal(got[f, k], raw[f, k])  # no flow: unchanged
                continue
            if isinstance(dist, Categorical):
                expected = (counts + pseudocount) / (counts + pseudocount).sum()
                result = np.exp(got[f, k] - got[f, k].max())
                result /= result.sum()
            else:
                successes = counts @ np.arange(size) + pseudocount
                trials = counts.sum() * (size - 1) + 2 * pseudocount
                expected = np.array([successes / trials])
                result = _probability(got[f, k])
            np.testing.assert_allclose(result, expected, rtol=1e-12, atol=1e-14)
            if pseudocount > 0:
                assert np.all(np.isfinite(got[f, k]))  # strictly inside (0, 1)


@pytest.mark.parametrize("seed", range(4))
def test_em_estimate_gaussian(seed: int) -> None:
    dist = Gaussian(min_variance=0.05)
    module, values, observed, flows = em_case(seed, dist)
    flows[:, 1, 1] = 0.0
    flows[2, 1, 1] = 1.0  # one observed point only: the variance floor
    observed[2, 1] = True
    raw = module.raw.detach().numpy()
    got = estimate(module, values, observed, flows, 0.3, integer=False)
    for f in range(raw.shape[0]):
        for k in range(raw.shape[1]):
            mean, var = raw[f, k, 0], math.exp(2 * raw[f, k, 1])
            w = flows[:, f, k]
            if w.sum() == 0:
                np.testing.assert_array_equal(got[f, k], raw[f, k])
                continue
            first = np.where(observed[:, f], values[:, f], mean)
            second = np.where(observed[:, f], values[:, f] ** 2, mean ** 2 + var)
            new_mean = (w * first).sum() / w.sum()
            new_var = max((w * second).sum() / w.sum() - new_mean ** 2, 0.05)
            assert got[f, k, 0] == pytest.approx(new_mean, rel=1e-10, abs=1e-12)
            assert got[f, k, 1] == pytest.approx(0.5 * math.log(new_var), rel=1e-9, abs=1e-10)
    assert got[1, 1, 1] == pytest.approx(0.5 * math.log(0.05))  # floored


def test_em_estimate_fixed_point_of_complete_data_mle_and_bad_input() -> None:
    """With every entry observed and flows of one, the estimate is the plain MLE; the compiled
    circuit then has that distribution (log-likelihood of the data is the MLE's)."""
    x = torch.tensor([[0.0], [1.5], [3.0], [2.5]], dtype=torch.float64)
    layer = InputLayer(0, 1, Gaussian())
    compiled = circuits.compile(Circuit(layer), dtype=torch.float64)
    module = compiled.folds[0]
    assert isinstance(module, FoldedInput)
    new = module.em_estimate(x, torch.ones(4, 1, dtype=torch.bool), torch.ones(4, 1, 1), 0.0)
    with torch.no_grad():
        module.raw.copy_(new)
    mean, var = float(x.mean()), float(x.var(unbiased=False))
    expected = -0.5 * ((x[:, 0] - mean) ** 2 / var + math.log(2 * math.pi * var))
    torch.testing.assert_close(compiled.log_likelihood(x).detach(), expected)
    with pytest.raises(InvalidInputError, match="flows of shape"):
        module.em_estimate(x, torch.ones(4, 1, dtype=torch.bool), torch.ones(4, 1), 0.0)
    with pytest.raises(InvalidInputError, match="pseudocount must be a finite number >= 0"):
        module.em_estimate(x, torch.ones(4, 1, dtype=torch.bool), torch.ones(4, 1, 1), -1.0)


# ---------------------------------------------------------------------------------------------
# Data, parameters, folding, serialisation, build_circuit
# ---------------------------------------------------------------------------------------------


def small_mixed() -> CompiledCircuit:
    families: dict[int, InputDistribution] = {0: Gaussian(), 1: Categorical(3), 2: Binomial(2)}
    return compile64(mixed_circuit(11, 3, families=families))


def test_real_valued_data_checks() -> None:
    compiled = small_mixed()
    assert compiled.real_valued and compiled.continuous_variables == (0,)
    with pytest.raises(InvalidInputError, match=r"x must be a floating-point tensor: variables \[0\]"):
        compiled.log_likelihood(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(InvalidInputError, match=r"x\[1, 1\] = 1.5 is not an integer: variable 1 is "
                                                r"discrete with 3 categories"):
        compiled.log_likelihood(torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.5, 0.0]]))
    with pytest.raises(InvalidInputError, match=r"x\[0, 2\] = 3 is out of range for variable 2 with 3"):
        compiled.log_likelihood(torch.tensor([[0.0, 1.0, 3.0]]))
    with pytest.raises(InvalidInputError, match=r"x\[0, 0\] = nan is not a real number: variable 0 is "
                                                r"Gaussian"):
        compiled.log_likelihood(torch.tensor([[math.nan, 1.0, 1.0]]))
    with pytest.raises(InvalidInputError, match=r"x\[0, 1\] = nan is not an integer"):
        compiled.log_likelihood(torch.tensor([[0.0, math.nan, 1.0]]))
    # unobserved entries are never read: NaN there changes nothing, and gradients stay finite
    observed = torch.tensor([False, True, True])
    clean = torch.tensor([[0.3, 1.0, 2.0]], dtype=torch.float64)
    dirty = clean.clone()
    dirty[0, 0] = math.nan
    compiled.zero_grad()
    value = compiled.log_marginal(dirty, observed)
    value.sum().backward()
    assert torch.equal(value.detach(), compiled.log_marginal(clean, observed).detach())
    assert all(torch.isfinite(p.grad).all() for p in compiled.parameters() if p.grad is not None)
    # float32 data for a float64 circuit is promoted; discrete-only circuits keep integer data
    compiled.log_likelihood(clean.float())
    discrete = compile64(mixed_circuit(2, 2, gaussian=False))
    with pytest.raises(InvalidInputError, match="x must hold integer category indices"):
        discrete.log_likelihood(torch.zeros(1, 2))
    with pytest.raises(InvalidInputError, match="apply to discrete variables only"):
        compiled.log_conditional(clean, torch.tensor([False, True, True]), [0])


def test_gradients_reach_every_family() -> None:
    compiled = small_mixed()
    x = torch.tensor([[0.3, 1.0, 2.0], [-1.0, 0.0, 0.0]], dtype=torch.float64)
    compiled.log_likelihood(x).sum().backward()
    for module in compiled.folds:
        if isinstance(module, FoldedInput):
            assert module.raw.grad is not None and torch.isfinite(module.raw.grad).all()
            assert module.raw.grad.abs().sum() > 0


def test_parameter_checks_name_tensor_layer_and_index() -> None:
    compiled = small_mixed()
    gaussian = next(m for m in compiled.folds if isinstance(m, FoldedInput)
                    and isinstance(m.plan.distribution, Gaussian))
    name = gaussian.plan.name
    for bad, problem, text in ((math.nan, ParameterProblem.NAN, "NaN"),
                               (INF, ParameterProblem.POSITIVE_INFINITY, "+inf"),
                               (-INF, None, "-inf")):
        with torch.no_grad():
            gaussian.raw[0, 0, 1] = bad
        with pytest.raises(InvalidParameterError) as info:
            compiled.log_partition()
        error = info.value
        assert (error.index, error.problem) == ((0, 0, 1), problem)
        assert f"{name!r} (the circuit's own parameters, raw)[0, 0, 1] is {text}" in str(error)
        assert gaussian.plan.layers[0].describe() in str(error)
        assert "log-standard-deviation must be finite" in str(error)
        with torch.no_grad():
            gaussian.raw[0, 0, 1] = 0.0
    compiled.log_partition()
    # success logits: +-inf are exact probabilities, NaN is not; external tables too
    circuit = Circuit(SumLayer([InputLayer(0, 2, Bernoulli())], 1))
    bernoulli = compile64(circuit)
    name = next(n for n in bernoulli.parameter_shapes() if n.startswith("input"))
    params = {name: torch.tensor([[[[INF], [-INF]]], [[[0.5], [math.nan]]]], dtype=torch.float64)}
    with pytest.raises(InvalidParameterError, match=rf"params\['{name}'\]\[1, 0, 1, 0\] is NaN"):
        bernoulli.log_likelihood(torch.tensor([[1], [0]]), params)
    params[name][1, 0, 1, 0] = 2.0
    got = bernoulli.log_likelihood(torch.tensor([[1], [0]]), params)
    weights = torch.softmax(bernoulli.folds[-1].raw.detach()[0, 0], -1)
    first = torch.tensor([1.0, 0.0], dtype=torch.float64)  # logits +inf, -inf: p = 1 and 0
    second = torch.sigmoid(torch.tensor([0.5, 2.0], dtype=torch.float64))
    expected = torch.log(torch.stack([(weights * first).sum(), (weights * (1 - second)).sum()]))
    torch.testing.assert_close(got.detach(), expected)


def test_per_row_parameters_equal_the_module_with_those_parameters() -> None:
    compiled = small_mixed()
    rng = np.random.default_rng(0)
    shapes = compiled.parameter_shapes()
    params = {n: torch.tensor(rng.normal(size=(3, *s)) * 0.7) for n, s in shapes.items()}
    x = torch.tensor([[0.3, 1.0, 2.0], [-1.0, 0.0, 0.0], [2.0, 2.0, 1.0]], dtype=torch.float64)
    observed = torch.tensor([[True, True, False], [False, True, True], [True, False, True]])
    joint = compiled.log_marginal(x, observed, params)
    states, values = compiled.map_state(x, observed, params)
    for b in range(3):
        single = compile64(compiled.circuit)
        with torch.no_grad():
            for plan, module in zip(single.plans, single.folds, strict=True):
                if plan.name in params:
                    module.raw.copy_(params[plan.name][b])
        assert float(joint[b]) == pytest.approx(float(single.log_marginal(x[b:b + 1], observed[b])),
                                                abs=1e-12)
        state, value = single.map_state(x[b:b + 1], observed[b])
        torch.testing.assert_close(states[b], state[0])
        assert float(values[b]) == pytest.approx(float(value[0]), abs=1e-12)
    samples = compiled.sample(generator=generator(0), params=params)
    assert samples.shape == (3, 3) and not torch.isnan(samples).any()


def test_only_layers_of_one_family_and_shape_fold_together() -> None:
    layers = [InputLayer(0, 2, Gaussian()), InputLayer(1, 2, Gaussian()), InputLayer(2, 2, Bernoulli()),
              InputLayer(3, 2, Binomial(2)), InputLayer(4, 2, Binomial(3)), InputLayer(5, 2, Binomial(3)),
              InputLayer(6, 2, Categorical(2)), InputLayer(7, 3, Gaussian())]
    body = ProductLayer([ProductLayer(layers[:7]), SumLayer([layers[7]], 2)])
    compiled = compile64(Circuit(SumLayer([body], 1)))
    groups = sorted(tuple(int(v) for v in m.variables) for m in compiled.folds
                    if isinstance(m, FoldedInput))
    assert groups == [(0, 1), (2,), (3,), (4, 5), (6,), (7,)]
    shapes = {tuple(int(v) for v in m.variables): tuple(m.raw.shape) for m in compiled.folds
              if isinstance(m, FoldedInput)}
    assert shapes[(0, 1)] == (2, 2, 2) and shapes[(4, 5)] == (2, 2, 1) and shapes[(6,)] == (1, 2, 2)


def test_structure_rules_of_the_families() -> None:
    with pytest.raises(StructureError, match="share its domain"):
        Circuit(SumLayer([InputLayer(0, 1, Gaussian()), InputLayer(0, 1, Bernoulli())], 1))
    # a Bernoulli and a Categorical(2) share the domain {0, 1}
    Circuit(SumLayer([InputLayer(0, 1, Categorical(2)), InputLayer(0, 1, Bernoulli())], 1))
    with pytest.raises(StructureError, match="hold their own raw parameters"):
        InputLayer(0, 1, Gaussian(), Softmax())
    with pytest.raises(StructureError, match="Native"):
        InputLayer(0, 1, Categorical(2), Native())
    with pytest.raises(StructureError, match="Native is for input families"):
        SumLayer([InputLayer(0, 1, Bernoulli())], 1, Native())
    with pytest.raises(StructureError, match="an instance"):
        InputLayer(0, 1, Gaussian)  # type: ignore[arg-type]
    with pytest.raises(StructureError, match="total_count >= 1"):
        Binomial(0)
    with pytest.raises(StructureError, match="min_variance > 0"):
        Gaussian(min_variance=0.0)
    with pytest.raises(StructureError, match="initial parameters must have shape"):
        InputLayer(0, 2, Gaussian(), initial=torch.zeros(2, 1))
    with pytest.raises(StructureError, match="real-valued"):
        _ = InputLayer(0, 1, Gaussian()).num_categories
    assert InputLayer(0, 3, Binomial(4)).parameter_shape == (3, 1)


def test_serialization_round_trips_the_families(tmp_path: Path) -> None:
    families: dict[int, InputDistribution] = {0: Gaussian(min_variance=0.01), 1: Binomial(3),
                                              2: Bernoulli(), 3: Categorical(2)}
    circuit = mixed_circuit(5, 4, families=families)
    path = tmp_path / "mixed.json"
    circuits.save_circuit(circuit, path)
    loaded = circuits.load_circuit(path)
    assert [(la.variable, la.distribution, type(la.parameterization)) for la in loaded.input_layers] == \
        [(la.variable, la.distribution, type(la.parameterization)) for la in circuit.input_layers]
    x = torch.tensor([[0.2, 1.0, 1.0, 0.0], [-2.0, 3.0, 0.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(compile64(loaded).log_likelihood(x), compile64(circuit).log_likelihood(x))
    data = circuits.circuit_to_dict(circuit)
    gaussian = next(e for e in data["layers"] if e["type"] == "input"
                    and e["distribution"]["type"] == "gaussian")
    assert gaussian["distribution"] == {"type": "gaussian", "min_variance": 0.01}
    assert gaussian["parameterization"] == "native"
    gaussian["initial"][0][1] = "-inf"
    with pytest.raises(SerializationError, match=r"initial\[0\]\[1\] is -inf; a Gaussian's mean"):
        circuits.circuit_from_dict(data)
    gaussian["initial"][0][1] = 0.0
    gaussian["distribution"] = {"type": "poisson", "rate": 1}
    with pytest.raises(SerializationError, match="'type': 'bernoulli'"):
        circuits.circuit_from_dict(data)
    gaussian["distribution"] = {"type": "gaussian", "min_variance": 0.01}
    gaussian["parameterization"] = "softmax"
    with pytest.raises(SerializationError, match="hold their own raw parameters"):
        circuits.circuit_from_dict(data)
    binomial = next(e for e in data["layers"] if e["type"] == "input"
                    and e["distribution"]["type"] == "binomial")
    assert binomial["distribution"] == {"type": "binomial", "total_count": 3}


def test_build_circuit_chooses_the_family() -> None:
    graph = region_graphs.quad_tree(2, 2)
    gaussian = region_graphs.build_circuit(graph, "cp", 3, 2, input_distribution=Gaussian())
    assert {type(la.distribution) for la in gaussian.input_layers} == {Gaussian}
    compiled = compile64(gaussian)
    assert float(compiled.log_partition()) == pytest.approx(0.0, abs=1e-12)
    mixed = region_graphs.build_circuit(graph, "tucker", 2, 2, input_parameterization=Exp(),
                                        input_distribution={0: Binomial(4), 1: Gaussian(),
                                                            2: Categorical(5), 3: Bernoulli()})
    kinds = {la.variable: (la.distribution, type(la.parameterization)) for la in mixed.input_layers}
    assert kinds == {0: (Binomial(4), Native), 1: (Gaussian(), Native), 2: (Categorical(5), Exp),
                     3: (Bernoulli(), Native)}
    default = region_graphs.build_circuit(graph, "cp", 2, 2, 3)
    assert {la.distribution for la in default.input_layers} == {Categorical(3)}
    with pytest.raises(RegionGraphError, match="not both"):
        region_graphs.build_circuit(graph, "cp", 2, 2, 3, input_distribution=Bernoulli())
    with pytest.raises(RegionGraphError, match="an instance such as Gaussian"):
        region_graphs.build_circuit(graph, "cp", 2, 2, input_distribution=Gaussian)
    with pytest.raises(RegionGraphError, match="no entry for variables"):
        region_graphs.build_circuit(graph, "cp", 2, 2, input_distribution={0: Gaussian()})
    with pytest.raises(RegionGraphError, match="give num_categories"):
        region_graphs.build_circuit(graph, "cp", 2, 2)
    with pytest.raises(RegionGraphError, match="input_parameterization applies to Categorical"):
        region_graphs.build_circuit(graph, "cp", 2, 2, input_parameterization=Exp(),
                                    input_distribution=Gaussian())
    # templates keep their num_categories signature and Categorical inputs
    assert {la.distribution for la in templates.btree(4, rank=2, num_categories=3).input_layers} == \
        {Categorical(3)}
