"""The maps from a hidden state ``e_t`` (B, d) to raw circuit parameters, one module per role.

* :class:`FullInputs`: the paper's unembedding tensor generalised to input folds: one
  ``(K, V, d)`` block per folded input layer, logits ``W e_t + b``.
* :class:`LeanInputs`: a shared, frozen LM head ``W_lm`` (V, d) applied to per-unit low-rank
  transforms of ``e_t``: logits ``W_lm (e_t + U V^T e_t) + b``.
* :class:`SumProjection`: the paper's ``R``: one linear map from ``e_t`` to the raw weights of every
  sum fold, with an optional near-identity bias on square sum layers (Appendix E).

Each input module is built from a list of :class:`FoldShape` (the input folds of a compiled
circuit) and returns ``{fold name: (B, F, K, V)}``; the sum projection returns
``{fold name: (B, F, K, D)}``. Every fold costs one matmul, whatever its number of slots. ``V``
here is the number of categories of the circuit's variables: the model's vocabulary, or a
compressed draft vocabulary (the head then passes the LM head's rows of those tokens).

For training, the input modules also give every unit's log-probability of the observed token
only (``target_log_probs``): computed in tiles of at most ``rows`` (position, unit) pairs
(:func:`~circuits_llm.heads.chunked.target_log_softmax`), so no ``(B, F, K, V)`` logits tensor
is ever held.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as nnf
from torch import Tensor, nn

from circuits_llm.heads.chunked import FullTiles, LeanTiles, default_rows, target_log_softmax

T = TypeVar("T")

@dataclass(frozen=True)
class FoldShape:
    """One parameterised fold: ``name`` and raw-parameter shape ``(F, K, D)``."""

    name: str
    folded: int
    units: int
    width: int
    #: input folds: the variable of each of the ``F`` slots.
    variables: tuple[int, ...] = ()

    @property
    def slots(self) -> int:
        """Number of units in the fold, ``F * K``."""
        return self.folded * self.units

    @property
    def numel(self) -> int:
        """Number of raw parameters per row, ``F * K * D``."""
        return self.folded * self.units * self.width


class DerivedCache:
    """Tensors derived from parameters, reused by calls that need no gradient through them.

    :meth:`get` rebuilds an entry when a source tensor changed: new storage (``.to()``,
    ``.data = ...``) or a bumped version counter (in-place updates: optimiser steps,
    ``load_state_dict``). The entry keeps aliases of its sources so their addresses cannot be
    reused while it exists. In-place edits through ``tensor.data`` are invisible to version
    counters: call :meth:`clear` after them. Entries built in inference mode serve only inference
    mode (inference tensors cannot enter autograd graphs later).
    """

    def __init__(self) -> None:
        self.entries: dict[str, tuple[tuple[object, ...], tuple[Tensor, ...], object]] = {}

    def get(self, name: str, sources: tuple[Tensor, ...], build: Callable[[], T]) -> T:
        """``build()``, cached under ``name`` unless a gradient must reach a source.

        Under ``torch.compile`` the entry is read as it stands (a traced graph cannot check
        version counters): compiled callers refresh it eagerly first (``MTPHead.refresh_derived``).
        """
        if torch.compiler.is_compiling():
            hit = self.entries.get(name)
            return build() if hit is None else hit[2]  # type: ignore[return-value]
        if torch.is_grad_enabled() and any(t.requires_grad for t in sources):
            return build()
        key = (torch.is_inference_mode_enabled(),
               *((t.data_ptr(), t._version, t.dtype, t.device) for t in sources))
        hit = self.entries.get(name)
        if hit is not None and hit[0] == key:
            return hit[2]  # type: ignore[return-value]
        with torch.no_grad():
            value = build()
        self.entries[name] = (key, tuple(t.detach() for t in sources), value)
        return value

    def clear(self) -> None:
        self.entries.clear()


def slot_targets(targets: Tensor, variables: tuple[int, ...], units: int) -> Tensor:
    """(S, n) categories of every variable -> (S, F * units): the category each input unit of a
    fold (slots ordered ``f * units + k``, as ``(F, K)`` flattens) reads; (S, n, m) ``m``
    categories per variable -> (S, F * units, m)."""
    index = torch.tensor(variables, device=targets.device)
    return targets.index_select(1, index).repeat_interleave(units, dim=1)


class FullInputs(nn.Module):
    """Per-unit unembedding matrices: ``logits[b, f, k] = W[f, k] e_b + bias[f, k]``.

    Parameters per fold: ``weight`` (F, K, V, d) and, when ``bias``, ``bias`` (F, K, V). With
    ``lm_head_weight`` (V, d) every ``W[f, k]`` starts as that matrix; units of the variables in
    ``noisy`` (those with several input units, which would otherwise stay interchangeable) get
    Gaussian noise of standard deviation ``init_noise * std(lm_head_weight)`` on top. Without
    ``lm_head_weight`` entries are ``N(0, 1/d)``. Biases start at zero.
    """

    def __init__(self, folds: list[FoldShape], hidden_size: int, vocab_size: int, bias: bool,
                 lm_head_weight: Tensor | None, init_noise: float, noisy: set[int],
                 generator: torch.Generator, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        #: the variable of every slot of each fold
        self.variables = {fold.name: fold.variables for fold in folds}
        self.weight = nn.ParameterDict()
        self.bias = nn.ParameterDict()
        for fold in folds:
            shape = (fold.folded, fold.units, vocab_size, hidden_size)
            value = torch.randn(shape, generator=generator, dtype=dtype)  # built in place
            if lm_head_weight is None:
                value.div_(math.sqrt(hidden_size))
            else:
                base = lm_head_weight.detach().to(device="cpu", dtype=dtype)
                mask = torch.tensor([v in noisy for v in fold.variables], dtype=dtype)
                value.mul_(mask[:, None, None, None] * (init_noise * float(base.std())))
                value.add_(base)
            self.weight[fold.name] = nn.Parameter(value)
            if bias:
                self.bias[fold.name] = nn.Parameter(
                    torch.zeros(fold.folded, fold.units, vocab_size, dtype=dtype))

    def forward(self, hidden: Tensor) -> dict[str, Tensor]:
        """``hidden`` (B, d) -> ``{name: logits (B, F, K, V)}`` (one matmul per fold)."""
        out = {}
        batch = hidden.shape[0]
        for name, weight in self.weight.items():
            folded, units, vocab, dim = weight.shape
            bias = self.bias[name].reshape(-1) if name in self.bias else None
            logits = nnf.linear(hidden, weight.reshape(folded * units * vocab, dim), bias)
            out[name] = logits.view(batch, folded, units, vocab)
        return out

    def target_log_probs(self, hidden: Tensor, targets: Tensor, rows: int | None = None,
                         ) -> dict[str, Tensor]:
        """``hidden`` (S, d), ``targets`` (S, n) the category of every variable ->
        ``{name: (S, F, K)}``, each unit's log-softmax at its variable's category (``(S, n, m)``
        categories -> ``(S, F, K, m)``), in tiles of
        ``rows`` (position, unit) pairs (default :func:`~circuits_llm.heads.chunked.default_rows`)."""
        out = {}
        for name, weight in self.weight.items():
            folded, units, vocab, dim = weight.shape
            bias = self.bias[name].reshape(folded * units, vocab) if name in self.bias else None
            tiled = FullTiles(hidden, weight.reshape(folded * units, vocab, dim), bias)
            picked = target_log_softmax(tiled, slot_targets(targets, self.variables[name], units),
                                        rows or default_rows(vocab))
            out[name] = picked.view(hidden.shape[0], folded, units, *targets.shape[2:])
        return out


class LeanInputs(nn.Module):
    """Frozen LM head on per-unit low-rank transforms: ``logits = W_lm (e + U (V^T e)) + bias``.

    Buffer ``lm_head`` (V, d), frozen (never trained, saved with the head). Parameters per fold:
    ``down`` (F, K, d, rho) drawn ``N(0, 1/d)``, ``up`` (F, K, rho, d) zero-initialised, so every
    unit starts exactly at the LM head; ``bias`` (F, K, V) zero-initialised when ``bias``.

    A call computes ``logits = W_lm e + (W_lm U) (V^T e) + bias`` from two derived maps per fold
    (:meth:`derived_maps`): ``V`` flattened to a ``(d, F K rho)`` matrix (one matmul gives every
    unit's codes) and the products ``W_lm U`` as ``(F K, rho, V)`` (one batched matmul gives every
    unit's logits): ``B d F K rho + B F K rho V`` multiply-adds per call instead of the
    ``B F K d V`` of pushing ``F K`` transformed states through the LM head. When no gradient
    reaches ``down`` / ``up`` (decoding, evaluation, frozen heads) the maps are cached
    (:class:`DerivedCache`: rebuilt after in-place updates, ``load_state_dict``, ``.to()``; call
    :meth:`clear_cache` after edits through ``tensor.data``). Cached and freshly built maps are
    the same tensors, so outputs are bitwise equal.
    """

    def __init__(self, folds: list[FoldShape], hidden_size: int, vocab_size: int, bias: bool,
                 lm_head_weight: Tensor, rank: int, generator: torch.Generator,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        #: the variable of every slot of each fold
        self.variables = {fold.name: fold.variables for fold in folds}
        self.register_buffer("lm_head", lm_head_weight.detach().to(dtype).clone())
        self.down = nn.ParameterDict()
        self.up = nn.ParameterDict()
        self.bias = nn.ParameterDict()
        for fold in folds:
            down = torch.randn((fold.folded, fold.units, hidden_size, rank), generator=generator,
                               dtype=torch.float64) / math.sqrt(hidden_size)
            self.down[fold.name] = nn.Parameter(down.to(dtype))
            self.up[fold.name] = nn.Parameter(
                torch.zeros(fold.folded, fold.units, rank, hidden_size, dtype=dtype))
            if bias:
                self.bias[fold.name] = nn.Parameter(
                    torch.zeros(fold.folded, fold.units, vocab_size, dtype=dtype))
        #: (down_flat, vocab_up) per fold name, see :meth:`derived_maps`
        self.cache = DerivedCache()

    def clear_cache(self) -> None:
        """Drop the cached derived maps (needed only after edits through ``tensor.data``)."""
        self.cache.clear()

    def _build_maps(self, name: str) -> tuple[Tensor, Tensor]:
        down, up = self.down[name], self.up[name]
        folded, units, dim, rank = down.shape
        down_flat = down.permute(2, 0, 1, 3).reshape(dim, folded * units * rank)
        vocab_up = torch.matmul(up.reshape(folded * units, rank, dim), self.lm_head.T)
        return down_flat, vocab_up

    def refresh(self) -> None:
        """Bring every fold's cached maps up to date (eagerly, before compiled code reads them)."""
        with torch.no_grad():
            for name in self.down:
                self.derived_maps(name)

    def derived_maps(self, name: str) -> tuple[Tensor, Tensor]:
        """Fold ``name``'s ``(down_flat (d, F K rho), vocab_up (F K, rho, V))``.

        Differentiable when a gradient must reach ``down`` or ``up``; otherwise cached
        (:class:`DerivedCache` over ``down``, ``up`` and ``lm_head``).
        """
        return self.cache.get(name, (self.down[name], self.up[name], self.lm_head),
                              lambda: self._build_maps(name))

    def forward(self, hidden: Tensor) -> dict[str, Tensor]:
        """``hidden`` (B, d) -> ``{name: logits (B, F, K, V)}``.

        Per fold: codes ``(B, F K rho) = e V`` (one matmul), then ``(F K, B, V) = bias + codes
        (W_lm U)`` (one batched matmul) plus the shared ``W_lm e`` (B, V).
        """
        out = {}
        batch = hidden.shape[0]
        base = nnf.linear(hidden, self.lm_head)  # (B, V)
        for name, down in self.down.items():
            folded, units, _, rank = down.shape
            down_flat, vocab_up = self.derived_maps(name)
            codes = (hidden @ down_flat).view(batch, folded * units, rank).transpose(0, 1)
            if name in self.bias:
                bias = self.bias[name].view(folded * units, 1, -1)
                delta = torch.baddbmm(bias, codes, vocab_up)  # (F K, B, V)
            else:
                delta = torch.bmm(codes, vocab_up)
            logits = delta.transpose(0, 1) + base[:, None, :]  # (B, F K, V)
            out[name] = logits.reshape(batch, folded, units, self.vocab_size)
        return out

    def target_log_probs(self, hidden: Tensor, targets: Tensor, rows: int | None = None,
                         ) -> dict[str, Tensor]:
        """``hidden`` (S, d), ``targets`` (S, n) the category of every variable ->
        ``{name: (S, F, K)}``, each unit's log-softmax at its variable's category (``(S, n, m)``
        categories -> ``(S, F, K, m)``), in tiles of
        ``rows`` (position, unit) pairs (default :func:`~circuits_llm.heads.chunked.default_rows`).

        Per fold the codes ``(S, F K, rho) = e V`` are one matmul; a tile's logits are
        ``W_lm e + codes (W_lm U) + bias`` for its positions and units only."""
        out = {}
        positions = hidden.shape[0]
        for name, down in self.down.items():
            folded, units, _, rank = down.shape
            down_flat, vocab_up = self.derived_maps(name)
            codes = (hidden @ down_flat).view(positions, folded * units, rank)
            bias = self.bias[name].view(folded * units, -1) if name in self.bias else None
            tiled = LeanTiles(hidden, self.lm_head, codes, vocab_up, bias)
            picked = target_log_softmax(tiled, slot_targets(targets, self.variables[name], units),
                                        rows or default_rows(self.vocab_size))
            out[name] = picked.view(positions, folded, units, *targets.shape[2:])
        return out


class SumProjection(nn.Module):
    """One linear map ``e_t -> `` raw weights of every sum fold (the paper's ``R``, plus a bias).

    Parameters: ``weight`` (S, d) and ``bias`` (S,), ``S = sum over sum folds of F * K * D``.
    ``weight`` starts ``N(0, init_std^2)`` (zero by default: the sum weights start context-free),
    ``bias`` at zero except, with ``identity_init``, ``identity_bias`` on the diagonal of every
    square fold (``K == D``), so each such sum starts with weight
    ``exp(b) / (exp(b) + D - 1)`` on its own input: an HMM then starts equal to a CP.
    """

    def __init__(self, folds: list[FoldShape], hidden_size: int, init_std: float,
                 identity_init: bool, identity_bias: float, generator: torch.Generator,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.folds = tuple(folds)
        total = sum(fold.numel for fold in folds)
        self.weight = nn.Parameter(
            (torch.randn((total, hidden_size), generator=generator, dtype=torch.float64)
             * init_std).to(dtype))
        bias = torch.zeros(total, dtype=dtype)
        offset = 0
        for fold in folds:
            if identity_init and fold.units == fold.width:
                block = bias[offset:offset + fold.numel].view(fold.folded, fold.units, fold.width)
                block.diagonal(dim1=1, dim2=2).fill_(identity_bias)
            offset += fold.numel
        self.bias = nn.Parameter(bias)
        #: ``weight`` transposed to (d, S), see :meth:`forward`
        self.cache = DerivedCache()

    def transposed_weight(self) -> Tensor:
        """``weight`` as a contiguous (d, S) tensor, cached for gradient-free calls."""
        return self.cache.get("weight", (self.weight,), lambda: self.weight.t().contiguous())

    def forward(self, hidden: Tensor) -> dict[str, Tensor]:
        """``hidden`` (B, d) -> ``{name: raw weights (B, F, K, D)}`` (one matmul in all).

        The matmul reads ``weight`` as a contiguous (d, S) copy, which BLAS streams faster at
        batch 1 (decoding) than the (S, d) layout; gradient-free calls cache that copy
        (:class:`DerivedCache`), so cached and fresh outputs are bitwise equal.
        """
        if not self.folds:
            return {}
        transposed = self.transposed_weight()
        flat = torch.addmm(self.bias, hidden, transposed)
        out = {}
        offset = 0
        batch = hidden.shape[0]
        for fold in self.folds:
            out[fold.name] = flat[:, offset:offset + fold.numel].view(
                batch, fold.folded, fold.units, fold.width)
            offset += fold.numel
        return out
