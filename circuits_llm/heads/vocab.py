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
* :func:`leading_tokens`, :func:`resolve_draft_vocab`: the draft vocabulary chosen without data
  that ``MTPHead.from_name`` uses by default on a vocabulary larger than :data:`COMPRESS_ABOVE`
  (the first :data:`DEFAULT_DRAFT_VOCAB` ids, plus the EOS ids), or the one a caller names.

A head's draft vocabulary (``MTPHead(..., draft_vocab=tokens)``) is a ``(K,)`` long tensor of
distinct model ids; the circuit's category ``k`` is model id ``tokens[k]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
from torch import Tensor

from circuits_llm.heads.config import HeadConfigError

__all__ = ["COMPRESS_ABOVE", "DEFAULT_DRAFT_VOCAB", "DraftVocab", "DraftVocabSource",
           "TokenCounts", "check_draft_tokens", "draft_positions", "frequent_tokens",
           "leading_tokens", "resolve_draft_vocab", "token_counts"]

#: ids counted per step of :func:`token_counts` (bounds its memory: 8 bytes per id)
COUNT_CHUNK = 1 << 22
#: ``MTPHead.from_name`` drafts over a compressed vocabulary by default when the model's has more
#: ids than this (a head's input units cost ``O(V)`` each per round; below it they are cheap)
COMPRESS_ABOVE = 16384
#: ``K`` of that default draft vocabulary. Measured with ``python -m benchmarks.decoder_bench
#: --first-head``: the README's first head on SmolLM2-135M (BTree, window 8, rank 16, LEAN)
#: costs at most 15% of a verify forward with it (about 1.0x over the whole vocabulary)
DEFAULT_DRAFT_VOCAB = 4096

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


class DraftVocab(Enum):
    """The named choices of ``MTPHead.from_name(..., draft_vocab=)`` (besides a size or ids).

    ``AUTO`` (the default): a compressed vocabulary of :data:`DEFAULT_DRAFT_VOCAB` leading ids
    when the vocabulary is larger than :data:`COMPRESS_ABOVE`, else every id. ``FULL``: every id.
    """

    AUTO = "auto"
    FULL = "full"


class DraftVocabSource(Enum):
    """How a head's draft vocabulary was chosen (shown in the head's ``repr``)."""

    FULL = "full"             #: every id of the vocabulary
    DEFAULT = "default"       #: by default: the leading ids and the EOS ids
    LEADING = "leading ids"   #: an explicit size ``K``: the leading ids and the EOS ids
    GIVEN = "given ids"       #: ids the caller passed (e.g. :func:`frequent_tokens` of data)


#: what ``draft_vocab=`` accepts: a named choice (or its value), a size ``K``, ids, or None (every id)
DraftVocabSpec = DraftVocab | str | int | Tensor | Sequence[int] | None


def leading_tokens(vocab_size: int, k: int, always: Iterable[int] = ()) -> Tensor:
    """The ``k`` smallest ids ``0 .. k-1``, with the ids of ``always`` (e.g. EOS) in place of the
    last ones when they lie beyond: a draft vocabulary chosen without data.

    In a BPE vocabulary ids follow the merges, so the first ids are the bytes, the special tokens
    and the earliest (most frequent) merges. This is :func:`frequent_tokens` over all-zero counts
    (every tie broken by increasing id), so the result has its order and checks.

    Returns:
        (K,) int64 distinct ids (CPU), increasing.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise HeadConfigError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    return frequent_tokens(TokenCounts(torch.zeros(vocab_size, dtype=torch.int64)), k,
                           always=always)


def resolve_draft_vocab(draft_vocab: DraftVocabSpec, vocab_size: int, eos_ids: Iterable[int] = (),
                        compress_above: int = COMPRESS_ABOVE,
                        ) -> tuple[Tensor | None, DraftVocabSource]:
    """The draft ids ``MTPHead.from_name`` builds a head over, and how they were chosen.

    Args:
        draft_vocab: :attr:`DraftVocab.AUTO` (or ``"auto"``): :func:`leading_tokens` of size
            :data:`DEFAULT_DRAFT_VOCAB` when ``vocab_size`` exceeds ``compress_above`` (and that
            size), else every id;
            :attr:`DraftVocab.FULL` (``"full"``) or None: every id; an int ``K``: the ``K``
            leading ids; a (K,) tensor or sequence of ids: those ids.
        vocab_size: ``V``, the model's vocabulary.
        eos_ids: ids a data-free choice always keeps (the model's EOS ids), so a draft can end an
            answer where the model would.
        compress_above: the threshold of ``AUTO`` (default :data:`COMPRESS_ABOVE`).

    Returns:
        ``(tokens, source)``: (K,) int64 ids or None for every id, and a
        :class:`DraftVocabSource`.

    Raises:
        HeadConfigError: an unknown name, a bad size or threshold, or invalid ids.
    """
    if isinstance(compress_above, bool) or not isinstance(compress_above, int) \
            or compress_above < 1:
        raise HeadConfigError(f"compress_above must be an int >= 1, got {compress_above!r}")
    if isinstance(draft_vocab, str) and not isinstance(draft_vocab, DraftVocab):
        try:
            draft_vocab = DraftVocab(draft_vocab.lower())
        except ValueError:
            names = ", ".join(repr(choice.value) for choice in DraftVocab)
            raise HeadConfigError(f"draft_vocab must be {names}, a size K, or a sequence of token "
                                  f"ids; got {draft_vocab!r}") from None
    if draft_vocab is None or draft_vocab is DraftVocab.FULL:
        return None, DraftVocabSource.FULL
    if draft_vocab is DraftVocab.AUTO:
        if vocab_size <= max(compress_above, DEFAULT_DRAFT_VOCAB):
            return None, DraftVocabSource.FULL
        return leading_tokens(vocab_size, DEFAULT_DRAFT_VOCAB, eos_ids), DraftVocabSource.DEFAULT
    if isinstance(draft_vocab, bool):
        raise HeadConfigError(f"draft_vocab must be a size K, ids or a named choice, got "
                              f"{draft_vocab!r}")
    if isinstance(draft_vocab, int):
        return leading_tokens(vocab_size, draft_vocab, eos_ids), DraftVocabSource.LEADING
    return check_draft_tokens(draft_vocab, vocab_size), DraftVocabSource.GIVEN
