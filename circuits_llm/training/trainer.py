"""One head-training run in one process: :class:`Trainer` (steps, validation, the loop).

One step (MTPC paper Sec. 4.1): draw ``batch_size`` sequences, run the frozen backbone
(``HFBackbone.hidden_states``: (B, L, d) draft hidden states, through the LoRA branch when
``lora_layers > 0``) or read their cached features and run only the ``k`` LoRA layers
(:meth:`Trainer.cached_features`, :mod:`circuits_llm.training.features`), evaluate
:func:`circuits_llm.training.loss.mtp_loss` (every position starts a
window, slot ``j`` weighted ``gamma^(j-1)``, per valid token normalisation), and take one AdamW
step on the head's and the LoRA parameters at a constant learning rate.

Nothing poisoned is kept (:class:`~circuits_llm.training.guards.NonFiniteTrainingError`, naming
the step and the last good checkpoint; :mod:`circuits_llm.training.guards`): a refused head output
or a NaN or infinite global loss or gradient norm stops before the optimiser step, a non-finite
parameter before a checkpoint is written.

The head is sized when the trainer is made (:func:`~circuits_llm.training.build.plan_head`: within
``head_budget`` of the backbone by default) and built once the training data are known
(:meth:`Trainer.build_head`: its draft vocabulary is the data's most frequent tokens). Every step's
peak memory is measured (:class:`~circuits_llm.training.memory.StepMemory`: CUDA's peak
allocation, or the process's peak resident memory on CPU) and reported in the history, the
progress bar and ``training.json``.

The trainer's parts live beside it: the checkpoint it resumes from and saves
(:class:`~circuits_llm.training.checkpointing.RunCheckpoint`), the guards that stop a step
(:mod:`circuits_llm.training.guards`), and the loop's progress bar and agreed early stop
(:mod:`circuits_llm.training.progress`), and the trainable module
(:class:`~circuits_llm.training.draft_model.DraftModel`). What stays here is the run's state and
what changes it: the head and optimiser built, the step, the validations and their history, and
the export. Another trained module takes the same loop through the hooks :meth:`Trainer.
plan_module`, :meth:`~Trainer.build_head`, :meth:`~Trainer.trained_module`,
:meth:`~Trainer.validation_sums`, :meth:`~Trainer.summary`, :meth:`~Trainer.export` and
:meth:`~Trainer.record` (:class:`~circuits_llm.training.block_trainer.BlockTrainer`: a draft block).
"""

from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from circuits.errors import InvalidParameterError
from circuits_llm.backbone import UnsupportedModelError
from circuits_llm.heads import MTPHead
from circuits_llm.runtime.checkpoint import CheckpointWriteError
from circuits_llm.text.models import backbone_identity
from circuits_llm.training.build import build_backbone, build_head, build_teacher, plan_head
from circuits_llm.training.checkpointing import RunCheckpoint, TrainedModule
from circuits_llm.training.config import HeadTrainingConfig, TargetLaw
from circuits_llm.training.datasets import SequenceSet, training_token_counts
from circuits_llm.training.distributed import DistributedContext
from circuits_llm.training.draft_model import DraftModel
from circuits_llm.training.feature_store import FeatureCacheError
from circuits_llm.training.features import FeatureRows, cached_feature_sets
from circuits_llm.training.guards import (
    NonFiniteTrainingError,
    gradient_norm,
    non_finite_error,
    refused_output,
)
from circuits_llm.training.loss import default_gamma, mtp_loss
from circuits_llm.training.memory import StepMemory
from circuits_llm.training.progress import agreed_stop, progress_bar, show_step
from circuits_llm.training.results import HeadTrainingResult, PositionValidation, export_run
from circuits_llm.training.signals import StopSignals, TrainingInterrupted

__all__ = ["DraftModel", "NonFiniteTrainingError", "Trainer"]

def _features(data: SequenceSet, index: Tensor, device: torch.device) -> Tensor | None:
    """The cached (b, L, d) features of rows ``index`` on ``device`` (None: not cached)."""
    return data.features(index).to(device) if isinstance(data, FeatureRows) else None


class Trainer:
    """The state of one run in one process (see :func:`train_head`)."""

    def __init__(self, model: PreTrainedModel, config: HeadTrainingConfig, run_dir: Path,
                 context: DistributedContext, progress: bool,
                 notify: Callable[[str], None] | None = None) -> None:
        self.model, self.config, self.run_dir, self.context = model, config, run_dir, context
        self.progress = progress and context.is_writer
        self.notify = notify or (lambda message: print(message, file=sys.stderr, flush=True))
        #: the feature cache files the run reads (empty: every step runs the backbone)
        self.feature_entries: list[Path] = []
        torch.manual_seed(config.seed)  # the LoRA initialisation draws from the global RNG
        self.backbone = build_backbone(model, config)
        self.plan_module()  # sized and checked; built with the data
        self.device = self.backbone.device
        self.gamma = default_gamma(config.window) if config.gamma is None else config.gamma
        self.generator = torch.Generator().manual_seed(config.seed)
        self.fingerprint = backbone_identity(model)
        self.memory = StepMemory(self.device)
        self.step, self.elapsed = 0, 0.0
        self.history: list[dict[str, Any]] = []
        self.recent_losses: list[float] = []
        self.recent_peak = 0  # the largest step peak since the last validation (bytes)
        self.last_peak = 0  # the last step's peak (bytes)
        self.initial: PositionValidation | None = None
        self.checkpoint = RunCheckpoint(run_dir, config, self.fingerprint, context.is_writer)
        #: the share of training tokens inside the head's draft vocabulary (None: not compressed)
        self.draft_coverage: float | None = None
        # made by build_head, once the training data are known
        self.head: MTPHead
        self.draft: DraftModel
        self.parameters: list[nn.Parameter]
        self.optimizer: torch.optim.AdamW

    def plan_module(self) -> None:
        """Size and check the trained module before any data exist (the head's plan); a
        subclass that trains another module checks its own config here."""
        self.plan = plan_head(self.config, self.backbone)

    def trained_module(self) -> MTPHead | TrainedModule:
        """What the checkpoint stores and restores (:class:`RunCheckpoint`): the head."""
        return self.head

    @property
    def validation_positions(self) -> int:
        """How many per-position NLLs a validation reports: the head's window."""
        return self.config.window

    def validation_sums(self, tokens: Tensor, mask: Tensor | None, features: Tensor | None,
                        ) -> tuple[Tensor, Tensor]:
        """``(nll_sum, count)``, each (:attr:`validation_positions`,), of one validation chunk:
        the head's token NLL per window position."""
        out = mtp_loss(self.head, self.draft.hidden(tokens, features), tokens, mask, self.gamma)
        return out.nll_sum, out.count

    def summary(self) -> str:
        """One line: the head's size against its budget, and the largest peak memory of a step."""
        size, peak = self.plan.size, self.peak_memory()
        share = size.parameters / size.backbone_parameters
        coverage = "" if self.draft_coverage is None else \
            f", covering {self.draft_coverage:.1%} of the training tokens"
        memory = "no step run" if peak["mib"] is None else f"{peak['mib']:,.1f} MiB ({peak['kind']})"
        return (f"{self.plan.describe()}: {size.parameters:,} parameters, {share:.2%} of the "
                f"backbone{coverage}; peak memory of a step: {memory}")

    def cached_features(self, train: SequenceSet, validation: SequenceSet,
                        ) -> tuple[SequenceSet, SequenceSet]:
        """The sets with their cached backbone features when the run caches them
        (:func:`~circuits_llm.training.features.cached_feature_sets`), else unchanged.

        Raises:
            FeatureCacheError: see :func:`~circuits_llm.training.features.cached_feature_sets`.
        """
        try:
            train, validation = cached_feature_sets(
                self.backbone, self.config, train, validation, context=self.context,
                progress=self.progress, notify=self.notify)
        except UnsupportedModelError as error:
            raise FeatureCacheError(f"cannot cache this model's features: {error}") from None
        self.feature_entries = [path for data in (train, validation)
                                if isinstance(data, FeatureRows) for path in data.entry_paths]
        return train, validation

    def build_head(self, train: SequenceSet) -> None:
        """Build the planned head (its draft vocabulary from ``train``'s token counts), the
        draft model (reading ``train``'s cached features, if any) and the optimiser."""
        counts = None
        if self.plan.size.draft_vocab is not None:
            counts = training_token_counts(train, self.backbone.vocab_size)
        self.head = build_head(self.plan, self.backbone, counts)
        if counts is not None and self.head.draft_tokens is not None:
            self.draft_coverage = counts.coverage(self.head.draft_tokens)
        branch = train.branch if isinstance(train, FeatureRows) else None
        self.draft = DraftModel(self.backbone, self.head, self.gamma, self.config.bf16, branch)
        if self.config.target_law is TargetLaw.MODEL:
            tokens = features = None
            if isinstance(train, FeatureRows) and len(train) > 0:  # checked against a live pass
                first = torch.zeros(1, dtype=torch.long)
                tokens, features = train.rows(first)[0], train.features(first)
            self.draft.teacher = build_teacher(self.model, self.backbone, self.head, self.config,
                                               tokens, features)
        self.parameters = [p for p in self.head.parameters() if p.requires_grad] + \
            self.backbone.draft_parameters()
        self.optimizer = torch.optim.AdamW(self.parameters, lr=self.config.learning_rate,
                                           weight_decay=self.config.weight_decay)

    # ------------------------------------------------------------------ checkpoints
    def read_checkpoint(self, resume_from: str | Path | None = None,
                        ) -> tuple[dict[str, Any], Path] | None:
        """The checked checkpoint to resume from, or None (:meth:`RunCheckpoint.read`)."""
        return self.checkpoint.read(resume_from)

    def restore(self, found: tuple[dict[str, Any], Path] | None) -> None:
        """Load a checkpoint of :meth:`read_checkpoint` into the built head, the LoRA layers,
        the optimiser and the generators, and take over its progress (nothing for None).

        Raises:
            CheckpointError: see :meth:`RunCheckpoint.load_into`. Nothing is written.
        """
        if found is None:
            return
        state = self.checkpoint.load_into(found, self.trained_module(), self.backbone,
                                          self.optimizer, self.generator)
        self.step, self.elapsed = int(state["step"]), float(state["elapsed"])
        self.history, self.recent_losses = list(state["history"]), list(state["recent_losses"])
        self.initial = PositionValidation.from_dict(state["initial_validation"])

    def kept(self) -> str:
        """What is on disk to resume from, for messages."""
        return self.checkpoint.kept()

    def interrupted(self, stop: TrainingInterrupted) -> str:
        """The message of a run stopped at once by a signal."""
        which = f"a second {stop.signal.name}" if stop.second else stop.signal.name
        again = "resume" if self.checkpoint.path.exists() else "start again"
        return f"stopped at once by {which} after step {self.step}; {self.kept()}; run the same " \
            f"command to {again}"

    def save(self) -> None:
        """Write ``checkpoint.pt`` if anything changed (:meth:`RunCheckpoint.save`).

        Raises:
            NonFiniteTrainingError: a parameter is NaN or infinite (nothing is written).
            CheckpointWriteError: the write failed (``checkpoint.pt`` is unchanged).
        """
        assert self.initial is not None
        self.checkpoint.save(self.trained_module(), self.backbone, self.optimizer,
                             self.generator, {
            "step": self.step, "elapsed": self.elapsed, "history": self.history,
            "recent_losses": self.recent_losses, "initial_validation": self.initial.to_dict()})

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self, data: SequenceSet) -> PositionValidation:
        """Token-weighted NLL per window position on the fixed validation sequences."""
        self.draft.eval()
        positions = self.validation_positions
        sums = torch.zeros(positions, dtype=torch.float64)
        counts = torch.zeros(positions, dtype=torch.float64)
        mine = torch.arange(len(data))[self.context.rank::self.context.world_size]
        for chunk in mine.split(max(1, self.config.batch_size // self.context.world_size)):
            tokens, mask = data.rows(chunk)
            mask = None if mask is None else mask.to(self.device)
            tokens = tokens.to(self.device)
            features = _features(data, chunk, self.device)
            with self.valid_outputs(self.step):
                nll_sum, count = self.validation_sums(tokens, mask, features)
            sums += nll_sum.double().cpu()
            counts += count.double().cpu()
        sums, counts = self.context.all_sum(sums), self.context.all_sum(counts)
        self.draft.train()
        nll = tuple(float(s / c) if c > 0 else math.nan for s, c in zip(sums, counts, strict=True))
        loss = sum(self.gamma ** j * value for j, value in enumerate(nll))
        return PositionValidation(self.step, nll, tuple(int(c) for c in counts), loss)

    def record_validation(self, data: SequenceSet) -> PositionValidation:
        result = self.validate(data)
        train_loss = sum(self.recent_losses) / len(self.recent_losses) if self.recent_losses \
            else None
        entry = {"step": self.step, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed,
                 "train_loss": train_loss, "validation": result.to_dict(),
                 "peak_step_memory_bytes": self.recent_peak or None}
        if self.context.enabled:  # DDP keeps the replicas equal: check it at every validation
            entry["replica_max_abs_diff"] = self.context.replica_difference(self.parameters)
        self.history.append(entry)
        self.recent_losses, self.recent_peak = [], 0
        return result

    @property
    def tokens_seen(self) -> int:
        return self.step * self.config.batch_size * self.config.seq_len

    # ------------------------------------------------------------------ training
    def train_step(self, data: SequenceSet, module: nn.Module) -> float:
        """One optimiser step on this rank's shard of a global batch; the global mean loss.

        Raises:
            NonFiniteTrainingError: the global loss or the gradient norm is NaN or infinite; the
                optimiser step is not taken, so the parameters and its state stay as they were.
        """
        config = self.config
        rows = torch.randint(0, len(data), (config.batch_size,), generator=self.generator)
        mine = self.context.shard(rows)
        tokens, mask = data.rows(mine)
        mask = None if mask is None else mask.to(self.device)
        features = _features(data, mine, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        self.memory.start()
        with self.valid_outputs(self.step + 1):
            loss, _, _ = module(tokens.to(self.device), mask, features)
        loss.backward()
        if config.grad_clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, config.grad_clip))
        else:
            norm = gradient_norm(self.parameters)
        mean_loss = float(self.context.all_sum(loss.detach().double().cpu()) /
                          self.context.world_size)
        if not (math.isfinite(mean_loss) and math.isfinite(norm)):
            what = f"the training loss is {mean_loss}" if not math.isfinite(mean_loss) else \
                f"the gradient norm is {norm}"
            raise self.non_finite(self.step + 1, what)
        self.optimizer.step()
        self.last_peak = self.memory.peak()  # forward, backward and update
        self.recent_peak = max(self.recent_peak, self.last_peak)
        self.step += 1
        return mean_loss

    def non_finite(self, step: int, what: str) -> NonFiniteTrainingError:
        """The error that stops training at ``step`` because ``what`` is not finite."""
        return non_finite_error(step, what, self.kept())

    @contextmanager
    def valid_outputs(self, step: int) -> Iterator[None]:
        """Turn the circuit's refusal of the head's outputs at ``step`` into the training stop."""
        try:
            yield
        except InvalidParameterError as error:
            raise self.non_finite(step, refused_output(error)) from None

    def run(self, train: SequenceSet, validation: SequenceSet, started: float,
            max_seconds: float | None, max_steps: int | None,
            signals: StopSignals) -> HeadTrainingResult:
        config = self.config
        limit = config.steps if max_steps is None else min(config.steps, max_steps)
        deadline = None if max_seconds is None else started + max_seconds
        if self.initial is None:
            self.initial = self.record_validation(validation)
        latest = PositionValidation.from_dict(self.history[-1]["validation"])
        module = self.context.wrap(self.draft, self.device)
        self.draft.train()
        session_start, session_first = time.perf_counter(), self.step
        elapsed_before, last_save = self.elapsed, time.perf_counter()
        loss = math.nan
        interrupted: signal.Signals | None = None
        with progress_bar(self.progress, limit, self.step) as bar:
            while self.step < limit:
                late, signalled = agreed_stop(self.context, deadline, signals)
                if signalled:  # another rank may have got it: the signal is then SIGTERM's
                    interrupted = signals.received or signal.SIGTERM
                if late or signalled:
                    break
                loss = self.train_step(train, module)
                self.recent_losses.append(loss)
                self.elapsed = elapsed_before + time.perf_counter() - session_start
                if self.step % config.eval_every == 0 or self.step == config.steps:
                    latest = self.record_validation(validation)
                    self.save()
                    last_save = time.perf_counter()
                elif time.perf_counter() - last_save >= config.checkpoint_every_s:
                    self.save()
                    last_save = time.perf_counter()
                show_step(bar, loss, latest.mean_bits,
                          (self.step - session_first) * config.batch_size * config.seq_len,
                          time.perf_counter() - session_start, self.last_peak)
        session_seconds = time.perf_counter() - session_start
        if interrupted is None and latest.step != self.step:
            latest = self.record_validation(validation)
        self.save()
        if interrupted is None:  # a signal asks for a quick exit: the export waits for the resume
            self.export(latest)
        self.context.barrier()
        session_steps = self.step - session_first
        return HeadTrainingResult(
            run_dir=self.run_dir, config=config, step=self.step,
            finished=self.step >= config.steps, tokens_seen=self.tokens_seen,
            elapsed_s=self.elapsed, session_steps=session_steps,
            seconds_per_step=session_seconds / session_steps if session_steps else 0.0,
            train_loss=loss, initial_validation=self.initial, validation=latest,
            history=list(self.history), interrupted_by=interrupted)

    def export(self, latest: PositionValidation) -> None:
        """Write ``head/``, ``adapter/`` and ``training.json`` (rank 0).

        Raises:
            CheckpointWriteError: a file could not be written (each file is replaced atomically,
                ``training.json`` last; the checkpoint is already saved).
        """
        if not self.context.is_writer:
            return
        try:
            export_run(self.run_dir, self.head, self.backbone, self.record(latest))
        except OSError as error:
            raise CheckpointWriteError(
                f"cannot write the exported head to {self.run_dir} ({error.strerror or error}); "
                f"{self.kept()}; free disk space and run the same command again to export it") \
                from None

    def peak_memory(self) -> dict[str, Any]:
        """The largest step peak of the run (every validation period, this session's steps since
        the last one included): ``{"bytes", "mib", "kind", "device"}`` (bytes None before any
        step)."""
        peak = max(_peak(self.history), self.recent_peak)
        return {"bytes": peak or None, "mib": round(peak / 2 ** 20, 1) if peak else None,
                "kind": self.memory.kind.value, "device": str(self.device)}

    def record(self, latest: PositionValidation) -> dict[str, Any]:
        """The contents of ``training.json``."""
        assert self.initial is not None
        return {"config": self.config.to_dict(), "finished": self.step >= self.config.steps,
                "step": self.step, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed,
                "world_size": self.context.world_size, "model_fingerprint": self.fingerprint,
                "head_parameters": self.head.num_parameters(),
                "head_size": self.plan.size.to_dict(),
                "draft_vocab_coverage": self.draft_coverage,
                "peak_step_memory": self.peak_memory(),
                "lora_parameters": sum(p.numel() for p in self.backbone.draft_parameters()),
                "feature_cache": [str(path) for path in self.feature_entries],
                "validation": latest.to_dict(), "initial_validation": self.initial.to_dict(),
                "history": self.history}


def _peak(entries: list[dict[str, Any]]) -> int:
    return max((int(e.get("peak_step_memory_bytes") or 0) for e in entries), default=0)
