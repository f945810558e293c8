"""Samplers against the exact distribution: a G-test with a negative control that must fail.

:func:`goodness_of_fit` is the one test applied everywhere. Its power is demonstrated, not
assumed: the negative controls wrap the real sampler with a planted bias of known total
variation (0.02-0.05) and the *same* function, at the same sample size and threshold, must reject
them, while accepting the unbiased sampler on the same circuits.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from factories import (
    Exact,
    any_circuits,
    compile64,
    deterministic_circuit,
    random_circuit,
    seeds,
    template_circuit,
)
from hypothesis import given, settings
from torch import Tensor

import circuits
from circuits import Circuit, CompiledCircuit
from circuits.errors import ZeroProbabilityEvidenceError

NUM_SAMPLES = 50_000
ALPHA = 1e-4  # reject below this p-value
MIN_EXPECTED = 5.0  # cells with fewer expected counts are pooled into one


def goodness_of_fit(samples: Tensor | np.ndarray, ex: Exact, probs: np.ndarray | None = None) -> float:
    """p-value of a G-test of complete samples ``(N, V)`` against ``probs`` over ``ex.states``.

    A sample outside the states, or on a state of probability zero, gives p = 0. Cells whose
    expected count is below :data:`MIN_EXPECTED` are pooled (the chi-square approximation of the
    G statistic needs it). The p-value is the chi-square survival function,
    ``gammaincc(df / 2, G / 2)``.
    """
    probs = ex.probs if probs is None else probs
    index = ex.index(np.asarray(samples))
    if (index < 0).any():
        return 0.0
    counts = np.bincount(index, minlength=len(probs)).astype(np.float64)
    if counts[probs == 0].any():
        return 0.0
    expected = probs * len(index)
    small = expected < MIN_EXPECTED
    observed_bins = list(counts[~small])
    expected_bins = list(expected[~small])
    if small.any():
        observed_bins.append(counts[small].sum())
        expected_bins.append(expected[small].sum())
    obs, exp = np.array(observed_bins), np.array(expected_bins)
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    df = len(obs) - 1
    if df == 0:
        return 1.0
    positive = obs > 0
    g = 2.0 * float((obs[positive] * np.log(obs[positive] / exp[positive])).sum())
    p = torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                torch.tensor(max(g, 0.0) / 2.0, dtype=torch.float64))
    return float(p)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


Sampler = Callable[[int, torch.Generator], Tensor]


def tilted(sampler: Sampler, ex: Exact, tv: float, seed: int) -> tuple[Sampler, float]:
    """Wrap ``sampler`` so it draws from ``q ∝ p * a`` with ``TV(p, q) = tv`` exactly.

    ``a = 1`` on a set ``A`` of states holding about half the mass and ``1 - t`` elsewhere
    (rejection sampling): a smooth tilt, the hardest kind of bias for a test to see at a given
    total variation. Returns the wrapper and its exact total variation.
    """
    probs = ex.probs
    order = np.argsort(-probs)
    in_a = np.zeros(len(probs), dtype=bool)
    mass = [0.0, 0.0]
    for s in order:  # greedy balanced split
        side = 0 if mass[0] <= mass[1] else 1
        in_a[s] = side == 0
        mass[side] += probs[s]
    a = float(probs[in_a].sum())
    if a > 0.5:
        in_a = ~in_a & (probs > 0)
        a = float(probs[in_a].sum())
    assert 0.1 < a <= 0.5, a  # the controls below use circuits where this holds
    keep_rest = a * (1 - a - tv) / ((a + tv) * (1 - a))
    accept = np.where(in_a, 1.0, keep_rest)
    q = probs * accept
    q /= q.sum()
    exact_tv = 0.5 * float(np.abs(q - probs).sum())
    rng = np.random.default_rng(seed)

    def biased(count: int, gen: torch.Generator) -> Tensor:
        kept: list[np.ndarray] = []
        total = 0
        while total < count:
            draw = sampler(count, gen).numpy()
            mask = rng.random(len(draw)) < accept[ex.index(draw)]
            kept.append(draw[mask])
            total += int(mask.sum())
        return torch.tensor(np.concatenate(kept)[:count])

    return biased, exact_tv


def mixed_with_uniform(sampler: Sampler, ex: Exact, tv: float, seed: int) -> tuple[Sampler, float]:
    """Wrap ``sampler``: with probability ``eps`` replace the sample by a uniform state of the
    support, ``eps`` chosen so that ``TV(p, q) = tv``."""
    support = np.flatnonzero(ex.probs > 0)
    uniform = np.zeros_like(ex.probs)
    uniform[support] = 1.0 / len(support)
    eps = tv / (0.5 * float(np.abs(uniform - ex.probs).sum()))
    assert 0 < eps < 1, eps
    q = (1 - eps) * ex.probs + eps * uniform
    rng = np.random.default_rng(seed)

    def biased(count: int, gen: torch.Generator) -> Tensor:
        draw = sampler(count, gen).numpy().copy()
        swap = rng.random(count) < eps
        draw[swap] = ex.states[rng.choice(support, size=int(swap.sum()))]
        return torch.tensor(draw)

    return biased, 0.5 * float(np.abs(q - ex.probs).sum())


def control_circuits() -> list[Circuit]:
    """Fixed circuits for the negative controls: normalised and unnormalised, 27 to 243 states."""
    return [random_circuit(1, 4, 3), random_circuit(2, 5, 2, exp_prob=1.0),
            random_circuit(5, 3, 3, exp_prob=0.0), deterministic_circuit(3, 4, 3),
            template_circuit("btree", 5, 2, 3), random_circuit(7, 5, 3)]


# Planted biases the test must detect at NUM_SAMPLES. A smooth tilt is the hardest bias per unit
# of total variation (its chi-square divergence is only ~4 TV^2), so on 243 states 0.03 is the
# smallest tilt reliably seen with 50k samples; mixing in a uniform component is seen from 0.02.
BIASES: tuple[tuple[Callable[..., tuple[Sampler, float]], tuple[float, ...]], ...] = (
    (tilted, (0.03, 0.05)),
    (mixed_with_uniform, (0.02, 0.03, 0.05)),
)


# ------------------------------------------------------------------------ the test has power


@pytest.mark.parametrize("index", range(len(control_circuits())))
def test_goodness_of_fit_accepts_the_sampler_and_rejects_planted_bias(index: int) -> None:
    compiled = compile64(control_circuits()[index])
    ex = Exact.of(compiled)

    def real(count: int, gen: torch.Generator) -> Tensor:
        return compiled.sample(count, generator=gen)

    assert goodness_of_fit(real(NUM_SAMPLES, generator(index)), ex) > ALPHA
    for bias, targets in BIASES:
        for target in targets:
            wrapped, tv = bias(real, ex, target, seed=index)
            assert tv == pytest.approx(target, abs=1e-9)
            p = goodness_of_fit(wrapped(NUM_SAMPLES, generator(100 + index)), ex)
            assert p < ALPHA, f"{bias.__name__}: total variation {tv:.3f} not detected (p={p:.3g})"


def test_goodness_of_fit_rejects_samples_off_the_support() -> None:
    compiled = compile64(random_circuit(3, 3, 2, zero_prob=0.5))
    ex = Exact.of(compiled)
    zero_state = ex.states[ex.values == 0]
    assert len(zero_state) > 0
    samples = compiled.sample(2000, generator=generator(0)).numpy()
    assert goodness_of_fit(samples, ex) > ALPHA
    samples[0] = zero_state[0]
    assert goodness_of_fit(samples, ex) == 0.0
    samples[0, min(ex.scope)] = -1
    assert goodness_of_fit(samples, ex) == 0.0


# ------------------------------------------------------------------------ unconditional sampling


@settings(max_examples=12)
@given(circuit=any_circuits(), seed=seeds)
def test_sample_matches_the_exact_distribution(circuit: Circuit, seed: int) -> None:
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    samples = compiled.sample(NUM_SAMPLES, generator=generator(seed))
    assert samples.shape == (NUM_SAMPLES, circuit.num_variables)
    assert samples.dtype == torch.long
    outside = [v for v in range(circuit.num_variables) if v not in ex.scope]
    assert (samples[:, outside] == -1).all()  # integrated-only columns are not sampled
    assert goodness_of_fit(samples, ex) > ALPHA


@pytest.mark.parametrize("exp_prob", [0.0, 1.0])
def test_sample_normalised_and_unnormalised_paths(exp_prob: float) -> None:
    """Softmax-only circuits skip the bottom-up pass; Exp circuits need it."""
    compiled = circuits.compile(random_circuit(21, 4, 3, exp_prob=exp_prob))
    assert compiled.normalized == (exp_prob == 0.0)
    ex = Exact.of(compiled)
    assert goodness_of_fit(compiled.sample(NUM_SAMPLES, generator=generator(1)), ex) > ALPHA


def test_out_of_scope_columns_are_minus_one() -> None:
    circuit = next(c for c in (random_circuit(s, 3, 2, integrated_prob=0.9,
                                              out_of_scope_variable=True) for s in range(100))
                   if c.num_variables > len(c.scope))
    compiled = compile64(circuit)
    samples = compiled.sample(500, generator=generator(0))
    extra = [v for v in range(circuit.num_variables) if v not in circuit.scope]
    assert (samples[:, extra] == -1).all()
    assert goodness_of_fit(compiled.sample(NUM_SAMPLES, generator=generator(2)),
                           Exact.of(compiled)) > ALPHA


# ------------------------------------------------------------------------ conditional sampling


def conditional_probs(ex: Exact, x: np.ndarray, observed: np.ndarray) -> np.ndarray:
    weights = np.where(ex.consistent(x, observed), ex.values, 0.0)
    return weights / weights.sum()


@settings(max_examples=12)
@given(circuit=any_circuits(), seed=seeds)
def test_conditional_sample_matches_the_exact_posterior(circuit: Circuit, seed: int) -> None:
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    positive = ex.states[ex.values > 0]
    evidence = positive[rng.integers(0, len(positive), size=2)]
    masks = rng.random((2, circuit.num_variables)) < 0.5
    # two evidence patterns interleaved row by row; unobserved entries hold garbage
    x = evidence[np.arange(NUM_SAMPLES) % 2].copy()
    observed = masks[np.arange(NUM_SAMPLES) % 2]
    x[~observed] = rng.integers(-3, 7, size=int((~observed).sum()))
    out = compiled.conditional_sample(torch.tensor(x), torch.tensor(observed),
                                      generator=generator(seed))
    got = out.numpy()
    np.testing.assert_array_equal(got[observed], x[observed])  # evidence copied through
    for group in range(2):
        rows = got[group::2]
        probs = conditional_probs(ex, evidence[group], masks[group])
        assert goodness_of_fit(rows, ex, probs) > ALPHA


def test_conditional_sample_negative_control() -> None:
    """The conditional check rejects a sampler that ignores the evidence."""
    compiled = compile64(random_circuit(8, 4, 3))
    ex = Exact.of(compiled)
    x = ex.states[int(np.argmax(ex.values))][None, :].repeat(NUM_SAMPLES, 0)
    observed = np.zeros(x.shape[1], dtype=bool)
    observed[0] = True
    probs = conditional_probs(ex, x[0], observed)
    good = compiled.conditional_sample(torch.tensor(x), torch.tensor(observed), generator(0))
    assert goodness_of_fit(good, ex, probs) > ALPHA
    # the prior sample, with the evidence pasted in: the right support, the wrong distribution
    prior = compiled.sample(NUM_SAMPLES, generator=generator(0)).numpy()
    prior[:, 0] = x[0, 0]
    assert goodness_of_fit(prior, ex, probs) < ALPHA


# ------------------------------------------------------------------------ external parameters


@settings(max_examples=8)
@given(circuit=any_circuits(), seed=seeds)
def test_sampling_with_per_row_external_parameters(circuit: Circuit, seed: int) -> None:
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    two: dict[str, Tensor] = {}
    for name, base in compiled.internal_parameters(2).items():
        noise = torch.tensor(rng.normal(size=tuple(base.shape)))
        two[name] = (base.detach() + 1.5 * noise).contiguous()
    rows = torch.arange(NUM_SAMPLES) % 2
    params = {name: value[rows] for name, value in two.items()}
    samples = compiled.sample(generator=generator(seed), params=params).numpy()
    assert samples.shape == (NUM_SAMPLES, circuit.num_variables)
    ex_by_set = [Exact.of(compiled, two, row=r) for r in range(2)]
    for r in range(2):
        assert goodness_of_fit(samples[r::2], ex_by_set[r]) > ALPHA
    # the two sets differ enough that mixing them up would be detected
    swapped = goodness_of_fit(samples[0::2], ex_by_set[1])
    tv = 0.5 * np.abs(ex_by_set[0].probs - ex_by_set[1].probs).sum()
    assert tv < 0.02 or swapped < ALPHA
    # conditional sampling with the same per-row parameters
    state = ex_by_set[0].states[int(np.argmax(ex_by_set[0].values * ex_by_set[1].values))]
    observed = np.zeros(circuit.num_variables, dtype=bool)
    observed[min(ex_by_set[0].scope)] = True
    x = torch.tensor(state[None, :].repeat(NUM_SAMPLES, 0))
    cond = compiled.conditional_sample(x, torch.tensor(observed), generator(seed + 1),
                                       params=params).numpy()
    for r in range(2):
        probs = conditional_probs(ex_by_set[r], state, observed)
        assert goodness_of_fit(cond[r::2], ex_by_set[r], probs) > ALPHA


# ------------------------------------------------------------------------ determinism, MAP


def test_same_generator_seed_gives_the_same_samples() -> None:
    compiled = compile64(random_circuit(12, 5, 3))
    a = compiled.sample(2000, generator=generator(5))
    b = compiled.sample(2000, generator=generator(5))
    c = compiled.sample(2000, generator=generator(6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    x = a[:100]
    observed = torch.tensor([True, False, True, False, False])
    d = compiled.conditional_sample(x, observed, generator(9))
    e = compiled.conditional_sample(x, observed, generator(9))
    assert torch.equal(d, e)


def test_sampling_does_not_touch_the_global_rng() -> None:
    compiled = compile64(random_circuit(13, 3, 3))
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    compiled.sample(50, generator=generator(1))
    assert torch.equal(torch.rand(3), before)


@pytest.mark.parametrize("seed", range(6))
def test_map_state_is_the_argmax_of_deterministic_circuits(seed: int) -> None:
    compiled: CompiledCircuit = compile64(deterministic_circuit(seed, 4, 3))
    ex = Exact.of(compiled)
    state, value = compiled.map_state()
    best = ex.values.max()
    assert ex.values[ex.index(state.numpy())[0]] == pytest.approx(best, rel=1e-12)
    assert float(value[0]) == pytest.approx(np.log(best), abs=1e-10)
    # with evidence on one variable, per row: the argmax of each posterior
    x = torch.tensor(ex.states[: min(6, len(ex.states))])
    observed = torch.zeros(x.shape, dtype=torch.bool)
    observed[:, 0] = True
    possible = torch.isfinite(compiled.log_marginal(x, observed)).detach()
    if not bool(possible.all()):  # x_0 of probability zero: no MAP completion
        with pytest.raises(ZeroProbabilityEvidenceError, match="probability zero"):
            compiled.map_state(x, observed)
        x, observed = x[possible], observed[possible]
    state, value = compiled.map_state(x, observed)
    for b in range(x.shape[0]):
        consistent = ex.consistent(x[b].numpy(), observed[b].numpy())
        top = ex.values[consistent].max()
        assert int(state[b, 0]) == int(x[b, 0])
        assert ex.values[ex.index(state[b: b + 1].numpy())[0]] == pytest.approx(top, rel=1e-12)
