"""``train-head --draft-block``: a :class:`~circuits_llm.draft_block.DraftBlock` trained by the
head-training loop (:class:`~circuits_llm.training.trainer.Trainer`: the same data, feature cache,
checkpoints, resume, lock, signals and torchrun), with its own module, loss and export.

Alignment. A training row of ``L`` tokens ``x_0..x_{L-1}`` has the features ``h_0..h_{L-1}`` (the
LM head's input, cached once with ``--cache-features`` or computed live). Block row ``j`` (``j =
0..L-3``, ``T = L - 2`` rows) reads ``(h_j, x_{j+1})`` and predicts ``x_{j+2}``, whose law under
the target is the LM head applied to ``h_{j+1}``: :meth:`BlockDraftModel.forward`.

Loss (FastMTP, EAGLE-3's training-time test). Depth ``a = 1..window-1`` is step ``a`` of a
drafting round (:func:`~circuits_llm.draft_block.training.depth_outputs`: depths >= 2 read the
block's own earlier outputs under the depth mask). At each depth the loss of a row is ``(1 - w)``
times the token NLL of ``x_{j+2}`` plus ``w`` times the cross-entropy to the target's own law at
``teacher_temperature`` over its ``teacher_top_k`` most likely draft tokens (``--target-law
model``; ``w`` = ``teacher_weight``; ``--target-law tokens``: ``w = 0``, and rows whose target is
outside the draft vocabulary are left out); depth ``a`` is averaged
over its valid rows (``j >= a - 1``, the loss mask of ``x_{j+1}`` and ``x_{j+2}``) and weighted
``gamma^(a-1)``. Validation reports the same per-depth loss (nats per row) on the fixed
validation rows.

Draft vocabulary: ``draft_vocab`` most frequent training tokens and EOS (default
:data:`DEFAULT_BLOCK_VOCAB` over a larger vocabulary, else every token; ``K >= V``: every token).

Export: ``run_dir/block/`` (:func:`~circuits_llm.draft_block.io.save_draft_block`) and
``training.json``; :func:`load_trained_block` reads them back for decoding.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from circuits.files import atomic_write_json
from circuits_llm.backbone import HFBackbone
from circuits_llm.draft_block.block import DraftBlock, DraftBlockError
from circuits_llm.draft_block.io import (
    DraftBlockFileError,
    load_draft_block,
    save_draft_block,
)
from circuits_llm.draft_block.training import depth_outputs
from circuits_llm.heads.vocab import frequent_tokens
from circuits_llm.runtime.checkpoint import CheckpointError, CheckpointWriteError
from circuits_llm.text.models import backbone_identity
from circuits_llm.training.build import always_drafted, backbone_parameters, build_teacher
from circuits_llm.training.checkpointing import TrainedModule
from circuits_llm.training.config import TargetLaw, TrainingConfigError
from circuits_llm.training.datasets import SequenceSet, training_token_counts
from circuits_llm.training.features import FeatureRows
from circuits_llm.training.results import (
    RECORD_FILE,
    RECORD_FORMAT,
    RECORD_VERSION,
    PositionValidation,
    read_record,
    record_config,
)
from circuits_llm.training.teacher import LanguageModelTeacher, TeacherLaw
from circuits_llm.training.trainer import Trainer

__all__ = ["BLOCK_DIR", "BlockDraftModel", "BlockModule", "BlockTrainer", "load_trained_block"]

#: where a run exports its block (beside ``training.json``)
BLOCK_DIR = "block"
#: the default draft vocabulary of a block over a vocabulary larger than this
DEFAULT_BLOCK_VOCAB = 8192


class BlockModule(TrainedModule):
    """A draft block as the checkpoint sees it: its own tensors and its structure's digest."""

    label = "draft block"

    def __init__(self, block: DraftBlock) -> None:
        self.block = block

    def tensors(self) -> dict[str, Tensor]:
        return dict(self.block.state_dict())

    def fingerprint(self) -> str:
        block = self.block
        ids = None if block.draft_tokens is None else \
            block.draft_tokens.to("cpu", torch.int64).tolist()
        record = {"kind": "draft_block", "steps": block.steps, "layers": len(block.layers),
                  "init": block.init.value, "hidden_size": block.hidden_size,
                  "vocab_size": block.vocab_size, "draft_tokens": ids}
        if block.fused_layers:  # absent otherwise: checkpoints of earlier runs keep resuming
            record["fused_layers"] = list(block.fused_layers)
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()

    def load(self, tensors: dict[str, Tensor]) -> None:
        self.block.load_state_dict(tensors)


class BlockDraftModel(nn.Module):
    """The trainable module of a block run: ``forward(tokens (B, L), mask (B, L) or None,
    features (B, L, d) or None) -> (loss, nll_sum (D,), count (D,))`` over ``D = depths``.

    The block is the one registered sub-module (DDP synchronises only it); the backbone is held
    by reference and runs only when no cached features are given.
    """

    def __init__(self, backbone: HFBackbone, block: DraftBlock, gamma: float, depths: int,
                 bf16: bool, teacher: LanguageModelTeacher | None) -> None:
        super().__init__()
        self.block = block
        self._backbone = (backbone,)
        self.gamma, self.depths, self.bf16 = gamma, depths, bf16
        self.teacher = teacher
        vocab = backbone.vocab_size
        lookup = torch.full((vocab,), -1, dtype=torch.long)
        if block.draft_tokens is None:
            lookup = torch.arange(vocab)
        else:
            ids = block.draft_tokens.cpu()
            lookup[ids] = torch.arange(ids.numel())
        self.register_buffer("lookup", lookup.to(backbone.device), persistent=False)

    def _features(self, tokens: Tensor, features: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """(B, L, F) features in the block's dtype (the fused layers' outputs, then the LM head's
        input) and the teacher's (B, L, K) logits (None without a teacher)."""
        backbone = self._backbone[0]
        logits = None
        if features is None:
            with torch.no_grad(), torch.autocast(device_type=backbone.device.type,
                                                 dtype=torch.bfloat16, enabled=self.bf16):
                live, hidden = backbone.hidden_states(tokens)
            if self.teacher is not None:
                logits = self.teacher.from_logits(live).logits
        else:
            hidden = features
            if self.teacher is not None:
                logits = self.teacher.from_features(self.block.last_hidden(features)).logits
        return hidden.to(self.block.dtype), logits

    def forward(self, tokens: Tensor, mask: Tensor | None,
                features: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``tokens`` (B, L), ``mask`` (B, L) bool or None, ``features`` (B, L, d) or None ->
        (the weighted loss () with gradients, the loss sum (D,) and the valid rows (D,) per
        depth); row ``j`` of depth ``a`` counts when ``j >= a - 1`` and the mask holds at
        ``j + 1`` and ``j + 2``."""
        hidden, logits = self._features(tokens, features)
        x, target = tokens[:, 1:-1], tokens[:, 2:]  # read with h_j; to predict
        valid = torch.ones_like(target, dtype=torch.bool) if mask is None else \
            (mask[:, 1:-1] & mask[:, 2:]).bool()
        weight = 0.0 if self.teacher is None else self.teacher.weight
        index = self.lookup[target]
        if weight < 1:  # the token loss needs the target inside the draft vocabulary
            valid = valid & (index >= 0)
        candidates = None
        if self.teacher is not None and logits is not None:
            law = TeacherLaw(logits[:, 1:-1], self.teacher.top_k, self.teacher.temperature,
                             weight)  # row j: the law of x_{j+2}, at position j + 1
            candidates = law.candidates()
        sums, counts = [], []
        loss = hidden.new_zeros((), dtype=torch.float32)
        for depth, output in enumerate(depth_outputs(self.block, hidden[:, :-2], x, self.depths),
                                       1):
            log_q = torch.log_softmax(self.block.logits(output).float(), -1)  # (B, T, K)
            row = torch.zeros(target.shape, dtype=torch.float32, device=log_q.device)
            if weight < 1:
                token_nll = -log_q.gather(-1, index.clamp(min=0)[..., None])[..., 0]
                row = row + (1 - weight) * token_nll
            if candidates is not None:
                where, prob = candidates
                soft = -(prob.float() * log_q.gather(-1, where)).sum(-1)
                row = row + weight * soft
            live = valid.clone()
            live[:, :depth - 1] = False  # no round reaches depth a before row a - 1
            total, count = torch.where(live, row, 0.0).sum(), live.sum()
            loss = loss + self.gamma ** (depth - 1) * total / count.clamp(min=1)
            sums.append(total.detach())
            counts.append(count)
        return loss, torch.stack(sums), torch.stack(counts)


class BlockTrainer(Trainer):
    """A :class:`Trainer` whose trained module is a draft block (see the module docstring)."""

    def plan_module(self) -> None:
        """Check the block's config (the head's plan is not made): ``draft_block``, depths."""
        config = self.config
        if not config.draft_block:
            raise TrainingConfigError("BlockTrainer trains configs with draft_block=True")
        vocab = self.backbone.vocab_size
        wanted = config.draft_vocab if config.draft_vocab is not None else \
            (DEFAULT_BLOCK_VOCAB if vocab > DEFAULT_BLOCK_VOCAB else None)
        #: K of the block's draft vocabulary (None: the whole vocabulary)
        self.block_vocab: int | None = None if wanted is None or wanted >= vocab else wanted
        self.depths = config.window - 1

    def build_head(self, train: SequenceSet) -> None:
        """Build the block (its draft vocabulary: the training data's most frequent tokens and
        EOS; or the weights and vocabulary of the saved block ``init_from``), its loss module and
        the optimiser."""
        config, backbone = self.config, self.backbone
        tokens, start = None, None
        if config.init_from is not None:  # its weights and its draft vocabulary
            try:
                start = load_draft_block(config.init_from, self.model)
            except DraftBlockFileError as error:
                raise TrainingConfigError(f"init_from: {error}") from None
            if len(start.layers) != config.block_layers:
                raise TrainingConfigError(
                    f"init_from {config.init_from} holds a block of {len(start.layers)} layer(s), "
                    f"this run trains {config.block_layers}; pass --block-layers "
                    f"{len(start.layers)}")
            tokens = start.draft_tokens
        elif self.block_vocab is not None:
            counts = training_token_counts(train, backbone.vocab_size)
            tokens = frequent_tokens(counts, self.block_vocab, vocab_size=backbone.vocab_size,
                                     always=always_drafted(self.model))
            self.draft_coverage = counts.coverage(tokens)
        try:
            self.block = DraftBlock(self.model, steps=self.depths, layers=config.block_layers,
                                    init=config.block_init, draft_vocab=tokens,
                                    fused_layers=config.fused_layers)
        except DraftBlockError as error:
            raise TrainingConfigError(str(error)) from None
        if start is not None:
            self._continue_from(start)
        teacher = None
        if config.target_law is TargetLaw.MODEL:
            first_tokens = first_features = None
            if isinstance(train, FeatureRows) and len(train) > 0:  # checked against a live pass
                first = torch.zeros(1, dtype=torch.long)
                first_tokens = train.rows(first)[0]
                first_features = self.block.last_hidden(train.features(first))
            teacher = build_teacher(self.model, backbone, self.block, config, first_tokens,
                                    first_features)
        self.draft = BlockDraftModel(  # type: ignore[assignment]
            backbone, self.block, self.gamma, self.depths, config.bf16, teacher)
        self.parameters = list(self.block.parameters())
        fusion = [] if not self.block.fused_layers else \
            list(self.block.layer_fusion.parameters())  # type: ignore[union-attr]
        kept = {id(p) for p in fusion}
        groups = [{"params": [p for p in self.parameters if id(p) not in kept]}]
        if fusion:  # it starts at zero: its own, larger rate (config.fusion_rate)
            groups.append({"params": fusion, "lr": config.fusion_rate})
        self.optimizer = torch.optim.AdamW(groups, lr=config.learning_rate,
                                           weight_decay=config.weight_decay)

    def _continue_from(self, start: DraftBlock) -> None:
        """Load ``init_from``'s weights. A block without fused layers continues into one with
        them: its fusion starts at zero, so the new block starts exactly where it stood. One with
        other fused layers is refused."""
        if start.fused_layers and start.fused_layers != self.block.fused_layers:
            raise TrainingConfigError(
                f"init_from {self.config.init_from} reads the outputs of layers "
                f"{list(start.fused_layers)}, this run fuses {list(self.block.fused_layers)}; "
                f"pass --fused-layers {','.join(map(str, start.fused_layers))}")
        missing, _ = self.block.load_state_dict(start.state_dict(), strict=False)
        assert all(name.startswith("layer_fusion.") for name in missing), missing

    def trained_module(self) -> BlockModule:  # type: ignore[override]
        return BlockModule(self.block)

    @property
    def validation_positions(self) -> int:
        """One loss per depth."""
        return self.depths

    def validation_sums(self, tokens: Tensor, mask: Tensor | None, features: Tensor | None,
                        ) -> tuple[Tensor, Tensor]:
        """``(loss_sum, rows)`` per depth (D,) of the training loss on one validation chunk."""
        _, sums, counts = self.draft(tokens, mask, features)
        return sums, counts

    def summary(self) -> str:
        """One line: the block's size and the largest peak memory of a step."""
        count = sum(p.numel() for p in self.block.parameters())
        share = count / backbone_parameters(self.model)
        coverage = "" if self.draft_coverage is None else \
            f", covering {self.draft_coverage:.1%} of the training tokens"
        peak = self.peak_memory()
        memory = "no step run" if peak["mib"] is None else f"{peak['mib']:,.1f} MiB ({peak['kind']})"
        return (f"draft block ({len(self.block.layers)} layer(s), {self.depths} steps, K = "
                f"{self.block.draft_size}): {count:,} parameters, {share:.2%} of the backbone"
                f"{coverage}; peak memory of a step: {memory}")

    def export(self, latest: PositionValidation) -> None:
        """Write ``block/`` and then ``training.json`` (rank 0).

        Raises:
            CheckpointWriteError: a file could not be written (the checkpoint is already saved).
        """
        if not self.context.is_writer:
            return
        try:
            save_draft_block(self.block, self.run_dir / BLOCK_DIR, self.model)
            atomic_write_json(self.run_dir / RECORD_FILE, {
                "format": RECORD_FORMAT, "version": RECORD_VERSION, **self.record(latest)},
                allow_nan=True)
        except OSError as error:
            raise CheckpointWriteError(
                f"cannot write the exported block to {self.run_dir} ({error.strerror or error}); "
                f"{self.kept()}; free disk space and run the same command again to export it") \
                from None

    def record(self, latest: PositionValidation) -> dict[str, Any]:
        """The contents of ``training.json``."""
        assert self.initial is not None
        return {"config": self.config.to_dict(), "finished": self.step >= self.config.steps,
                "step": self.step, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed,
                "world_size": self.context.world_size, "model_fingerprint": self.fingerprint,
                "block_parameters": sum(p.numel() for p in self.block.parameters()),
                "block_dir": BLOCK_DIR, "draft_vocab_coverage": self.draft_coverage,
                "peak_step_memory": self.peak_memory(),
                "feature_cache": [str(path) for path in self.feature_entries],
                "validation": latest.to_dict(), "initial_validation": self.initial.to_dict(),
                "history": self.history}


def load_trained_block(run_dir: str | Path, model: PreTrainedModel) -> DraftBlock:
    """The block a ``train-head --draft-block`` run exported, for ``model`` (eval mode); decode
    with ``SpeculativeDecoder(HFBackbone(model), BlockDrafter(block))``.

    Raises:
        CheckpointError: missing or corrupt run files, a run that trained a head, or a block
            for another model.
    """
    run_dir = Path(run_dir)
    record = read_record(run_dir)
    config = record_config(record, run_dir / RECORD_FILE)
    if not config.draft_block:
        raise CheckpointError(f"{run_dir} trained a circuit head, not a draft block; load it with "
                              "load_trained_head")
    if backbone_identity(model) != record.get("model_fingerprint"):
        raise CheckpointError(f"the block in {run_dir} was trained for another model (its config "
                              "or LM head weights differ)")
    try:
        return load_draft_block(run_dir / BLOCK_DIR, model)
    except DraftBlockFileError as error:
        raise CheckpointError(f"cannot load the trained block from {run_dir}: {error}") from None
