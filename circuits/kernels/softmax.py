"""Fused operations on categorical logits: what a round needs from ``n r`` softmax distributions.

A circuit head's input layers are categorical distributions ``softmax(logits)`` over a
vocabulary. A decoding round reads only a few numbers from each: the log-probabilities of the
tokens the circuit observes, a draw from some of them, and, for the exact draft conditionals,
posterior-weighted mixtures of them. These operations compute exactly that from the logits, so
the triton path never writes a ``log_softmax`` table or its ``exp`` (the torch path, the
reference, does; both agree to float rounding and, given the same uniforms, draw the same
categories).

* :func:`softmax_stats`: per row the log-normaliser, the log-probabilities of given categories
  and optionally a Gumbel-max draw with its log-probability.
* :func:`softmax_mixture`: ``weights @ softmax(logits)`` per fold and parameter set (the last
  step of :func:`circuits.compiled.queries.all_conditionals`).

Logits must be finite or ``-inf`` (a masked category); a row that is entirely ``-inf`` has
log-normaliser ``-inf``, log-probabilities ``-inf`` and draws category 0.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from circuits.errors import InvalidInputError
from circuits.kernels.backend import BackendLike, TritonKernel, run_triton
from circuits.kernels.ops import gumbel_argmax


def _fused() -> ModuleType:
    """The triton launchers (imported only when a triton path runs: triton is optional)."""
    return importlib.import_module("circuits.kernels._triton_softmax")


class SoftmaxStats(NamedTuple):
    """What :func:`softmax_stats` returns for logits ``(R, C)``.

    Attributes:
        log_normalizer: (R,) ``logsumexp`` of each row.
        log_probs: (R, T) ``log softmax(logits)[r, tokens[r, t]]``, or None without ``tokens``.
        draw: (R,) long, a category drawn from each row's softmax, or None without ``uniforms``.
        draw_log_prob: (R,) its log-probability, or None.
    """

    log_normalizer: Tensor
    log_probs: Tensor | None
    draw: Tensor | None
    draw_log_prob: Tensor | None


def _safe_log_softmax(logits: Tensor, lse: Tensor) -> Tensor:
    """``logits - lse`` with ``-inf`` (not NaN) in rows without mass."""
    return torch.where(torch.isfinite(lse)[..., None], logits - lse[..., None], -torch.inf)


def _check_stats(logits: Tensor, tokens: Tensor | None, uniforms: Tensor | None) -> None:
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise InvalidInputError(f"softmax_stats needs float logits (R, C), got "
                                f"{tuple(getattr(logits, 'shape', ()))}")
    rows, size = logits.shape
    if size == 0:
        raise InvalidInputError("softmax_stats needs at least one category (C >= 1)")
    if tokens is not None:
        if tokens.dtype != torch.long or tokens.dim() != 2 or tokens.shape[0] != rows:
            raise InvalidInputError(f"tokens must be ({rows}, T) long, got "
                                    f"{tuple(tokens.shape)} {tokens.dtype}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= size):
            raise InvalidInputError(f"tokens must lie in [0, {size}), got values in "
                                    f"[{int(tokens.min())}, {int(tokens.max())}]")
    if uniforms is not None and (tuple(uniforms.shape) != (rows, size)
                                 or uniforms.dtype != torch.float64):
        raise InvalidInputError(f"uniforms must be ({rows}, {size}) float64 in (0, 1), got "
                                f"{tuple(uniforms.shape)} {uniforms.dtype}")


@torch.no_grad()
def softmax_stats(logits: Tensor, tokens: Tensor | None = None, uniforms: Tensor | None = None,
                  backend: BackendLike | None = None) -> SoftmaxStats:
    """Normaliser, selected log-probabilities and a draw of ``softmax(logits)``, row by row.

    Args:
        logits: (R, C) float32 or float64, finite or ``-inf``.
        tokens: (R, T) long categories whose log-probabilities are wanted, or None.
        uniforms: (R, C) float64 in (0, 1) (``torch.rand``) for a Gumbel-max draw
            ``argmax_c(logits[r, c] - log(-log(u[r, c])))``, or None for no draw.
        backend: force a backend for this call.

    Returns:
        :class:`SoftmaxStats`. Not differentiable (a decoding-time operation).
    """
    _check_stats(logits, tokens, uniforms)
    tensors = tuple(t for t in (logits, tokens, uniforms) if t is not None)
    fused = run_triton(TritonKernel.SOFTMAX_STATS, tensors,
                       lambda: _fused().softmax_stats(logits, tokens, uniforms), backend)
    if fused is not None:
        return SoftmaxStats(*fused)
    lse = torch.logsumexp(logits, -1)
    log_probs = None
    if tokens is not None:
        log_probs = _safe_log_softmax(logits.gather(1, tokens), lse)
    draw = draw_log_prob = None
    if uniforms is not None:
        draw = gumbel_argmax(logits, uniforms)
        draw_log_prob = _safe_log_softmax(logits.gather(1, draw[:, None]), lse)[:, 0]
    return SoftmaxStats(lse, log_probs, draw, draw_log_prob)


def _check_mixture(weights: Tensor, logits: Tensor, lse: Tensor | None) -> None:
    if weights.dim() != 3 or logits.dim() != 4:
        raise InvalidInputError(
            f"softmax_mixture needs weights (F, B, K) and logits (S, F, K, C), got "
            f"{tuple(weights.shape)} and {tuple(logits.shape)}")
    fold, batch, units = weights.shape
    sets = logits.shape[0]
    if tuple(logits.shape[1:3]) != (fold, units) or sets == 0 or batch % sets:
        raise InvalidInputError(
            f"softmax_mixture: logits {tuple(logits.shape)} do not match weights "
            f"{tuple(weights.shape)} (need S dividing B, then (S, F, K, C))")
    if logits.dtype != weights.dtype or (lse is not None and (
            tuple(lse.shape) != tuple(logits.shape[:3]) or lse.dtype != logits.dtype)):
        raise InvalidInputError(
            f"softmax_mixture: weights {weights.dtype}, logits {logits.dtype} and lse "
            f"{None if lse is None else (tuple(lse.shape), lse.dtype)} must share one dtype, "
            f"lse being (S, F, K)")


@torch.no_grad()
def softmax_mixture(weights: Tensor, logits: Tensor, lse: Tensor | None = None,
                    backend: BackendLike | None = None) -> Tensor:
    """``out[f, b, c] = sum_k weights[f, b, k] * exp(logits[s, f, k, c] - lse[s, f, k])``.

    Rows ``b`` of the batch are served by parameter set ``s = b // (B / S)`` (the grouped layout
    of :meth:`circuits.compiled.CompiledCircuit.evaluate`).

    Args:
        weights: (F, B, K) non-negative mixture weights.
        logits: (S, F, K, C) logits, or log-probabilities when ``lse`` is None.
        lse: (S, F, K) their log-normalisers (:func:`softmax_stats`), or None.
        backend: force a backend for this call.

    Returns:
        (F, B, C) in the weights' dtype. Not differentiable.
    """
    _check_mixture(weights, logits, lse)
    tensors = (weights, logits) if lse is None else (weights, logits, lse)
    fused = run_triton(TritonKernel.SOFTMAX_MIXTURE, tensors,
                       lambda: _fused().softmax_mixture(weights, logits, lse), backend)
    if fused is not None:
        return fused
    probs = (logits if lse is None else _safe_log_softmax(logits, lse)).exp()
    sets, fold, units, size = probs.shape
    batch = weights.shape[1]
    per_set = probs.transpose(0, 1).reshape(fold * sets, units, size)
    grouped = weights.reshape(fold * sets, batch // sets, units)
    return torch.bmm(grouped, per_set).view(fold, batch, size)
