"""``train-head --on-block DIR``: a circuit head trained on a frozen draft block's outputs, in the
head-training loop (:class:`~circuits_llm.training.trainer.Trainer`: the same data, feature cache,
head sizing, checkpoints, resume, lock, signals and torchrun), the circuit drafted by
:class:`~circuits_llm.draft_block.BlockCircuitDrafter`.

Alignment. A training row ``x_0..x_{L-1}`` has the features ``h_0..h_{L-1}`` (the LM head's
input: cached once with ``--cache-features``, or live). The frozen block runs once over the row,
causally, on the pairs ``(h_t, x_{t+1})``, ``t = 0..L-2``: its output ``o_t`` has read the
context up to ``x_{t+1}`` through the block's attention, exactly as the decoder's block cache gives
``o_1`` after the verified token ``c = x_{t+1}``. ``o_t`` replaces ``h_t`` as the loss's hidden
state at ``t`` (:func:`~circuits_llm.training.loss.mtp_loss`: the window ``x_{t+1}..x_{t+n}``, the
round's ``(X_0 = c, d_1, ..)``); the last position has no block output (it would read
``x_L``) and a zero row stands there, whose window has no target inside the row. The model's own
law (``--target-law model``) is read from the features, as for a head on the backbone.

The block is held by reference, frozen and outside the trained module (DDP and the optimiser see
only the head); the run records the block's directory and the SHA-256 of its tensors in the
checkpoint and ``training.json`` and refuses to resume against another block. Export:
``RUN_DIR/head`` (:func:`~circuits_llm.heads.save_head`) and ``training.json``, atomic, as for
every head run; :func:`load_trained_block_head` reads back the block and the head.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from circuits_llm.backbone import HFBackbone
from circuits_llm.draft_block.block import DraftBlock, DraftBlockError
from circuits_llm.draft_block.circuit_drafter import check_block_head
from circuits_llm.draft_block.io import BLOCK_CONFIG_FILE, DraftBlockFileError, load_draft_block
from circuits_llm.draft_block.training import depth_outputs
from circuits_llm.heads import MTPHead
from circuits_llm.runtime.checkpoint import CheckpointError
from circuits_llm.training.block_trainer import BLOCK_DIR
from circuits_llm.training.config import TrainingConfigError
from circuits_llm.training.datasets import SequenceSet
from circuits_llm.training.draft_model import DraftModel
from circuits_llm.training.results import (
    RECORD_FILE,
    PositionValidation,
    load_exported_head,
    read_record,
    record_config,
)
from circuits_llm.training.teacher import TeacherLaw
from circuits_llm.training.trainer import Trainer

__all__ = ["BlockHeadDraftModel", "BlockHeadTrainer", "block_outputs", "block_sha256",
           "load_block", "load_trained_block_head"]

#: the checkpoint's and the record's key for the block a head run reads
BLOCK_KEY = "on_block"


def load_block(path: str | Path, model: PreTrainedModel) -> DraftBlock:
    """The draft block at ``path`` for ``model`` (eval mode): a ``save_draft_block`` directory
    (``block_config.json`` inside) or a ``train-head --draft-block`` run directory (its
    ``block/``).

    Raises:
        TrainingConfigError: nothing of the kind at ``path``, corrupt files, or a block trained
            for another model (the message says which and what to do).
    """
    path = Path(path)
    try:
        if (path / BLOCK_CONFIG_FILE).is_file():
            return load_draft_block(path, model)
        if (path / RECORD_FILE).is_file():
            if not record_config(read_record(path), path / RECORD_FILE).draft_block:
                raise TrainingConfigError(f"{path} is a run that trained a circuit head, not a "
                                          "draft block: give a train-head --draft-block run")
            return load_draft_block(path / BLOCK_DIR, model)  # checks the model it is for
    except (DraftBlockFileError, CheckpointError) as error:
        raise TrainingConfigError(f"cannot use the draft block in {path}: {error}") from None
    raise TrainingConfigError(f"{path} holds no draft block: give a directory written by "
                              f"save_draft_block ({BLOCK_CONFIG_FILE} inside) or a train-head "
                              "--draft-block run directory")


def block_sha256(block: DraftBlock) -> str:
    """SHA-256 of the block's own tensors (names, shapes, values) and its draft vocabulary: what
    ties a head run to the block it was trained on."""
    digest = hashlib.sha256()
    tensors = dict(block.state_dict())
    if block.draft_tokens is not None:
        tensors["draft_tokens"] = block.draft_tokens
    for name in sorted(tensors):
        value = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def block_outputs(block: DraftBlock, hidden: Tensor, tokens: Tensor) -> Tensor:
    """The frozen block's outputs as a head's hidden states.

    Args:
        block: the draft block (frozen; run without gradients).
        hidden: (B, L, d) the features ``h_t``.
        tokens: (B, L) long, ``x_t``.

    Returns:
        (B, L, d) float32: ``o_t`` (the block's causal pass over ``(h_t, x_{t+1})``) at ``t =
        0..L-2`` and a zero row at ``L - 1``.
    """
    dtype = block.dtype
    output = next(depth_outputs(block, hidden[:, :-1].to(dtype), tokens[:, 1:], 1))
    return torch.cat([output.float(), output.new_zeros(output.shape[0], 1, output.shape[2],
                                                       dtype=torch.float32)], 1)


class BlockHeadDraftModel(DraftModel):
    """A :class:`DraftModel` whose head reads the frozen block's outputs instead of the
    backbone's features (:func:`block_outputs`); the model's own law still comes from the
    features. The block is held by reference, not registered (DDP sees only the head)."""

    def __init__(self, backbone: HFBackbone, head: MTPHead, gamma: float, bf16: bool,
                 block: DraftBlock) -> None:
        super().__init__(backbone, head, gamma, bf16)
        self._block = (block,)

    def states(self, tokens: Tensor, features: Tensor | None = None,
               ) -> tuple[Tensor, TeacherLaw | None]:
        """The (B, L, d) float32 block outputs and, with a teacher, the LM's law at every
        position."""
        hidden, law = super().states(tokens, features)
        return block_outputs(self._block[0], hidden, tokens.to(hidden.device)), law


class BlockHeadTrainer(Trainer):
    """A :class:`Trainer` of a circuit head on a frozen draft block's outputs (module
    docstring); :func:`~circuits_llm.training.train_head` picks it for a config with
    ``on_block`` set."""

    def plan_module(self) -> None:
        """Load and check the block (this model's, frozen), then plan the head as usual."""
        config = self.config
        if config.on_block is None:
            raise TrainingConfigError("BlockHeadTrainer trains configs with on_block set")
        self.block = load_block(config.on_block, self.model)
        self.block.requires_grad_(False)
        if self.block.fused_layers:
            raise TrainingConfigError(
                f"the block in {config.on_block} reads the outputs of layers "
                f"{list(self.block.fused_layers)}; train-head --on-block trains heads on blocks "
                f"that read the LM head's input alone (train one on such a block, or use "
                f"circuits_llm.training.block_circuit.train_block_head with the fused features)")
        if self.block.hidden_size != self.backbone.hidden_size:
            raise TrainingConfigError(f"the block in {config.on_block} outputs "
                                      f"{self.block.hidden_size} wide states but the model's are "
                                      f"{self.backbone.hidden_size}")
        self.block_sha256 = block_sha256(self.block)
        super().plan_module()

    def build_head(self, train: SequenceSet) -> None:
        """The head, its optimiser and teacher as for any head run; its draft model reads the
        block's outputs (:class:`BlockHeadDraftModel`)."""
        super().build_head(train)
        try:
            check_block_head(self.block, self.head)
        except DraftBlockError as error:
            raise TrainingConfigError(str(error)) from None
        teacher = self.draft.teacher
        self.draft = BlockHeadDraftModel(self.backbone, self.head, self.gamma, self.config.bf16,
                                         self.block)
        self.draft.teacher = teacher

    def read_checkpoint(self, resume_from: str | Path | None = None,
                        ) -> tuple[dict[str, Any], Path] | None:
        """As for any run, and the checkpoint must have read this very block."""
        found = super().read_checkpoint(resume_from)
        if found is not None:
            state, source = found
            saved = (state.get(BLOCK_KEY) or {}).get("sha256")
            if saved != self.block_sha256:
                raise CheckpointError(
                    f"{source} trained its head on another draft block than the one now in "
                    f"{self.config.on_block} (its tensors differ); restore that block, or start "
                    "the head in a new run directory")
        return found

    def save(self) -> None:
        """Write ``checkpoint.pt`` as :meth:`Trainer.save` does, with the block's identity."""
        assert self.initial is not None
        self.checkpoint.save(self.trained_module(), self.backbone, self.optimizer,
                             self.generator, {
            "step": self.step, "elapsed": self.elapsed, "history": self.history,
            "recent_losses": self.recent_losses, "initial_validation": self.initial.to_dict(),
            BLOCK_KEY: self.block_identity()})

    def block_identity(self) -> dict[str, Any]:
        """What the run records of its block: directory, tensor digest, steps and sizes."""
        block = self.block
        return {"path": str(Path(str(self.config.on_block)).resolve()),
                "sha256": self.block_sha256, "steps": block.steps, "layers": len(block.layers),
                "draft_size": block.draft_size}

    def summary(self) -> str:
        return f"{super().summary()}; on the draft block {self.config.on_block}"

    def record(self, latest: PositionValidation) -> dict[str, Any]:
        """``training.json``: a head run's record and the block's identity."""
        return {**super().record(latest), BLOCK_KEY: self.block_identity()}


def load_trained_block_head(run_dir: str | Path, model: PreTrainedModel,
                            block_dir: str | Path | None = None) -> tuple[DraftBlock, MTPHead]:
    """The block and the head of a ``train-head --on-block`` run, for ``model`` (eval mode);
    decode with ``SpeculativeDecoder(model, BlockCircuitDrafter(block, head))``.

    Args:
        run_dir: the head run's directory.
        model: the model the block and the head were trained for.
        block_dir: where the block is now (default: the directory the run recorded).

    Raises:
        CheckpointError: missing or corrupt run files, a run that did not train on a block, or a
            block whose tensors are not the ones the head was trained on.
        TrainingConfigError: another model, or no block at the directory.
    """
    run_dir = Path(run_dir)
    record = read_record(run_dir)
    config = record_config(record, run_dir / RECORD_FILE)
    identity = record.get(BLOCK_KEY)
    if config.on_block is None or not isinstance(identity, dict):
        raise CheckpointError(f"{run_dir} trained a head on the backbone's features, not on a "
                              "draft block; load it with load_trained_head")
    where = identity.get("path") if block_dir is None else block_dir
    block = load_block(str(where), model)
    if block_sha256(block) != identity.get("sha256"):
        raise CheckpointError(f"the draft block in {where} is not the one the head in {run_dir} "
                              "was trained on (its tensors differ)")
    head, _ = load_exported_head(run_dir, model)
    try:
        check_block_head(block, head)
    except DraftBlockError as error:
        raise CheckpointError(f"the head in {run_dir} cannot read the block in {where}: "
                              f"{error}") from None
    return block, head
