"""LogParameters: every query gives the same answers from prepared log-parameters as from raw ones."""

from __future__ import annotations

import pytest
import torch
from factories import random_circuit

import circuits
from circuits.compiled import CompiledCircuit, LogParameters
from circuits.errors import InvalidInputError, ZeroProbabilityEvidenceError


def prepared_case(seed: int) -> tuple[CompiledCircuit, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A random float64 circuit (zeros, Exp layers, integrated inputs), per-row raw parameters
    for 5 rows, complete data and an evidence mask."""
    compiled = circuits.compile(random_circuit(seed, num_variables=4, num_categories=3),
                                dtype=torch.float64, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    params = {k: v + 0.3 * torch.randn(v.shape, generator=generator, dtype=v.dtype)
              for k, v in compiled.internal_parameters(5).items()}
    x = torch.randint(0, 3, (5, compiled.num_variables), generator=generator)
    observed = torch.rand(5, compiled.num_variables, generator=generator) < 0.5
    return compiled, params, x, observed


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("seed", range(6))
def test_every_query_agrees_with_raw_parameters(seed: int) -> None:
    compiled, params, x, observed = prepared_case(seed)
    prepared = compiled.log_parameters(params)
    assert prepared.batch == 5 and compiled.log_parameters(prepared) is prepared
    close(compiled.log_likelihood(x, prepared), compiled.log_likelihood(x, params))
    close(compiled.log_marginal(x, observed, prepared), compiled.log_marginal(x, observed, params))
    close(compiled.log_partition(prepared), compiled.log_partition(params))
    close(compiled.log_prefix_marginals(x, params=prepared),
          compiled.log_prefix_marginals(x, params=params))
    scope = list(compiled.scope)
    close(compiled.log_prefix_conditionals(x, scope[::-1], prepared),
          compiled.log_prefix_conditionals(x, scope[::-1], params))
    free = torch.zeros(compiled.num_variables, dtype=torch.bool)
    free[scope[0]] = True
    close(compiled.log_conditional(x, ~free, params=prepared),
          compiled.log_conditional(x, ~free, params=params))
    possible = torch.isfinite(compiled.log_marginal(x, observed, params))
    if not bool(possible.all()):  # evidence of probability zero: both forms raise
        for use in (prepared, params):
            with pytest.raises(ZeroProbabilityEvidenceError):
                compiled.conditional_sample(x, observed, params=use)
            with pytest.raises(ZeroProbabilityEvidenceError):
                compiled.map_state(x, observed, use)
        x, observed = x[possible], observed[possible]
        params = {k: v[possible] for k, v in params.items()}
        prepared = compiled.log_parameters(params)
    drawn = [compiled.conditional_sample(x, observed, torch.Generator().manual_seed(seed), use)
             for use in (prepared, params)]  # the same uniforms give the same samples
    assert torch.equal(drawn[0], drawn[1])
    assert torch.equal(compiled.sample(generator=torch.Generator().manual_seed(1), params=prepared),
                       compiled.sample(generator=torch.Generator().manual_seed(1), params=params))
    state, value = compiled.map_state(x, observed, prepared)
    state_raw, value_raw = compiled.map_state(x, observed, params)
    assert torch.equal(state, state_raw)
    close(value, value_raw)


def test_internal_parameters_gradients_and_batch_checks() -> None:
    compiled, params, x, _ = prepared_case(7)
    internal = compiled.log_parameters()
    assert internal.batch is None
    close(compiled.log_likelihood(x, internal), compiled.log_likelihood(x))
    close(compiled.log_partition(internal), compiled.log_partition())
    raw = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ours = torch.autograd.grad(compiled.log_prefix_marginals(x, params=compiled.log_parameters(
        raw)).sum(), list(raw.values()))
    theirs = torch.autograd.grad(compiled.log_prefix_marginals(x, params=raw).sum(),
                                 list(raw.values()))
    for a, b in zip(ours, theirs, strict=True):
        close(a, b)
    with pytest.raises(InvalidInputError, match="5 parameter sets but the data has 2 rows"):
        compiled.log_likelihood(x[:2], compiled.log_parameters(params))


def test_derived_tensors_are_computed_once() -> None:
    compiled, params, x, _ = prepared_case(3)
    prepared = compiled.log_parameters(params)
    assert isinstance(prepared, LogParameters) and not prepared.derived
    compiled.log_prefix_conditionals(x, params=prepared)
    derived = dict(prepared.derived)
    assert derived and {kind for kind, _ in derived} <= {"probs", "exp_weights"}
    compiled.log_prefix_conditionals(x, params=prepared)
    assert all(prepared.derived[key] is value for key, value in derived.items())


# ------------------------------------------------------------------ the module's own parameters, cached
def fresh_value(compiled: CompiledCircuit, x: torch.Tensor) -> torch.Tensor:
    """The log-likelihood computed without the own-parameter cache."""
    compiled.own_cache.clear()
    with torch.no_grad():
        value = compiled.log_marginal(x, torch.ones_like(x, dtype=torch.bool))
    compiled.own_cache.clear()
    return value


def edits() -> dict[str, object]:
    """Every way of changing a parameter in place, including those version counters miss."""
    def through_data(raw: torch.nn.Parameter) -> None:
        raw.data.add_(0.5)  # invisible to raw._version

    def no_grad(raw: torch.nn.Parameter) -> None:
        with torch.no_grad():
            raw.mul_(0.5)

    def swap_data(raw: torch.nn.Parameter) -> None:
        raw.data = raw.data.flip(-1).clone()

    def from_state_dict(raw: torch.nn.Parameter) -> None:
        with torch.no_grad():
            raw.copy_(torch.randn_like(raw))

    return {"data": through_data, "no_grad": no_grad, "swap": swap_data, "copy": from_state_dict}


@pytest.mark.parametrize("edit", list(edits()))
@pytest.mark.parametrize("inference", [False, True])
def test_own_parameter_cache_never_goes_stale(edit: str, inference: bool) -> None:
    """Cached own log-parameters are bit-for-bit what a fresh normalisation gives, after every
    kind of in-place edit (``.data`` included), in and out of inference mode."""
    compiled, _, x, _ = prepared_case(2)
    context = torch.inference_mode if inference else torch.no_grad
    with context():
        first = compiled.log_likelihood(x)
    assert compiled.own_cache.entries, "queries without gradients fill the cache"
    with context():
        again = compiled.log_likelihood(x)
    assert torch.equal(first, again)
    for name in compiled.parameter_shapes():
        raw = next(m.raw for p, m in zip(compiled.plans, compiled.folds, strict=True) if p.name == name)
        edits()[edit](raw)  # type: ignore[operator]
        with context():
            got = compiled.log_likelihood(x)
        assert torch.equal(got, fresh_value(compiled, x)), (edit, name)


def test_own_parameter_cache_keeps_gradients_and_checks() -> None:
    """Gradients still reach the module's own parameters, a cache made in inference mode never
    enters an autograd graph, and a parameter made invalid after caching is still reported."""
    compiled, _, x, _ = prepared_case(4)
    with torch.inference_mode():
        compiled.log_likelihood(x)
    loss = compiled.log_likelihood(x).sum()  # grad mode: fresh, differentiable tensors
    loss.backward()
    assert all(p.grad is not None for p in compiled.parameters())
    with torch.no_grad():
        compiled.log_likelihood(x)
        raw = compiled.folds[0].raw
        raw.data[0, 0, 0] = float("nan")  # behind the version counter's back
        with pytest.raises(circuits.InvalidParameterError, match="is NaN"):
            compiled.log_likelihood(x)


def test_moving_the_module_clears_the_own_parameter_cache() -> None:
    compiled, _, x, _ = prepared_case(5)
    with torch.no_grad():
        compiled.log_likelihood(x)
        assert compiled.own_cache.entries
        compiled.float()
        assert not compiled.own_cache.entries
        got = compiled.log_likelihood(x)
    assert got.dtype == torch.float32 and torch.equal(got, fresh_value(compiled, x))
