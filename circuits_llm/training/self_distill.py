"""Self-distilled training data (FastMTP Sec. 2.4): the target model continues corpus prompts.

A head trained on the model's own continuations learns the distribution acceptance is measured
against, instead of the corpus's. :func:`self_distilled_rows` produces

* ``distill_samples`` training rows: a prompt of ``distill_prompt_len`` tokens cut from the
  tokenised training split at a seeded random position, continued by the model for
  ``response_len = seq_len - distill_prompt_len`` tokens;
* ``eval_windows`` validation rows: the first ``distill_prompt_len`` tokens of each of the first
  ``eval_windows`` non-overlapping ``seq_len`` windows of the validation split, continued the same
  way.

Sampling is at ``distill_temperature`` (0: greedy: a greedy head learns from greedy
continuations), from the law the decoders sample (:func:`circuits_llm.decoding.warping.target_probs`),
with no EOS stop, so every row has ``seq_len`` tokens.

Batched: ``distill_batch`` rows (:data:`BATCH_ROWS` by default) are continued together, one
forward of the whole batch per token on the model's KV cache. Every prompt has exactly
``distill_prompt_len`` tokens and every row generates ``response_len`` tokens without stopping,
so the batch needs no padding: the positions and the causal mask of a row are those of a row
generated alone, and a greedy row is the one-at-a-time continuation (in exact arithmetic; a
float64 model gives identical tokens). The law is the same too: row ``i`` (training rows first,
then validation rows) draws from its own generator seeded with ``seed + i`` (one
``torch.multinomial`` per row and token, from the batch's warped probabilities), so a row does not
depend on which rows were generated before it or in the same batch, and equals the row
:class:`~circuits_llm.decoding.decoder.AutoregressiveDecoder` samples with that generator. The
batch size is part of the cache key (it can change the last bits of the logits), so a resumed
generation repeats the same numerics.

Resumable: each batch is written, whole or not at all, to ``run_dir/self_distilled.parts/`` as a
verified checkpoint keyed by everything that determines the rows (the settings, the model's
fingerprint, the tokenizer's and the corpus's). An interrupted generation (SIGINT, SIGKILL, a full
disk) continues with the first missing batch. When every batch is there they are joined into
``run_dir/self_distilled.pt`` (the cache later runs read) and the parts are removed. A cache or a
part made with other settings is an error naming it (it is never overwritten).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers import PreTrainedModel

from circuits_llm.decoding.warping import SamplingConfig, target_probs
from circuits_llm.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from circuits_llm.text.corpus import TokenStream
from circuits_llm.text.models import backbone_identity
from circuits_llm.text.tokens import TextTokenizer
from circuits_llm.training.config import HeadTrainingConfig

DISTILL_KIND = "circuits_llm.self_distilled"
DISTILL_PART_KIND = "circuits_llm.self_distilled_part"
DISTILL_FILE = "self_distilled.pt"
PARTS_DIR = "self_distilled.parts"
#: Rows generated together by default (one batched forward per token); part of the cache key.
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
        key: what produced the rows (settings, model, tokenizer, corpus, batch size).
        batch_rows: rows generated together (``distill_batch``).
    """

    prompts: Tensor
    train_rows: int
    response_len: int
    temperature: float
    seed: int
    key: dict[str, Any]
    batch_rows: int = BATCH_ROWS

    @property
    def rows(self) -> int:
        return int(self.prompts.shape[0])

    @property
    def batches(self) -> int:
        return -(-self.rows // self.batch_rows)

    def batch(self, index: int) -> range:
        """The rows of batch ``index``."""
        first = index * self.batch_rows
        return range(first, min(first + self.batch_rows, self.rows))

    # what :func:`generate_rows` reads of a plan (a chat plan, :mod:`.chat_distill`, has the same)
    parts_dir: ClassVar[str] = PARTS_DIR
    part_kind: ClassVar[str] = DISTILL_PART_KIND
    stop_ids: ClassVar[tuple[int, ...]] = ()

    @property
    def row_length(self) -> int:
        return int(self.prompts.shape[1]) + self.response_len

    def batch_prompts(self, index: int) -> Tensor:
        """(b, P) prompts of batch ``index``."""
        rows = self.batch(index)
        return self.prompts[rows.start:rows.stop]

    def row_seed(self, row: int) -> int:
        """The seed of row ``row``'s generator."""
        return self.seed + row


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
           "batch_rows": config.distill_batch}
    return DistillPlan(prompts, config.distill_samples, config.response_len,
                       float(config.distill_temperature), config.seed, key, config.distill_batch)


@torch.no_grad()
def continue_rows(model: PreTrainedModel, prompts: Tensor, response_len: int, temperature: float,
                  generators: list[torch.Generator], stop_ids: tuple[int, ...] = ()) -> Tensor:
    """(b, P) prompts -> (b, P + R) prompts followed by ``R = response_len`` generated tokens.

    One forward over the prompts, then one per token with the model's KV cache, every row at
    once (equal lengths: no padding). Greedy (``temperature == 0``): every row's first argmax.
    Sampling: the batch's warped probabilities in one call, then row ``i`` draws its token from
    ``generators[i]`` (on the model's device), exactly as a one-row decoder draws it.

    ``stop_ids``: once every row has generated one of them, the batch stops and the remaining
    columns are filled with the first of them (a chat reply ends; what follows is never trained
    on: :func:`circuits_llm.training.chat_distill.reply_mask`). A row that has stopped keeps being
    fed its sampled tokens until then, which changes nothing before its stop.

    Raises:
        InvalidDistributionError: the model's logits are NaN or infinite.
    """
    device = model.device
    config = SamplingConfig(temperature)
    tokens = prompts.to(device)
    out = model(input_ids=tokens, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    generated: list[Tensor] = []
    ended = torch.zeros(tokens.shape[0], dtype=torch.bool, device=device)
    stops = torch.tensor(stop_ids, dtype=tokens.dtype, device=device)
    for step in range(response_len):
        probs = target_probs(logits, config, "the model's logits")
        if config.greedy:
            column = probs.argmax(dim=-1, keepdim=True)
        else:
            column = torch.cat([torch.multinomial(probs[i], 1, generator=generators[i])
                                for i in range(tokens.shape[0])])[:, None]
        generated.append(column)
        if stop_ids:
            ended |= torch.isin(column[:, 0], stops)
            if bool(ended.all()):
                filler = torch.full((tokens.shape[0], response_len - step - 1), stop_ids[0],
                                    dtype=tokens.dtype, device=device)
                generated.append(filler)
                break
        if step + 1 < response_len:
            out = model(input_ids=column, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
    return torch.cat([tokens, *generated], dim=1).cpu()


def _part_path(run_dir: Path, index: int, parts_dir: str = PARTS_DIR) -> Path:
    return run_dir / parts_dir / f"part-{index:05d}.pt"


def _mismatch(path: Path, found: object, key: dict[str, Any]) -> CheckpointError:
    return CheckpointError(f"{path} was generated with other settings or another model ({found} != "
                           f"{key}); delete it or use a new run directory")


def _load_part(path: Path, plan_: Any, index: int) -> Tensor | None:
    if not path.is_file():
        return None
    part = load_checkpoint(path, plan_.part_kind)
    if part.get("key") != plan_.key or part.get("index") != index:
        raise _mismatch(path, part.get("key"), plan_.key)
    rows = part["rows"]
    count = len(plan_.batch(index))
    if tuple(rows.shape) != (count, plan_.row_length):
        raise CheckpointError(f"{path} holds rows of the wrong shape; the file is corrupt: delete it")
    return rows


def generate_rows(model: PreTrainedModel, plan_: Any, run_dir: Path | None,
                  progress: bool = False,
                  on_batch: Callable[[int], None] | None = None) -> Tensor:
    """Every row of ``plan_`` (N, P + R), resuming from and writing parts in ``run_dir`` (None:
    in memory only). ``plan_``: a :class:`DistillPlan`, or a chat plan
    (:class:`circuits_llm.training.chat_distill.ChatPlan`), whose batches group prompts of one
    length; rows come back in the plan's row order either way.

    ``on_batch(index)`` is called after each newly generated batch is saved (tests use it).
    """
    from tqdm import tqdm
    parts: list[Tensor | None] = [None] * plan_.batches
    if run_dir is not None:
        parts = [_load_part(_part_path(run_dir, k, plan_.parts_dir), plan_, k)
                 for k in range(plan_.batches)]
    done = sum(len(plan_.batch(k)) for k, p in enumerate(parts) if p is not None)
    bar = tqdm(total=plan_.rows, initial=done, desc="self-distil", unit="seq",
               disable=not progress, dynamic_ncols=True)
    started, generated = time.perf_counter(), 0
    with bar:
        for k in range(plan_.batches):
            if parts[k] is not None:
                continue
            rows_k = plan_.batch(k)
            generators = [torch.Generator(device=model.device).manual_seed(plan_.row_seed(i))
                          for i in rows_k]
            prompts = plan_.batch_prompts(k)
            response_len = plan_.row_length - prompts.shape[1]
            rows = continue_rows(model, prompts, response_len, plan_.temperature, generators,
                                 plan_.stop_ids)
            if run_dir is not None:
                save_checkpoint(_part_path(run_dir, k, plan_.parts_dir), plan_.part_kind,
                                {"key": plan_.key, "index": k, "rows": rows})
            parts[k] = rows
            generated += len(rows_k) * response_len
            bar.set_postfix(tokens_s=f"{generated / (time.perf_counter() - started):,.0f}")
            bar.update(len(rows_k))
            if on_batch is not None:
                on_batch(k)
    rows = torch.cat([p for p in parts if p is not None])
    order = torch.tensor([i for k in range(plan_.batches) for i in plan_.batch(k)])
    return rows[torch.argsort(order)]


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
