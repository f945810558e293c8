"""Training a draft block on cached prefill features, as it drafts ("training-time test").

Data: one prefill of the target over ``x_0..x_T`` gives, at every position ``j < T``, the feature
``h_j`` (the backbone's draft hidden state after ``x_j``), the token after it ``x_{j+1}``, and the
target's own law of ``x_{j+2}`` (its logits after ``x_{j+1}``): :class:`BlockFeatures`. No
generation is needed: the target's law is the teacher (``--target-law model``).

Depth ``a`` (1-based) is step ``a`` of a round that started at ``t = j - a + 1``: its row at ``j``
reads the block's own depth ``a - 1`` output at ``j - 1`` (depth 1: the feature ``h_j``) with the
token ``x_{j+1}`` and predicts ``x_{j+2}``; it attends to depth-1 rows at positions ``<= t`` (the
verified cache of that round) and to the depth-``b`` row at ``t + b - 1`` for ``b = 2..a`` (the
round's own speculative entries), which is exactly what the block sees when it drafts
(:mod:`~circuits_llm.draft_block.drafter`). Depth ``a`` runs the rows of depths ``1..a`` in one
call with that mask (:func:`depth_mask`), so later depths read earlier depths' outputs with
gradients, as EAGLE-3 trains. The loss at each depth is the soft cross-entropy to the target's law
over the draft vocabulary, weighted by ``decay ** (a - 1)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_llm.draft_block.block import DraftBlock, DraftBlockError

__all__ = ["BlockFeatures", "block_loss", "depth_mask", "depth_outputs", "prefill_features",
           "train_block"]


@dataclass(frozen=True)
class BlockFeatures:
    """What the block trains on, from prefills of the target.

    Attributes:
        hidden: (B, T, d) features ``h_j``.
        tokens: (B, T) long, ``x_{j+1}``: the token read with ``h_j``.
        teacher: (B, T, V) the target's logits after ``x_{j+1}`` (its law of ``x_{j+2}``).
    """

    hidden: Tensor
    tokens: Tensor
    teacher: Tensor

    def __post_init__(self) -> None:
        batch, length = self.tokens.shape
        if self.hidden.shape[:2] != (batch, length) or self.teacher.shape[:2] != (batch, length):
            raise DraftBlockError(f"features must be hidden (B, T, d), tokens (B, T), teacher "
                                  f"(B, T, V) with the same B, T; got {tuple(self.hidden.shape)}, "
                                  f"{tuple(self.tokens.shape)}, {tuple(self.teacher.shape)}")


@torch.no_grad()
def prefill_features(backbone: object, ids: Tensor) -> BlockFeatures:
    """:class:`BlockFeatures` of the sequences ``ids`` (B, T + 1) from one prefill of an
    :class:`~circuits_llm.backbone.HFBackbone` (``hidden_states``: its caches are untouched)."""
    logits, hidden = backbone.hidden_states(ids)  # type: ignore[attr-defined]
    return BlockFeatures(hidden[:, :-1].detach(), ids[:, 1:], logits[:, 1:].detach())


def depth_mask(depth: int, length: int, device: torch.device | None = None) -> Tensor:
    """(a T, a T) bool: which rows of depths ``1..a`` (``a = depth``, ``T = length`` positions
    each, depth-major) a row attends to, as in a round (see the module docstring)."""
    rows = torch.arange(depth * length, device=device)
    level, position = rows // length + 1, rows % length  # depth and position of each row/key
    a, i = level[:, None], position[:, None]
    b, j = level[None, :], position[None, :]
    verified = (b == 1) & (j <= i - a + 1)
    own = (b >= 2) & (b <= a) & (j == i - a + b)
    return verified | own


def depth_outputs(block: DraftBlock, hidden: Tensor, tokens: Tensor, depths: int
                  ) -> Iterator[Tensor]:
    """Each depth's (B, T, d) block outputs, depth ``1..depths`` in order (with gradients).

    ``hidden`` (B, T, F) are the features ``h_j`` (with the fused layers' outputs before them when
    the block has some: :meth:`~circuits_llm.draft_block.block.DraftBlock.read_features`),
    ``tokens`` (B, T) the tokens ``x_{j+1}`` read with them; depth ``a``'s row ``j`` is step
    ``a`` of a round started at ``j - a + 1`` (rows ``j < a - 1`` have no such round: their
    values are computed but mean nothing). Depth ``a``
    reads depth ``a - 1``'s output at the previous position and attends, under the last ``T``
    rows of :func:`depth_mask`, to the keys and values of depths ``1..a`` kept in a KV cache
    (rows of depth ``b`` attend only to depths ``<= b``, so their keys and values do not change
    when later depths are added: each depth runs only its own ``T`` rows; the cache keeps the
    autograd graph, so later depths' losses reach earlier depths' weights and inputs).
    """
    if isinstance(depths, bool) or not isinstance(depths, int) or depths < 1:
        raise DraftBlockError(f"depths must be an int >= 1, got {depths!r}")
    batch, length, _ = hidden.shape
    if depths > length:
        raise DraftBlockError(f"{depths} depths need at least as many positions, got {length}")
    positions = torch.arange(length, device=hidden.device)
    cache = block.new_cache()
    rows = block.read_features(hidden)  # (B, T, d): the fused layers' outputs read, if any
    for depth in range(1, depths + 1):
        mask = depth_mask(depth, length, hidden.device)[-length:]  # (T, depth T)
        output = block(rows, tokens, positions, mask, cache)
        yield output
        if depth < depths:  # the next depth reads this depth's output at the previous position
            rows = torch.cat([output.new_zeros(batch, 1, output.shape[-1]), output[:, :-1]], 1)


def block_loss(block: DraftBlock, features: BlockFeatures, depths: int, decay: float = 0.5
               ) -> tuple[Tensor, list[float]]:
    """The weighted soft cross-entropy over ``depths`` recursive steps.

    Returns:
        (the loss () with gradients, the mean cross-entropy at each depth as floats).
    """
    hidden, tokens, teacher = features.hidden, features.tokens, features.teacher
    if block.draft_tokens is not None:
        teacher = teacher.index_select(-1, block.draft_tokens.to(teacher.device))
    target = torch.softmax(teacher.double(), -1).to(hidden.dtype)  # mass outside K is dropped
    total, weights, per_depth = hidden.new_zeros(()), 0.0, []
    for depth, output in enumerate(depth_outputs(block, hidden, tokens, depths), 1):
        log_q = torch.log_softmax(block.logits(output).double(), -1).to(hidden.dtype)
        loss = -(target * log_q).sum(-1)[:, depth - 1:].mean()  # rows j >= depth - 1 exist
        weight = decay ** (depth - 1)
        total, weights = total + weight * loss, weights + weight
        per_depth.append(float(loss.detach()))
    return total / weights, per_depth


def train_block(block: DraftBlock, features: BlockFeatures, *, depths: int = 3, steps: int = 100,
                lr: float = 1e-3, decay: float = 0.5, batch_size: int | None = None,
                generator: torch.Generator | None = None) -> list[list[float]]:
    """Adam on the block's own parameters (the target stays frozen) for ``steps`` steps over
    ``features`` (mini-batches of ``batch_size`` sequences, all when ``None``).

    Returns:
        the per-depth cross-entropies of every step (before its update).
    """
    optimizer = torch.optim.Adam(block.parameters(), lr=lr)
    count = features.tokens.shape[0]
    size = count if batch_size is None else min(batch_size, count)
    history = []
    block.train()
    for _ in range(steps):
        pick = torch.randperm(count, generator=generator)[:size]
        batch = BlockFeatures(features.hidden[pick], features.tokens[pick], features.teacher[pick])
        loss, per_depth = block_loss(block, batch, depths, decay)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append(per_depth)
    block.eval()
    return history
