"""The draft block (circuits_llm.draft_block): greedy decoding with it is ``model.generate``; its
KV cache follows the verifier's (after a decode it equals a fresh prefill of the block over the
accepted sequence); it starts as the identity; and bad inputs raise one clear error."""

from __future__ import annotations

import pytest
import torch
from draft_block_models import assert_cache_is_a_fresh_prefill, perturbed_block, tiny_llama

from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.warping import DecoderError
from circuits_llm.draft_block import BlockDrafter, BlockInit, DraftBlock, DraftBlockError
from circuits_llm.protocols import context_drafter_problem

MODEL = tiny_llama(scale=8.0)
#: (prompt, max_new_tokens): a one-token prompt takes the autoregressive first step
CASES = [([1], 12), ([1, 5], 9), ([1, 5, 7, 9, 3], 15), ([4, 2, 2], 1)]


def _generate(prompt: list[int], count: int) -> list[int]:
    out = MODEL.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=count,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize(("layers", "vocab"), [(1, None), (2, list(range(0, 48, 2)))],
                         ids=["one-layer", "two-layers-compressed"])
def test_greedy_equals_hf_generate(layers: int, vocab: list[int] | None) -> None:
    block = perturbed_block(MODEL, layers=layers, draft_vocab=vocab)
    decoder = SpeculativeDecoder(MODEL, BlockDrafter(block))
    for prompt, count in CASES:
        result = decoder.generate(prompt, count, eos_token_id=())
        assert result.tokens.tolist() == _generate(prompt, count)
        assert decoder.backbone.length == len(prompt) + count - 1


def _prefill_cache(block: DraftBlock, sequence: list[int]) -> BlockDrafter:
    """A fresh drafter whose cache holds the block's prefill over ``sequence``'s pairs
    ``(h_j, x_{j+1})``, ``j = 0..len - 3`` (what a decode's cache holds between rounds)."""
    backbone = HFBackbone(MODEL)
    _, hidden = backbone.hidden_states(torch.tensor([sequence[:-1]]))
    fresh = BlockDrafter(block)
    fresh.begin(hidden[:, :-1], torch.tensor(sequence[1:-1], dtype=torch.long))
    fresh.flush()
    return fresh


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
def test_cache_equals_a_fresh_prefill_after_rounds(temperature: float) -> None:
    block = perturbed_block(MODEL, layers=2, draft_vocab=list(range(0, 48, 3)))
    drafter = BlockDrafter(block)
    decoder = SpeculativeDecoder(MODEL, drafter)
    for prompt in ([3], [3, 8, 1, 4]):
        result = decoder.generate(prompt, 17, temperature=temperature, eos_token_id=(),
                                  generator=torch.Generator().manual_seed(2))
        assert len(result.rounds) > 3
        sequence = prompt + result.tokens.tolist()
        drafter.flush()
        # the last round may have emitted more than max_new_tokens kept: compare what both hold
        fresh = _prefill_cache(block, sequence)
        held = min(drafter.length, fresh.length)
        assert held >= len(sequence) - 2 - (block.window - 1)
        assert drafter.cache.get_seq_length() == drafter.length
        for mine, theirs in zip(drafter.cache.layers, fresh.cache.layers, strict=True):
            torch.testing.assert_close(mine.keys[..., :held, :], theirs.keys[..., :held, :],
                                       rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(mine.values[..., :held, :], theirs.values[..., :held, :],
                                       rtol=1e-9, atol=1e-11)


def test_identity_start_gives_the_targets_law_at_the_feature() -> None:
    vocab = [0, 3, 5, 11, 40]
    for init in BlockInit:
        block = DraftBlock(MODEL, init=init, draft_vocab=vocab)
        backbone = HFBackbone(MODEL)
        logits, hidden = backbone.hidden_states(torch.tensor([[1, 5, 7, 9]]))
        drafter = BlockDrafter(block)
        drafter.begin(hidden[:, :0], torch.zeros(0, dtype=torch.long))
        with torch.no_grad():
            out = drafter.step(drafter.cache, hidden, torch.tensor([[5, 7, 9, 2]]))
            # equal up to the norms' eps (the feature is already normed, its scale near 1)
            torch.testing.assert_close(block.logits(out), logits[..., vocab], rtol=1e-2,
                                       atol=1e-2)
        assert sum(p.numel() for p in block.parameters()) > 0
        assert all("target" not in name for name in block.state_dict())


def test_drafter_meets_the_contract_and_bad_inputs_raise_one_clear_error() -> None:
    block = perturbed_block(MODEL)
    drafter = BlockDrafter(block)
    assert context_drafter_problem(drafter) is None
    with pytest.raises(DraftBlockError, match="steps must be an int >= 1"):
        DraftBlock(MODEL, steps=0)
    with pytest.raises(DraftBlockError, match="distinct"):
        DraftBlock(MODEL, draft_vocab=[1, 1])
    with pytest.raises(DraftBlockError, match="must lie in"):
        DraftBlock(MODEL, draft_vocab=[1, 99])
    with pytest.raises(DraftBlockError, match="init must be a BlockInit"):
        DraftBlock(MODEL, init="identity")  # type: ignore[arg-type]
    with pytest.raises(DraftBlockError, match=r"features must be \(1, m, 32\)"):
        drafter.begin(torch.zeros(1, 2, 31, dtype=torch.float64), torch.tensor([1, 2]))
    with pytest.raises(DraftBlockError, match="one per feature"):
        drafter.follow(torch.zeros(1, 2, 32, dtype=torch.float64), torch.tensor([1]))
    with pytest.raises(DraftBlockError, match=r"hidden must be \(B, m, 32\)"):
        block.extend(torch.zeros(2, 32, dtype=torch.float64), torch.tensor([[1, 2]]),
                     block.new_cache())
    with pytest.raises(DraftBlockError, match="a DraftBlock"):
        BlockDrafter(MODEL)  # type: ignore[arg-type]
    for steps in (0, -1, 2.0, True):
        with pytest.raises(DraftBlockError, match="steps must be a positive integer"):
            BlockDrafter(block, steps=steps)  # type: ignore[arg-type]
    with pytest.raises(DecoderError, match=r"DraftLength.fixed\(4\) asks for more drafts"):
        SpeculativeDecoder(MODEL, drafter, draft_length=DraftLength.fixed(4))
    with pytest.raises(DecoderError, match=r"DraftHead.*ContextDrafter"):
        SpeculativeDecoder(MODEL, block)  # the block's weights alone: pass BlockDrafter(block)


def test_compressed_readout_is_gathered_once_and_follows_the_lm_head() -> None:
    """The draft vocabulary's LM-head rows are gathered once (a gather per call cost more than a
    backbone step on a column-major weight), equal the full logits' columns, and are gathered
    again after the LM head's weight changes in place."""
    model = tiny_llama(seed=3)
    vocab = list(range(1, 48, 3))
    block = perturbed_block(model, draft_vocab=vocab)
    output = torch.randn(2, 5, 32, dtype=torch.float64)
    first, _ = block.readout()
    assert block.readout()[0] is first  # kept, not gathered again
    full = torch.nn.functional.linear(model.model.norm(output), model.lm_head.weight)
    torch.testing.assert_close(block.logits(output), full[..., vocab], rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    assert block.readout()[0] is not first
    torch.testing.assert_close(block.logits(output), 2.0 * full[..., vocab], rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("steps", [1, 6])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
def test_recursion_runs_to_any_depth(steps: int, temperature: float) -> None:
    """A block trained for 2 steps drafts 1 or 6 per round (shared weights): greedy output is
    still ``generate``'s, and the block's cache still equals a fresh prefill."""
    block = perturbed_block(MODEL, steps=2, draft_vocab=list(range(0, 48, 2)))
    drafter = BlockDrafter(block, steps=steps)
    assert drafter.window == steps + 1
    decoder = SpeculativeDecoder(MODEL, drafter)
    for prompt, count in CASES:
        result = decoder.generate(prompt, count, temperature=temperature, eos_token_id=(),
                                  generator=torch.Generator().manual_seed(5))
        if temperature == 0:
            assert result.tokens.tolist() == _generate(prompt, count)
        assert max(r.drafted for r in result.rounds) <= steps
        assert steps == 1 or count < 3 or any(r.drafted > 2 for r in result.rounds)
        if len(prompt) + count > 2:
            assert_cache_is_a_fresh_prefill(drafter, MODEL, prompt + result.tokens.tolist(),
                                            drafter.window)
