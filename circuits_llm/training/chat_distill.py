"""Self-distilled chat rows: the model's own replies to chat requests, next to its code continuations.

An instruct model's users chat as well as write code. ``train-head --distill-chat-samples N``
adds ``N`` training rows (and ``eval_windows`` validation rows) in which the model replies to a
chat request (:mod:`circuits_llm.text.chat_requests`, wrapped in its chat template) to the
``distill_samples`` corpus rows of :mod:`circuits_llm.training.self_distill`. They are generated,
cached and resumed like those (one verified part per batch, then ``self_distilled_chat.pt`` in the
run directory), with three differences:

* **Prompts of many lengths.** A row is its prompt then ``seq_len - len(prompt)`` reply tokens, so
  every row has ``seq_len`` tokens and joins the corpus rows in one set. Batches group prompts of
  one length (sorted by length, then row), so no padding is needed and a row's positions are
  those of a row generated alone. Prompts take at most :func:`max_prompt_tokens` ids.
* **Replies end.** Generation stops a batch once every row has produced an end-of-sequence id
  (the model's ``generation_config``, as ``model.generate``); :func:`reply_mask` trains on the
  reply up to and including its first end, never on what follows.
* **Seeds.** Row ``i`` draws from a generator seeded ``seed + CHAT_SEED_OFFSET + i``, apart from
  the corpus rows' ``seed + i``.

The key a cache is checked against holds the settings, the model's and the tokenizer's
fingerprints and the SHA-256 of the prompts' ids, so a change to the requests is a new cache.
"""

from __future__ import annotations

import hashlib
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers import PreTrainedModel

from circuits_llm.decoding.stopping import eos_ids
from circuits_llm.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from circuits_llm.text.byte_level import Split
from circuits_llm.text.chat_requests import ChatRequestError, chat_prompts
from circuits_llm.text.models import backbone_identity
from circuits_llm.text.tokens import ChatTemplateError, TextTokenizer
from circuits_llm.training.config import HeadTrainingConfig, TrainingConfigError
from circuits_llm.training.self_distill import _mismatch, generate_rows

__all__ = ["CHAT_DISTILL_FILE", "CHAT_SEED_OFFSET", "ChatPlan", "chat_distilled_rows", "chat_plan",
           "max_prompt_tokens", "reply_mask"]

CHAT_DISTILL_FILE = "self_distilled_chat.pt"
CHAT_KIND = "circuits_llm.self_distilled_chat"
CHAT_PART_KIND = "circuits_llm.self_distilled_chat_part"
CHAT_PARTS_DIR = "self_distilled_chat.parts"
#: Added to the run's seed for the chat rows' generators (the corpus rows use ``seed + i``).
CHAT_SEED_OFFSET = 1 << 31


def max_prompt_tokens(seq_len: int, window: int) -> int:
    """The longest chat prompt a row holds: two thirds of it, leaving room for a reply of at
    least a window and one token."""
    return min(2 * seq_len // 3, seq_len - window - 1)


@dataclass(frozen=True)
class ChatPlan:
    """What to generate: chat prompts of many lengths, in batches of one length.

    Attributes:
        prompts: N 1-D int64 prompts, the training rows then the validation rows.
        train_rows: how many of them are training rows.
        row_length: tokens per row (``seq_len``): prompt, then reply.
        temperature: the sampling temperature (0: greedy).
        seed: row ``i`` samples with a generator seeded ``seed + CHAT_SEED_OFFSET + i``.
        key: what produced the rows.
        batch_rows: rows generated together at most.
        stop_ids: the model's end-of-sequence ids (a batch stops once every row has one).
    """

    prompts: list[Tensor]
    train_rows: int
    row_length: int
    temperature: float
    seed: int
    key: dict[str, Any]
    batch_rows: int
    stop_ids: tuple[int, ...]
    groups: list[list[int]] = field(init=False, repr=False)

    parts_dir: ClassVar[str] = CHAT_PARTS_DIR
    part_kind: ClassVar[str] = CHAT_PART_KIND

    def __post_init__(self) -> None:
        by_length: dict[int, list[int]] = defaultdict(list)
        for row, prompt in enumerate(self.prompts):
            by_length[int(prompt.shape[0])].append(row)
        groups = [rows[start:start + self.batch_rows] for _, rows in sorted(by_length.items())
                  for start in range(0, len(rows), self.batch_rows)]
        object.__setattr__(self, "groups", groups)

    @property
    def rows(self) -> int:
        return len(self.prompts)

    @property
    def batches(self) -> int:
        return len(self.groups)

    def batch(self, index: int) -> list[int]:
        """The rows of batch ``index`` (prompts of one length)."""
        return self.groups[index]

    def batch_prompts(self, index: int) -> Tensor:
        return torch.stack([self.prompts[row] for row in self.groups[index]])

    def row_seed(self, row: int) -> int:
        return self.seed + CHAT_SEED_OFFSET + row

    def prompt_lengths(self) -> Tensor:
        """(N,) the prompt length of every row."""
        return torch.tensor([int(p.shape[0]) for p in self.prompts])


def _digest(prompts: list[Tensor]) -> str:
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(prompt.to(torch.int64).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()


def chat_plan(model: PreTrainedModel, tokenizer: TextTokenizer, config: HeadTrainingConfig,
              root: Path | None = None) -> ChatPlan:
    """The chat prompts (training split, then ``eval_windows`` of the validation split) and the
    cache key of a run's chat rows.

    Raises:
        TrainingConfigError: the tokenizer has no chat template, or too few requests fit
            :func:`max_prompt_tokens`.
    """
    longest = max_prompt_tokens(config.seq_len, config.window)
    try:
        prompts = (chat_prompts(tokenizer, Split.TRAIN, config.distill_chat_samples, config.seed,
                                max_tokens=longest, root=root) +
                   chat_prompts(tokenizer, Split.VALIDATION, config.eval_windows, config.seed,
                                max_tokens=longest, root=root))
    except (ChatTemplateError, ChatRequestError) as error:
        raise TrainingConfigError(f"--distill-chat-samples: {error}") from None
    names = ("seed", "seq_len", "window", "distill_chat_samples", "distill_temperature",
             "eval_windows")
    key = {**{name: getattr(config, name) for name in names}, "model": backbone_identity(model),
           "tokenizer": tokenizer.fingerprint, "prompts": _digest(prompts),
           "batch_rows": config.distill_batch}
    return ChatPlan(prompts, config.distill_chat_samples, config.seq_len,
                    float(config.distill_temperature), config.seed, key, config.distill_batch,
                    eos_ids(model))


def reply_mask(rows: Tensor, prompt_lengths: Tensor, stop_ids: tuple[int, ...]) -> Tensor:
    """(N, L) bool: True from each row's last prompt token through its reply's first
    end-of-sequence id (or the row's end): windows start there and targets lie there."""
    length = rows.shape[1]
    positions = torch.arange(length)
    start = (prompt_lengths - 1)[:, None]
    in_reply = positions[None, :] >= prompt_lengths[:, None]
    ends = torch.isin(rows, torch.tensor(stop_ids, dtype=rows.dtype)) & in_reply \
        if stop_ids else torch.zeros_like(in_reply)
    last = torch.where(ends.any(dim=1), ends.float().argmax(dim=1),
                       torch.full((rows.shape[0],), length - 1))
    return (positions[None, :] >= start) & (positions[None, :] <= last[:, None])


def chat_distilled_rows(model: PreTrainedModel, plan_: ChatPlan, run_dir: Path, *, writer: bool,
                        progress: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(train rows, train mask, validation rows, validation mask)``: from
    ``self_distilled_chat.pt``, or generated (resuming from its parts) and cached there; only
    the ``writer`` writes.

    Raises:
        CheckpointError: the cache or a part is corrupt or was made with other settings.
    """
    path = run_dir / CHAT_DISTILL_FILE
    if path.exists():
        cached = load_checkpoint(path, CHAT_KIND)
        if cached.get("key") != plan_.key:
            raise _mismatch(path, cached.get("key"), plan_.key)
        rows = cached["rows"]
        if tuple(rows.shape) != (plan_.rows, plan_.row_length):
            raise CheckpointError(f"{path} holds rows of the wrong shape; the file is corrupt")
    else:
        rows = generate_rows(model, plan_, run_dir if writer else None, progress and writer)
        if writer:
            save_checkpoint(path, CHAT_KIND, {"key": plan_.key, "rows": rows})
            shutil.rmtree(run_dir / CHAT_PARTS_DIR, ignore_errors=True)
    mask = reply_mask(rows, plan_.prompt_lengths(), plan_.stop_ids)
    cut = plan_.train_rows
    return rows[:cut], mask[:cut], rows[cut:], mask[cut:]
