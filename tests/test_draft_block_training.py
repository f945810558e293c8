"""Training the draft block on cached prefill features: depth ``a`` of the training pass is step
``a`` of a drafting round (same logits as the drafter's, teacher-forced drafts), and a few steps
lower the weighted soft cross-entropy to the target's law on a toy model."""

from __future__ import annotations

import pytest
import torch
from draft_block_models import perturbed_block, tiny_llama

from circuits_llm.backbone import HFBackbone
from circuits_llm.draft_block import BlockDrafter, DraftBlock, DraftBlockError
from circuits_llm.draft_block.training import block_loss, prefill_features, train_block

MODEL = tiny_llama(vocab=16, scale=4.0)


def _depth_logits(block: DraftBlock, ids: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """Each depth's (T, K) logits, read from the training pass (through ``block_loss``'s inputs)."""
    features = prefill_features(HFBackbone(MODEL), ids)
    captured: list[torch.Tensor] = []
    original = block.logits

    def spy(output: torch.Tensor) -> torch.Tensor:
        result = original(output)
        captured.append(result[0].detach())
        return result

    block.logits = spy  # type: ignore[method-assign]
    try:
        block_loss(block, features, depths)
    finally:
        del block.logits
    return captured


def test_training_depths_are_the_drafters_recursive_steps() -> None:
    block = perturbed_block(MODEL, steps=3, layers=2, draft_vocab=list(range(0, 16, 2)))
    ids = torch.tensor([[1, 4, 9, 3, 7, 2, 5, 11, 6, 8]])
    depths = 3
    logits = _depth_logits(block, ids, depths)
    _, hidden = HFBackbone(MODEL).hidden_states(ids)
    seq = ids[0].tolist()
    for t in range(0, len(seq) - 1 - depths):  # a round starting at t, teacher-forced drafts
        drafter = BlockDrafter(block)
        drafter.begin(hidden[:, :t], ids[0, 1:t + 1])
        with torch.no_grad():
            output = drafter.first_step(hidden[:, t], ids[0, t + 1:t + 2])
            for depth in range(1, depths + 1):
                j = t + depth - 1
                torch.testing.assert_close(block.logits(output)[0], logits[depth - 1][j],
                                           rtol=1e-9, atol=1e-9)
                output = drafter.next_step(output, torch.tensor([seq[j + 2]]))


def test_training_lowers_the_loss() -> None:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (8, 13), generator=generator)
    features = prefill_features(HFBackbone(MODEL), ids)
    block = DraftBlock(MODEL, steps=3)
    before, depths = block_loss(block, features, 3)
    assert len(depths) == 3
    history = train_block(block, features, depths=3, steps=40, lr=3e-3, generator=generator)
    after, _ = block_loss(block, features, 3)
    assert len(history) == 40
    assert float(after.detach()) < float(before.detach()) - 0.05
    assert all(p.grad is None for p in MODEL.parameters())  # the target stays untouched
    with pytest.raises(DraftBlockError, match="depths must be an int >= 1"):
        block_loss(block, features, 0)
