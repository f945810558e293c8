"""Training a circuit head on a frozen draft block's outputs (the circuit on the block, issue 44
item 2(b); :mod:`~circuits_llm.draft_block.circuit_drafter` drafts with the result): a small,
in-memory loop over given features. The resumable run on the corpus, in the head-training loop
(feature cache, checkpoints, export, torchrun), is ``train-head --on-block``
(:mod:`~circuits_llm.training.block_head_trainer`), with the same alignment.

Data: :class:`~circuits_llm.draft_block.training.BlockFeatures` of prefills of the target, pairs
``(h_j, x_{j+1})`` for ``j = 0..T-1`` of sequences ``x_0..x_T``, and the target's law of
``x_{j+2}``. The block runs once over each sequence, causally, exactly as
:func:`~circuits_llm.draft_block.training.train_block` computes its depth-1 outputs (and as the
decoder's cache, which follows the verifier, gives them at inference): ``o_j`` (B, T, d).

Alignment with the MTP loss (:func:`~circuits_llm.training.loss.mtp_loss`, whose hidden state at
``t`` describes the window ``x_{t+1}..x_{t+n}``): ``o_j`` reads ``x_{j+1}`` and the round drafts
the window ``(X_0 = x_{j+1}, x_{j+2}, ..)`` from it, so ``o_j`` is the loss's hidden state at
``t = j``. The loss's sequence is ``x_0..x_T`` (T + 1 positions): ``x_0`` is not in the features
and is never read as a target or a token input (only as "a real token"), so a stand-in id takes its
place; position ``T`` has no block output and starts no window with a target (a zero row). The
target's law, when used as the teacher (``--target-law model``), is known at positions
``1..T`` only, so position ``0``'s window is then left out (masked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_llm.draft_block.block import DraftBlock, DraftBlockError
from circuits_llm.draft_block.circuit_drafter import check_block_head
from circuits_llm.draft_block.training import BlockFeatures, depth_outputs
from circuits_llm.training.loss import MTPLossOutput, mtp_loss
from circuits_llm.training.teacher import TeacherLaw

__all__ = ["BlockHeadData", "block_head_data", "block_head_loss", "train_block_head"]


@dataclass(frozen=True)
class BlockHeadData:
    """The MTP loss's inputs for a head on a frozen block (see the module docstring).

    Attributes:
        hidden: (B, T + 1, d) the block's outputs ``o_0..o_{T-1}`` and a zero row.
        tokens: (B, T + 1) long, ``x_0..x_T`` (``x_0``: a stand-in, ``x_1``).
        mask: (B, T + 1) bool, the real tokens (all, or all but ``x_0`` with a teacher).
        teacher: (B, T + 1, V) the target's logits of ``x_{t+1}`` at each ``t`` (row 0 zeros,
            masked), or ``None``.
    """

    hidden: Tensor
    tokens: Tensor
    mask: Tensor
    teacher: Tensor | None = None

    def rows(self, pick: Tensor) -> BlockHeadData:
        """The sequences ``pick`` (b,) long of this data (a mini-batch)."""
        return BlockHeadData(self.hidden[pick], self.tokens[pick], self.mask[pick],
                             None if self.teacher is None else self.teacher[pick])


@torch.no_grad()
def block_head_data(block: DraftBlock, features: BlockFeatures, *, teacher: bool = False,
                    chunk: int = 64) -> BlockHeadData:
    """The frozen block's outputs on ``features``, aligned for the MTP loss.

    Args:
        block: the draft block (run once, in eval mode, without gradients).
        features: the target's prefill features (``T >= 1`` positions).
        teacher: keep the target's law for the loss's teacher term (then position 0 is masked).
        chunk: sequences the block runs at once (memory: ``chunk T d`` activations).
    """
    hidden, tokens = features.hidden, features.tokens
    batch, length, width = hidden.shape
    if length < 1:
        raise DraftBlockError("the features need at least one position")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise DraftBlockError(f"chunk must be an int >= 1, got {chunk!r}")
    training = block.training
    block.eval()
    try:  # (B, T, d): depth 1 of the block's training pass, causal over each sequence
        outputs = torch.cat([next(depth_outputs(block, hidden[i:i + chunk], tokens[i:i + chunk], 1))
                             for i in range(0, batch, chunk)])
    finally:
        block.train(training)
    padded = torch.cat([outputs, outputs.new_zeros(batch, 1, width)], 1)
    sequence = torch.cat([tokens[:, :1], tokens], 1)  # x_0's stand-in: x_1 (never read)
    mask = torch.ones_like(sequence, dtype=torch.bool)
    law = None
    if teacher:
        mask[:, 0] = False
        law = torch.cat([features.teacher.new_zeros(batch, 1, features.teacher.shape[-1]),
                         features.teacher], 1)
    return BlockHeadData(padded.detach(), sequence, mask, law)


def block_head_loss(head: torch.nn.Module, data: BlockHeadData, gamma: float | None = None, *,
                    top_k: int = 16) -> MTPLossOutput:
    """The project's MTP loss (:func:`~circuits_llm.training.loss.mtp_loss`) of ``head`` on the
    block's outputs; with a teacher in ``data``, against the target's law over the head's
    categories (its ``top_k`` most likely ones)."""
    law = None
    if data.teacher is not None:
        logits = data.teacher
        draft = getattr(head, "draft_tokens", None)
        if draft is not None:
            logits = logits.index_select(-1, draft.to(logits.device))
        law = TeacherLaw(logits.float(), top_k)
    hidden = data.hidden.to(getattr(head, "dtype", data.hidden.dtype))
    return mtp_loss(head, hidden, data.tokens, data.mask, gamma, teacher=law)


def train_block_head(block: DraftBlock, head: torch.nn.Module, features: BlockFeatures, *,
                     steps: int = 100, lr: float = 1e-3, gamma: float | None = None,
                     teacher: bool = False, top_k: int = 16, batch_size: int | None = None,
                     generator: torch.Generator | None = None) -> list[float]:
    """Adam on the head's parameters for ``steps`` steps over the frozen block's outputs on
    ``features`` (computed once; mini-batches of ``batch_size`` sequences, all when ``None``).

    Returns:
        the loss of every step (before its update).

    Raises:
        DraftBlockError: a head that cannot read the block's outputs
            (:func:`~circuits_llm.draft_block.circuit_drafter.check_block_head`) or bad
            ``steps`` / ``batch_size``.
    """
    check_block_head(block, head)
    for name, value in (("steps", steps), ("batch_size", 1 if batch_size is None else batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DraftBlockError(f"{name} must be an int >= 1, got {value!r}")
    data = block_head_data(block, features, teacher=teacher)
    count = data.tokens.shape[0]
    size = count if batch_size is None else min(batch_size, count)
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    history = []
    head.train()
    for _ in range(steps):
        pick = torch.randperm(count, generator=generator)[:size]
        loss = block_head_loss(head, data.rows(pick), gamma, top_k=top_k).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append(float(loss.detach()))
    head.eval()
    return history
