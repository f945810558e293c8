"""Compressed draft vocabularies: a head drafts over the K most frequent tokens of its data.

FR-Spec (Zhao et al., 2025) and FastMTP (Sec. 2.2) observe that a small set of tokens accounts
for almost every occurrence in text, and restrict the drafter's output space to it: the drafter's
logits are computed for ``K`` rows of the LM head instead of ``V``. The verifier keeps the whole
vocabulary, so decoding stays lossless: a draft law ``q`` that is zero outside the ``K`` tokens
is corrected by the verifier's residual like any other (see ``docs/decoder-exactness.md``).

* :class:`TokenCounts`: how often every id ``0 .. V-1`` occurs (:func:`token_counts` builds it
  from a token stream, chunk by chunk, never holding more than one chunk).
* :func:`frequent_tokens`: the ``K`` ids a head drafts over, by decreasing frequency (ties by
  increasing id), optionally always including some ids (EOS, so a draft can end an answer).
* :func:`check_draft_tokens`, :func:`draft_positions`: validation and the id -> draft-index map.

A head's draft vocabulary (``MTPHead(..., draft_vocab=tokens)``) is a ``(K,)`` long tensor of
distinct model ids; the circuit's category ``k`` is model id ``tokens[k]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from circuits_llm.heads.config import HeadConfigError

__all__ = ["TokenCounts", "check_draft_tokens", "draft_positions", "frequent_tokens",
           "token_counts"]

#: ids counted per step of :func:`token_counts` (bounds its memory: 8 bytes per id)
COUNT_CHUNK = 1 << 22

TokenSource = Tensor | np.ndarray | Iterable[Tensor | np.ndarray | Sequence[int]]


@dataclass(frozen=True)
class TokenCounts:
    """Occurrences of every token id of a vocabulary.

    Attributes:
        counts: (V,) int64, ``counts[i]`` = occurrences of id ``i`` (>= 0).
    """

    counts: Tensor

    def __post_init__(self) -> None:
        counts = self.counts
        if not isinstance(counts, Tensor) or counts.dim() != 1 or counts.numel() == 0 \
                or counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
            got = tuple(counts.shape) if isinstance(counts, Tensor) else type(counts).__name__
            raise HeadConfigError(f"token counts must be a non-empty (V,) integer tensor, got {got}")
        if bool((counts < 0).any()):
            raise HeadConfigError("token counts must be >= 0")
        object.__setattr__(self, "counts", counts.detach().to("cpu", torch.int64))

    @property
    def vocab_size(self) -> int:
        """``V``: the number of ids counted."""
        return int(self.counts.shape[0])

    @property
    def total(self) -> int:
        """Occurrences of every id together."""
        return int(self.counts.sum())

    def coverage(self, tokens: Tensor) -> float:
        """The fraction of all occurrences that fall on ``tokens`` (K,) (1.0 for no data)."""
        total = self.total
        if total == 0:
            return 1.0
        return float(self.counts[tokens.to("cpu", torch.long)].sum()) / total


def _chunks(source: TokenSource) -> Iterable[np.ndarray]:
    """``source`` as 1-D integer numpy chunks of at most :data:`COUNT_CHUNK` ids."""
    parts: Iterable[Tensor | np.ndarray | Sequence[int]]
    if isinstance(source, (Tensor, np.ndarray)):
        parts = (source,)
    elif isinstance(source, Iterable):
        parts = source
    else:
        raise HeadConfigError(f"a token stream must be a tensor, a numpy array or an iterable of "
                              f"them, got {type(source).__name__}")
    for part in parts:
        if isinstance(part, Tensor):
            if part.is_floating_point() or part.is_complex() or part.dtype == torch.bool:
                raise HeadConfigError(f"token ids must be integers, got a {part.dtype} tensor")
            array = part.detach().reshape(-1).cpu().numpy()
        else:
            array = np.asarray(part).reshape(-1)
            if array.size and not np.issubdtype(array.dtype, np.integer):
                raise HeadConfigError(f"token ids must be integers, got an array of {array.dtype}")
        for start in range(0, array.shape[0], COUNT_CHUNK):
            yield array[start:start + COUNT_CHUNK]


def token_counts(source: TokenSource, vocab_size: int) -> TokenCounts:
    """Count the ids of a token stream: a tensor or array of ids (any shape, e.g. a memory-mapped
    corpus) or an iterable of such chunks, read :data:`COUNT_CHUNK` ids at a time.

    Raises:
        HeadConfigError: a non-integer stream, or an id outside ``0 .. vocab_size-1``.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise HeadConfigError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for chunk in _chunks(source):
        if chunk.size == 0:
            continue
        ids = chunk.astype(np.int64, copy=False)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise HeadConfigError(f"token id {bad} is outside the vocabulary 0..{vocab_size - 1}")
        counts += np.bincount(ids, minlength=vocab_size)
    return TokenCounts(torch.from_numpy(counts))


def frequent_tokens(source: TokenCounts | TokenSource, k: int, *, vocab_size: int | None = None,
                    always: Iterable[int] = ()) -> Tensor:
    """The ``k`` most frequent ids, by decreasing count, ties broken by increasing id.

    Args:
        source: :class:`TokenCounts`, or a token stream (see :func:`token_counts`; then
            ``vocab_size`` is required).
        k: ``K``, ``1 <= K <= V``. Ids that never occur fill the last places (by id) when
            fewer than ``K`` ids occur.
        vocab_size: ``V`` of a token stream (must equal ``counts.vocab_size`` when given with
            counts).
        always: ids that are part of the result whatever their counts (e.g. EOS); the others
            are the most frequent of the rest. The result stays ordered by (count, id).

    Returns:
        (K,) int64 distinct ids (CPU).

    Raises:
        HeadConfigError: a bad ``k``, ``vocab_size`` or ``always`` id, or more ``always`` ids
            than ``k``.
    """
    if isinstance(source, TokenCounts):
        counts = source
        if vocab_size is not None and vocab_size != counts.vocab_size:
            raise HeadConfigError(f"vocab_size {vocab_size} differs from the {counts.vocab_size} "
                                  "ids counted")
    else:
        if vocab_size is None:
            raise HeadConfigError("frequent_tokens of a token stream needs vocab_size (or pass "
                                  "TokenCounts)")
        counts = token_counts(source, vocab_size)
    size = counts.vocab_size
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= size:
        raise HeadConfigError(f"the draft vocabulary size K must be an int in 1..{size} (the "
                              f"vocabulary), got {k!r}")
    forced = sorted({int(i) for i in always})
    if any(not 0 <= i < size for i in forced):
        raise HeadConfigError(f"always-included ids {forced} must lie in 0..{size - 1}")
    if len(forced) > k:
        raise HeadConfigError(f"{len(forced)} always-included ids do not fit in K = {k}")
    # stable sort of -count: equal counts keep increasing id order
    order = torch.sort(-counts.counts, stable=True).indices
    chosen = torch.zeros(size, dtype=torch.bool)
    chosen[forced] = True
    rest = order[~chosen[order]][:k - len(forced)]
    chosen[rest] = True
    return order[chosen[order]].clone()


def check_draft_tokens(tokens: Tensor | Sequence[int], vocab_size: int) -> Tensor:
    """``tokens`` as a (K,) int64 CPU tensor after checking it is a draft vocabulary of a
    ``vocab_size`` model: non-empty, 1-D, integer, distinct ids in ``0 .. vocab_size-1``.

    Raises:
        HeadConfigError: naming what is wrong.
    """
    if not isinstance(tokens, Tensor):
        try:
            tokens = torch.tensor(list(tokens))
        except (TypeError, ValueError, RuntimeError):
            raise HeadConfigError(f"draft_vocab must be a (K,) tensor or sequence of token ids, "
                                  f"got {type(tokens).__name__}") from None
    if tokens.dim() != 1 or tokens.numel() == 0 or tokens.is_floating_point() \
            or tokens.is_complex() or tokens.dtype == torch.bool:
        raise HeadConfigError(f"draft_vocab must be a non-empty (K,) integer tensor of token ids, "
                              f"got shape {tuple(tokens.shape)} and dtype {tokens.dtype}")
    tokens = tokens.detach().to("cpu", torch.long).contiguous()
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise HeadConfigError(f"draft_vocab ids must lie in 0..{vocab_size - 1} (the model's "
                              f"vocabulary), got {low if low < 0 else high}")
    if int(torch.unique(tokens).numel()) != tokens.numel():
        raise HeadConfigError("draft_vocab ids must be distinct")
    return tokens


def draft_positions(tokens: Tensor, vocab_size: int) -> Tensor:
    """(V,) int64 on ``tokens``' device: ``position[tokens[k]] = k``, ``-1`` for ids outside."""
    position = torch.full((vocab_size,), -1, dtype=torch.long, device=tokens.device)
    position[tokens] = torch.arange(tokens.numel(), device=tokens.device)
    return position
