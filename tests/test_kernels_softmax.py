"""circuits.kernels.softmax: the categorical-logits operations and the lazy softmax inputs.

As in ``test_kernels.py``, the ``test_triton_*`` tests need triton's interpreter from process
start; :func:`test_triton_softmax_kernels_in_the_interpreter` runs them in a child process with
``TRITON_INTERPRET=1``. The other tests check the torch path (the reference) against numpy and
the lazy :class:`~circuits.compiled.layers.SoftmaxParts` path of the queries against the
materialised tables, on any machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from triton_helpers import chi_square_p

import circuits
from circuits import kernels
from circuits.compiled.circuit import LogParameters
from circuits.compiled.layers import SoftmaxParts
from circuits.errors import InvalidInputError
from circuits.kernels.softmax import softmax_mixture, softmax_stats
from circuits.templates import btree, hmm

INF = float("inf")
IN_INTERPRETER = kernels.interpreter_usable()
interpreted = pytest.mark.skipif(
    not IN_INTERPRETER,
    reason="needs TRITON_INTERPRET=1 from process start: run by "
           "test_triton_softmax_kernels_in_the_interpreter")


@pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")
@pytest.mark.skipif(IN_INTERPRETER, reason="already in the interpreter: the tests run in-process")
def test_triton_softmax_kernels_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(kernels.ENV_VAR, None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-k", "test_triton_ and not in_the_interpreter", str(Path(__file__).resolve())]
    result = subprocess.run(command, cwd=Path(__file__).resolve().parent.parent, env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary


# ----------------------------------------------------------------------------- data
def logits_with_holes(shape: tuple[int, ...], seed: int, dtype: torch.dtype, p_inf: float,
                      whole_rows: bool) -> Tensor:
    """``N(0, 3^2)`` logits, a fraction ``p_inf`` of them ``-inf``, maybe whole ``-inf`` rows."""
    gen = torch.Generator().manual_seed(seed)
    values = 3.0 * torch.randn(shape, generator=gen, dtype=torch.float64)
    values[torch.rand(shape, generator=gen, dtype=torch.float64) < p_inf] = -INF
    if whole_rows:
        values[torch.rand(shape[:-1], generator=gen, dtype=torch.float64) < 0.3] = -INF
    return values.to(dtype)


def numpy_log_softmax(logits: np.ndarray) -> np.ndarray:
    """Independent reference: ``-inf`` everywhere in rows without mass."""
    peak = logits.max(-1, keepdims=True)
    safe = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(divide="ignore"):
        lse = np.log(np.exp(logits - safe).sum(-1, keepdims=True)) + safe
        return np.where(np.isfinite(lse), logits - lse, -np.inf)


STATS = st.tuples(st.integers(1, 70), st.integers(1, 300), st.integers(0, 4),
                  st.sampled_from([torch.float32, torch.float64]), st.sampled_from([0.0, 0.3]),
                  st.booleans(), st.integers(0, 2**31))
MIXTURES = st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 20), st.integers(1, 40),
                     st.integers(1, 70), st.sampled_from([torch.float32, torch.float64]),
                     st.sampled_from([0.0, 0.3]), st.booleans(), st.integers(0, 2**31))


def stats_inputs(case: tuple) -> tuple[Tensor, Tensor, Tensor, torch.dtype]:
    rows, size, count, dtype, p_inf, whole_rows, seed = case
    logits = logits_with_holes((rows, size), seed, dtype, p_inf, whole_rows)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, size, (rows, count), generator=gen)
    uniforms = torch.rand(rows, size, generator=gen, dtype=torch.float64)
    return logits, tokens, uniforms, dtype


def tolerance(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 1e-12


def assert_log_close(got: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    assert not got.isnan().any() and torch.equal(got == -INF, want == -INF)
    finite = want > -INF
    torch.testing.assert_close(got[finite], want[finite], rtol=tolerance(dtype),
                               atol=tolerance(dtype))


# ----------------------------------------------------------------------------- torch path
@settings(max_examples=40, deadline=None)
@given(STATS)
def test_torch_softmax_stats_match_numpy(case: tuple) -> None:
    logits, tokens, uniforms, dtype = stats_inputs(case)
    stats = softmax_stats(logits, tokens, uniforms, backend="torch")
    reference = numpy_log_softmax(logits.double().numpy())
    rows = np.arange(logits.shape[0])[:, None]
    assert_log_close(stats.log_probs, torch.from_numpy(reference[rows, tokens.numpy()]).to(dtype),
                     dtype)
    gumbel = logits.double().numpy() - np.log(-np.log(uniforms.numpy()))
    draw = torch.from_numpy(gumbel.argmax(-1))
    assert torch.equal(stats.draw, draw)
    assert_log_close(stats.draw_log_prob,
                     torch.from_numpy(reference[np.arange(len(draw)), draw.numpy()]).to(dtype),
                     dtype)


@settings(max_examples=40, deadline=None)
@given(MIXTURES, st.booleans())
def test_torch_softmax_mixture_matches_numpy(case: tuple, with_lse: bool) -> None:
    sets, fold, per_set, units, size, dtype, p_inf, whole_rows, seed = case
    logits = logits_with_holes((sets, fold, units, size), seed, dtype, p_inf, whole_rows)
    weights = torch.rand(fold, sets * per_set, units, dtype=dtype,
                         generator=torch.Generator().manual_seed(seed))
    probs = np.exp(numpy_log_softmax(logits.double().numpy()))  # (S, F, K, C)
    lse = torch.logsumexp(logits, -1)
    got = softmax_mixture(weights, logits if with_lse else torch.log(torch.from_numpy(probs))
                          .to(dtype), lse if with_lse else None, backend="torch")
    w = weights.double().numpy().reshape(fold, sets, per_set, units)
    want = np.einsum("fsbk,sfkc->fsbc", w, probs).reshape(fold, sets * per_set, size)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=tolerance(dtype),
                               atol=tolerance(dtype))


def test_input_validation() -> None:
    logits = torch.zeros(3, 5)
    with pytest.raises(InvalidInputError, match=r"lie in \[0, 5\)"):
        softmax_stats(logits, torch.tensor([[5], [0], [1]]))
    with pytest.raises(InvalidInputError, match="float64"):
        softmax_stats(logits, uniforms=torch.rand(3, 5))
    with pytest.raises(InvalidInputError, match="at least one category"):
        softmax_stats(torch.zeros(3, 0))
    with pytest.raises(InvalidInputError, match="S dividing B"):
        softmax_mixture(torch.zeros(1, 5, 2), torch.zeros(2, 1, 2, 4))
    with pytest.raises(InvalidInputError, match="share one dtype"):
        softmax_mixture(torch.zeros(1, 4, 2), torch.zeros(2, 1, 2, 4, dtype=torch.float64))


# ----------------------------------------------------------------------------- lazy inputs
def head_like(name: str = "btree") -> tuple[circuits.CompiledCircuit, dict[str, Tensor]]:
    """A float64 circuit over 4 variables of 6 categories with random external parameters."""
    circuit = (btree if name == "btree" else hmm)(4, 3, 6)
    compiled = circuits.compile(circuit, dtype=torch.float64, seed=0)
    gen = torch.Generator().manual_seed(5)
    params = {name: 2.0 * torch.randn(1, *shape, generator=gen, dtype=torch.float64)
              for name, shape in compiled.parameter_shapes().items()}
    return compiled, params


def lazy(compiled: circuits.CompiledCircuit, params: dict[str, Tensor]) -> LogParameters:
    """The log-parameters with every input fold as SoftmaxParts, built by hand (torch path)."""
    prepared = compiled.log_parameters(params)
    values = dict(prepared.values)
    for plan, module in zip(compiled.plans, compiled.folds, strict=True):
        if isinstance(module, circuits.compiled.layers.FoldedInput):
            values[plan.fold_id] = module.softmax_parts(params[plan.name])
    return LogParameters(values, prepared.batch)


def decoder_queries(compiled: circuits.CompiledCircuit,
                    params: dict[str, Tensor] | LogParameters) -> tuple[Tensor, ...]:
    """What a decoding round asks of a head's circuit: likelihood, draft, MAP, conditionals."""
    rows = 5
    x = torch.randint(0, 6, (rows, 4), generator=torch.Generator().manual_seed(1))
    observed = torch.tensor([True, False, False, False])
    one = x[:1]
    prepared = params.expand(rows) if isinstance(params, LogParameters) else \
        {k: v.expand(rows, *v.shape[1:]) for k, v in params.items()}
    return (compiled.log_likelihood(x, prepared),
            compiled.conditional_sample(one, observed, torch.Generator().manual_seed(2), params),
            compiled.map_state(one, observed, params)[0],
            compiled.log_prefix_conditionals(x, None, prepared),
            compiled.log_conditional(x, observed.expand(rows, -1), None, prepared))


@pytest.mark.parametrize("name", ["btree", "hmm"])
def test_softmax_parts_answer_every_query_like_the_table(name: str) -> None:
    compiled, params = head_like(name)
    for want, got in zip(decoder_queries(compiled, params),
                         decoder_queries(compiled, lazy(compiled, params)), strict=True):
        if want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        else:
            assert torch.equal(got, want)


def test_log_parameters_stay_tables_on_the_torch_backend() -> None:
    compiled, params = head_like()
    with kernels.use_backend("torch"):
        prepared = compiled.log_parameters(params)
    assert all(isinstance(v, Tensor) for v in prepared.values.values())


# ----------------------------------------------------------------------------- triton path
@interpreted
@settings(max_examples=30, deadline=None)
@given(STATS, st.booleans())
def test_triton_softmax_stats_match_torch(case: tuple, small_blocks: bool) -> None:
    from circuits.kernels import _triton_softmax

    logits, tokens, uniforms, dtype = stats_inputs(case)
    want = softmax_stats(logits, tokens, uniforms, backend="torch")
    blocks = {"BLOCK_R": 4, "BLOCK_C": 16} if small_blocks else None
    got = _triton_softmax.softmax_stats(logits, tokens, uniforms, blocks)
    assert_log_close(got[0], want.log_normalizer, dtype)
    assert_log_close(got[1], want.log_probs, dtype)
    assert torch.equal(got[2], want.draw)
    assert_log_close(got[3], want.draw_log_prob, dtype)
    plain = softmax_stats(logits, backend="triton")
    assert plain.log_probs is None and plain.draw is None
    assert_log_close(plain.log_normalizer, want.log_normalizer, dtype)


@interpreted
@settings(max_examples=30, deadline=None)
@given(MIXTURES, st.booleans(), st.booleans())
def test_triton_softmax_mixture_matches_torch(case: tuple, with_lse: bool,
                                              expanded: bool) -> None:
    from circuits.kernels import _triton_softmax

    sets, fold, per_set, units, size, dtype, p_inf, whole_rows, seed = case
    logits = logits_with_holes((1 if expanded else sets, fold, units, size), seed, dtype, p_inf,
                               whole_rows)
    logits = logits.expand(sets, -1, -1, -1)  # stride 0 over sets: read in place
    lse = torch.logsumexp(logits, -1) if with_lse else None
    source = logits if with_lse else torch.log_softmax(logits, -1).nan_to_num(nan=-INF)
    weights = torch.rand(fold, sets * per_set, units, dtype=dtype,
                         generator=torch.Generator().manual_seed(seed))
    want = softmax_mixture(weights, source, lse, backend="torch")
    got = _triton_softmax.softmax_mixture(weights, source, lse,
                                          {"BLOCK_B": 16, "BLOCK_K": 16, "BLOCK_C": 16})
    torch.testing.assert_close(got, want, rtol=tolerance(dtype), atol=tolerance(dtype))
    torch.testing.assert_close(softmax_mixture(weights, source, lse, backend="triton"), want,
                               rtol=tolerance(dtype), atol=tolerance(dtype))


@interpreted
def test_triton_draws_follow_the_softmax_and_reject_a_biased_control() -> None:
    draws = 6000
    row = torch.tensor([0.0, 1.0, 2.0, -INF, -1.0, 0.5, 0.2])
    probs = torch.softmax(row.double(), -1)
    uniforms = torch.rand(draws, 7, generator=torch.Generator().manual_seed(7),
                          dtype=torch.float64)
    stats = softmax_stats(row.expand(draws, -1), uniforms=uniforms, backend="triton")
    assert chi_square_p(stats.draw, probs) > 1e-3
    torch.testing.assert_close(stats.draw_log_prob, probs.log()[stats.draw].float())
    # negative control: category 0's logit off by 0.5 (total variation ~0.04) must be rejected
    biased = softmax_stats((row + torch.eye(7)[0] * 0.5).expand(draws, -1), uniforms=uniforms,
                           backend="triton")
    assert chi_square_p(biased.draw, probs) < 1e-6


@interpreted
@pytest.mark.parametrize("name", ["btree", "hmm"])
def test_triton_lazy_round_queries_equal_the_torch_round(name: str) -> None:
    compiled, params = head_like(name)
    with kernels.use_backend("triton"):
        prepared = compiled.log_parameters(params)
        assert any(isinstance(v, SoftmaxParts) for v in prepared.values.values())
        got = decoder_queries(compiled, prepared)
    with kernels.use_backend("torch"):
        want = decoder_queries(compiled, compiled.log_parameters(params))
    for mine, ref in zip(got, want, strict=True):
        if ref.is_floating_point():
            torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-12)
        else:
            assert torch.equal(mine, ref)
