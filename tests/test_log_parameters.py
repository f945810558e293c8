"""LogParameters: every query gives the same answers from prepared log-parameters as from raw ones."""

from __future__ import annotations

import pytest
import torch
from factories import random_circuit

import circuits
from circuits.compiled import CompiledCircuit, LogParameters
from circuits.errors import InvalidInputError, ZeroProbabilityEvidenceError


def setup(seed: int) -> tuple[CompiledCircuit, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
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
    compiled, params, x, observed = setup(seed)
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
    compiled, params, x, _ = setup(7)
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
    compiled, params, x, _ = setup(3)
    prepared = compiled.log_parameters(params)
    assert isinstance(prepared, LogParameters) and not prepared.derived
    compiled.log_prefix_conditionals(x, params=prepared)
    derived = dict(prepared.derived)
    assert derived and {kind for kind, _ in derived} <= {"probs", "exp_weights"}
    compiled.log_prefix_conditionals(x, params=prepared)
    assert all(prepared.derived[key] is value for key, value in derived.items())
