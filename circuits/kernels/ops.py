"""The fused operations, each with a torch path (the reference) and a triton path.

* :func:`log_matmul`: the log-space sum layer ``out[f, b, k] = log sum_d exp(x[f, b, d] +
  logw[f, k, d])`` (weights ``(F, K, D)`` shared by the batch, or ``(B, F, K, D)`` one set per
  row), differentiable in both arguments. The torch path is
  :func:`circuits.compiled.layers.log_matmul`; the triton path is one fused kernel forward and,
  for shared weights, two fused kernels backward (``dx`` and ``dlogw``, exponentials computed on
  the fly); per-row weights and double backward (``create_graph=True``) use the exact torch math
  of :func:`log_matmul_backward`, the expression autograd derives for the torch path.
* :func:`sum_child_choice`: the top-down sampling step through a sum fold: per ``(f, b)`` a
  chosen unit (or -1), logits ``logw[f, unit, :] + x[f, b, :]``, and the child drawn by Gumbel-max
  from uniforms the caller supplies, so both paths consume the same random numbers and return the
  same children.
* :class:`GumbelChooser`: the sampler's chooser; :func:`choose_sum_children` lets the top-down
  pass use the fused step whenever the triton backend is selected.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor

from circuits.errors import InvalidInputError
from circuits.kernels.backend import (
    BackendLike,
    KernelBackend,
    TritonKernel,
    record_failure,
    requested_backend,
    run_triton,
    use_backend,
    use_triton,
)


def _fused() -> ModuleType:
    """The triton launchers (imported only when a triton path runs: triton is optional)."""
    from circuits.kernels import _triton

    return _triton


def _check_log_matmul(x: Tensor, logw: Tensor) -> None:
    if x.dim() != 3 or logw.dim() not in (3, 4):
        raise InvalidInputError(
            f"log_matmul needs x (F, B, D) and logw (F, K, D) or (B, F, K, D), got "
            f"{tuple(x.shape)} and {tuple(logw.shape)}")
    fold, batch, width = x.shape
    expected = (fold, width) if logw.dim() == 3 else (batch, fold, width)
    got = (logw.shape[0], logw.shape[2]) if logw.dim() == 3 else (*logw.shape[:2], logw.shape[3])
    if tuple(got) != expected or x.dtype != logw.dtype:
        raise InvalidInputError(
            f"log_matmul: x {tuple(x.shape)} {x.dtype} does not match logw {tuple(logw.shape)} "
            f"{logw.dtype} (same dtype; shared weights (F, K, D), per-row weights (B, F, K, D))")


def _finite_max(t: Tensor) -> Tensor:
    """``amax`` over the last dim (kept), with infinite maxima replaced by 0 (no grad)."""
    peak = t.detach().amax(-1, keepdim=True)
    return torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))


def log_matmul_backward(x: Tensor, logw: Tensor, out: Tensor, grad: Tensor,
                        needs: tuple[bool, bool] = (True, True)) -> tuple[Tensor | None, ...]:
    """Exact gradients of ``out = log_matmul(x, logw)`` w.r.t. ``x`` and ``logw``.

    With ``P = exp(x - max_d x)``, ``W = exp(logw - max_d logw)`` and ``G = grad * exp(shift -
    out)`` (``= grad / sum_d P W``, and 0 where ``out = -inf``, as for the torch path):
    ``dx = P * (G @ W)`` and ``dlogw = W * (G^T @ P)`` (per-row weights: ``W * G P``).

    Args:
        x: (F, B, D); logw: (F, K, D) or (B, F, K, D); out, grad: (F, B, K).
        needs: which of the two gradients to compute (the other is returned as None).
    """
    x_max, w_max = _finite_max(x), _finite_max(logw)
    probs = torch.exp(x - x_max)  # (F, B, D)
    weights = torch.exp(logw - w_max)
    if logw.dim() == 3:
        shift = x_max + w_max.squeeze(-1)[:, None, :]
    else:
        shift = x_max + w_max.squeeze(-1).transpose(0, 1)
    finite = out > -torch.inf
    scale = torch.where(finite, grad * torch.exp(shift - torch.where(finite, out, shift)),
                        torch.zeros_like(grad))  # (F, B, K)
    grad_x = grad_w = None
    if logw.dim() == 3:
        if needs[0]:
            grad_x = probs * torch.bmm(scale, weights)
        if needs[1]:
            grad_w = weights * torch.bmm(scale.transpose(1, 2), probs)
    else:
        fold, batch, width = x.shape
        if needs[0]:
            w_rows = weights.transpose(0, 1).reshape(fold * batch, -1, width)  # (F*B, K, D)
            mixed = torch.bmm(scale.reshape(fold * batch, 1, -1), w_rows)
            grad_x = probs * mixed.view(fold, batch, width)
        if needs[1]:
            per_row = scale.transpose(0, 1)[..., None]  # (B, F, K, 1)
            grad_w = weights * per_row * probs.transpose(0, 1)[:, :, None, :]
    return grad_x, grad_w


class TritonLogMatmul(torch.autograd.Function):
    """Fused triton forward of :func:`log_matmul`; fused backward for shared weights.

    ``apply(x, logw, auto)``: with ``auto`` (the ``AUTO`` backend chose triton) a backward kernel
    that fails falls back to the torch math, as :func:`~circuits.kernels.backend.run_triton` does.
    """

    @staticmethod
    def forward(ctx, x: Tensor, logw: Tensor, auto: bool = False) -> Tensor:  # type: ignore[override]
        launch = _fused().lse_matmul_shared if logw.dim() == 3 else _fused().lse_matvec_rows
        out = launch(x, logw)
        ctx.save_for_backward(x, logw, out)
        ctx.auto = auto
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, logw, out = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:2])
        kernel = TritonKernel.LSE_MATMUL_BACKWARD
        fused = logw.dim() == 3 and not torch.is_grad_enabled() and (
            not ctx.auto or use_triton(x, logw, kernel=kernel))
        if fused:
            # no (F, B, D) / (F, K, D) exponentials or (F, B, K) scales are written. Under
            # create_graph (double backward) the differentiable torch math runs instead.
            x_max, w_max = _finite_max(x).squeeze(-1), _finite_max(logw).squeeze(-1)
            try:
                return (*_fused().lse_matmul_shared_backward(x, logw, out, grad.contiguous(),
                                                             x_max, w_max, needs), None)
            except Exception as error:
                if not ctx.auto:
                    raise
                record_failure(kernel, (x, logw), error)
        return (*log_matmul_backward(x, logw, out, grad, needs), None)


def triton_log_matmul(x: Tensor, logw: Tensor, backend: BackendLike | None = None) -> Tensor | None:
    """The fused :func:`log_matmul` when triton is selected for it, else ``None`` (run torch).

    Unchecked shapes: callers validate. Shared weights ``(F, K, D)`` or per-row ``(B, F, K, D)``.
    """
    kernel = TritonKernel.LSE_MATMUL if logw.dim() == 3 else TritonKernel.LSE_MATVEC_ROWS
    auto = requested_backend(backend) is KernelBackend.AUTO
    return run_triton(kernel, (x, logw), lambda: TritonLogMatmul.apply(x, logw, auto), backend)


def log_matmul(x: Tensor, logw: Tensor, backend: BackendLike | None = None) -> Tensor:
    """``log(exp(x) @ exp(logw)^T)`` per fold, stable, ``-inf`` safe and differentiable.

    Args:
        x: (F, B, D) log-values.
        logw: (F, K, D) shared by the batch, or (B, F, K, D) one set per row; x's dtype.
        backend: force a backend for this call (default: see :mod:`circuits.kernels.backend`).

    Returns:
        (F, B, K); an all ``-inf`` row gives ``-inf`` with zero gradients, never NaN.
    """
    _check_log_matmul(x, logw)
    fused = triton_log_matmul(x, logw, backend)
    if fused is not None:
        return fused
    from circuits.compiled.layers import log_matmul as torch_log_matmul

    with use_backend(KernelBackend.TORCH):  # the layer's own dispatch must not pick triton
        return torch_log_matmul(x, logw)


def gumbel_argmax(logits: Tensor, uniforms: Tensor) -> Tensor:
    """``argmax(logits - log(-log(u)))`` in float64: an exact ``softmax(logits)`` draw per row."""
    return (logits.double() - torch.log(-torch.log(uniforms))).argmax(-1)


def rows_of(table: Tensor, unit: Tensor) -> Tensor:
    """Row ``unit[f, b]`` (>= 0) of a ``(F, K, D)`` or ``(B, F, K, D)`` table: ``(F, B, D)``."""
    fold, batch = unit.shape
    folds = torch.arange(fold, device=unit.device)[:, None]
    if table.dim() == 3:
        return table[folds, unit]
    return table[torch.arange(batch, device=unit.device)[None, :], folds, unit]


def _check_choice(logw: Tensor, unit: Tensor, x: Tensor | None, uniforms: Tensor) -> None:
    if unit.dim() != 2 or unit.dtype != torch.long or logw.dim() not in (3, 4):
        raise InvalidInputError(
            f"sum_child_choice needs unit (F, B) long and logw (F, K, D) or (B, F, K, D), got "
            f"{tuple(unit.shape)} {unit.dtype} and {tuple(logw.shape)}")
    fold, batch = unit.shape
    width = logw.shape[-1]
    lead = (fold,) if logw.dim() == 3 else (batch, fold)
    if tuple(logw.shape[:-2]) != lead:
        raise InvalidInputError(f"logw {tuple(logw.shape)} does not match unit {tuple(unit.shape)}")
    if x is not None and (tuple(x.shape) != (fold, batch, width) or x.dtype != logw.dtype):
        raise InvalidInputError(
            f"x must be ({fold}, {batch}, {width}) {logw.dtype}, got {tuple(x.shape)} {x.dtype}")
    if tuple(uniforms.shape) != (fold, batch, width) or uniforms.dtype != torch.float64:
        raise InvalidInputError(
            f"uniforms must be ({fold}, {batch}, {width}) float64, got {tuple(uniforms.shape)} "
            f"{uniforms.dtype}")


@torch.no_grad()
def sum_child_choice(logw: Tensor, unit: Tensor, x: Tensor | None, uniforms: Tensor,
                     backend: BackendLike | None = None) -> Tensor:
    """One Gumbel-max step through a sum fold: the chosen input unit per ``(f, b)``.

    Args:
        logw: (F, K, D) or (B, F, K, D) log-weights.
        unit: (F, B) long, the chosen sum unit, or -1 where the fold is not visited.
        x: (F, B, D) the fold's input log-values (conditional sampling), or None.
        uniforms: (F, B, D) float64 in [0, 1) (``torch.rand``), one per candidate child.
        backend: force a backend for this call.

    Returns:
        (F, B) long: ``argmax_d(logw[f, unit, d] + x[f, b, d] - log(-log(u[f, b, d])))``
        (logits added in the parameters' dtype, the noise in float64; first index on ties), and
        -1 where ``unit`` is -1. Both backends return the same children for the same uniforms.
    """
    _check_choice(logw, unit, x, uniforms)
    tensors = (logw, unit, uniforms) if x is None else (logw, unit, uniforms, x)
    fused = run_triton(TritonKernel.GUMBEL_SUM_CHOICE, tensors,
                       lambda: _fused().gumbel_sum_choice(logw, unit, x, uniforms), backend)
    if fused is not None:
        return fused
    logits = rows_of(logw, unit.clamp(min=0))
    if x is not None:
        logits = logits + x
    return torch.where(unit >= 0, gumbel_argmax(logits, uniforms), -1)


class GumbelChooser:
    """Exact sampling chooser: ``argmax(logits + Gumbel)`` with float64 uniforms from a generator.

    Calling it on logits ``(..., D)`` draws ``torch.rand`` of that shape; :meth:`uniforms` draws
    the same numbers for the fused sum step, so both consume the generator identically.
    """

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator

    def uniforms(self, shape: tuple[int, ...], device: torch.device) -> Tensor:
        return torch.rand(shape, generator=self.generator, dtype=torch.float64, device=device)

    def __call__(self, logits: Tensor) -> Tensor:
        return gumbel_argmax(logits, self.uniforms(tuple(logits.shape), logits.device))


def choose_sum_children(choose: Callable[[Tensor], Tensor], logw: Tensor, unit: Tensor,
                        x: Tensor | None) -> Tensor:
    """The top-down step through a sum fold with any chooser: ``(F, B)`` child or -1.

    A :class:`GumbelChooser` on the triton backend runs the fused kernel; every other case builds
    the logits ``(F, B, D)`` and calls ``choose`` on them (the torch path).
    """
    tensors = (logw, unit) if x is None else (logw, unit, x)
    if isinstance(choose, GumbelChooser) and \
            use_triton(*tensors, kernel=TritonKernel.GUMBEL_SUM_CHOICE):
        # the same uniforms either way: should AUTO fall back inside, torch draws the same child
        shape = (*unit.shape, logw.shape[-1])
        return sum_child_choice(logw, unit, x, choose.uniforms(shape, unit.device))
    logits = rows_of(logw, unit.clamp(min=0))
    if x is not None:
        logits = logits + x
    return torch.where(unit >= 0, choose(logits), -1)
