"""``benchmarks/fused_features_probe.py``: what it reads from the model is the LM head's input and
the named layers' outputs, its acceptance is ``sum min(p, q)`` computed independently, every arm
starts where the block stands (the fusion is zero at the start), training moves only what the arm
trains, and the block given is never changed (float64 tiny Llama)."""

from __future__ import annotations

import pytest
import torch
from draft_block_models import perturbed_block, tiny_llama

from benchmarks.fused_features_probe import (
    Arm,
    LayerFusion,
    acceptance,
    read_text,
    run_probe,
    sample_windows,
    table,
    tokens_per_round,
    train_arm,
)
from circuits_llm.backbone import HFBackbone

MODEL = tiny_llama(scale=4.0)


def _ids(count: int = 6, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 47, (count, length), generator=torch.Generator().manual_seed(seed))


def test_read_text_is_the_head_input_and_the_layers_outputs() -> None:
    block = perturbed_block(MODEL, draft_vocab=list(range(0, 48, 2)))
    ids = _ids()
    text = read_text(MODEL, block, ids, [0, 1], batch=4)
    logits, hidden = HFBackbone(MODEL).hidden_states(ids)
    with torch.no_grad():
        states = MODEL(input_ids=ids, output_hidden_states=True).hidden_states
    assert torch.allclose(text.top, hidden[:, :-2], atol=1e-12)
    assert torch.allclose(text.layers[:, :, 0], states[1][:, :-2], atol=1e-12)
    with torch.no_grad():  # the last layer's output is what the final norm turns into the top
        assert torch.allclose(MODEL.model.norm(text.layers[:, :, 1]), text.top, atol=1e-12)
    law = torch.softmax(logits[:, 1:-1].double(), -1)[..., block.draft_tokens]
    assert torch.allclose(text.law, law, atol=1e-12)
    assert torch.equal(text.tokens, ids[:, 1:-1])


def test_depth_one_acceptance_is_sum_min_p_q() -> None:
    block = perturbed_block(MODEL)
    ids = _ids(count=3)
    text = read_text(MODEL, block, ids, [1])
    measured = acceptance(block, None, text, depths=2)[0]
    expected = []
    for row in range(ids.shape[0]):
        cache = block.new_cache()
        with torch.no_grad():
            out = block.extend(text.top[row:row + 1], text.tokens[row:row + 1], cache)
            q = torch.softmax(block.logits(out)[0], -1)
            for j in range(ids.shape[1] - 2):
                p = torch.softmax(MODEL(input_ids=ids[row:row + 1, :j + 2]).logits[0, -1], -1)
                expected.append(float(torch.minimum(p, q[j]).sum()))
    assert measured == pytest.approx(sum(expected) / len(expected), abs=1e-12)


def test_every_arm_starts_where_the_block_stands_and_a_moved_fusion_differs() -> None:
    block = perturbed_block(MODEL)
    ids = _ids()
    record = run_probe(MODEL, block, ids, _ids(seed=1), layers=[0, 1], arms=list(Arm), steps=0,
                       depths=3)
    rows = [record["arms"][arm.value]["acceptance"] for arm in Arm]
    assert all(row == rows[0] for row in rows)
    text = read_text(MODEL, block, _ids(seed=1), [0, 1])
    fusion = LayerFusion(block.hidden_size, 2).double()
    with torch.no_grad():
        fusion.project.weight.normal_(0.0, 0.5)  # the negative control: a fusion that reads
    assert acceptance(block, fusion, text, 3) != pytest.approx(rows[0], abs=1e-6)


def test_training_moves_only_what_the_arm_trains() -> None:
    block = perturbed_block(MODEL)
    before = {name: value.clone() for name, value in block.state_dict().items()}
    text = read_text(MODEL, block, _ids(count=8), [0, 1])
    options = dict(layers=2, steps=3, batch=4, depths=2, block_lr=1e-2, fusion_lr=1e-2,
                   top_k=4, seed=0)
    fused_block, fusion = train_arm(block, Arm.FUSION, text, **options)
    assert fusion is not None and fusion.project.weight.abs().sum() > 0
    assert all(torch.equal(fused_block.state_dict()[n], v) for n, v in before.items())
    trained, none = train_arm(block, Arm.BLOCK, text, **options)
    assert none is None
    assert any(not torch.equal(trained.state_dict()[n], v) for n, v in before.items())
    assert all(torch.equal(block.state_dict()[n], v) for n, v in before.items())  # untouched
    assert trained.target is block.target


def test_tokens_per_round_table_and_windows() -> None:
    assert tokens_per_round([0.5, 0.5]) == pytest.approx(1.75)
    assert tokens_per_round([]) == 1.0
    text = table({"arms": {"base": {"acceptance": [0.5, 0.5]}}})
    assert "| base | 0.500 | 0.500 | 1.75 |" in text
    windows = sample_windows(torch.arange(100), 5, 10, seed=3)
    assert windows.shape == (5, 10)
    assert torch.equal(windows[:, 1:] - windows[:, :-1], torch.ones(5, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="fewer than a window"):
        sample_windows(torch.arange(5), 1, 10, seed=0)
