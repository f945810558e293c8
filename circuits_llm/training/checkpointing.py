"""A training run's checkpoint as one run sees it: :class:`RunCheckpoint`.

``checkpoint.pt`` in the run directory holds everything a resumed run needs to continue
bit-identically: the head's and the LoRA tensors, the optimiser state, the data generator's and
torch's RNG states, and the run's progress (step, elapsed seconds, validation history). This
module reads it back checked (:meth:`RunCheckpoint.read`: the config, the model and, once the head
is built, the head's structure must be this run's), loads it into the built head
(:meth:`RunCheckpoint.load_into`), writes it (:meth:`RunCheckpoint.save`: atomically, the
previous one kept, rank 0 writing, skipped when nothing changed, refused when a parameter is not
finite) and says what is on disk for messages (:meth:`RunCheckpoint.kept`).

What a step does and when the loop saves are the trainer's (:mod:`circuits_llm.training.trainer`);
the file format, its checksum and verified reading are :mod:`circuits_llm.runtime.checkpoint`'s and
:mod:`circuits_llm.training.resume`'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_llm.backbone import HFBackbone
from circuits_llm.heads import MTPHead
from circuits_llm.heads.io import head_tensors
from circuits_llm.runtime.checkpoint import CheckpointError, save_checkpoint
from circuits_llm.training.build import head_fingerprint
from circuits_llm.training.config import HeadTrainingConfig
from circuits_llm.training.guards import first_non_finite, non_finite_error
from circuits_llm.training.results import record_config
from circuits_llm.training.resume import (
    CHECKPOINT_FILE,
    CHECKPOINT_KIND,
    check_config,
    checkpoint_source,
    read_state,
)


class TrainedModule(ABC):
    """What a checkpoint stores of the trained module (under the state's ``head`` keys): its
    tensors, a fingerprint of its structure, and how to load tensors back. A head is adapted by
    :class:`_HeadModule`; a draft block by :mod:`circuits_llm.training.block_trainer`."""

    label = "head"

    @abstractmethod
    def tensors(self) -> dict[str, Tensor]:
        """The module's defining tensors, by name."""

    @abstractmethod
    def fingerprint(self) -> str:
        """SHA-256 of the module's structure (not of its values)."""

    @abstractmethod
    def load(self, tensors: dict[str, Tensor]) -> None:
        """Copy ``tensors`` (the names of :meth:`tensors`) into the module."""


class _HeadModule(TrainedModule):
    """A circuit head as a :class:`TrainedModule`."""

    def __init__(self, head: MTPHead) -> None:
        self.head = head

    def tensors(self) -> dict[str, Tensor]:
        return head_tensors(self.head)

    def fingerprint(self) -> str:
        return head_fingerprint(self.head)

    def load(self, tensors: dict[str, Tensor]) -> None:
        self.head.load_state_dict(tensors, strict=False)


def _trained(module: MTPHead | TrainedModule) -> TrainedModule:
    return module if isinstance(module, TrainedModule) else _HeadModule(module)


class RunCheckpoint:
    """``checkpoint.pt`` of one run directory, for one process of the run.

    Attributes:
        path: the checkpoint file.
        saved_step: the step of the checkpoint on disk written or resumed by this run (None: none).
    """

    def __init__(self, run_dir: Path, config: HeadTrainingConfig, fingerprint: str,
                 writer: bool) -> None:
        self.run_dir, self.config, self.fingerprint, self.writer = run_dir, config, fingerprint, writer
        self.path = run_dir / CHECKPOINT_FILE
        self.saved_step: int | None = None
        self._marker: tuple[int, int] | None = None  # (step, history length) on disk

    def read(self, resume_from: str | Path | None = None) -> tuple[dict[str, Any], Path] | None:
        """The checkpoint to resume from (``checkpoint.pt`` or ``resume_from``), checked against
        this run's config and model, or None for a fresh run. Needs no head.

        Raises:
            CheckpointError: a file failing its checksum, another config or another model, or
                an exported run whose checkpoint is missing. Nothing is written.
        """
        source = checkpoint_source(self.run_dir, self.config, resume_from)
        if source is None:
            return None
        state = read_state(source, explicit=resume_from is not None)
        check_config(record_config(state, source), self.config, source)
        if state["model_fingerprint"] != self.fingerprint:
            raise CheckpointError(f"{source} was written while training against "
                                  "another model (its config or LM head weights differ)")
        return state, Path(source)

    def load_into(self, found: tuple[dict[str, Any], Path], head: MTPHead | TrainedModule,
                  backbone: HFBackbone, optimizer: torch.optim.Optimizer,
                  generator: torch.Generator) -> dict[str, Any]:
        """Load a checkpoint of :meth:`read` into the built head (or another
        :class:`TrainedModule`, e.g. a draft block), the LoRA layers, the optimiser and the
        generators; the state, whose progress the caller takes over.

        Raises:
            CheckpointError: the checkpoint holds a head of another structure (e.g. a changed
                circuit file or draft vocabulary size), or is corrupt. Nothing is written.
        """
        state, source = found
        trained = _trained(head)
        if state["head_fingerprint"] != trained.fingerprint():
            raise CheckpointError(f"{source} holds a {trained.label} of another structure (was "
                                  "the circuit file, or the training data that choose its draft "
                                  "vocabulary, changed?)")
        try:
            _load_tensors(state, trained, backbone)
            optimizer.load_state_dict(state["optimizer"])
            generator.set_state(state["data_generator"])
            torch.set_rng_state(state["torch_rng"])
        except (RuntimeError, ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{source} cannot be restored ({error}); the "
                                  "file is corrupt") from None
        if source == self.path:
            step = int(state["step"])
            self.saved_step, self._marker = step, (step, len(state["history"]))
        return state

    def save(self, head: MTPHead | TrainedModule, backbone: HFBackbone,
             optimizer: torch.optim.Optimizer,
             generator: torch.Generator, progress: dict[str, Any]) -> None:
        """Write ``checkpoint.pt`` atomically, keeping the previous one (rank 0 writes).

        ``progress`` holds the run's ``step``, ``elapsed``, ``history``, ``recent_losses`` and
        ``initial_validation``. Skipped when nothing changed since the last write (so a resumed run
        that does no step does not displace the previous checkpoint with a copy of the current
        one).

        Raises:
            NonFiniteTrainingError: a parameter is NaN or infinite (nothing is written).
            CheckpointWriteError: the write failed (``checkpoint.pt`` is unchanged).
        """
        step = progress["step"]
        marker = (step, len(progress["history"]))
        if marker == self._marker:
            return
        trained = _trained(head)
        tensors = {k: v.detach().cpu().clone() for k, v in trained.tensors().items()}
        lora = backbone.lora_state_dict()
        bad = first_non_finite({**tensors, **lora})
        if bad is not None:
            raise non_finite_error(step, f"parameter {bad} is NaN or infinite", self.kept())
        if self.writer:
            save_checkpoint(self.path, CHECKPOINT_KIND, {
                "config": self.config.to_dict(), "model_fingerprint": self.fingerprint,
                "head_fingerprint": trained.fingerprint(), "head": tensors, "lora": lora,
                "optimizer": optimizer.state_dict(),
                "data_generator": generator.get_state(), "torch_rng": torch.get_rng_state(),
                **progress}, summary={"step": step}, keep_previous=True)
        self.saved_step, self._marker = step, marker

    def kept(self) -> str:
        """What is on disk to resume from, for messages."""
        if self.saved_step is not None:
            return f"the last good checkpoint, step {self.saved_step}, is kept in {self.path}"
        if self.path.exists():
            return f"{self.path} is left as it was"
        return "no checkpoint was written"


def _load_tensors(state: dict[str, Any], trained: TrainedModule, backbone: HFBackbone) -> None:
    own = trained.tensors()
    if set(state["head"]) != set(own):
        raise KeyError(f"{trained.label} tensors {sorted(set(state['head']) ^ set(own))}")
    trained.load(state["head"])
    lora = {name: p for name, p in backbone.draft_layers.named_parameters() if "lora_" in name}
    if set(state["lora"]) != set(lora):
        raise KeyError(f"LoRA tensors {sorted(set(state['lora']) ^ set(lora))}")
    with torch.no_grad():
        for name, value in state["lora"].items():
            if value.shape != lora[name].shape:
                raise ValueError(f"LoRA tensor {name} has shape {tuple(value.shape)}")
            lora[name].copy_(value)
