"""The triton kernels and their launchers (imported only when a triton path actually runs).

Kernels are plain functions, jitted and launched through :mod:`circuits.kernels._triton_launch`
(once per interpreter mode; the interpreter also needs ``TRITON_INTERPRET`` set before triton
itself is imported, see :func:`circuits.kernels.interpreter_usable`). Every kernel
flattens its whole grid into program axis 0 (no 65535 limit on the other axes) and takes element
strides, so expanded (stride-0) and other non-contiguous views are read in place.

Tensor shapes (``F`` folds, ``B`` batch, ``K`` sum units, ``D`` input units):

* :func:`lse_matmul_shared`: ``x (F, B, D)``, ``logw (F, K, D)`` -> ``(F, B, K)``;
* :func:`lse_matvec_rows`: ``x (F, B, D)``, ``logw (B, F, K, D)`` -> ``(F, B, K)``;
* :func:`lse_matmul_shared_backward`: the gradients of :func:`lse_matmul_shared` with respect to
  ``x`` and ``logw`` from ``out`` and the upstream ``grad`` (both ``(F, B, K)``), two tiled
  products whose operands are exponentiated on the fly;
* :func:`gumbel_sum_choice`: ``logw (F, K, D)`` or ``(B, F, K, D)``, ``unit (F, B)``,
  ``x (F, B, D)`` or None, ``uniforms (F, B, D)`` float64 -> ``(F, B)`` long.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from circuits.kernels._triton_launch import Blocks, KernelLaunch, block, launch, uses_dot


def _lse_matmul_shared_kernel(x_ptr, w_ptr, out_ptr, B, K, D,
                              sxf, sxb, sxd, swf, swk, swd, sof, sob, sok,
                              BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr):
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
    # elementwise running maxima, reduced once after the loop (a reduction inside the loop
    # crashes triton 3.6's TritonGPUOptimizeThreadLocality pass)
    x_hi = tl.full([BLOCK_B, BLOCK_D], neg_inf, dtype)
    w_hi = tl.full([BLOCK_D, BLOCK_K], neg_inf, dtype)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        xt = tl.load(x_rows + offs_d[None, :] * sxd, mask=mask_b[:, None] & mask_d[None, :],
                     other=neg_inf)
        wt = tl.load(w_cols + offs_d[:, None] * swd, mask=mask_d[:, None] & mask_k[None, :],
                     other=neg_inf)
        x_hi = tl.maximum(x_hi, xt)
        w_hi = tl.maximum(w_hi, wt)
    x_max = tl.max(x_hi, axis=1)
    w_max = tl.max(w_hi, axis=0)
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
        if USE_DOT:
            acc = tl.dot(p, q, acc, input_precision="ieee")
        else:  # float64: tl.dot does not compile before triton 3.9
            acc += tl.sum(p[:, :, None] * q[None, :, :], axis=1)
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
    x_hi = tl.full([BLOCK_B, 1, BLOCK_D], neg_inf, dtype)  # running maxima, reduced after
    w_hi = tl.full([BLOCK_B, BLOCK_K, BLOCK_D], neg_inf, dtype)
    for d0 in range(0, D, BLOCK_D):
        offs_d = (d0 + tl.arange(0, BLOCK_D))[None, None, :]
        mask_d = offs_d < D
        xt = tl.load(x_rows + offs_d * sxd, mask=(offs_b < B)[:, None, None] & mask_d,
                     other=neg_inf)  # (BLOCK_B, 1, BLOCK_D)
        wt = tl.load(w_rows + offs_d * swd, mask=mask_bk & mask_d, other=neg_inf)
        x_hi = tl.maximum(x_hi, xt)
        w_hi = tl.maximum(w_hi, wt)
    x_max = tl.max(x_hi, axis=2)  # (BLOCK_B, 1)
    w_max = tl.max(w_hi, axis=2)  # (BLOCK_B, BLOCK_K)
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


def _lse_matmul_grad_x_kernel(x_ptr, w_ptr, out_ptr, grad_ptr, xmax_ptr, wmax_ptr, dx_ptr,
                              B, K, D, sxf, sxb, sxd, swf, swk, swd, sof, sob, sok,
                              sgf, sgb, sgk, smf, smb, snf, snk, sdf, sdb, sdd,
                              BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr):
    """``dx[f, b, d] = exp(x - x_max) * sum_k G[f, b, k] exp(logw[f, k, d] - w_max[f, k])`` with
    ``G = grad * exp(x_max + w_max - out)`` (0 where ``out = -inf``)."""
    pid = tl.program_id(0)
    num_b = tl.cdiv(B, BLOCK_B)
    num_d = tl.cdiv(D, BLOCK_D)
    f = (pid // (num_b * num_d)).to(tl.int64)
    rest = pid % (num_b * num_d)
    offs_b = (rest // num_d) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_d = (rest % num_d) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_b = offs_b < B
    mask_d = offs_d < D
    rows = offs_b.to(tl.int64)
    neg_inf = float("-inf")
    x_max = tl.load(xmax_ptr + f * smf + rows * smb, mask=mask_b, other=0.0)
    dtype = dx_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask_bk = mask_b[:, None] & mask_k[None, :]
        w_max = tl.load(wmax_ptr + f * snf + offs_k * snk, mask=mask_k, other=0.0)
        grad = tl.load(grad_ptr + f * sgf + rows[:, None] * sgb + offs_k[None, :] * sgk,
                       mask=mask_bk, other=0.0)
        out = tl.load(out_ptr + f * sof + rows[:, None] * sob + offs_k[None, :] * sok,
                      mask=mask_bk, other=neg_inf)
        finite = out > neg_inf
        scale = tl.where(finite, grad * tl.exp(x_max[:, None] + w_max[None, :]
                                               - tl.where(finite, out, 0.0)), 0.0)
        w = tl.load(w_ptr + f * swf + offs_k[:, None] * swk + offs_d[None, :] * swd,
                    mask=mask_k[:, None] & mask_d[None, :], other=neg_inf)
        q = tl.exp(w - w_max[:, None])  # (BLOCK_K, BLOCK_D)
        if USE_DOT:
            acc = tl.dot(scale, q, acc, input_precision="ieee")
        else:
            acc += tl.sum(scale[:, :, None] * q[None, :, :], axis=1)
    mask_bd = mask_b[:, None] & mask_d[None, :]
    x = tl.load(x_ptr + f * sxf + rows[:, None] * sxb + offs_d[None, :] * sxd, mask=mask_bd,
                other=neg_inf)
    tl.store(dx_ptr + f * sdf + rows[:, None] * sdb + offs_d[None, :] * sdd,
             (tl.exp(x - x_max[:, None]) * acc).to(dtype), mask=mask_bd)


def _lse_matmul_grad_w_kernel(x_ptr, w_ptr, out_ptr, grad_ptr, xmax_ptr, wmax_ptr, dw_ptr,
                              B, K, D, sxf, sxb, sxd, swf, swk, swd, sof, sob, sok,
                              sgf, sgb, sgk, smf, smb, snf, snk, sdf, sdk, sdd,
                              BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr):
    """``dlogw[f, k, d] = exp(logw - w_max) * sum_b G[f, b, k] exp(x[f, b, d] - x_max[f, b])``."""
    pid = tl.program_id(0)
    num_k = tl.cdiv(K, BLOCK_K)
    num_d = tl.cdiv(D, BLOCK_D)
    f = (pid // (num_k * num_d)).to(tl.int64)
    rest = pid % (num_k * num_d)
    offs_k = (rest // num_d) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = (rest % num_d) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_k = offs_k < K
    mask_d = offs_d < D
    neg_inf = float("-inf")
    w_max = tl.load(wmax_ptr + f * snf + offs_k * snk, mask=mask_k, other=0.0)
    dtype = dw_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_K, BLOCK_D], dtype)
    for b0 in range(0, B, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        mask_b = offs_b < B
        rows = offs_b.to(tl.int64)
        mask_kb = mask_k[:, None] & mask_b[None, :]
        x_max = tl.load(xmax_ptr + f * smf + rows * smb, mask=mask_b, other=0.0)
        grad_t = tl.load(grad_ptr + f * sgf + rows[None, :] * sgb + offs_k[:, None] * sgk,
                         mask=mask_kb, other=0.0)  # (BLOCK_K, BLOCK_B)
        out_t = tl.load(out_ptr + f * sof + rows[None, :] * sob + offs_k[:, None] * sok,
                        mask=mask_kb, other=neg_inf)
        finite = out_t > neg_inf
        scale_t = tl.where(finite, grad_t * tl.exp(x_max[None, :] + w_max[:, None]
                                                   - tl.where(finite, out_t, 0.0)), 0.0)
        x = tl.load(x_ptr + f * sxf + rows[:, None] * sxb + offs_d[None, :] * sxd,
                    mask=mask_b[:, None] & mask_d[None, :], other=neg_inf)
        p = tl.exp(x - x_max[:, None])  # (BLOCK_B, BLOCK_D)
        if USE_DOT:
            acc = tl.dot(scale_t, p, acc, input_precision="ieee")
        else:
            acc += tl.sum(scale_t[:, :, None] * p[None, :, :], axis=1)
    mask_kd = mask_k[:, None] & mask_d[None, :]
    w = tl.load(w_ptr + f * swf + offs_k[:, None] * swk + offs_d[None, :] * swd, mask=mask_kd,
                other=neg_inf)
    tl.store(dw_ptr + f * sdf + offs_k[:, None] * sdk + offs_d[None, :] * sdd,
             (tl.exp(w - w_max[:, None]) * acc).to(dtype), mask=mask_kd)


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


def lse_matmul_shared_blocks(dtype: torch.dtype, batch: int, units: int, width: int) -> Blocks:
    """Tile sizes of :func:`lse_matmul_shared` and its backward (float64 tiles are smaller: its
    products are broadcast, see :func:`~circuits.kernels._triton_launch.uses_dot`)."""
    if uses_dot(dtype):
        return {"BLOCK_B": block(batch, 16, 64), "BLOCK_K": block(units, 16, 64),
                "BLOCK_D": block(width, 16, 32)}
    return {"BLOCK_B": block(batch, 16, 32), "BLOCK_K": block(units, 16, 32),
            "BLOCK_D": block(width, 8, 8)}


def lse_matvec_rows_blocks(batch: int, units: int, width: int) -> Blocks:
    """Tile sizes of :func:`lse_matvec_rows`: at most 8192 elements in a 3-D tile."""
    block_k, block_d = block(units, 16, 64), block(width, 16, 64)
    return {"BLOCK_B": block(batch, 1, max(1, 8192 // (block_k * block_d))), "BLOCK_K": block_k,
            "BLOCK_D": block_d}


def gumbel_sum_choice_blocks(width: int) -> Blocks:
    """Tile sizes of :func:`gumbel_sum_choice`."""
    block_d = block(width, 16, 128)
    return {"BLOCK_B": max(1, min(64, 4096 // block_d)), "BLOCK_D": block_d}


def lse_matmul_shared(x: Tensor, logw: Tensor, blocks: Blocks | None = None) -> Tensor:
    """``out[f, b, k] = log sum_d exp(x[f, b, d] + logw[f, k, d])``: ``(F, B, K)``."""
    fold, batch, width = x.shape
    units = logw.shape[1]
    out = torch.empty(fold, batch, units, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    sizes = {**lse_matmul_shared_blocks(x.dtype, batch, units, width), **(blocks or {})}
    grid = (fold * triton.cdiv(batch, sizes["BLOCK_B"]) * triton.cdiv(units, sizes["BLOCK_K"]),)
    launch(KernelLaunch(_lse_matmul_shared_kernel, grid,
                        (x, logw, out, batch, units, width, *x.stride(), *logw.stride(),
                         *out.stride()), {**sizes, "USE_DOT": uses_dot(x.dtype)}))
    return out


def lse_matvec_rows(x: Tensor, logw: Tensor, blocks: Blocks | None = None) -> Tensor:
    """``out[f, b, k] = log sum_d exp(x[f, b, d] + logw[b, f, k, d])``: ``(F, B, K)``."""
    fold, batch, width = x.shape
    units = logw.shape[2]
    out = torch.empty(fold, batch, units, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    sizes = {**lse_matvec_rows_blocks(batch, units, width), **(blocks or {})}
    grid = (fold * triton.cdiv(batch, sizes["BLOCK_B"]) * triton.cdiv(units, sizes["BLOCK_K"]),)
    launch(KernelLaunch(_lse_matvec_rows_kernel, grid,
                        (x, logw, out, batch, units, width, *x.stride(), *logw.stride(),
                         *out.stride()), sizes))
    return out


def lse_matmul_shared_backward(x: Tensor, logw: Tensor, out: Tensor, grad: Tensor,
                               x_max: Tensor, w_max: Tensor, needs: tuple[bool, bool],
                               blocks: Blocks | None = None) -> tuple[Tensor | None, ...]:
    """Gradients of ``out = lse_matmul_shared(x, logw)``: ``dx (F, B, D)``, ``dlogw (F, K, D)``.

    ``x_max`` (F, B) and ``w_max`` (F, K) are the finite row maxima the forward shifted by
    (0 for rows without a finite maximum), as in
    :func:`circuits.kernels.ops.log_matmul_backward`.
    """
    fold, batch, width = x.shape
    units = logw.shape[1]
    sizes = {**lse_matmul_shared_blocks(x.dtype, batch, units, width), **(blocks or {}),
             "USE_DOT": uses_dot(x.dtype)}
    common = (x, logw, out, grad, x_max, w_max)
    strides = (*x.stride(), *logw.stride(), *out.stride(), *grad.stride(), *x_max.stride(),
               *w_max.stride())
    grad_x = grad_w = None
    if needs[0]:
        grad_x = torch.empty(fold, batch, width, dtype=x.dtype, device=x.device)
        if grad_x.numel():
            grid = (fold * triton.cdiv(batch, sizes["BLOCK_B"]) * triton.cdiv(width, sizes["BLOCK_D"]),)
            launch(KernelLaunch(_lse_matmul_grad_x_kernel, grid,
                                (*common, grad_x, batch, units, width, *strides,
                                 *grad_x.stride()), sizes))
    if needs[1]:
        grad_w = torch.empty(fold, units, width, dtype=x.dtype, device=x.device)
        if grad_w.numel():
            grid = (fold * triton.cdiv(units, sizes["BLOCK_K"]) * triton.cdiv(width, sizes["BLOCK_D"]),)
            launch(KernelLaunch(_lse_matmul_grad_w_kernel, grid,
                                (*common, grad_w, batch, units, width, *strides,
                                 *grad_w.stride()), sizes))
    return grad_x, grad_w


def gumbel_sum_choice(logw: Tensor, unit: Tensor, x: Tensor | None, uniforms: Tensor,
                      blocks: Blocks | None = None) -> Tensor:
    """Child ``argmax_d(logw[.., f, unit, d] + x[f, b, d] - log(-log(u)))`` or -1: ``(F, B)``."""
    fold, batch = unit.shape
    width = logw.shape[-1]
    out = torch.empty(fold, batch, dtype=torch.long, device=unit.device)
    if out.numel() == 0:
        return out
    sizes = {**gumbel_sum_choice_blocks(width), **(blocks or {})}
    w_strides = (0, *logw.stride()) if logw.dim() == 3 else logw.stride()
    x_arg, x_strides = (logw, (0, 0, 0)) if x is None else (x, x.stride())
    grid = (fold * triton.cdiv(batch, sizes["BLOCK_B"]),)
    launch(KernelLaunch(_gumbel_sum_choice_kernel, grid,
                        (logw, x_arg, uniforms, unit, out, batch, width, *w_strides, *x_strides,
                         *uniforms.stride(), *unit.stride(), *out.stride()),
                        {"HAS_X": x is not None, **sizes}))
    return out
