"""circuits.kernels: backend selection, and the triton kernels against the torch reference.

The triton kernels run on CPU tensors in triton's interpreter, which only works when
``TRITON_INTERPRET=1`` is set before the process imports triton (triton builds its own library
functions at import time, and other test modules import triton through transformers). So the
``test_triton_*`` tests run in a child pytest process started with that variable by
:func:`test_triton_kernels_in_the_interpreter`, and are skipped in the parent. Running this file
directly with ``TRITON_INTERPRET=1`` runs them in-process instead. The interpreter costs tens of
milliseconds per program instance, so shapes stay tiny and some examples force 16-wide blocks to
exercise the multi-tile and multi-chunk paths.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from triton_helpers import chi_square_p

import circuits
from circuits import kernels
from circuits.errors import InvalidInputError
from circuits.kernels import KernelBackend, KernelBackendError
from circuits.kernels.ops import torch_log_matmul
from circuits.templates import btree

HAS_TRITON = kernels.triton_available()
IN_INTERPRETER = kernels.interpreter_usable()
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
interpreted = pytest.mark.skipif(
    not IN_INTERPRETER,
    reason="needs TRITON_INTERPRET=1 from process start: run by test_triton_kernels_in_the_interpreter")
INF = float("inf")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def clean_selection(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No env var, no global setting, a fresh ``import triton`` cache before and after."""
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    kernels.set_backend(None)
    kernels.reset_triton_import_cache()
    yield
    kernels.set_backend(None)
    kernels.reset_triton_import_cache()


def fake_cuda(dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    """Stands in for a CUDA tensor in the selection logic (which reads only device and dtype)."""
    return SimpleNamespace(device=torch.device("cuda"), dtype=dtype,
                           is_floating_point=lambda: dtype.is_floating_point)


@needs_triton
@pytest.mark.skipif(IN_INTERPRETER, reason="already in the interpreter: the tests run in-process")
def test_triton_kernels_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(kernels.ENV_VAR, None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0",
               "-k", "test_triton_ and not in_the_interpreter", str(Path(__file__).resolve())]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary


# ----------------------------------------------------------------------------- backend selection
def test_auto_never_picks_triton_on_cpu(clean_selection: None, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(1, 2, 3)
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        assert kernels.resolve_backend(x) is KernelBackend.TORCH
        assert kernels.resolve_backend(x, backend="auto") is KernelBackend.TORCH


@needs_triton
def test_auto_picks_triton_on_cuda_for_supported_dtypes(clean_selection: None) -> None:
    assert kernels.resolve_backend(fake_cuda()) is KernelBackend.TRITON  # type: ignore[arg-type]
    half = fake_cuda(torch.float16)
    assert kernels.resolve_backend(half) is KernelBackend.TORCH  # type: ignore[arg-type]
    with pytest.raises(KernelBackendError, match="float32 and float64"):
        kernels.resolve_backend(half, backend="triton")  # type: ignore[arg-type]


def test_selection_precedence(clean_selection: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels.requested_backend() is KernelBackend.AUTO
    monkeypatch.setenv(kernels.ENV_VAR, "TRITON")
    assert kernels.requested_backend() is KernelBackend.TRITON
    kernels.set_backend("torch")
    assert kernels.requested_backend() is KernelBackend.TORCH
    with kernels.use_backend(KernelBackend.TRITON):
        assert kernels.requested_backend() is KernelBackend.TRITON
        with kernels.use_backend("auto"):
            assert kernels.requested_backend() is KernelBackend.AUTO
        assert kernels.requested_backend("torch") is KernelBackend.TORCH
    assert kernels.requested_backend() is KernelBackend.TORCH
    kernels.set_backend(None)
    monkeypatch.setenv(kernels.ENV_VAR, "cuda")
    with pytest.raises(KernelBackendError, match=kernels.ENV_VAR):
        kernels.requested_backend()
    with pytest.raises(KernelBackendError, match="unknown kernel backend"):
        kernels.use_backend("fast").__enter__()


@needs_triton
def test_forced_triton_on_cpu_without_interpreter_is_one_clear_error(
        clean_selection: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w = torch.zeros(1, 2, 3), torch.zeros(1, 4, 3)
    with pytest.raises(KernelBackendError, match="start the process with TRITON_INTERPRET=1"):
        kernels.log_matmul(x, w, backend="triton")
    if not IN_INTERPRETER:  # triton was imported without it: setting it now cannot help
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(KernelBackendError, match="set after this process imported triton"):
            kernels.log_matmul(x, w, backend="triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled = circuits.compile(btree(2, 2, 2))
    data = torch.zeros(3, 2, dtype=torch.long)
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    with pytest.raises(KernelBackendError, match=r"KernelBackend\.TORCH"):
        compiled(data)
    with kernels.use_backend("torch"):
        assert torch.isfinite(compiled(data)).all()


def test_import_failure_falls_back_to_torch(clean_selection: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    kernels.reset_triton_import_cache()
    assert not kernels.triton_available()
    assert kernels.resolve_backend(fake_cuda()) is KernelBackend.TORCH  # type: ignore[arg-type]
    x, w = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    torch.testing.assert_close(kernels.log_matmul(x, w), torch_log_matmul(x, w))
    with pytest.raises(KernelBackendError, match="not importable"):
        kernels.log_matmul(x, w, backend="triton")


def test_circuits_work_when_triton_cannot_be_imported() -> None:
    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # every `import triton` now raises ImportError
        import torch, circuits
        from circuits.templates import btree
        c = circuits.compile(btree(4, 2, 3))
        x = torch.zeros(5, 4, dtype=torch.long)
        assert torch.isfinite(c(x)).all()
        assert c.sample(7, generator=torch.Generator().manual_seed(0)).shape == (7, 4)
        assert not circuits.kernels.triton_available()
        assert "circuits.kernels._triton" not in sys.modules
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_input_validation() -> None:
    with pytest.raises(InvalidInputError, match="per-row weights"):
        kernels.log_matmul(torch.zeros(2, 3, 4), torch.zeros(2, 5, 3))
    unit = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(InvalidInputError, match="float64"):
        kernels.sum_child_choice(torch.zeros(1, 3, 4), unit, None, torch.rand(1, 2, 4))


# ----------------------------------------------------------------------------- helpers
def random_log_values(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype,
                      p_inf: float, whole_rows: bool) -> Tensor:
    """``N(0, 3^2)`` entries, a fraction ``p_inf`` of them ``-inf``, maybe whole ``-inf`` rows."""
    values = 3.0 * torch.randn(shape, generator=gen, dtype=torch.float64)
    values[torch.rand(shape, generator=gen, dtype=torch.float64) < p_inf] = -INF
    if whole_rows:
        rows = torch.rand(shape[:-1], generator=gen, dtype=torch.float64) < 0.3
        values[rows] = -INF
    return values.to(dtype)


def assert_log_close(got: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    """Same ``-inf`` pattern, no NaN, finite values equal to a relative tolerance."""
    assert not got.isnan().any()
    assert torch.equal(got == -INF, want == -INF)
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    finite = want > -INF
    torch.testing.assert_close(got[finite], want[finite], rtol=tol, atol=tol)


BLOCKS = st.sampled_from([None, 16])
SHAPES = st.tuples(st.integers(1, 2), st.integers(1, 20), st.integers(1, 19), st.integers(1, 37))
CASES = st.tuples(SHAPES, st.sampled_from([torch.float32, torch.float64]),
                  st.sampled_from([0.0, 0.3]), st.booleans(), BLOCKS, st.integers(0, 2**31))


def check_against_torch(x: Tensor, w: Tensor, block: int | None, dtype: torch.dtype,
                        gen: torch.Generator) -> None:
    """Forward values and gradients (random upstream gradient) of triton vs the torch path."""
    from circuits.kernels import _triton

    x_t, w_t = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want = torch_log_matmul(x_t, w_t)
    if block is None:
        got_x, got_w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        got = kernels.log_matmul(got_x, got_w, backend="triton")
    else:  # forced small blocks: several tiles per fold and several chunks along D
        sizes = {"BLOCK_B": 16 if w.dim() == 3 else 2, "BLOCK_K": block, "BLOCK_D": block}
        launch = _triton.lse_matmul_shared if w.dim() == 3 else _triton.lse_matvec_rows
        got = launch(x, w, sizes)
        got_x = got_w = None
    assert_log_close(got.detach(), want.detach(), dtype)
    if got_x is None or got_w is None:
        return
    upstream = torch.randn(want.shape, generator=gen, dtype=torch.float64).to(dtype)
    want.backward(upstream)
    got.backward(upstream)
    assert x_t.grad is not None and w_t.grad is not None
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for mine, ref in ((got_x.grad, x_t.grad), (got_w.grad, w_t.grad)):
        assert mine is not None and not mine.isnan().any()
        torch.testing.assert_close(mine, ref, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- log_matmul
@interpreted
@settings(max_examples=30)
@given(CASES)
def test_triton_shared_weights_match_torch(case: tuple) -> None:
    (fold, batch, units, width), dtype, p_inf, whole_rows, block, seed = case
    gen = torch.Generator().manual_seed(seed)
    x = random_log_values((fold, batch, width), gen, dtype, p_inf, whole_rows)
    w = random_log_values((fold, units, width), gen, dtype, p_inf, whole_rows)
    check_against_torch(x, w, block, dtype, gen)


@interpreted
@settings(max_examples=20)
@given(CASES, st.booleans())
def test_triton_per_row_weights_match_torch(case: tuple, expanded: bool) -> None:
    (fold, batch, units, width), dtype, p_inf, whole_rows, block, seed = case
    batch, units = min(batch, 6), min(units, 6)  # per-row tiles are 3-D: keep the grid small
    gen = torch.Generator().manual_seed(seed)
    x = random_log_values((fold, batch, width), gen, dtype, p_inf, whole_rows)
    if expanded:  # the module's own weights broadcast to every row: stride 0, read in place
        w = random_log_values((fold, units, width), gen, dtype, p_inf, whole_rows)
        w = w.unsqueeze(0).expand(batch, -1, -1, -1)
    else:
        w = random_log_values((batch, fold, units, width), gen, dtype, p_inf, whole_rows)
    check_against_torch(x, w, block, dtype, gen)


@interpreted
@settings(max_examples=20)
@given(CASES)
def test_triton_fused_backward_matches_torch_with_small_blocks(case: tuple) -> None:
    from circuits.kernels import _triton
    from circuits.kernels.ops import _finite_max

    (fold, batch, units, width), dtype, p_inf, whole_rows, _, seed = case
    gen = torch.Generator().manual_seed(seed)
    x = random_log_values((fold, batch, width), gen, dtype, p_inf, whole_rows)
    w = random_log_values((fold, units, width), gen, dtype, p_inf, whole_rows)
    x_t, w_t = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = torch_log_matmul(x_t, w_t)
    upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    out.backward(upstream)
    blocks = {"BLOCK_B": 16, "BLOCK_K": 16, "BLOCK_D": 16}  # several tiles and chunks
    got_x, got_w = _triton.lse_matmul_shared_backward(
        x, w, out.detach(), upstream, _finite_max(x).squeeze(-1), _finite_max(w).squeeze(-1),
        (True, True), blocks)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for mine, ref in ((got_x, x_t.grad), (got_w, w_t.grad)):
        assert mine is not None and ref is not None and not mine.isnan().any()
        torch.testing.assert_close(mine, ref, rtol=tol, atol=tol)


@interpreted
def test_triton_all_minus_inf_gives_minus_inf_and_zero_gradients() -> None:
    for w in (torch.zeros(2, 3, 5), torch.zeros(4, 2, 3, 5)):
        x = torch.full((2, 4, 5), -INF, requires_grad=True)
        w = w.requires_grad_(True)
        out = kernels.log_matmul(x, w, backend="triton")
        assert (out == -INF).all()
        out.sum().backward()
        assert x.grad is not None and w.grad is not None
        assert (x.grad == 0).all() and (w.grad == 0).all()


@interpreted
def test_triton_gradcheck_float64() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 3, generator=gen, dtype=torch.float64)
    x[0, 1, 0] = -INF  # a -inf entry (not a whole row: finite differences of -inf are NaN)
    shared = torch.randn(1, 2, 3, generator=gen, dtype=torch.float64)
    per_row = torch.randn(2, 1, 2, 3, generator=gen, dtype=torch.float64)
    for w in (shared, per_row):
        args = (x.clone().requires_grad_(True), w.clone().requires_grad_(True))
        assert torch.autograd.gradcheck(lambda a, b: kernels.log_matmul(a, b, backend="triton"), args)
    tiny = (x[:, :1, 1:].clone().requires_grad_(True), shared[:, :, 1:].clone().requires_grad_(True))
    assert torch.autograd.gradgradcheck(lambda a, b: kernels.log_matmul(a, b, backend="triton"), tiny)


# ----------------------------------------------------------------------------- sampling step
def reference_choice(logw: Tensor, unit: Tensor, x: Tensor | None, uniforms: Tensor) -> Tensor:
    """The sampler's original torch arithmetic, written out independently of circuits.kernels."""
    fold, batch = unit.shape
    safe = unit.clamp(min=0)
    folds = torch.arange(fold)[:, None]
    rows = logw[folds, safe] if logw.dim() == 3 else logw[torch.arange(batch)[None, :], folds, safe]
    logits = rows if x is None else rows + x
    child = (logits.double() - torch.log(-torch.log(uniforms))).argmax(-1)
    return torch.where(unit >= 0, child, -1)


@interpreted
@settings(max_examples=30)
@given(CASES, st.booleans(), st.booleans())
def test_triton_sampling_step_gives_the_torch_choices(case: tuple, per_row: bool,
                                               with_x: bool) -> None:
    from circuits.kernels import _triton

    (fold, batch, units, width), dtype, p_inf, whole_rows, block, seed = case
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, fold, units, width) if per_row else (fold, units, width)
    logw = random_log_values(shape, gen, dtype, p_inf, whole_rows)
    x = random_log_values((fold, batch, width), gen, dtype, p_inf, whole_rows) if with_x else None
    unit = torch.randint(-1, units, (fold, batch), generator=gen)
    uniforms = torch.rand(fold, batch, width, generator=gen, dtype=torch.float64)
    want = reference_choice(logw, unit, x, uniforms)
    assert torch.equal(kernels.sum_child_choice(logw, unit, x, uniforms, backend="torch"), want)
    if block is None:
        got = kernels.sum_child_choice(logw, unit, x, uniforms, backend="triton")
    else:
        got = _triton.gumbel_sum_choice(logw, unit, x, uniforms, {"BLOCK_B": 4, "BLOCK_D": block})
    assert torch.equal(got, want)


@interpreted
def test_triton_sampling_step_follows_softmax_and_rejects_a_biased_control() -> None:
    draws = 6000
    logw = torch.tensor([[[0.0, 1.0, 2.0, -INF, -1.0, 0.5]]])  # F=1, K=1, D=6
    x = torch.tensor([0.3, 0.0, -0.5, 1.0, 0.0, 0.0]).expand(1, draws, 6).contiguous()
    probs = torch.softmax((logw[0, 0] + x[0, 0]).double(), -1)
    unit = torch.zeros(1, draws, dtype=torch.long)
    uniforms = torch.rand(1, draws, 6, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    choices = kernels.sum_child_choice(logw, unit, x, uniforms, backend="triton")[0]
    assert chi_square_p(choices, probs) > 1e-3
    # negative control: the same kernel and uniforms with child 0's logit off by 0.3 (total
    # variation 0.037 from the target) must be rejected by the same test at the same size
    off = logw + torch.tensor([0.3, 0.0, 0.0, 0.0, 0.0, 0.0])
    biased = kernels.sum_child_choice(off, unit, x, uniforms, backend="triton")[0]
    assert chi_square_p(biased, probs) < 1e-6


# ----------------------------------------------------------------------------- whole circuits
@interpreted
def test_triton_compiled_circuit_same_values_gradients_and_samples() -> None:
    compiled = circuits.compile(btree(4, 3, 3), dtype=torch.float64, seed=1)
    data = torch.randint(0, 3, (6, 4), generator=torch.Generator().manual_seed(0))
    observed = torch.tensor([True, False, True, False])
    results = {}
    for backend in ("torch", "triton"):
        compiled.zero_grad()
        with kernels.use_backend(backend):
            marginal = compiled.log_marginal(data, observed)
            marginal.sum().backward()
            per_row = compiled(data, params=compiled.internal_parameters(6))
            samples = compiled.sample(5, generator=torch.Generator().manual_seed(2))
            conditional = compiled.conditional_sample(
                data, observed, generator=torch.Generator().manual_seed(3))
        grads = [p.grad.clone() for p in compiled.parameters() if p.grad is not None]
        results[backend] = (marginal.detach(), per_row.detach(), samples, conditional, grads)
    ref, got = results["torch"], results["triton"]
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)
    assert torch.equal(got[2], ref[2]) and torch.equal(got[3], ref[3])
    assert len(got[4]) == len(ref[4]) > 0
    for mine, want in zip(got[4], ref[4], strict=True):
        torch.testing.assert_close(mine, want, rtol=1e-10, atol=1e-12)
