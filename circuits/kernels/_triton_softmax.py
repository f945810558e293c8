"""Triton kernels over categorical logits (imported only when a triton path actually runs).

Both kernels read logits and never write a ``softmax`` or ``log_softmax`` table: a head's input
layers hold ``n r`` categorical distributions over the vocabulary, and a decoding round needs only
a few numbers from each (see :mod:`circuits.kernels.softmax`).

* :func:`softmax_stats`: ``logits (R, C)`` -> per row the log-normaliser, the log-probabilities
  of up to ``T`` given categories, and optionally a Gumbel-max draw with its log-probability,
  in one pass over ``C`` (online max-shifted sum).
* :func:`softmax_mixture`: ``weights (F, S * R, K)``, ``logits (S, F, K, C)`` and their
  log-normalisers -> ``out[f, s R + b, c] = sum_k w[f, s R + b, k] softmax(logits[s, f, k])[c]``,
  a tiled matrix product whose right operand is exponentiated on the fly.

Every kernel flattens its grid into program axis 0 and takes element strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from circuits.kernels._triton_launch import Blocks, KernelLaunch, block, launch, uses_dot


def _softmax_stats_kernel(x_ptr, tok_ptr, u_ptr, lse_ptr, logp_ptr, draw_ptr, draw_logp_ptr,
                          R, C, T, sxr, sxc, str_, stt, sur, suc, slr, spr, spt,
                          HAS_TOKENS: tl.constexpr, HAS_DRAW: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """``BLOCK_R`` rows: one pass over the categories for the normaliser and the Gumbel-max draw,
    then the requested entries."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < R
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * sxr
    dtype = lse_ptr.dtype.element_ty
    neg_inf = float("-inf")
    peak = tl.full([BLOCK_R], neg_inf, dtype)
    total = tl.zeros([BLOCK_R], dtype)
    best_val = tl.full([BLOCK_R], neg_inf, tl.float64)
    best_idx = tl.zeros([BLOCK_R], tl.int64)
    best_logit = tl.full([BLOCK_R], neg_inf, dtype)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = mask_r[:, None] & (cols < C)[None, :]
        x = tl.load(x_rows + cols[None, :] * sxc, mask=mask, other=neg_inf)
        new_peak = tl.maximum(peak, tl.max(x, axis=1))
        finite = new_peak > neg_inf
        shift = tl.where(finite, new_peak, 0.0)
        total = total * tl.exp(tl.where(finite, peak - shift, 0.0)) \
            + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        peak = new_peak
        if HAS_DRAW:
            u = tl.load(u_ptr + rows64[:, None] * sur + cols[None, :] * suc, mask=mask, other=0.5)
            score = tl.where(mask, x.to(tl.float64) - tl.log(-tl.log(u)), neg_inf)
            chunk_val = tl.max(score, axis=1)
            chunk_idx = tl.argmax(score, axis=1, tie_break_left=True)
            chunk_logit = tl.sum(tl.where(cols[None, :] == (c0 + chunk_idx)[:, None], x, 0.0),
                                 axis=1)
            better = chunk_val > best_val  # strict: ties keep the earlier index, like torch
            best_val = tl.where(better, chunk_val, best_val)
            best_idx = tl.where(better, chunk_idx.to(tl.int64) + c0, best_idx)
            best_logit = tl.where(better, chunk_logit, best_logit)
    lse = tl.where(peak > neg_inf, peak + tl.log(total), neg_inf)
    tl.store(lse_ptr + rows64 * slr, lse.to(dtype), mask=mask_r)
    has_mass = lse > neg_inf
    if HAS_DRAW:
        tl.store(draw_ptr + rows64, best_idx, mask=mask_r)
        tl.store(draw_logp_ptr + rows64,
                 tl.where(has_mass, best_logit - lse, neg_inf).to(dtype), mask=mask_r)
    if HAS_TOKENS:
        for t0 in range(0, T, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            mask_t = mask_r[:, None] & (offs_t < T)[None, :]
            tokens = tl.load(tok_ptr + rows64[:, None] * str_ + offs_t[None, :] * stt,
                             mask=mask_t, other=0).to(tl.int64)
            picked = tl.load(x_rows + tokens * sxc, mask=mask_t, other=neg_inf)
            logp = tl.where(has_mass[:, None], picked - lse[:, None], neg_inf)
            tl.store(logp_ptr + rows64[:, None] * spr + offs_t[None, :] * spt, logp.to(dtype),
                     mask=mask_t)


def _softmax_mixture_kernel(w_ptr, x_ptr, lse_ptr, out_ptr, S, R, K, C,
                            swf, swb, swk, sxs, sxf, sxk, sxc, sls, slf, slk, sof, sob, soc,
                            HAS_LSE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_C: tl.constexpr, USE_DOT: tl.constexpr):
    """One (fold, set, row block, category block) tile of ``W @ softmax(logits)``."""
    pid = tl.program_id(0)
    num_b = tl.cdiv(R, BLOCK_B)
    num_c = tl.cdiv(C, BLOCK_C)
    group = pid // (num_b * num_c)
    f = (group // S).to(tl.int64)
    s = (group % S).to(tl.int64)
    rest = pid % (num_b * num_c)
    offs_b = (rest // num_c) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_c = (rest % num_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_b = offs_b < R
    mask_c = offs_c < C
    rows = s * R + offs_b.to(tl.int64)  # rows of the weights and of the output
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_B, BLOCK_C], dtype)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(w_ptr + f * swf + rows[:, None] * swb + offs_k[None, :] * swk,
                    mask=mask_b[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptr + s * sxs + f * sxf + offs_k[:, None] * sxk + offs_c[None, :] * sxc,
                    mask=mask_k[:, None] & mask_c[None, :], other=float("-inf"))
        if HAS_LSE:
            norm = tl.load(lse_ptr + s * sls + f * slf + offs_k * slk, mask=mask_k, other=0.0)
            # a row without mass (lse = -inf) contributes 0, not NaN
            x = tl.where((norm > float("-inf"))[:, None], x - norm[:, None], float("-inf"))
        p = tl.exp(x)  # (BLOCK_K, BLOCK_C)
        if USE_DOT:
            acc = tl.dot(w, p, acc, input_precision="ieee")
        else:  # float64: see circuits.kernels._triton_launch.uses_dot
            acc += tl.sum(w[:, :, None] * p[None, :, :], axis=1)
    out = out_ptr + f * sof + rows[:, None] * sob + offs_c[None, :] * soc
    tl.store(out, acc.to(dtype), mask=mask_b[:, None] & mask_c[None, :])


def softmax_stats_blocks(categories: int, tokens: int) -> Blocks:
    """Tile sizes of :func:`softmax_stats` (requested tokens are read 64 at a time at most)."""
    block_c = block(categories, 16, 256)
    return {"BLOCK_R": max(1, min(64, 4096 // block_c)), "BLOCK_C": block_c,
            "BLOCK_T": block(tokens, 1, 64)}


def softmax_mixture_blocks(dtype: torch.dtype, rows: int, units: int, categories: int) -> Blocks:
    """Tile sizes of :func:`softmax_mixture` (float64 tiles are smaller: broadcast products)."""
    if uses_dot(dtype):
        return {"BLOCK_B": block(rows, 16, 64), "BLOCK_K": block(units, 16, 32),
                "BLOCK_C": block(categories, 16, 128)}
    return {"BLOCK_B": block(rows, 16, 32), "BLOCK_K": block(units, 8, 8),
            "BLOCK_C": block(categories, 16, 32)}


def softmax_stats(logits: Tensor, tokens: Tensor | None, uniforms: Tensor | None,
                  blocks: Blocks | None = None
                  ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """``logits (R, C)`` -> ``lse (R,)``, ``log_probs (R, T)``, ``draw (R,)``, ``draw_logp (R,)``."""
    rows, size = logits.shape
    lse = torch.empty(rows, dtype=logits.dtype, device=logits.device)
    count = 0 if tokens is None else tokens.shape[1]
    logp = None if tokens is None else torch.empty(rows, count, dtype=logits.dtype,
                                                   device=logits.device)
    draw = None if uniforms is None else torch.empty(rows, dtype=torch.long, device=logits.device)
    draw_logp = None if uniforms is None else torch.empty_like(lse)
    if rows == 0:
        return lse, logp, draw, draw_logp
    sizes = {**softmax_stats_blocks(size, count), **(blocks or {})}
    grid = (triton.cdiv(rows, sizes["BLOCK_R"]),)
    token_arg, token_strides = (lse, (0, 0)) if tokens is None else (tokens, tokens.stride())
    u_arg, u_strides = (logits, (0, 0)) if uniforms is None else (uniforms, uniforms.stride())
    logp_arg, logp_strides = (lse, (0, 0)) if logp is None else (logp, logp.stride())
    launch(KernelLaunch(_softmax_stats_kernel, grid,
                        (logits, token_arg, u_arg, lse, logp_arg,
                         lse if draw is None else draw, lse if draw_logp is None else draw_logp,
                         rows, size, count, *logits.stride(), *token_strides, *u_strides,
                         *lse.stride(), *logp_strides),
                        {"HAS_TOKENS": tokens is not None, "HAS_DRAW": uniforms is not None,
                         **sizes}))
    return lse, logp, draw, draw_logp


def softmax_mixture(weights: Tensor, logits: Tensor, lse: Tensor | None,
                    blocks: Blocks | None = None) -> Tensor:
    """``weights (F, S R, K)``, ``logits (S, F, K, C)``, ``lse (S, F, K)`` -> ``(F, S R, C)``."""
    fold, batch, units = weights.shape
    sets, size = logits.shape[0], logits.shape[-1]
    per_set = batch // sets
    out = torch.empty(fold, batch, size, dtype=weights.dtype, device=weights.device)
    if out.numel() == 0:
        return out
    if units == 0:
        return out.zero_()
    sizes = {**softmax_mixture_blocks(weights.dtype, per_set, units, size), **(blocks or {})}
    grid = (fold * sets * triton.cdiv(per_set, sizes["BLOCK_B"])
            * triton.cdiv(size, sizes["BLOCK_C"]),)
    lse_arg, lse_strides = (logits, (0, 0, 0)) if lse is None else (lse, lse.stride())
    launch(KernelLaunch(_softmax_mixture_kernel, grid,
                        (weights, logits, lse_arg, out, sets, per_set, units, size,
                         *weights.stride(), *logits.stride(), *lse_strides, *out.stride()),
                        {"HAS_LSE": lse is not None, "USE_DOT": uses_dot(weights.dtype),
                         **sizes}))
    return out
