"""The fused operations, each with a torch path (the reference) and a triton path.

* :func:`log_matmul`: the log-space sum layer ``out[f, b, k] = log sum_d exp(x[f, b, d] +
  logw[f, k, d])`` (weights ``(F, K, D)`` shared by the batch, or ``(S, F, K, D)``: one set per
  group of ``B / S`` consecutive rows), differentiable in both arguments. One dispatch picks the
  torch path (:func:`torch_log_matmul`, the reference) or the triton path: one fused kernel
  forward and,
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

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

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
    use_triton,
)


def _fused() -> ModuleType:
    """The triton launchers (imported only when a triton path runs: triton is optional)."""
    return importlib.import_module("circuits.kernels._triton")


def rows_per_set(batch: int, sets: int) -> int:
    """How many consecutive rows of a batch of ``batch`` each of ``sets`` parameter sets serves.

    The grouped layout of per-call parameters: set ``s`` serves rows ``s * g .. (s + 1) * g - 1``
    with ``g = batch // sets`` (``sets = batch``: one set per row). No sets serve no rows.
    """
    return batch // max(sets, 1)


def _check_log_matmul(x: Tensor, logw: Tensor) -> None:
    if x.dim() != 3 or logw.dim() not in (3, 4):
        raise InvalidInputError(
            f"log_matmul needs x (F, B, D) and logw (F, K, D) or (S, F, K, D), got "
            f"{tuple(x.shape)} and {tuple(logw.shape)}")
    fold, batch, width = x.shape
    if (logw.shape[-3], logw.shape[-1]) != (fold, width) or x.dtype != logw.dtype:
        raise InvalidInputError(
            f"log_matmul: x {tuple(x.shape)} {x.dtype} does not match logw {tuple(logw.shape)} "
            f"{logw.dtype} (same dtype; shared weights (F, K, D), per-row weights (B, F, K, D) or "
            f"one set per group of rows (S, F, K, D))")
    if logw.dim() == 4 and batch % max(logw.shape[0], 1) != 0:
        raise InvalidInputError(f"log_matmul: {batch} rows cannot be split into groups for "
                                f"{logw.shape[0]} weight sets (S must divide B)")


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


class ExpWeights(NamedTuple):
    """The weight operand of :func:`torch_log_matmul`, from :func:`exp_weights`.

    ``weights``: ``exp(log_weights - max)`` as ``(F, K, D)`` or, per set, ``(F * S, K, D)``
    (fold-major, the layout of the batched matmul); ``transposed``: its ``(.., D, K)`` view;
    ``shift``: the max, ``(F, 1, K)`` or ``(F, S, 1, K)`` (0 for all ``-inf`` rows).
    """

    weights: Tensor
    transposed: Tensor
    shift: Tensor


def exp_weights(log_weights: Tensor) -> ExpWeights:
    """:class:`ExpWeights` of ``log_weights`` (F, K, D) or (S, F, K, D)."""
    w_max = log_weights.detach().amax(-1, keepdim=True).nan_to_num_(nan=0.0, posinf=0.0,
                                                                    neginf=0.0)
    weights = (log_weights - w_max).exp_()
    if weights.dim() == 3:
        return ExpWeights(weights, weights.transpose(1, 2), w_max.squeeze(-1)[:, None, :])
    sets, fold, units, width = weights.shape
    weights = weights.transpose(0, 1).reshape(fold * sets, units, width)
    return ExpWeights(weights, weights.transpose(1, 2),
                      w_max.squeeze(-1).transpose(0, 1)[:, :, None, :])


#: the weight operand, or a function making it only when the torch path runs (e.g. a cache)
WeightsLike = ExpWeights | Callable[[], ExpWeights]


def torch_log_matmul(x: Tensor, logw: Tensor, weights: WeightsLike | None = None,
                     keep: dict[str, Tensor] | None = None) -> Tensor:
    """The torch path (the reference) of :func:`log_matmul`, on unchecked operands.

    Args:
        x: (F, B, D) log-values.
        logw: (F, K, D) shared by the batch, or (S, F, K, D): one set per group of ``B // S``
            consecutive rows (:func:`rows_per_set`).
        weights: :func:`exp_weights` of ``logw`` when already computed (e.g. cached by
            :class:`~circuits.compiled.prepared.LogParameters` for several passes), or a function
            returning it.
        keep: when given, the gradient-free path stores its shifted linear-domain operands
            there: ``probs = exp(x - max)`` (F, B, D) and ``total = probs W^T`` (F, B, K), for a
            derivative pass (:mod:`circuits.compiled.derivatives`).

    Both operands are shifted by their maxima before exponentiating, so nothing overflows; rows
    whose true value is 0 come out as ``-inf`` with zero (not NaN) gradients.
    """
    grad = torch.is_grad_enabled() and (x.requires_grad or logw.requires_grad)
    # non-finite maxima (all -inf rows) shift by 0; nan_to_num avoids slow bool masks on CPU
    in_max = (x.detach() if grad else x).amax(-1, keepdim=True).nan_to_num_(
        nan=0.0, posinf=0.0, neginf=0.0)
    probs = (x - in_max).exp_()
    if callable(weights):  # made only now that the torch path runs
        weights = weights()
    w = exp_weights(logw) if weights is None else weights
    if logw.dim() == 3:
        total = torch.bmm(probs, w.transposed)  # (F, B, K)
        shift = in_max + w.shift
    else:  # one weight set per group of batch // sets consecutive rows
        fold, batch, width = probs.shape
        sets, units = logw.shape[0], logw.shape[2]
        groups = rows_per_set(batch, sets)
        total = torch.bmm(probs.reshape(fold * sets, groups, width), w.transposed)
        total = total.view(fold, batch, units)
        shift = (in_max.view(fold, sets, groups, 1) + w.shift).view(fold, batch, units)
    if grad:
        positive = total > 0  # masked so that zero rows get zero, not NaN, gradients
        safe = torch.where(positive, total, torch.ones_like(total))
        return torch.where(positive, torch.log(safe) + shift, torch.full_like(total, -torch.inf))
    # no gradient needed: the same values without bool masks (log 0 = -inf; NaN -> -inf as above)
    if keep is not None:
        keep["probs"], keep["total"] = probs, total
        out = total.log()
    else:
        out = total.log_()
    return out.add_(shift).nan_to_num_(nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf)


def triton_log_matmul(x: Tensor, logw: Tensor, backend: BackendLike | None = None) -> Tensor | None:
    """The fused :func:`log_matmul` when triton is selected for it, else ``None`` (run torch).

    Unchecked shapes: callers validate. Shared weights ``(F, K, D)`` or per-row ``(B, F, K, D)``.
    """
    kernel = TritonKernel.LSE_MATMUL if logw.dim() == 3 else TritonKernel.LSE_MATVEC_ROWS
    if not use_triton(x, logw, backend=backend, kernel=kernel):  # torch.compile: always torch
        return None
    auto = requested_backend(backend) is KernelBackend.AUTO
    return run_triton(kernel, (x, logw), lambda: TritonLogMatmul.apply(x, logw, auto), backend)


def log_matmul(x: Tensor, logw: Tensor, backend: BackendLike | None = None, *,
               weights: WeightsLike | None = None, keep: dict[str, Tensor] | None = None) -> Tensor:
    """``log(exp(x) @ exp(logw)^T)`` per fold, stable, ``-inf`` safe and differentiable.

    The one dispatch of the log-space sum layer: the fused triton kernel where it is selected for
    these operands (shared weights, or one set per row), :func:`torch_log_matmul` otherwise.

    Args:
        x: (F, B, D) log-values.
        logw: (F, K, D) shared by the batch, or (S, F, K, D) one set per group of ``B // S``
            consecutive rows (``S = B``: one set per row); x's dtype.
        backend: force a backend for this call (default: see :mod:`circuits.kernels.backend`).
        weights, keep: torch path only, see :func:`torch_log_matmul` (``weights`` is not
            computed when triton runs).

    Returns:
        (F, B, K); an all ``-inf`` row gives ``-inf`` with zero gradients, never NaN.
    """
    _check_log_matmul(x, logw)
    if logw.dim() == 3 or logw.shape[0] == x.shape[1]:
        fused = triton_log_matmul(x, logw, backend)
        if fused is not None:
            return fused
    return torch_log_matmul(x, logw, weights, keep)


def gumbel_argmax(logits: Tensor, uniforms: Tensor) -> Tensor:
    """``argmax(logits - log(-log(u)))`` in float64: an exact ``softmax(logits)`` draw per row."""
    return (logits.double() - torch.log(-torch.log(uniforms))).argmax(-1)


def rows_of(table: Tensor, unit: Tensor) -> Tensor:
    """Row ``unit[f, b]`` (>= 0) of a ``(F, K, D)`` or ``(S, F, K, D)`` table: ``(F, B, D)``.

    Per-set tables serve groups of consecutive rows (:func:`rows_per_set`; ``S = B``: one each).
    """
    fold, batch = unit.shape
    folds = torch.arange(fold, device=unit.device)[:, None]
    if table.dim() == 3:
        return table[folds, unit]
    rows = torch.arange(batch, device=unit.device)[None, :]
    if table.shape[0] != batch and batch:
        rows = rows // rows_per_set(batch, table.shape[0])
    return table[rows, folds, unit]


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
