"""The sequences a head is trained and validated on.

* :attr:`DataSource.CORPUS`: every window of ``seq_len`` tokens of the packed stdlib training
  split (stride 1, a view); validation: the first ``eval_windows`` non-overlapping windows of the
  validation split.
* :attr:`DataSource.SELF_DISTILLED` (FastMTP Sec. 2.4): prompts of ``distill_prompt_len`` tokens
  cut from the training split at seeded random positions, each continued by the target model
  itself for ``seq_len - distill_prompt_len`` tokens with :class:`AutoregressiveDecoder`
  (sampling at ``distill_temperature`` with a generator seeded by ``seed``; no EOS stop, so every
  sequence has exactly ``seq_len`` tokens). Validation prompts come from the validation split.
  The loss covers the responses only: windows start at the last prompt token or later. The
  generated sequences are cached in ``run_dir/self_distilled.pt`` together with what produced
  them (config values and the model fingerprint); a cache made otherwise is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel

from circuits_llm.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from circuits_llm.data import Split, corpus_files, pack, stdlib_root
from circuits_llm.decoder import AutoregressiveDecoder
from circuits_llm.training.build import model_fingerprint
from circuits_llm.training.config import DataSource, HeadTrainingConfig, TrainingConfigError

DISTILL_KIND = "circuits_llm.self_distilled"
DISTILL_FILE = "self_distilled.pt"


@dataclass(frozen=True)
class SequenceSet:
    """Equal-length token sequences and where the loss applies.

    Attributes:
        sequences: (N, L) long token ids.
        loss_mask: (N, L) bool, True for tokens that may start a window or be a target (the
            ``mask`` of :func:`circuits_llm.loss.mtp_loss`); None: every token.
    """

    sequences: Tensor
    loss_mask: Tensor | None = None

    def __len__(self) -> int:
        return int(self.sequences.shape[0])

    def rows(self, index: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(tokens (b, L), mask (b, L) or None)`` for the row indices ``index`` (b,)."""
        mask = None if self.loss_mask is None else self.loss_mask[index]
        return self.sequences[index], mask


def _split_stream(split: Split, root: Path, max_bytes: int | None) -> Tensor:
    """The packed stream of ``split`` of the corpus at ``root`` (a clear error when it is empty)."""
    name, share = {Split.TRAIN: ("training", "about 90%"),
                   Split.VALIDATION: ("validation", "about 5%")}[split]
    files = corpus_files(split, root)
    if not files:
        raise TrainingConfigError(
            f"the corpus {root} has no {name} files (.py files whose path hash puts them in the "
            f"{split.value} split: {share} of them); give --corpus-root a directory with more "
            ".py files")
    return pack(files, max_bytes=max_bytes)


def _streams(config: HeadTrainingConfig, root: Path | None) -> tuple[Tensor, Tensor]:
    """The packed training stream (capped at ``max_train_bytes``) and validation stream.

    Raises:
        TrainingConfigError: the corpus directory is missing, a split has no files, or a split
            is too short for one training sequence or ``eval_windows`` validation sequences;
            the message names the corpus and what to change.
    """
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise TrainingConfigError(f"the corpus directory {root} does not exist; give --corpus-root "
                                  "a directory of .py files")
    train = _split_stream(Split.TRAIN, root, config.max_train_bytes)
    if train.numel() < config.seq_len + 1:  # max_train_bytes >= seq_len + 1: the corpus is short
        raise TrainingConfigError(
            f"the training split of the corpus {root} has {train.numel()} tokens, fewer than one "
            f"sequence of seq_len + 1 = {config.seq_len + 1}; add .py files to the corpus or "
            "lower --seq-len")
    needed = config.eval_windows * config.seq_len
    validation = _split_stream(Split.VALIDATION, root, needed)
    if validation.numel() < needed:
        raise TrainingConfigError(
            f"the validation split of the corpus {root} has {validation.numel()} tokens, fewer "
            f"than eval_windows * seq_len = {needed}; lower --eval-windows or --seq-len, or add "
            ".py files to the corpus")
    return train, validation


def corpus_sets(config: HeadTrainingConfig, root: Path | None = None,
                ) -> tuple[SequenceSet, SequenceSet]:
    """``(train, validation)`` windows of the stdlib corpus (see the module docstring)."""
    train, validation = _streams(config, root)
    return (SequenceSet(train.unfold(0, config.seq_len, 1)),
            SequenceSet(validation[:config.eval_windows * config.seq_len].view(-1, config.seq_len)))


def _distill_key(config: HeadTrainingConfig, model: PreTrainedModel) -> dict[str, object]:
    names = ("seed", "seq_len", "distill_samples", "distill_prompt_len", "distill_temperature",
             "eval_windows", "max_train_bytes")
    return {**{name: getattr(config, name) for name in names}, "model": model_fingerprint(model)}


def _continue(decoder: AutoregressiveDecoder, prompts: Tensor, config: HeadTrainingConfig,
              generator: torch.Generator, label: str, progress: bool) -> Tensor:
    """(N, P) prompts -> (N, P + R) prompt + R sampled tokens of the decoder's model."""
    rows = []
    iterator = prompts
    if progress:
        from tqdm import tqdm
        iterator = tqdm(prompts, desc=f"self-distil {label}", unit="seq", dynamic_ncols=True)
    for prompt in iterator:
        result = decoder.generate(prompt, config.response_len,
                                  temperature=config.distill_temperature, generator=generator)
        rows.append(torch.cat([prompt, result.tokens.to(prompt.device)]))
    return torch.stack(rows)


def generate_self_distilled(model: PreTrainedModel, config: HeadTrainingConfig,
                            root: Path | None = None, progress: bool = False,
                            ) -> tuple[Tensor, Tensor]:
    """``(train (distill_samples, L), validation (eval_windows, L))`` self-distilled sequences."""
    train, validation = _streams(config, root)
    prompt_len = config.distill_prompt_len
    picker = torch.Generator().manual_seed(config.seed)
    starts = torch.randint(0, train.numel() - prompt_len + 1, (config.distill_samples,),
                           generator=picker)
    train_prompts = torch.stack([train[s:s + prompt_len] for s in starts.tolist()])
    val_prompts = validation.view(-1, config.seq_len)[:, :prompt_len]
    decoder = AutoregressiveDecoder(model)
    sampler = torch.Generator(device=decoder.device).manual_seed(config.seed)
    with torch.no_grad():
        train_rows = _continue(decoder, train_prompts, config, sampler, "train", progress)
        val_rows = _continue(decoder, val_prompts, config, sampler, "validation", progress)
    return train_rows.cpu(), val_rows.cpu()


def _response_mask(sequences: Tensor, prompt_len: int) -> Tensor:
    """True from the last prompt token on: windows start there or later (responses only)."""
    mask = torch.zeros(sequences.shape, dtype=torch.bool)
    mask[:, prompt_len - 1:] = True
    return mask


def self_distilled_sets(model: PreTrainedModel, config: HeadTrainingConfig, run_dir: Path, *,
                        writer: bool, root: Path | None = None, progress: bool = False,
                        ) -> tuple[SequenceSet, SequenceSet]:
    """Load ``run_dir/self_distilled.pt`` or generate it (only ``writer`` writes it).

    Raises:
        CheckpointError: the cache is corrupt or was generated with other settings or another
            model (it is left untouched).
    """
    path = run_dir / DISTILL_FILE
    key = _distill_key(config, model)
    if path.exists():
        cached = load_checkpoint(path, DISTILL_KIND)
        if cached.get("key") != key:
            raise CheckpointError(
                f"{path} was generated with other settings or another model ({cached.get('key')}"
                f" != {key}); delete it or use a new run directory")
        train, validation = cached["train"], cached["validation"]
        expected = [(config.distill_samples, config.seq_len), (config.eval_windows, config.seq_len)]
        if [tuple(train.shape), tuple(validation.shape)] != expected:
            raise CheckpointError(f"{path} holds sequences of the wrong shape; the file is corrupt")
    else:
        train, validation = generate_self_distilled(model, config, root, progress and writer)
        if writer:
            save_checkpoint(path, DISTILL_KIND, {"key": key, "train": train,
                                                 "validation": validation})
    prompt_len = config.distill_prompt_len
    return (SequenceSet(train, _response_mask(train, prompt_len)),
            SequenceSet(validation, _response_mask(validation, prompt_len)))


def training_sets(model: PreTrainedModel, config: HeadTrainingConfig, run_dir: Path, *,
                  writer: bool, root: Path | None = None, progress: bool = False,
                  ) -> tuple[SequenceSet, SequenceSet]:
    """``(train, validation)`` for ``config.data``."""
    if config.data is DataSource.SELF_DISTILLED:
        return self_distilled_sets(model, config, run_dir, writer=writer, root=root,
                                   progress=progress)
    return corpus_sets(config, root)
