"""The triton kernels and their launchers (imported only when a triton path actually runs).

Kernels are plain functions compiled with ``triton.jit`` on first use, once per interpreter mode
(``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps a function; the interpreter also needs it
set before triton itself is imported, see :func:`circuits.kernels.interpreter_usable`). Every kernel
flattens its whole grid into program axis 0 (no 65535 limit on the other axes) and takes element
strides, so expanded (stride-0) and other non-contiguous views are read in place.

Tensor shapes (``F`` folds, ``B`` batch, ``K`` sum units, ``D`` input units):

* :func:`lse_matmul_shared`: ``x (F, B, D)``, ``logw (F, K, D)`` -> ``(F, B, K)``;
* :func:`lse_matvec_rows`: ``x (F, B, D)``, ``logw (B, F, K, D)`` -> ``(F, B, K)``;
* :func:`gumbel_sum_choice`: ``logw (F, K, D)`` or ``(B, F, K, D)``, ``unit (F, B)``,
  ``x (F, B, D)`` or None, ``uniforms (F, B, D)`` float64 -> ``(F, B)`` long.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from torch import Tensor

from circuits.kernels.backend import interpreter_enabled

Blocks = dict[str, int]


def _lse_matmul_shared_kernel(x_ptr, w_ptr, out_ptr, B, K, D,
                              sxf, sxb, sxd, swf, swk, swd, sof, sob, sok,
                              BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_D: tl.constexpr):
    """One (fold, batch block, unit block) tile: two passes over D (maxima, then exp-dot)."""
    pid = tl.program_id(0)
    num_b = tl.cdiv(B, BLOCK_B)
    num_k = tl.cdiv(K, BLOCK_K)
    f = (pid // (num_b * num_k)).to(tl.int64)
    rest = pid % (num_b * num_k)
    offs_b = (rest // num_k) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_k = (rest % num_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_b = offs_b < B
    mask_k = offs_k < K
    x_rows = x_ptr + f * sxf + offs_b[:, None].to(tl.int64) * sxb  # (BLOCK_B, 1)
    w_cols = w_ptr + f * swf + offs_k[None, :].to(tl.int64) * swk  # (1, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    neg_inf = float("-inf")
    x_max = tl.full([BLOCK_B], neg_inf, dtype)
    w_max = tl.full([BLOCK_K], neg_inf, dtype)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        xt = tl.load(x_rows + offs_d[None, :] * sxd, mask=mask_b[:, None] & mask_d[None, :],
                     other=neg_inf)
        wt = tl.load(w_cols + offs_d[:, None] * swd, mask=mask_d[:, None] & mask_k[None, :],
                     other=neg_inf)
        x_max = tl.maximum(x_max, tl.max(xt, axis=1))
        w_max = tl.maximum(w_max, tl.max(wt, axis=0))
    # all -inf (or an infinite maximum): shift by 0, exactly as the torch reference does
    x_max = tl.where((x_max > neg_inf) & (x_max < float("inf")), x_max, 0.0)
    w_max = tl.where((w_max > neg_inf) & (w_max < float("inf")), w_max, 0.0)
    acc = tl.zeros([BLOCK_B, BLOCK_K], dtype)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        xt = tl.load(x_rows + offs_d[None, :] * sxd, mask=mask_b[:, None] & mask_d[None, :],
                     other=neg_inf)
        wt = tl.load(w_cols + offs_d[:, None] * swd, mask=mask_d[:, None] & mask_k[None, :],
                     other=neg_inf)
        p = tl.exp(xt - x_max[:, None])  # (BLOCK_B, BLOCK_D)
        q = tl.exp(wt - w_max[None, :])  # (BLOCK_D, BLOCK_K)
        acc = tl.dot(p, q, acc, input_precision="ieee")
    positive = acc > 0
    result = tl.where(positive, tl.log(tl.where(positive, acc, 1.0)) + x_max[:, None]
                      + w_max[None, :], neg_inf)
    out = out_ptr + f * sof + offs_b[:, None].to(tl.int64) * sob + offs_k[None, :] * sok
    tl.store(out, result.to(dtype), mask=mask_b[:, None] & mask_k[None, :])


def _lse_matvec_rows_kernel(x_ptr, w_ptr, out_ptr, B, K, D,
                            sxf, sxb, sxd, swb, swf, swk, swd, sof, sob, sok,
                            BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (fold, row block, unit block) tile of the per-row variant: weights differ per row.

    Tiles are 3-D ``(BLOCK_B, BLOCK_K, BLOCK_D)``: no weight is shared between rows, so this is
    a batched matrix-vector product reduced over the last axis.
    """
    pid = tl.program_id(0)
    num_b = tl.cdiv(B, BLOCK_B)
    num_k = tl.cdiv(K, BLOCK_K)
    f = (pid // (num_b * num_k)).to(tl.int64)
    rest = pid % (num_b * num_k)
    offs_b = (rest // num_k) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_k = (rest % num_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_bk = (offs_b < B)[:, None, None] & (offs_k < K)[None, :, None]  # (BLOCK_B, BLOCK_K, 1)
    rows_b = offs_b.to(tl.int64)[:, None, None]
    x_rows = x_ptr + f * sxf + rows_b * sxb  # (BLOCK_B, 1, 1)
    w_rows = w_ptr + f * swf + rows_b * swb + offs_k.to(tl.int64)[None, :, None] * swk
    dtype = out_ptr.dtype.element_ty
    neg_inf = float("-inf")
    x_max = tl.full([BLOCK_B, 1], neg_inf, dtype)
    w_max = tl.full([BLOCK_B, BLOCK_K], neg_inf, dtype)
    for d0 in range(0, D, BLOCK_D):
        offs_d = (d0 + tl.arange(0, BLOCK_D))[None, None, :]
        mask_d = offs_d < D
        xt = tl.load(x_rows + offs_d * sxd, mask=(offs_b < B)[:, None, None] & mask_d,
                     other=neg_inf)  # (BLOCK_B, 1, BLOCK_D)
        wt = tl.load(w_rows + offs_d * swd, mask=mask_bk & mask_d, other=neg_inf)
        x_max = tl.maximum(x_max, tl.max(xt, axis=2))
        w_max = tl.maximum(w_max, tl.max(wt, axis=2))
    x_max = tl.where((x_max > neg_inf) & (x_max < float("inf")), x_max, 0.0)
    w_max = tl.where((w_max > neg_inf) & (w_max < float("inf")), w_max, 0.0)
    acc = tl.zeros([BLOCK_B, BLOCK_K], dtype)
    for d0 in range(0, D, BLOCK_D):
        offs_d = (d0 + tl.arange(0, BLOCK_D))[None, None, :]
        mask_d = offs_d < D
        xt = tl.load(x_rows + offs_d * sxd, mask=(offs_b < B)[:, None, None] & mask_d,
                     other=neg_inf)
        wt = tl.load(w_rows + offs_d * swd, mask=mask_bk & mask_d, other=neg_inf)
        p = tl.exp(xt - x_max[:, :, None])  # (BLOCK_B, 1, BLOCK_D)
        q = tl.exp(wt - w_max[:, :, None])  # (BLOCK_B, BLOCK_K, BLOCK_D)
        acc += tl.sum(q * p, axis=2)
    positive = acc > 0
    result = tl.where(positive, tl.log(tl.where(positive, acc, 1.0)) + x_max + w_max, neg_inf)
    out = out_ptr + f * sof + offs_b.to(tl.int64)[:, None] * sob + offs_k[None, :] * sok
    tl.store(out, result.to(dtype), mask=(offs_b < B)[:, None] & (offs_k < K)[None, :])


def _gumbel_sum_choice_kernel(w_ptr, x_ptr, u_ptr, unit_ptr, out_ptr, B, D,
                              swb, swf, swk, swd, sxf, sxb, sxd, suf, sub, sud,
                              snf, snb, sof, sob,
                              HAS_X: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """Gumbel-max choice of a child for ``BLOCK_B`` rows of one fold (``swb = 0``: shared)."""
    pid = tl.program_id(0)
    num_b = tl.cdiv(B, BLOCK_B)
    f = (pid // num_b).to(tl.int64)
    offs_b = (pid % num_b) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    rows_b = offs_b.to(tl.int64)
    unit = tl.load(unit_ptr + f * snf + rows_b * snb, mask=mask_b, other=-1).to(tl.int64)
    active = unit >= 0
    w_rows = w_ptr + f * swf + rows_b[:, None] * swb + tl.where(active, unit, 0)[:, None] * swk
    x_rows = x_ptr + f * sxf + rows_b[:, None] * sxb
    u_rows = u_ptr + f * suf + rows_b[:, None] * sub
    neg_inf = float("-inf")
    best_val = tl.full([BLOCK_B], neg_inf, tl.float64)
    best_idx = tl.zeros([BLOCK_B], tl.int64)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = (mask_b & active)[:, None] & (offs_d < D)[None, :]
        logits = tl.load(w_rows + offs_d[None, :] * swd, mask=mask, other=neg_inf)
        if HAS_X:  # added in the parameters' dtype, then widened: as the torch path does
            logits = logits + tl.load(x_rows + offs_d[None, :] * sxd, mask=mask, other=0.0)
        uniform = tl.load(u_rows + offs_d[None, :] * sud, mask=mask, other=0.5)
        score = tl.where(mask, logits.to(tl.float64) - tl.log(-tl.log(uniform)), neg_inf)
        chunk_val = tl.max(score, axis=1)
        chunk_idx = tl.argmax(score, axis=1, tie_break_left=True).to(tl.int64) + d0
        better = chunk_val > best_val  # strict: ties keep the earlier index, like torch.argmax
        best_val = tl.where(better, chunk_val, best_val)
        best_idx = tl.where(better, chunk_idx, best_idx)
    tl.store(out_ptr + f * sof + rows_b * sob, tl.where(active, best_idx, -1), mask=mask_b)


_BUILT: dict[bool, SimpleNamespace] = {}


def kernels() -> SimpleNamespace:
    """The jitted kernels for the current interpreter mode (built once per mode)."""
    mode = interpreter_enabled()
    if mode not in _BUILT:
        _BUILT[mode] = SimpleNamespace(
            shared=triton.jit(_lse_matmul_shared_kernel),
            rows=triton.jit(_lse_matvec_rows_kernel),
            choice=triton.jit(_gumbel_sum_choice_kernel))
    return _BUILT[mode]


def _block(n: int, low: int, high: int) -> int:
    """A power of two in ``[low, high]`` covering ``n`` where possible."""
    return max(low, min(high, triton.next_power_of_2(max(n, 1))))


def lse_matmul_shared(x: Tensor, logw: Tensor, blocks: Blocks | None = None) -> Tensor:
    """``out[f, b, k] = log sum_d exp(x[f, b, d] + logw[f, k, d])``: ``(F, B, K)``."""
    fold, batch, width = x.shape
    units = logw.shape[1]
    out = torch.empty(fold, batch, units, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    high_d = 32 if x.dtype == torch.float32 else 16
    sizes = {"BLOCK_B": _block(batch, 16, 64), "BLOCK_K": _block(units, 16, 64),
             "BLOCK_D": _block(width, 16, high_d), **(blocks or {})}
    grid = (fold * triton.cdiv(batch, sizes["BLOCK_B"]) * triton.cdiv(units, sizes["BLOCK_K"]),)
    kernels().shared[grid](x, logw, out, batch, units, width, *x.stride(), *logw.stride(),
                           *out.stride(), **sizes)
    return out


def lse_matvec_rows(x: Tensor, logw: Tensor, blocks: Blocks | None = None) -> Tensor:
    """``out[f, b, k] = log sum_d exp(x[f, b, d] + logw[b, f, k, d])``: ``(F, B, K)``."""
    fold, batch, width = x.shape
    units = logw.shape[2]
    out = torch.empty(fold, batch, units, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_k, block_d = _block(units, 16, 64), _block(width, 16, 64)
    block_b = _block(batch, 1, max(1, 8192 // (block_k * block_d)))
    sizes = {"BLOCK_B": block_b, "BLOCK_K": block_k, "BLOCK_D": block_d, **(blocks or {})}
    grid = (fold * triton.cdiv(batch, sizes["BLOCK_B"]) * triton.cdiv(units, sizes["BLOCK_K"]),)
    kernels().rows[grid](x, logw, out, batch, units, width, *x.stride(), *logw.stride(),
                         *out.stride(), **sizes)
    return out


def gumbel_sum_choice(logw: Tensor, unit: Tensor, x: Tensor | None, uniforms: Tensor,
                      blocks: Blocks | None = None) -> Tensor:
    """Child ``argmax_d(logw[.., f, unit, d] + x[f, b, d] - log(-log(u)))`` or -1: ``(F, B)``."""
    fold, batch = unit.shape
    width = logw.shape[-1]
    out = torch.empty(fold, batch, dtype=torch.long, device=unit.device)
    if out.numel() == 0:
        return out
    block_d = _block(width, 16, 128)
    sizes = {"BLOCK_B": max(1, min(64, 4096 // block_d)), "BLOCK_D": block_d, **(blocks or {})}
    w_strides = (0, *logw.stride()) if logw.dim() == 3 else logw.stride()
    x_arg, x_strides = (logw, (0, 0, 0)) if x is None else (x, x.stride())
    grid = (fold * triton.cdiv(batch, sizes["BLOCK_B"]),)
    kernels().choice[grid](logw, x_arg, uniforms, unit, out, batch, width, *w_strides, *x_strides,
                           *uniforms.stride(), *unit.stride(), *out.stride(),
                           HAS_X=x is not None, **sizes)
    return out
