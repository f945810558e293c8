"""``AUTO`` never crashes where torch would not: a triton kernel that fails is replaced by torch.

No GPU here, so ``AUTO`` is made to consider triton for CPU tensors (``_all_on_cuda`` and
``_triton_obstacle`` patched) and the launchers are replaced by stubs that fail as triton 3.6
failed on a GPU. The torch results are the reference: a fallback must return exactly them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from circuits import kernels
from circuits.kernels import KernelBackend, KernelFallbackWarning, TritonKernel, ops, softmax
from circuits.kernels import backend as backend_module
from circuits.kernels.ops import torch_log_matmul


class CompileFailure(RuntimeError):
    pass


def failing(*_: object, **__: object) -> None:
    raise CompileFailure("PassManager::run failed")


@pytest.fixture
def triton_considered(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """``AUTO`` picks triton for any tensors; every launcher fails; calls are counted."""
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    kernels.set_backend(None)
    kernels.reset_triton_import_cache()
    monkeypatch.setattr(backend_module, "_all_on_cuda", lambda tensors: bool(tensors))
    monkeypatch.setattr(backend_module, "_triton_obstacle", lambda tensors: None)
    monkeypatch.setattr(backend_module, "triton_version", lambda: (3, 6))
    calls = SimpleNamespace(count=0)

    def counted(*args: object, **kw: object) -> None:
        calls.count += 1
        failing()

    stub = SimpleNamespace(lse_matmul_shared=counted, lse_matvec_rows=counted,
                           lse_matmul_shared_backward=counted, gumbel_sum_choice=counted,
                           softmax_stats=counted, softmax_mixture=counted)
    monkeypatch.setattr(ops, "_fused", lambda: stub)
    monkeypatch.setattr(softmax, "_fused", lambda: stub)
    yield calls
    kernels.reset_triton_import_cache()


def test_a_failing_kernel_falls_back_once_with_one_warning(triton_considered: SimpleNamespace) -> None:
    x, w = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 5, 4, dtype=torch.float64)
    with pytest.warns(KernelFallbackWarning, match="log-space sum layer .shared weights. failed "
                                                   "for torch.float64.*PassManager::run failed"):
        first = kernels.log_matmul(x, w)
    assert triton_considered.count == 1
    torch.testing.assert_close(first, torch_log_matmul(x, w), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, and the kernel is not tried again
        torch.testing.assert_close(kernels.log_matmul(x, w), first, rtol=0, atol=0)
    assert triton_considered.count == 1
    key = (TritonKernel.LSE_MATMUL, torch.float64, "cpu")
    assert "PassManager::run failed" in kernels.failed_kernels()[key]
    # another dtype is probed on its own
    with pytest.warns(KernelFallbackWarning, match="torch.float32"):
        kernels.log_matmul(x.float(), w.float())
    assert triton_considered.count == 2


def test_a_forced_triton_backend_propagates_the_failure(triton_considered: SimpleNamespace) -> None:
    x, w = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    with pytest.raises(CompileFailure):
        kernels.log_matmul(x, w, backend=KernelBackend.TRITON)
    assert kernels.failed_kernels() == {}


def test_every_kernel_site_falls_back_to_the_torch_result(triton_considered: SimpleNamespace) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, 9, (6, 2), generator=gen)
    uniforms = torch.rand(6, 9, generator=gen, dtype=torch.float64)
    with pytest.warns(KernelFallbackWarning):
        got = softmax.softmax_stats(logits, tokens, uniforms)
    want = softmax.softmax_stats(logits, tokens, uniforms, backend="torch")
    for mine, ref in zip(got, want, strict=True):
        torch.testing.assert_close(mine, ref, rtol=0, atol=0)

    weights = torch.rand(2, 6, 3, generator=gen, dtype=torch.float64)
    table = torch.randn(2, 2, 3, 9, generator=gen, dtype=torch.float64)
    with pytest.warns(KernelFallbackWarning):
        got_mix = softmax.softmax_mixture(weights, table, None)
    torch.testing.assert_close(got_mix, softmax.softmax_mixture(weights, table, None,
                                                                backend="torch"), rtol=0, atol=0)

    logw = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    unit = torch.tensor([[0, 2, -1], [1, 1, 0]])
    draws = torch.rand(2, 3, 5, generator=gen, dtype=torch.float64)
    with pytest.warns(KernelFallbackWarning, match="Gumbel-max"):
        children = ops.sum_child_choice(logw, unit, None, draws)
    assert torch.equal(children, ops.sum_child_choice(logw, unit, None, draws, backend="torch"))

    per_row = torch.randn(3, 2, 5, 4, generator=gen, dtype=torch.float64)
    x = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    with pytest.warns(KernelFallbackWarning, match="per-row"):
        rows = kernels.log_matmul(x, per_row)
    torch.testing.assert_close(rows, kernels.log_matmul(x, per_row, backend="torch"), rtol=0, atol=0)


def test_the_sampler_draws_the_same_children_after_a_fallback(triton_considered: SimpleNamespace) -> None:
    """The chooser's uniforms are drawn before the kernel is tried: the torch path that replaces
    it consumes the same random numbers and so draws the same sample."""
    logw = torch.randn(2, 3, 5, dtype=torch.float64)
    unit = torch.tensor([[0, 2, -1], [1, 1, 0]])
    auto = ops.GumbelChooser(torch.Generator().manual_seed(7))
    with pytest.warns(KernelFallbackWarning):
        got = ops.choose_sum_children(auto, logw, unit, None)
    reference = ops.GumbelChooser(torch.Generator().manual_seed(7))
    with kernels.use_backend("torch"):
        want = ops.choose_sum_children(reference, logw, unit, None)
    assert torch.equal(got, want)


def test_a_failing_fused_backward_falls_back_to_the_torch_gradients(
        triton_considered: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that compiles and a backward that does not: the gradients come from torch."""
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    stub = ops._fused()
    monkeypatch.setattr(stub, "lse_matmul_shared",
                        lambda a, b: torch.logsumexp(a[:, :, None, :] + b[:, None, :, :], -1))
    with pytest.warns(KernelFallbackWarning, match="backward") as caught:
        kernels.log_matmul(x, w).sum().backward()
    assert len(caught) == 1
    assert [key[0] for key in kernels.failed_kernels()] == [TritonKernel.LSE_MATMUL_BACKWARD]
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch_log_matmul(xr, wr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-12, atol=1e-12)


def test_an_untested_old_triton_is_left_to_torch_with_one_warning(
        triton_considered: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_module, "triton_version", lambda: (3, 5))
    x, w = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    with pytest.warns(KernelFallbackWarning, match=r"triton 3\.5 is older than 3\.6"):
        assert kernels.resolve_backend(x, w) is KernelBackend.TORCH
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(kernels.log_matmul(x, w), torch_log_matmul(x, w))
    assert triton_considered.count == 0
    # forcing triton still tries it (and here fails, loudly)
    with pytest.raises(CompileFailure):
        kernels.log_matmul(x, w, backend="triton")
