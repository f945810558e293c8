"""Every input unit's log-probability of its observed token, without a (positions, units, K) table.

The training loss reads a head's input units only at the observed tokens: unit ``u`` of the
head applied at position ``s`` contributes ``log softmax(logits[s, u])[target[s, u]] =
logits[s, u, target] - logsumexp(logits[s, u])``. :func:`target_log_softmax` computes that for
every ``(s, u)`` tile by tile: a tile holds at most ``rows`` pairs ``(s, u)``, so the largest
intermediate is ``rows x K`` logits, whatever the number of positions and units.

Gradients are exact: the forward keeps only its inputs and the ``(S, U)`` log-normalisers; the
backward recomputes each tile's logits, turns them in place into ``G = g (onehot(target) -
softmax)`` and hands ``G`` to the map's explicit backward, which accumulates full-size gradients
(parameter-sized, never ``rows x K`` per position). The recomputation costs one more forward of
the logits. The maps (:class:`TiledLogits`): :class:`FullTiles` (per-unit unembeddings) and
:class:`LeanTiles` (the frozen LM head on low-rank transforms, its ``W_lm e`` term computed once
per block of positions and shared by the block's units).

Tiles run positions-outer, over at least :data:`MIN_TILE_POSITIONS` positions each when ``rows``
allows (:func:`tiles`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as nnf
from torch import Tensor

__all__ = ["DEFAULT_TILE_ELEMENTS", "FullTiles", "LeanTiles", "TiledLogits", "default_rows",
           "target_log_softmax", "tiles"]

#: logits held at once by default (rows x K): 2^24 values, 64 MB in float32 (smaller tiles are
#: slower on CPU: their per-unit products run over fewer positions)
DEFAULT_TILE_ELEMENTS = 1 << 24
#: positions a tile spans at least (when ``rows`` allows), its units split instead
MIN_TILE_POSITIONS = 32


def default_rows(categories: int, elements: int = DEFAULT_TILE_ELEMENTS) -> int:
    """Rows ``(s, u)`` per tile so that a tile holds about ``elements`` logits of ``categories``."""
    return max(1, elements // max(1, categories))


def _blocks(size: int, step: int) -> Iterator[slice]:
    for start in range(0, size, step):
        yield slice(start, min(start + step, size))


def tiles(positions: int, units: int, rows: int) -> Iterator[tuple[slice, list[slice]]]:
    """``(position block, its unit blocks)``, each tile at most ``rows`` pairs: ``P = rows // U``
    positions by all ``U`` units, or, when that would be fewer than :data:`MIN_TILE_POSITIONS`
    positions, that many positions by ``rows // P`` units (the per-unit matrix products and
    gradient updates are then over enough positions to run near full speed)."""
    block_positions = max(1, min(positions, rows, max(MIN_TILE_POSITIONS, rows // max(1, units))))
    block_units = max(1, min(units, rows // block_positions))
    unit_blocks = list(_blocks(units, block_units))
    for position_block in _blocks(positions, block_positions):
        yield position_block, unit_blocks


class TiledLogits(ABC):
    """A head fold's logits ``(U, S, K)``, one tile ``(units, positions)`` at a time.

    ``values`` are the map's tensors in the order of :attr:`inputs` (what the autograd function
    saves); ``grads`` a list of the same length holding a full-size zero-initialised gradient for
    each input that needs one (None otherwise), which :meth:`backward` accumulates into.
    """

    #: the tensors the logits depend on (gradients flow to those that require grad)
    inputs: tuple[Tensor, ...]

    def shared(self, values: Sequence[Tensor], positions: slice) -> Any:
        """What every unit block of a position block shares (computed once per block)."""
        return None

    @abstractmethod
    def logits(self, values: Sequence[Tensor], shared: Any, positions: slice,
               units: slice) -> Tensor:
        """The tile's ``(Ub, P, K)`` logits (a fresh tensor: the backward overwrites it)."""

    @abstractmethod
    def backward(self, values: Sequence[Tensor], shared: Any, positions: slice, units: slice,
                 upstream: Tensor, grads: list[Tensor | None]) -> None:
        """Accumulate the gradients of ``sum(upstream * logits)``, ``upstream`` (Ub, P, K)."""

    def finish(self, values: Sequence[Tensor], shared: Any, positions: slice,
               grads: list[Tensor | None]) -> None:
        """End of a position block's backward (flush what :meth:`shared` accumulated); nothing
        by default."""
        return None


class FullTiles(TiledLogits):
    """FULL logits ``logits[u, s] = W_u e_s + b_u``: ``hidden`` (S, d), ``weight`` (U, K, d),
    ``bias`` (U, K) or None."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None) -> None:
        self.has_bias = bias is not None
        self.inputs = (hidden, weight) if bias is None else (hidden, weight, bias)

    def logits(self, values: Sequence[Tensor], shared: Any, positions: slice,
               units: slice) -> Tensor:
        hidden, weight = values[0][positions], values[1][units]
        states = hidden.expand(weight.shape[0], *hidden.shape)  # (Ub, P, d), no copy
        if self.has_bias:
            bias = values[2][units][:, None, :].expand(-1, hidden.shape[0], -1)
            return torch.baddbmm(bias, states, weight.transpose(1, 2))
        return torch.bmm(states, weight.transpose(1, 2))

    def backward(self, values: Sequence[Tensor], shared: Any, positions: slice, units: slice,
                 upstream: Tensor, grads: list[Tensor | None]) -> None:
        hidden, weight = values[0][positions], values[1][units]
        if grads[0] is not None:  # sum_u G_u W_u
            grads[0][positions] += torch.bmm(upstream, weight).sum(0)
        if grads[1] is not None:  # G_u^T e
            states = hidden.expand(weight.shape[0], *hidden.shape)
            grads[1][units] += torch.bmm(upstream.transpose(1, 2), states)
        if self.has_bias and grads[2] is not None:
            grads[2][units] += upstream.sum(1)


class LeanTiles(TiledLogits):
    """LEAN logits ``logits[u, s] = W_lm e_s + codes[s, u] (W_lm U)_u + b_u``: ``hidden`` (S, d),
    ``lm_head`` (K, d) (frozen), ``codes`` (S, U, rho), ``vocab_up`` (U, rho, K), ``bias`` (U, K)
    or None. ``W_lm e`` is computed once per position block (:meth:`shared`)."""

    def __init__(self, hidden: Tensor, lm_head: Tensor, codes: Tensor, vocab_up: Tensor,
                 bias: Tensor | None) -> None:
        self.has_bias = bias is not None
        inputs = (hidden, lm_head, codes, vocab_up)
        self.inputs = inputs if bias is None else (*inputs, bias)

    def shared(self, values: Sequence[Tensor], positions: slice) -> dict[str, Tensor | None]:
        return {"base": nnf.linear(values[0][positions], values[1]), "grad": None}  # (P, K)

    def logits(self, values: Sequence[Tensor], shared: Any, positions: slice,
               units: slice) -> Tensor:
        codes = values[2][positions, units].transpose(0, 1)  # (Ub, P, rho)
        vocab_up = values[3][units]
        if self.has_bias:
            bias = values[4][units][:, None, :].expand(-1, codes.shape[1], -1)
            logits = torch.baddbmm(bias, codes, vocab_up)
        else:
            logits = torch.bmm(codes, vocab_up)
        return logits.add_(shared["base"])  # (Ub, P, K) + (P, K)

    def backward(self, values: Sequence[Tensor], shared: Any, positions: slice, units: slice,
                 upstream: Tensor, grads: list[Tensor | None]) -> None:
        codes = values[2][positions, units].transpose(0, 1)  # (Ub, P, rho)
        if grads[0] is not None:  # W_lm e: G summed over units, pushed through W_lm per block
            total = upstream.sum(0)
            shared["grad"] = total if shared["grad"] is None else shared["grad"].add_(total)
        if grads[2] is not None:  # (Ub, P, K) (Ub, K, rho) -> (P, Ub, rho)
            grads[2][positions, units] += torch.bmm(upstream, values[3][units].transpose(1, 2)
                                                    ).transpose(0, 1)
        if grads[3] is not None:
            grads[3][units] += torch.bmm(codes.transpose(1, 2), upstream)
        if self.has_bias and grads[4] is not None:
            grads[4][units] += upstream.sum(1)

    def finish(self, values: Sequence[Tensor], shared: Any, positions: slice,
               grads: list[Tensor | None]) -> None:
        if grads[0] is not None and shared["grad"] is not None:
            grads[0][positions] += shared["grad"] @ values[1]


class _TargetLogSoftmax(torch.autograd.Function):
    """See :func:`target_log_softmax`; ``values`` are ``tiled.inputs``."""

    @staticmethod
    def forward(ctx: Any, tiled: TiledLogits, targets: Tensor, rows: int, *values: Tensor) -> Tensor:
        positions, units, picks = targets.shape
        out = torch.empty(units, positions, picks, dtype=values[0].dtype, device=targets.device)
        lse_all = torch.empty(units, positions, dtype=values[0].dtype, device=targets.device)
        index = targets.transpose(0, 1)  # (U, S, m)
        for block, unit_blocks in tiles(positions, units, rows):
            shared = tiled.shared(values, block)
            for unit_block in unit_blocks:
                logits = tiled.logits(values, shared, block, unit_block)
                lse = torch.logsumexp(logits, -1)
                picked = logits.gather(-1, index[unit_block, block])
                out[unit_block, block] = picked - lse[..., None]
                lse_all[unit_block, block] = lse
                del logits
        ctx.tiled, ctx.rows = tiled, rows
        ctx.save_for_backward(targets, lse_all, *values)
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        targets, lse_all, *values = ctx.saved_tensors
        tiled: TiledLogits = ctx.tiled
        wanted = ctx.needs_input_grad[3:]
        grads: list[Tensor | None] = [torch.zeros_like(v) if need else None
                                      for v, need in zip(values, wanted, strict=True)]
        positions, units, _ = targets.shape
        index = targets.transpose(0, 1)  # (U, S, m)
        upstream_all = grad.transpose(0, 1).to(lse_all.dtype)  # (U, S, m)
        for block, unit_blocks in tiles(positions, units, ctx.rows):
            shared = tiled.shared(values, block)
            for unit_block in unit_blocks:
                g = upstream_all[unit_block, block]  # (Ub, P, m)
                # G = sum_m g_m onehot(target_m) - (sum_m g_m) softmax, built in place on the
                # recomputed logits
                upstream = tiled.logits(values, shared, block, unit_block)
                upstream.sub_(lse_all[unit_block, block][..., None]).exp_()
                upstream.mul_(-g.sum(-1, keepdim=True))
                upstream.scatter_add_(-1, index[unit_block, block], g)
                tiled.backward(values, shared, block, unit_block, upstream, grads)
                del upstream
            tiled.finish(values, shared, block, grads)
        return (None, None, None, *grads)


def target_log_softmax(tiled: TiledLogits, targets: Tensor, rows: int) -> Tensor:
    """``log softmax(logits[u, s])[targets[s, u]]`` for every position ``s`` and unit ``u``.

    Args:
        tiled: the logits' map (:class:`FullTiles`, :class:`LeanTiles`).
        targets: (S, U) long, categories in ``0 .. K-1``; or (S, U, m): ``m`` categories per
            ``(s, u)`` (the training target and a teacher's candidates,
            :mod:`circuits_llm.training.loss`), all read from one computation of the tile.
        rows: at most this many ``(s, u)`` pairs per tile (>= 1).

    Returns:
        (S, U) log-probabilities, or (S, U, m) for (S, U, m) targets; differentiable with respect
        to every ``tiled.inputs`` tensor that requires grad (exact gradients, see the module
        docstring).
    """
    if targets.dim() not in (2, 3) or targets.dtype != torch.long:
        raise ValueError(f"targets must be a (S, U) or (S, U, m) long tensor, got "
                         f"{tuple(targets.shape)} {targets.dtype}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    several = targets.dim() == 3
    result: Tensor = _TargetLogSoftmax.apply(tiled, targets if several else targets[..., None],
                                             rows, *tiled.inputs)
    return result if several else result.squeeze(-1)
