"""What a training run produces: validation records, the exported run and how to load it back.

An exported run directory holds::

    head/            heads.save_head: head.safetensors + head_config.json
    adapter/         HFBackbone.save_adapter (only when lora_layers > 0)
    training.json    config, history, validation per window position, model fingerprint

Every file is replaced atomically, and ``training.json`` last: once it exists, the head and the
adapter next to it are complete (an interrupted later export may have refreshed them already).
:func:`load_trained_head` rebuilds the head and the backbone (with its adapter) for decoding; a
head trained on a draft block's outputs (``train-head --on-block``) loads with its block through
:func:`~circuits_llm.training.block_head_trainer.load_trained_block_head` instead, which reads the
head with :func:`load_exported_head`.
"""

from __future__ import annotations

import json
import math
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from circuits.files import atomic_write_json
from circuits_llm.backbone import AdapterMismatchError, HFBackbone
from circuits_llm.heads import HeadConfigError, MTPHead, load_head, save_head
from circuits_llm.runtime.checkpoint import CheckpointError
from circuits_llm.text.models import config_fingerprint
from circuits_llm.training.config import HeadTrainingConfig, TrainingConfigError

RECORD_FILE = "training.json"
HEAD_DIR = "head"
ADAPTER_DIR = "adapter"
RECORD_FORMAT = "circuits_llm.head_training"
RECORD_VERSION = 1


@dataclass(frozen=True)
class PositionValidation:
    """Validation NLL per window position ``j = 1..n`` after ``step`` optimiser steps.

    Attributes:
        step: optimiser steps done when measured.
        nll: (n,) nats per target at window position ``j`` (pooled over all valid targets,
            ``-log q_t(x_{t+j} | x_{t+1..t+j-1})``).
        tokens: (n,) number of valid targets per position.
        loss: the discounted loss ``sum_j gamma^(j-1) nll_j`` (comparable to the train loss).
    """

    step: int
    nll: tuple[float, ...]
    tokens: tuple[int, ...]
    loss: float

    @property
    def bits(self) -> tuple[float, ...]:
        """(n,) bits per target at each window position."""
        return tuple(value / math.log(2) for value in self.nll)

    @property
    def mean_nll(self) -> float:
        """Mean over window positions of :attr:`nll` (nats)."""
        return sum(self.nll) / len(self.nll)

    @property
    def mean_bits(self) -> float:
        """Mean over window positions of :attr:`bits`."""
        return self.mean_nll / math.log(2)

    @property
    def draft_mean_bits(self) -> float:
        """Mean over positions ``j = 2..n`` of :attr:`bits`: the positions a round drafts (the
        first is the verifier's token; a head that reads it is not trained on it)."""
        drafted = self.bits[1:]
        return sum(drafted) / len(drafted) if drafted else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "nll": list(self.nll), "tokens": list(self.tokens),
                "bits": list(self.bits), "mean_nll": self.mean_nll, "mean_bits": self.mean_bits,
                "draft_mean_bits": self.draft_mean_bits}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PositionValidation:
        return cls(int(values["step"]), tuple(float(v) for v in values["nll"]),
                   tuple(int(v) for v in values["tokens"]), float(values["loss"]))


@dataclass(frozen=True)
class HeadTrainingResult:
    """What :func:`~circuits_llm.training.train_head` returns.

    Attributes:
        run_dir: where the checkpoint and the exported head live.
        config: the run's configuration.
        step: optimiser steps done in total (over every session of the run).
        finished: whether ``step == config.steps`` (else the call stopped at a time or step
            limit; calling again resumes).
        tokens_seen: training tokens processed in total (``step * batch_size * seq_len``).
        elapsed_s: training seconds over every session.
        session_steps: steps done by this call.
        seconds_per_step: wall seconds per step in this call (0 when it did none).
        train_loss: the last step's discounted training loss (NaN when no step was done yet).
        initial_validation: validation before the first step.
        validation: validation of the exported head.
        history: one dict per validation: step, tokens, mean train loss since the previous one,
            and the validation record.
        interrupted_by: the signal that stopped this call early (``handle_signals``); the
            checkpoint holds the state reached, the export is not refreshed. None otherwise.
    """

    run_dir: Path
    config: HeadTrainingConfig
    step: int
    finished: bool
    tokens_seen: int
    elapsed_s: float
    session_steps: int
    seconds_per_step: float
    train_loss: float
    initial_validation: PositionValidation
    validation: PositionValidation
    history: list[dict[str, Any]]
    interrupted_by: signal.Signals | None = None


def export_run(run_dir: Path, head: MTPHead, backbone: HFBackbone, record: dict[str, Any]) -> None:
    """Write ``head/``, ``adapter/`` (LoRA only) and then ``training.json`` into ``run_dir``."""
    save_head(head, run_dir / HEAD_DIR)
    if backbone.lora_layers > 0:
        backbone.save_adapter(run_dir / ADAPTER_DIR)
    atomic_write_json(run_dir / RECORD_FILE,
                      {"format": RECORD_FORMAT, "version": RECORD_VERSION, **record}, allow_nan=True)


def read_record(run_dir: str | Path) -> dict[str, Any]:
    """The parsed ``training.json`` of a run; :class:`CheckpointError` when missing or corrupt."""
    path = Path(run_dir) / RECORD_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; is {run_dir} a finished or exported "
                              "train-head run directory?")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}); the file is corrupt") from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT \
            or record.get("version") != RECORD_VERSION or "config" not in record:
        raise CheckpointError(f"{path} is not a {RECORD_FORMAT} version {RECORD_VERSION} record")
    return record


def record_config(record: dict[str, Any], source: Path) -> HeadTrainingConfig:
    """The :class:`HeadTrainingConfig` stored in a record or checkpoint (CheckpointError if bad)."""
    try:
        return HeadTrainingConfig.from_dict(record["config"])
    except (TrainingConfigError, TypeError) as error:
        raise CheckpointError(f"{source} holds an invalid training config: {error}") from None


def load_trained_head(run_dir: str | Path, model: PreTrainedModel, *, compile: bool = False,
                      ) -> tuple[MTPHead, HFBackbone]:
    """Rebuild a head trained on the backbone's features and its backbone (with the LoRA adapter)
    for decoding.

    Args:
        run_dir: a directory written by ``train_head`` (its ``training.json``, ``head/`` and,
            with LoRA, ``adapter/``).
        model: the same causal LM the head was trained on (any device).
        compile: a backbone with a static KV cache and compiled forwards
            (``HFBackbone(..., compile=True)``), for ``SpeculativeDecoder(..., compile=True)``.

    Returns:
        ``(head, backbone)``, both in eval mode on the model's device; use them as
        ``SpeculativeDecoder(backbone, head)``.

    Raises:
        CheckpointError: missing or corrupt run files, a run that trained a draft block, or one
            that trained its head on a draft block's outputs (``on_block``): that head reads the
            block's outputs, so on the backbone's hidden states it would decode from inputs it
            never saw; :func:`~circuits_llm.training.block_head_trainer.load_trained_block_head`
            loads it with its block.
        TrainingConfigError: the model is not the one the head was trained for.
    """
    run_dir = Path(run_dir)
    config = record_config(read_record(run_dir), run_dir / RECORD_FILE)
    if config.on_block is not None:
        raise CheckpointError(
            f"{run_dir} trained its head on a draft block's outputs (train-head --on-block "
            f"{config.on_block}), not on the backbone's hidden states; load it with its block "
            "through circuits_llm.training.block_head_trainer.load_trained_block_head and decode "
            "with BlockCircuitDrafter(block, head)")
    return load_exported_head(run_dir, model, compile=compile)


def load_exported_head(run_dir: str | Path, model: PreTrainedModel, *, compile: bool = False,
                       ) -> tuple[MTPHead, HFBackbone]:
    """The head a ``train_head`` run exported and its backbone (with the LoRA adapter), both in
    eval mode, whatever the head reads: the loaders that know its inputs check them
    (:func:`load_trained_head`: the backbone's features;
    :func:`~circuits_llm.training.block_head_trainer.load_trained_block_head`: a draft block's
    outputs). Arguments and errors as :func:`load_trained_head`'s, less the ``on_block`` refusal.
    """
    run_dir = Path(run_dir)
    record = read_record(run_dir)
    config = record_config(record, run_dir / RECORD_FILE)
    if config.draft_block:
        raise CheckpointError(f"{run_dir} trained a draft block, not a circuit head; load it with "
                              "circuits_llm.training.load_trained_block")
    if not isinstance(model, PreTrainedModel):
        raise TrainingConfigError(f"model must be a Hugging Face PreTrainedModel, got "
                                  f"{type(model).__name__}")
    trained_for = (record.get("model_fingerprint") or {}).get("config")
    if trained_for != config_fingerprint(model):
        raise TrainingConfigError(
            f"the head in {run_dir} was trained for a model with another configuration "
            f"(fingerprint {trained_for} != {config_fingerprint(model)})")
    window = config.window
    backbone = HFBackbone(model, lora_layers=config.lora_layers, lora_rank=config.lora_rank,
                          compile=compile, compiled_lengths=sorted({1, window}) if compile else None)
    try:
        if config.lora_layers > 0:
            backbone.load_adapter(run_dir / ADAPTER_DIR)
        head = load_head(run_dir / HEAD_DIR, backbone.hidden_size, backbone.vocab_size,
                         device=backbone.device, expected_fingerprint=trained_for)
    except (AdapterMismatchError, HeadConfigError, FileNotFoundError) as error:
        raise CheckpointError(f"cannot load the trained head from {run_dir}: {error}") from None
    return head.eval(), backbone.eval()
