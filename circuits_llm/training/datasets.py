"""The sequences a head is trained and validated on, in the model's own tokens.

The corpus (by default this interpreter's standard library; ``--corpus-root`` otherwise) is
tokenised with the model's tokenizer once and cached on disk (:mod:`circuits_llm.text.corpus`): a
resumed run or a second head reads the memory-mapped token file, and nothing holds the whole
corpus in memory. The tokenizer is the one given, else the model's own
(:func:`circuits_llm.text.tokens.tokenizer_for`: the reference :func:`circuits_llm.text.models.load_causal_lm`
recorded, or bytes for a byte model); it must fit the model's vocabulary
(:func:`circuits_llm.text.tokens.check_vocabulary`), so a byte corpus is never fed to a subword model.

* :attr:`DataSource.CORPUS`: every window of ``seq_len`` tokens of the training split, capped at
  ``max_train_bytes`` tokens (stride 1: :class:`StreamWindows`), or its disjoint windows (stride
  ``seq_len``) when the run caches backbone features (``cache_features`` ``ON``:
  :mod:`circuits_llm.training.features`); validation: the first ``eval_windows``
  non-overlapping windows of the validation split.
* :attr:`DataSource.SELF_DISTILLED` (FastMTP Sec. 2.4): prompts from the same streams continued
  by the model itself (:mod:`circuits_llm.training.self_distill`, cached and resumable in the run
  directory); the loss covers the responses only (windows start at the last prompt token or
  later). With ``distill_chat_samples`` the model's replies to chat requests follow them
  (:mod:`circuits_llm.training.chat_distill`; :class:`JoinedSequences`), trained on up to each
  reply's end.

Every problem with the data is one :class:`~circuits_llm.training.config.TrainingConfigError`
naming the corpus and what to change, raised before anything is written.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedModel

from circuits_llm.heads.vocab import TokenCounts, token_counts
from circuits_llm.text.byte_level import Split, stdlib_root
from circuits_llm.text.corpus import CorpusError, TokenStream, tokenized_split
from circuits_llm.text.tokens import TextTokenizer, TokenizerError, check_vocabulary, tokenizer_for
from circuits_llm.training.chat_distill import chat_distilled_rows, chat_plan
from circuits_llm.training.config import (
    DataSource,
    FeatureCaching,
    HeadTrainingConfig,
    TrainingConfigError,
)
from circuits_llm.training.self_distill import (
    DISTILL_FILE,
    DISTILL_KIND,
    PARTS_DIR,
    plan,
    self_distilled_rows,
)

__all__ = ["DISTILL_FILE", "DISTILL_KIND", "PARTS_DIR", "JoinedSequences", "SequenceSet",
           "StreamWindows",
           "TensorSequences", "corpus_sets", "self_distilled_sets", "training_sets",
           "training_streams", "training_tokenizer"]


class SequenceSet(ABC):
    """Equal-length token sequences and where the loss applies: what the trainer draws from."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of sequences."""

    @abstractmethod
    def rows(self, index: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(tokens (b, L) int64, mask (b, L) bool or None)`` for the row indices ``index`` (b,);
        the mask (:func:`circuits_llm.training.loss.mtp_loss`'s) marks tokens that may start a window or
        be a target, None: every token."""

    @property
    def token_source(self) -> SequenceSet:
        """The set whose tokens these rows are: itself, or the set a wrapper (e.g. the cached
        features of :mod:`circuits_llm.training.features`) adds to."""
        return self


@dataclass(frozen=True)
class TensorSequences(SequenceSet):
    """Sequences held in memory (the self-distilled rows).

    Attributes:
        sequences: (N, L) int64 token ids.
        loss_mask: (N, L) bool, or None for every token.
    """

    sequences: Tensor
    loss_mask: Tensor | None = None

    def __len__(self) -> int:
        return int(self.sequences.shape[0])

    def rows(self, index: Tensor) -> tuple[Tensor, Tensor | None]:
        mask = None if self.loss_mask is None else self.loss_mask[index]
        return self.sequences[index], mask


@dataclass(frozen=True)
class JoinedSequences(SequenceSet):
    """Sets of equal-length rows one after the other (the corpus rows, then the chat rows):
    row ``i`` of the join is row ``i - offset`` of the part it falls in.

    Attributes:
        parts: the sets, every row of every part of one length.
    """

    parts: tuple[SequenceSet, ...]

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    def locate(self, index: Tensor) -> list[tuple[int, Tensor, Tensor]]:
        """``(part, where, local)`` for each part holding some of ``index`` (b,): the positions
        ``where`` in ``index`` and the rows ``local`` within the part."""
        flat = index.reshape(-1).long()
        found, offset = [], 0
        for number, part in enumerate(self.parts):
            inside = (flat >= offset) & (flat < offset + len(part))
            if bool(inside.any()):
                where = inside.nonzero().reshape(-1)
                found.append((number, where, flat[where] - offset))
            offset += len(part)
        return found

    def rows(self, index: Tensor) -> tuple[Tensor, Tensor | None]:
        tokens: Tensor | None = None
        mask: Tensor | None = None
        flat = index.reshape(-1).long()
        for number, where, local in self.locate(flat):
            part_tokens, part_mask = self.parts[number].rows(local)
            if tokens is None:
                tokens = part_tokens.new_zeros((flat.shape[0], part_tokens.shape[1]))
                mask = torch.ones(tokens.shape, dtype=torch.bool)
            tokens[where] = part_tokens
            if part_mask is not None and mask is not None:
                mask[where] = part_mask
        if tokens is None:
            raise IndexError("no rows asked of a joined sequence set")
        return tokens, mask


@dataclass(frozen=True)
class StreamWindows(SequenceSet):
    """Windows of a memory-mapped token stream: window ``i`` is ``ids[i*stride : i*stride+length]``.

    Attributes:
        stream: the tokens.
        length: tokens per window (``seq_len``).
        stride: start-to-start distance (1: every window; ``length``: disjoint windows).
        count: number of windows (at most the number that fit).
    """

    stream: TokenStream
    length: int
    stride: int
    count: int

    def __post_init__(self) -> None:
        fits = (len(self.stream) - self.length) // self.stride + 1 if len(self.stream) >= \
            self.length else 0
        if not 0 <= self.count <= fits:
            raise ValueError(f"{self.count} windows of {self.length} tokens (stride {self.stride}) "
                             f"do not fit in a stream of {len(self.stream)} tokens")

    def __len__(self) -> int:
        return self.count

    def rows(self, index: Tensor) -> tuple[Tensor, None]:
        return self.stream.windows(index.reshape(-1).long() * self.stride, self.length), None


# ---------------------------------------------------------------------------- tokenised streams
def training_tokenizer(model: PreTrainedModel, tokenizer: TextTokenizer | None) -> TextTokenizer:
    """``tokenizer`` or the model's own, checked to fit the model (see the module docstring)."""
    try:
        chosen = tokenizer_for(model) if tokenizer is None else tokenizer
        check_vocabulary(chosen, model)
    except TokenizerError as error:
        raise TrainingConfigError(str(error)) from None
    return chosen


def training_streams(config: HeadTrainingConfig, tokenizer: TextTokenizer, root: Path | None = None,
                     cache_dir: Path | None = None, progress: bool = False,
                     ) -> tuple[TokenStream, TokenStream]:
    """The training stream (capped at ``max_train_bytes`` tokens) and the validation stream.

    Raises:
        TrainingConfigError: the corpus directory is missing, a split has no files, or a split
            is too short for one training sequence or ``eval_windows`` validation sequences;
            the message names the corpus and what to change.
    """
    root = stdlib_root() if root is None else Path(root)
    try:
        train = tokenized_split(tokenizer, Split.TRAIN, root, cache_dir, progress)
        validation = tokenized_split(tokenizer, Split.VALIDATION, root, cache_dir, progress)
    except CorpusError as error:
        raise TrainingConfigError(str(error)) from None
    train = train.head(config.max_train_bytes)
    if len(train) < config.seq_len + 1:  # max_train_bytes >= seq_len + 1: the corpus is short
        raise TrainingConfigError(
            f"the training split of the corpus {root} has {len(train)} tokens, fewer than one "
            f"sequence of seq_len + 1 = {config.seq_len + 1}; add .py files to the corpus or "
            "lower --seq-len")
    needed = config.eval_windows * config.seq_len
    if len(validation) < needed:
        raise TrainingConfigError(
            f"the validation split of the corpus {root} has {len(validation)} tokens, fewer "
            f"than eval_windows * seq_len = {needed}; lower --eval-windows or --seq-len, or add "
            ".py files to the corpus")
    return train, validation


def corpus_sets(config: HeadTrainingConfig, train: TokenStream, validation: TokenStream,
                ) -> tuple[SequenceSet, SequenceSet]:
    """``(train, validation)`` corpus windows (see the module docstring): every window of the
    training stream, or its disjoint ones when ``cache_features`` is ``ON``."""
    stride = config.seq_len if config.cache_features is FeatureCaching.ON else 1
    count = (len(train) - config.seq_len) // stride + 1
    return (StreamWindows(train, config.seq_len, stride, count),
            StreamWindows(validation, config.seq_len, config.seq_len, config.eval_windows))


def _response_mask(sequences: Tensor, prompt_len: int) -> Tensor:
    """True from the last prompt token on: windows start there or later (responses only)."""
    mask = torch.zeros(sequences.shape, dtype=torch.bool)
    mask[:, prompt_len - 1:] = True
    return mask


def self_distilled_sets(model: PreTrainedModel, config: HeadTrainingConfig, tokenizer: TextTokenizer,
                        train: TokenStream, validation: TokenStream, run_dir: Path, *,
                        writer: bool, progress: bool = False, root: Path | None = None,
                        ) -> tuple[SequenceSet, SequenceSet]:
    """``(train, validation)`` self-distilled rows, from ``run_dir``'s cache or generated into it.

    Raises:
        CheckpointError: the cache is corrupt or was generated with other settings or another
            model (it is left untouched).
    """
    rows_train, rows_validation = self_distilled_rows(
        model, plan(model, tokenizer, config, train, validation), run_dir, writer=writer,
        progress=progress)
    prompt_len = config.distill_prompt_len
    corpus = (TensorSequences(rows_train, _response_mask(rows_train, prompt_len)),
              TensorSequences(rows_validation, _response_mask(rows_validation, prompt_len)))
    if not config.distill_chat_samples:
        return corpus
    chat_train, mask_train, chat_validation, mask_validation = chat_distilled_rows(
        model, chat_plan(model, tokenizer, config, root), run_dir, writer=writer,
        progress=progress)
    return (JoinedSequences((corpus[0], TensorSequences(chat_train, mask_train))),
            JoinedSequences((corpus[1], TensorSequences(chat_validation, mask_validation))))


def training_sets(model: PreTrainedModel, config: HeadTrainingConfig, run_dir: Path, *,
                  writer: bool, root: Path | None = None, progress: bool = False,
                  tokenizer: TextTokenizer | None = None, cache_dir: Path | None = None,
                  ) -> tuple[SequenceSet, SequenceSet]:
    """``(train, validation)`` for ``config.data``, in the tokens of ``tokenizer`` (default: the
    model's own; see the module docstring). ``cache_dir``: the corpus cache
    (:func:`circuits_llm.text.corpus.corpus_cache_dir` by default)."""
    chosen = training_tokenizer(model, tokenizer)
    train, validation = training_streams(config, chosen, root, cache_dir, progress)
    if config.data is DataSource.SELF_DISTILLED:
        return self_distilled_sets(model, config, chosen, train, validation, Path(run_dir),
                                   writer=writer, progress=progress, root=root)
    return corpus_sets(config, train, validation)


def training_token_counts(data: SequenceSet, vocab_size: int) -> TokenCounts:
    """How often every id occurs where the head is trained: the token stream a corpus's windows
    cover, or the loss-masked tokens of in-memory sequences (the self-distilled responses); any
    other :class:`SequenceSet` is read row by row. A wrapper counts the set it wraps
    (:attr:`SequenceSet.token_source`)."""
    data = data.token_source
    if isinstance(data, StreamWindows):
        covered = 0 if data.count == 0 else (data.count - 1) * data.stride + data.length
        return token_counts(np.asarray(data.stream.ids[:covered]), vocab_size)
    if isinstance(data, TensorSequences):
        tokens = data.sequences if data.loss_mask is None else data.sequences[data.loss_mask]
        return token_counts(tokens, vocab_size)
    if isinstance(data, JoinedSequences):
        return TokenCounts(sum((training_token_counts(part, vocab_size).counts
                                for part in data.parts), torch.zeros(vocab_size, dtype=torch.int64)))
    rows = torch.arange(len(data))
    return token_counts((data.rows(chunk)[0] for chunk in rows.split(256)), vocab_size)
