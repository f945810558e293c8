"""Self-distilled training data (FastMTP Sec. 2.4): the target model continues corpus prompts.

A head trained on the model's own continuations learns the distribution acceptance is measured
against, instead of the corpus's. :func:`self_distilled_rows` produces

* ``distill_samples`` training rows: a prompt of ``distill_prompt_len`` tokens cut from the
  tokenised training split at a seeded random position, continued by the model for
  ``response_len = seq_len - distill_prompt_len`` tokens;
* ``eval_windows`` validation rows: the first ``distill_prompt_len`` tokens of each of the first
  ``eval_windows`` non-overlapping ``seq_len`` windows of the validation split, continued the same
  way.

Sampling is at ``distill_temperature`` (0: greedy), from the law the decoders sample
(:func:`circuits_llm.decoding.warping.target_probs`), with no EOS stop, so every row has ``seq_len`` tokens.
Row ``i`` (training rows first, then validation rows) draws from its own generator seeded with
``seed + i``, so a row does not depend on which rows were generated before it or in the same
batch; rows are generated :data:`BATCH_ROWS` at a time in one batched forward per token (the
batch composition is fixed, so a resumed generation repeats the same numerics).

Resumable: each batch is written, whole or not at all, to ``run_dir/self_distilled.parts/`` as a
verified checkpoint keyed by everything that determines the rows (the settings, the model's
fingerprint, the tokenizer's and the corpus's). An interrupted generation (SIGINT, SIGKILL, a full
disk) continues with the first missing batch. When every batch is there they are joined into
``run_dir/self_distilled.pt`` (the cache later runs read) and the parts are removed. A cache or a
part made with other settings is an error naming it (it is never overwritten).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from circuits_llm.decoding.warping import SamplingConfig, sample_token, target_probs
from circuits_llm.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from circuits_llm.text.corpus import TokenStream
from circuits_llm.text.models import backbone_identity
from circuits_llm.text.tokens import TextTokenizer
from circuits_llm.training.config import HeadTrainingConfig

DISTILL_KIND = "circuits_llm.self_distilled"
DISTILL_PART_KIND = "circuits_llm.self_distilled_part"
DISTILL_FILE = "self_distilled.pt"
PARTS_DIR = "self_distilled.parts"
#: Rows generated together (one batched forward per token); part of the cache key.
BATCH_ROWS = 16


@dataclass(frozen=True)
class DistillPlan:
    """What to generate: the prompts of every row, and the key the cache is checked against.

    Attributes:
        prompts: (N, P) int64 prompt ids, the ``distill_samples`` training rows then the
            ``eval_windows`` validation rows.
        train_rows: how many of them are training rows.
        response_len: tokens generated per row.
        temperature: the sampling temperature (0: greedy).
        seed: row ``i`` samples with a generator seeded ``seed + i``.
        key: what produced the rows (settings, model, tokenizer, corpus).
    """

    prompts: Tensor
    train_rows: int
    response_len: int
    temperature: float
    seed: int
    key: dict[str, Any]

    @property
    def rows(self) -> int:
        return int(self.prompts.shape[0])

    @property
    def batches(self) -> int:
        return -(-self.rows // BATCH_ROWS)


def plan(model: PreTrainedModel, tokenizer: TextTokenizer, config: HeadTrainingConfig,
         train: TokenStream, validation: TokenStream) -> DistillPlan:
    """The prompts and the cache key of a run's self-distillation (see the module docstring).

    ``train`` is the (capped) training stream, ``validation`` holds at least
    ``eval_windows * seq_len`` tokens (the caller checks both).
    """
    # here, not at the top: training.build reads the sequence sets of training.datasets, which
    # imports this module
    length = config.distill_prompt_len
    picker = torch.Generator().manual_seed(config.seed)
    starts = torch.randint(0, len(train) - length + 1, (config.distill_samples,), generator=picker)
    val_starts = [j * config.seq_len for j in range(config.eval_windows)]
    prompts = torch.cat([train.windows(starts, length), validation.windows(val_starts, length)])
    names = ("seed", "seq_len", "distill_samples", "distill_prompt_len", "distill_temperature",
             "eval_windows", "max_train_bytes")
    key = {**{name: getattr(config, name) for name in names}, "model": backbone_identity(model),
           "tokenizer": tokenizer.fingerprint, "corpus": [train.path.stem, validation.path.stem],
           "batch_rows": BATCH_ROWS}
    return DistillPlan(prompts, config.distill_samples, config.response_len,
                       float(config.distill_temperature), config.seed, key)


@torch.no_grad()
def continue_rows(model: PreTrainedModel, prompts: Tensor, response_len: int, temperature: float,
                  generators: list[torch.Generator]) -> Tensor:
    """(b, P) prompts -> (b, P + R) prompts followed by ``R = response_len`` sampled tokens.

    One forward over the prompts, then one per token with the model's KV cache; row ``i`` draws
    its tokens from ``generators[i]`` (on the model's device) at ``temperature``.
    """
    device = model.device
    config = SamplingConfig(temperature)
    tokens = prompts.to(device)
    out = model(input_ids=tokens, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    generated = []
    for step in range(response_len):
        chosen = [sample_token(target_probs(logits[i], config, "the model's logits"), config.greedy,
                               generators[i]) for i in range(tokens.shape[0])]
        column = torch.tensor(chosen, dtype=torch.long, device=device)[:, None]
        generated.append(column)
        if step + 1 < response_len:
            out = model(input_ids=column, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
    return torch.cat([tokens, *generated], dim=1).cpu()


def _part_path(run_dir: Path, index: int) -> Path:
    return run_dir / PARTS_DIR / f"part-{index:05d}.pt"


def _mismatch(path: Path, found: object, key: dict[str, Any]) -> CheckpointError:
    return CheckpointError(f"{path} was generated with other settings or another model ({found} != "
                           f"{key}); delete it or use a new run directory")


def _load_part(path: Path, plan_: DistillPlan, index: int) -> Tensor | None:
    if not path.is_file():
        return None
    part = load_checkpoint(path, DISTILL_PART_KIND)
    if part.get("key") != plan_.key or part.get("index") != index:
        raise _mismatch(path, part.get("key"), plan_.key)
    rows = part["rows"]
    count = min(BATCH_ROWS, plan_.rows - index * BATCH_ROWS)
    if tuple(rows.shape) != (count, plan_.prompts.shape[1] + plan_.response_len):
        raise CheckpointError(f"{path} holds rows of the wrong shape; the file is corrupt: delete it")
    return rows


def generate_rows(model: PreTrainedModel, plan_: DistillPlan, run_dir: Path | None,
                  progress: bool = False,
                  on_batch: Callable[[int], None] | None = None) -> Tensor:
    """Every row of ``plan_`` (N, P + R), resuming from and writing parts in ``run_dir`` (None:
    in memory only).

    ``on_batch(index)`` is called after each newly generated batch is saved (tests use it).
    """
    from tqdm import tqdm
    parts: list[Tensor | None] = [None] * plan_.batches
    if run_dir is not None:
        parts = [_load_part(_part_path(run_dir, k), plan_, k) for k in range(plan_.batches)]
    done = sum(min(BATCH_ROWS, plan_.rows - k * BATCH_ROWS) for k, p in enumerate(parts)
               if p is not None)
    bar = tqdm(total=plan_.rows, initial=done, desc="self-distil", unit="seq",
               disable=not progress, dynamic_ncols=True)
    with bar:
        for k in range(plan_.batches):
            if parts[k] is not None:
                continue
            first = k * BATCH_ROWS
            last = min(first + BATCH_ROWS, plan_.rows)
            generators = [torch.Generator(device=model.device).manual_seed(plan_.seed + i)
                          for i in range(first, last)]
            rows = continue_rows(model, plan_.prompts[first:last], plan_.response_len,
                                 plan_.temperature, generators)
            if run_dir is not None:
                save_checkpoint(_part_path(run_dir, k), DISTILL_PART_KIND,
                                {"key": plan_.key, "index": k, "rows": rows})
            parts[k] = rows
            bar.update(last - first)
            if on_batch is not None:
                on_batch(k)
    return torch.cat([p for p in parts if p is not None])


def self_distilled_rows(model: PreTrainedModel, plan_: DistillPlan, run_dir: Path, *,
                        writer: bool, progress: bool = False,
                        on_batch: Callable[[int], None] | None = None) -> tuple[Tensor, Tensor]:
    """``(train (distill_samples, L), validation (eval_windows, L))``: from ``self_distilled.pt``,
    or generated (resuming from its parts) and cached there; only the ``writer`` writes.

    Raises:
        CheckpointError: the cache or a part is corrupt, or was generated with other settings or
            another model (nothing is overwritten).
    """
    path = run_dir / DISTILL_FILE
    length = plan_.prompts.shape[1] + plan_.response_len
    if path.exists():
        cached = load_checkpoint(path, DISTILL_KIND)
        if cached.get("key") != plan_.key:
            raise _mismatch(path, cached.get("key"), plan_.key)
        train, validation = cached["train"], cached["validation"]
        expected = [(plan_.train_rows, length), (plan_.rows - plan_.train_rows, length)]
        if [tuple(train.shape), tuple(validation.shape)] != expected:
            raise CheckpointError(f"{path} holds sequences of the wrong shape; the file is corrupt")
        return train, validation
    rows = generate_rows(model, plan_, run_dir if writer else None, progress and writer, on_batch)
    train, validation = rows[:plan_.train_rows], rows[plan_.train_rows:]
    if writer:
        save_checkpoint(path, DISTILL_KIND, {"key": plan_.key, "train": train,
                                             "validation": validation})
        shutil.rmtree(run_dir / PARTS_DIR, ignore_errors=True)
    return train, validation
