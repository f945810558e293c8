"""``train_head``: fit a circuit MTP head (and optional LoRA draft layers) to a frozen LM.

One step (MTPC paper Sec. 4.1): draw ``batch_size`` sequences, run the frozen backbone
(``HFBackbone.hidden_states``: (B, L, d) draft hidden states, through the LoRA branch when
``lora_layers > 0``), evaluate :func:`circuits_llm.loss.mtp_loss` (every position starts a
window, slot ``j`` weighted ``gamma^(j-1)``, per valid token normalisation), and take one AdamW
step on the head's and the LoRA parameters at a constant learning rate.

Resumability: ``run_dir/checkpoint.pt`` (atomic) holds the head, the LoRA weights, the optimiser,
the data generator and RNG states, the step and the history. It is written every
``checkpoint_every_s`` seconds, at every validation and when the call returns. Calling
``train_head`` again on the same directory continues exactly where the checkpoint left off: a
run to N steps in one call and a run to k steps then resumed to N give identical parameters.
Under ``torchrun`` the same call trains data-parallel (:mod:`.distributed`); only rank 0 writes.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from circuits_llm.backbone import HFBackbone
from circuits_llm.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from circuits_llm.heads import MTPHead
from circuits_llm.heads.io import head_tensors
from circuits_llm.loss import default_gamma, mtp_loss
from circuits_llm.training.build import (
    build_backbone,
    build_head,
    head_fingerprint,
    model_fingerprint,
)
from circuits_llm.training.config import HeadTrainingConfig, TrainingConfigError
from circuits_llm.training.datasets import SequenceSet, training_sets
from circuits_llm.training.distributed import DistributedContext, distributed_context
from circuits_llm.training.results import (
    RECORD_FILE,
    HeadTrainingResult,
    PositionValidation,
    export_run,
    read_record,
    record_config,
)

CHECKPOINT_KIND = "circuits_llm.train_head"
CHECKPOINT_FILE = "checkpoint.pt"
_STATE_KEYS = ("config", "model_fingerprint", "head_fingerprint", "head", "lora", "optimizer",
               "data_generator", "torch_rng", "step", "elapsed", "history", "recent_losses",
               "initial_validation")


class DraftModel(nn.Module):
    """The trainable part of the draft model: the head and the LoRA draft layers.

    ``forward(tokens (B, L), mask (B, L) or None) -> (loss, nll_sum (n,), count (n,))``. The
    frozen LM is reached through the backbone but not registered as a sub-module, so DDP only
    sees (and synchronises) the head and the draft layers.
    """

    def __init__(self, backbone: HFBackbone, head: MTPHead, gamma: float, bf16: bool) -> None:
        super().__init__()
        self.head = head
        self.draft_layers = backbone.draft_layers
        self._backbone = (backbone,)
        self.gamma = gamma
        self.bf16 = bf16

    def hidden(self, tokens: Tensor) -> Tensor:
        """(B, L) tokens -> (B, L, d) float32 draft hidden states."""
        backbone = self._backbone[0]
        with torch.autocast(device_type=backbone.device.type, dtype=torch.bfloat16,
                            enabled=self.bf16):
            _, hidden = backbone.hidden_states(tokens)
        return hidden.float()

    def forward(self, tokens: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        out = mtp_loss(self.head, self.hidden(tokens), tokens, mask, self.gamma)
        return out.loss, out.nll_sum, out.count


class _Trainer:
    """The state of one run in one process (see :func:`train_head`)."""

    def __init__(self, model: PreTrainedModel, config: HeadTrainingConfig, run_dir: Path,
                 context: DistributedContext, progress: bool) -> None:
        self.model, self.config, self.run_dir, self.context = model, config, run_dir, context
        self.progress = progress and context.is_writer
        torch.manual_seed(config.seed)  # the LoRA initialisation draws from the global RNG
        self.backbone = build_backbone(model, config)
        self.head = build_head(config, self.backbone)
        self.device = self.backbone.device
        self.gamma = default_gamma(config.window) if config.gamma is None else config.gamma
        self.draft = DraftModel(self.backbone, self.head, self.gamma, config.bf16)
        self.parameters = [p for p in self.head.parameters() if p.requires_grad] + \
            self.backbone.draft_parameters()
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.fingerprint = model_fingerprint(model)
        self.step, self.elapsed = 0, 0.0
        self.history: list[dict[str, Any]] = []
        self.recent_losses: list[float] = []
        self.initial: PositionValidation | None = None

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINT_FILE

    def restore(self) -> None:
        """Load ``checkpoint.pt`` if present, after checking it belongs to this run.

        Raises:
            CheckpointError: corrupt files, another config, another model or head structure,
                or an exported run whose checkpoint is missing. Nothing is written.
        """
        record_path = self.run_dir / RECORD_FILE
        if record_path.exists():
            self._check_config(record_config(read_record(self.run_dir), record_path), record_path)
            if not self.checkpoint_path.exists():
                raise CheckpointError(f"{self.run_dir} holds an exported run but no "
                                      f"{CHECKPOINT_FILE} to resume from; use a new run directory")
        if not self.checkpoint_path.exists():
            return
        state = load_checkpoint(self.checkpoint_path, CHECKPOINT_KIND)
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise CheckpointError(f"{self.checkpoint_path} lacks {missing}; the file is corrupt")
        self._check_config(record_config(state, self.checkpoint_path), self.checkpoint_path)
        if state["model_fingerprint"] != self.fingerprint:
            raise CheckpointError(f"{self.checkpoint_path} was written while training against "
                                  "another model (its config or LM head weights differ)")
        if state["head_fingerprint"] != head_fingerprint(self.head):
            raise CheckpointError(f"{self.checkpoint_path} holds a head of another structure "
                                  "(was the circuit file changed?)")
        try:
            self._load_tensors(state)
            self.optimizer.load_state_dict(state["optimizer"])
            self.generator.set_state(state["data_generator"])
            torch.set_rng_state(state["torch_rng"])
        except (RuntimeError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{self.checkpoint_path} cannot be restored ({error}); the "
                                  "file is corrupt") from None
        self.step, self.elapsed = int(state["step"]), float(state["elapsed"])
        self.history, self.recent_losses = list(state["history"]), list(state["recent_losses"])
        self.initial = PositionValidation.from_dict(state["initial_validation"])

    def _check_config(self, saved: HeadTrainingConfig, source: Path) -> None:
        differences = saved.differences(self.config)
        if differences:
            raise CheckpointError(
                f"{source} was written with a different configuration ({'; '.join(differences)})"
                "; use the same settings or a new run directory")

    def _load_tensors(self, state: dict[str, Any]) -> None:
        own = head_tensors(self.head)
        if set(state["head"]) != set(own):
            raise KeyError(f"head tensors {sorted(set(state['head']) ^ set(own))}")
        self.head.load_state_dict(state["head"], strict=False)
        lora = {name: p for name, p in self.backbone.draft_layers.named_parameters()
                if "lora_" in name}
        if set(state["lora"]) != set(lora):
            raise KeyError(f"LoRA tensors {sorted(set(state['lora']) ^ set(lora))}")
        with torch.no_grad():
            for name, value in state["lora"].items():
                if value.shape != lora[name].shape:
                    raise ValueError(f"LoRA tensor {name} has shape {tuple(value.shape)}")
                lora[name].copy_(value)

    def save(self) -> None:
        """Write ``checkpoint.pt`` atomically (rank 0 only)."""
        if not self.context.is_writer:
            return
        assert self.initial is not None
        save_checkpoint(self.checkpoint_path, CHECKPOINT_KIND, {
            "config": self.config.to_dict(), "model_fingerprint": self.fingerprint,
            "head_fingerprint": head_fingerprint(self.head),
            "head": {k: v.detach().cpu().clone() for k, v in head_tensors(self.head).items()},
            "lora": self.backbone.lora_state_dict(), "optimizer": self.optimizer.state_dict(),
            "data_generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
            "step": self.step, "elapsed": self.elapsed, "history": self.history,
            "recent_losses": self.recent_losses, "initial_validation": self.initial.to_dict()})

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self, data: SequenceSet) -> PositionValidation:
        """Token-weighted NLL per window position on the fixed validation sequences."""
        self.draft.eval()
        window = self.config.window
        sums = torch.zeros(window, dtype=torch.float64)
        counts = torch.zeros(window, dtype=torch.float64)
        mine = torch.arange(len(data))[self.context.rank::self.context.world_size]
        for chunk in mine.split(max(1, self.config.batch_size // self.context.world_size)):
            tokens, mask = data.rows(chunk)
            mask = None if mask is None else mask.to(self.device)
            tokens = tokens.to(self.device)
            out = mtp_loss(self.head, self.draft.hidden(tokens), tokens, mask, self.gamma)
            sums += out.nll_sum.double().cpu()
            counts += out.count.double().cpu()
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
                 "train_loss": train_loss, "validation": result.to_dict()}
        if self.context.enabled:  # DDP keeps the replicas equal: check it at every validation
            entry["replica_max_abs_diff"] = self.context.replica_difference(self.parameters)
        self.history.append(entry)
        self.recent_losses = []
        return result

    @property
    def tokens_seen(self) -> int:
        return self.step * self.config.batch_size * self.config.seq_len

    # ------------------------------------------------------------------ training
    def train_step(self, data: SequenceSet, module: nn.Module) -> float:
        """One optimiser step on this rank's shard of a global batch; the global mean loss."""
        config = self.config
        rows = torch.randint(0, len(data), (config.batch_size,), generator=self.generator)
        tokens, mask = data.rows(self.context.shard(rows))
        mask = None if mask is None else mask.to(self.device)
        loss, _, _ = module(tokens.to(self.device), mask)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters, config.grad_clip)
        self.optimizer.step()
        self.step += 1
        return float(self.context.all_sum(loss.detach().double().cpu()) / self.context.world_size)

    def should_stop(self, deadline: float | None) -> bool:
        """Whether the time budget is spent (agreed on by every rank)."""
        if deadline is None:
            return False
        late = torch.tensor([1.0 if time.perf_counter() >= deadline else 0.0])
        return bool(self.context.all_sum(late) > 0)

    def run(self, train: SequenceSet, validation: SequenceSet, started: float,
            max_seconds: float | None, max_steps: int | None) -> HeadTrainingResult:
        config = self.config
        limit = config.steps if max_steps is None else min(config.steps, max_steps)
        deadline = None if max_seconds is None else started + max_seconds
        if self.initial is None:
            self.initial = self.record_validation(validation)
        latest = PositionValidation.from_dict(self.history[-1]["validation"])
        module = self.context.wrap(self.draft, self.device)
        self.draft.train()
        bar = None
        if self.progress:
            from tqdm import tqdm
            bar = tqdm(total=limit, initial=min(self.step, limit), desc="train-head",
                       unit="step", dynamic_ncols=True)
        session_start, session_first = time.perf_counter(), self.step
        elapsed_before, last_save = self.elapsed, time.perf_counter()
        loss = math.nan
        while self.step < limit and not self.should_stop(deadline):
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
            if bar is not None:
                rate = (self.step - session_first) * config.batch_size * config.seq_len / \
                    max(time.perf_counter() - session_start, 1e-9)
                bar.set_postfix(loss=f"{loss:.3f}", val_bits=f"{latest.mean_bits:.3f}",
                                bytes_s=f"{rate:,.0f}")
                bar.update(1)
        if bar is not None:
            bar.close()
        session_seconds = time.perf_counter() - session_start
        if latest.step != self.step:
            latest = self.record_validation(validation)
        self.save()
        record = self.record(latest)
        if self.context.is_writer:
            export_run(self.run_dir, self.head, self.backbone, record)
        self.context.barrier()
        session_steps = self.step - session_first
        return HeadTrainingResult(
            run_dir=self.run_dir, config=config, step=self.step, finished=record["finished"],
            tokens_seen=self.tokens_seen, elapsed_s=self.elapsed, session_steps=session_steps,
            seconds_per_step=session_seconds / session_steps if session_steps else 0.0,
            train_loss=loss, initial_validation=self.initial, validation=latest,
            history=list(self.history))

    def record(self, latest: PositionValidation) -> dict[str, Any]:
        """The contents of ``training.json``."""
        assert self.initial is not None
        return {"config": self.config.to_dict(), "finished": self.step >= self.config.steps,
                "step": self.step, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed,
                "world_size": self.context.world_size, "model_fingerprint": self.fingerprint,
                "head_parameters": self.head.num_parameters(),
                "lora_parameters": sum(p.numel() for p in self.backbone.draft_parameters()),
                "validation": latest.to_dict(), "initial_validation": self.initial.to_dict(),
                "history": self.history}


def train_head(model: PreTrainedModel, config: HeadTrainingConfig, run_dir: str | Path, *,
               max_seconds: float | None = None, max_steps: int | None = None,
               progress: bool = True, corpus_root: Path | None = None) -> HeadTrainingResult:
    """Train (or resume) a circuit MTP head on ``model`` in ``run_dir``.

    Args:
        model: the target causal LM (Hugging Face); it is frozen and put in eval mode.
        config: the run's :class:`HeadTrainingConfig`.
        run_dir: where ``checkpoint.pt`` and the export (``head/``, ``adapter/``,
            ``training.json``) go; a directory with a checkpoint is resumed.
        max_seconds: return after about this many seconds of this call (the checkpoint and the
            export hold the state reached; call again to continue).
        max_steps: stop once this many steps are done in total (at most ``config.steps``).
        progress: show a progress bar (loss, bytes/s, ETA) on rank 0.
        corpus_root: the corpus directory (default: this interpreter's standard library).

    Returns:
        :class:`HeadTrainingResult`; ``finished`` tells whether ``config.steps`` were reached.
        The export is written whenever the call returns, finished or not.

    Side effects: seeds torch's global RNG with ``config.seed`` (the LoRA initialisation draws
    from it); freezes ``model`` and puts it in eval mode.

    Raises:
        TrainingConfigError: the config or the head does not fit the model.
        CheckpointError: the run directory holds a corrupt checkpoint, or one written with
            another config or model. In both cases nothing in ``run_dir`` is changed.
    """
    started = time.perf_counter()
    if not isinstance(config, HeadTrainingConfig):
        raise TrainingConfigError(f"config must be a HeadTrainingConfig, got "
                                  f"{type(config).__name__}")
    for name, value in (("max_seconds", max_seconds), ("max_steps", max_steps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value < 0):
            raise TrainingConfigError(f"{name} must be None or a number >= 0, got {value!r}")
    if not isinstance(model, PreTrainedModel):
        raise TrainingConfigError(f"model must be a Hugging Face PreTrainedModel, got "
                                  f"{type(model).__name__}")
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainingConfigError(f"run_dir {run_dir} exists and is not a directory")
    context = distributed_context(model.device, config.batch_size)
    try:
        trainer = _Trainer(model, config, run_dir, context, progress)
        trainer.restore()
        train, validation = training_sets(model, config, run_dir, writer=context.is_writer,
                                          root=corpus_root, progress=trainer.progress)
        return trainer.run(train, validation, started, max_seconds, max_steps)
    finally:
        context.close()
