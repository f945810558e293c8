"""A batch of sequences of different lengths on one backbone: per-row lengths, positions and
rollback, each row seeing only its own tokens.

A batch decoder appends a block of ``m`` tokens to every row in one backbone call, then each row
keeps its own number of them (a speculative round's accepted drafts differ per row). The KV
caches are one tensor per layer, ``(B, H, P, D)``: slot ``j`` of every row sits at the same index.
:class:`RaggedCache` keeps, per row, which slots hold its tokens (``mask`` (B, P) bool) and how
many it holds (``lengths`` (B,)), and gives every call

* an attention mask over the slots: a row attends to its own tokens only (left padding and the
  holes a rollback left are masked out);
* position ids from the row's own length: a row's ``k``-th token has position ``k`` whatever
  slot it sits in, so rotary and absolute position embeddings see the row as if it were alone.

So each row's keys and values at its own slots, and its logits, are those of a fresh prefill of
that row alone (``tests/test_batch_cache.py`` checks it on the model zoo, up to float rounding).

Rollback per row (:meth:`RaggedCache.keep`) only unmasks the dropped slots: they become holes.
Slots no row holds at the end are cropped, and when the holes make the caches longer than the
longest row by more than a slack (``slack_fraction`` of it, at least ``min_slack`` slots), the
caches are compacted: each row's tokens move to the right end, left padding before them
(``HFBackbone.gather_slots``, one copy of the caches), so a batch's caches stay within the slack
of what batched autoregressive decoding holds. Rows that finish leave the batch
(:meth:`RaggedCache.select`) and cost nothing afterwards.

:class:`RaggedBackbone` is the contract a batch decoder is written against;
:func:`ragged_backbone` gives one for an :class:`~circuits_llm.backbone.hf.HFBackbone` (its
dynamic cache; the static cache and compiled forwards have no per-row layout yet) or for a
backbone with a ``ragged()`` method of its own (the tests' toy LM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from circuits_llm.backbone._arch import UnsupportedModelError
from circuits_llm.backbone._static import CacheKind
from circuits_llm.backbone.hf import HFBackbone
from circuits_llm.protocols import BackboneStep

__all__ = ["RaggedBackbone", "RaggedCache", "context_length", "ragged_backbone"]


class RaggedBackbone(Protocol):
    """A backbone holding a batch of sequences of different lengths (see the module docstring).

    Rows are numbered by their place in the current batch (``0 .. batch_size - 1``); after
    :meth:`select` the kept rows are renumbered in the order given.
    """

    vocab_size: int
    hidden_size: int

    @property
    def lengths(self) -> list[int]:
        """Tokens each row holds."""
        ...

    def start(self, rows: Sequence[Sequence[int]]) -> Tensor:
        """Empty the caches and prefill each row's tokens (a row may be empty) in one call ->
        (B, d) the draft hidden state at each row's last token (zeros for an empty row)."""
        ...

    def extend(self, tokens: Tensor) -> BackboneStep:
        """Append ``tokens`` (B, m) to every row in one call -> logits (B, m, V) and draft
        hidden states (B, m, d) at the new positions."""
        ...

    def prefill_features(self, row: int) -> Tensor:
        """(1, n, d) the draft hidden states of row ``row``'s ``n`` prefilled tokens (what a
        prefill of that row alone gives; read by a draft block's cache), valid between
        :meth:`start` and the next :meth:`extend` or :meth:`select`."""
        ...

    def keep(self, counts: Sequence[int]) -> None:
        """After :meth:`extend` of ``m`` tokens: row ``b`` keeps the first ``counts[b]``
        (``1 <= counts[b] <= m``) and drops the rest (rollback per row)."""
        ...

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices into the current batch, in the new order)."""
        ...


def context_length(backbone: object) -> int | None:
    """How many positions the backbone's model can read (``max_position_embeddings`` or GPT-2's
    ``n_positions``; a static cache's capacity when smaller); ``None`` when unknown."""
    limits = []
    config = getattr(getattr(backbone, "model", None), "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            limits.append(value)
            break
    capacity = getattr(backbone, "max_length", None)
    if isinstance(capacity, int) and not isinstance(capacity, bool):
        limits.append(capacity)
    return min(limits) if limits else None


def sliding_window(config: object) -> int | None:
    """The sliding window a model's attention uses (``config.sliding_window`` when some layer
    slides: no ``layer_types``, or one of them ``"sliding_attention"``), else ``None``."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return window


def ragged_backbone(backbone: object) -> RaggedBackbone:
    """The :class:`RaggedBackbone` view of a decoder's backbone: a :class:`RaggedCache` over an
    :class:`HFBackbone`, or what the backbone's own ``ragged()`` returns.

    Raises:
        UnsupportedModelError: the backbone has no per-row layout (a static or compiled
            ``HFBackbone``, sliding-window caches, or another backbone without ``ragged()``).
    """
    if isinstance(backbone, HFBackbone):
        return RaggedCache(backbone)
    make = getattr(backbone, "ragged", None)
    if callable(make):
        return make()  # type: ignore[no-any-return]
    raise UnsupportedModelError(
        f"batch decoding needs a backbone that holds rows of different lengths: an HFBackbone "
        f"(dynamic cache) or one with a ragged() method returning a circuits_llm.backbone."
        f"ragged_cache.RaggedBackbone; {type(backbone).__name__} has neither: decode its prompts "
        f"one at a time")


class RaggedCache:
    """Per-row lengths, positions and rollback over an :class:`HFBackbone`'s dynamic caches.

    Args:
        backbone: the backbone (dynamic cache; its caches are reset by :meth:`start`).
        pad_token_id: the id written into padding slots (never attended to).
        slack_fraction, min_slack: compact the caches when they hold more than
            ``max(min_slack, slack_fraction * longest row)`` slots beyond the longest row.

    Attributes:
        mask: (B, P) bool, the slots each row holds.
        positions: (B,) long, tokens each row holds (its next token's position).
    """

    def __init__(self, backbone: HFBackbone, pad_token_id: int = 0, slack_fraction: float = 0.125,
                 min_slack: int = 16) -> None:
        if backbone.cache_kind is not CacheKind.DYNAMIC or backbone.compiled:
            raise UnsupportedModelError(
                "rows of different lengths need the dynamic KV cache: build the HFBackbone "
                "without compile=True and with cache=CacheKind.DYNAMIC to decode a batch")
        window = sliding_window(backbone.model.config)
        if window is not None:
            raise UnsupportedModelError(
                f"{type(backbone.model).__name__} attends through a sliding window of {window} "
                f"slots, which padding and per-row holes would shift: decode this model's "
                f"prompts one at a time")
        self.backbone = backbone
        self.vocab_size = backbone.vocab_size
        self.hidden_size = backbone.hidden_size
        self.pad_token_id = pad_token_id
        self.slack_fraction = slack_fraction
        self.min_slack = min_slack
        self.device = backbone.device
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
        #: how many slots the last extend appended (what keep() may roll back)
        self._block = 0
        #: how many compactions ran (the tests read it)
        self.compactions = 0
        #: the last start's draft hidden states (B, W, d), left-padded, until the next extend
        self._prefill: Tensor | None = None

    # ------------------------------------------------------------------ protocol
    @property
    def lengths(self) -> list[int]:
        return [int(n) for n in self.positions.tolist()]

    @property
    def batch_size(self) -> int:
        return int(self.mask.shape[0])

    def start(self, rows: Sequence[Sequence[int]]) -> Tensor:
        """Left-pad the rows to the longest and prefill them in one call (see
        :class:`RaggedBackbone`); with every row empty, nothing runs."""
        backbone = self.backbone
        backbone.reset()
        batch, width = len(rows), max((len(row) for row in rows), default=0)
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(batch, width, dtype=torch.bool)
        for b, row in enumerate(rows):
            if row:
                ids[b, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
                mask[b, width - len(row):] = True
        self.mask = mask.to(self.device)
        self.positions = self.mask.sum(1)
        self._block = 0
        hidden = torch.zeros(batch, self.hidden_size, device=self.device)
        self._prefill = hidden[:, None][:, :0]  # (B, 0, d): no row has a prefilled token
        if width == 0:
            return hidden
        positions = (self.mask.long().cumsum(1) - 1).clamp(min=0)
        step = backbone.extend_rows(ids.to(self.device), self.mask.long(), positions)
        self._check_layers()
        self._prefill = step.draft_hidden
        last = step.draft_hidden[:, -1]
        return torch.where(self.positions[:, None] > 0, last, torch.zeros_like(last))

    def prefill_features(self, row: int) -> Tensor:
        """Row ``row``'s slice of the last :meth:`start`'s draft hidden states (see
        :class:`RaggedBackbone`): its tokens sit at the right end (left padding)."""
        if self._prefill is None:
            raise ValueError("prefill_features is read between start() and the first extend() "
                             "or select(): start the batch again")
        if not 0 <= row < self.batch_size:
            raise ValueError(f"row {row} is not in the batch of {self.batch_size}")
        width, count = self._prefill.shape[1], int(self.positions[row])
        return self._prefill[row:row + 1, width - count:]

    def extend(self, tokens: Tensor) -> BackboneStep:
        batch, m = tokens.shape
        self._prefill = None
        if batch != self.batch_size:
            raise UnsupportedModelError(f"tokens has {batch} rows but the batch holds "
                                        f"{self.batch_size}")
        new = torch.ones(batch, m, dtype=torch.bool, device=self.device)
        mask = torch.cat([self.mask, new], 1)
        positions = self.positions[:, None] + torch.arange(m, device=self.device)[None, :]
        step = self.backbone.extend_rows(tokens.to(self.device), mask.long(), positions)
        if self.backbone.length == m:  # the first call of a batch whose prefill was empty
            self._check_layers()
        self.mask, self._block = mask, m
        self.positions = self.positions + m
        return step

    def keep(self, counts: Sequence[int]) -> None:
        """Roll each row back to its kept count (see :class:`RaggedBackbone`), then crop the
        slots no row holds at the end and compact when the holes exceed the slack."""
        m = self._block
        if len(counts) != self.batch_size or not all(1 <= c <= m for c in counts):
            raise ValueError(f"keep needs one count in 1..{m} per row of {self.batch_size}, got "
                             f"{list(counts)}")
        self._block = 0
        kept = torch.tensor(list(counts), dtype=torch.long, device=self.device)
        total = self.mask.shape[1]
        block = torch.arange(m, device=self.device)[None, :] < kept[:, None]  # (B, m)
        self.mask = torch.cat([self.mask[:, :total - m], block], 1)
        self.positions = self.positions - m + kept
        self._tidy()

    def select(self, rows: Sequence[int]) -> None:
        self._prefill = None
        index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        if not rows:
            self.backbone.reset()
            return
        slots = torch.arange(self.mask.shape[1], device=self.device)
        self.backbone.gather_slots(index, slots[None, :].expand(len(rows), -1))
        self._tidy()

    # ------------------------------------------------------------------ layout
    def row_slots(self, row: int) -> Tensor:
        """(n,) long: the slots row ``row`` holds, in its sequence's order."""
        return self.mask[row].nonzero()[:, 0]

    def _tidy(self) -> None:
        """Crop the slots no row holds at the end; compact when the holes exceed the slack."""
        held = self.mask.any(0).nonzero()
        end = int(held[-1, 0]) + 1 if held.numel() else 0
        if end < self.mask.shape[1]:
            self.mask = self.mask[:, :end]
            if end == 0:
                self.backbone.reset()
            else:
                self.backbone.crop(end)
        longest = int(self.positions.max()) if self.positions.numel() else 0
        if end - longest > max(self.min_slack, int(self.slack_fraction * longest)):
            self._compact(longest)

    def _compact(self, longest: int) -> None:
        """Move every row's tokens to the right end of ``longest`` slots (left padding before
        them): one gather of the caches."""
        batch = self.batch_size
        slots = torch.zeros(batch, longest, dtype=torch.long, device=self.device)
        for b in range(batch):
            held = self.row_slots(b)
            if held.numel():
                slots[b, longest - held.numel():] = held
        target = torch.arange(longest, device=self.device)[None, :]
        self.mask = target >= (longest - self.positions)[:, None]
        self.backbone.gather_slots(torch.arange(batch, device=self.device), slots)
        self.compactions += 1

    def _check_layers(self) -> None:
        """Refuse cache layers a per-row layout would break (a sliding-window layer keeps the
        last slots, not each row's last tokens; linear attention has no slots)."""
        for cache in (self.backbone.verifier_cache, self.backbone.draft_cache):
            for layer in cache.layers:
                if isinstance(layer, DynamicSlidingWindowLayer) or not isinstance(layer, DynamicLayer):
                    self.backbone.reset()
                    raise UnsupportedModelError(
                        f"batch decoding keeps per-row slots in every cache layer, which "
                        f"{type(layer).__name__} (a sliding-window or non-KV cache) cannot: "
                        f"decode this model's prompts one at a time")
