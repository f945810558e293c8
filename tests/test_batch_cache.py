"""Ragged KV caches (circuits_llm/backbone/ragged_cache.py): rows of different lengths on one
backbone, rolled back per row, each row's cache identical to a fresh prefill of that row alone.

On the model zoo of the backbone tests (Llama with grouped KV heads, GPT-2's absolute positions,
OPT's offset positions), float64, with and without a LoRA draft branch: after a left-padded
prefill (one row empty), rounds of blocks whose rows keep different numbers of tokens, a
compaction of the holes and rows leaving the batch, every row's logits and draft hidden states
equal a fresh single-row forward, and the keys and values at the slots it holds equal a fresh
prefill's, layer by layer (verifier and draft caches).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedModel,
)

from circuits_llm.backbone import HFBackbone, UnsupportedModelError
from circuits_llm.backbone.ragged_cache import RaggedCache, context_length, ragged_backbone

V = 40
ATOL = 1e-10


def _zoo() -> dict[str, PreTrainedModel]:
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=3, n_head=4,
                                      n_positions=96, bos_token_id=0, eos_token_id=1))
    opt = OPTForCausalLM(OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, ffn_dim=64,
                                   num_attention_heads=4, max_position_embeddings=96,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=1))
    return {name: model.double().eval() for name, model in
            {"llama": llama, "gpt2": gpt2, "opt": opt}.items()}


ZOO = _zoo()


def _backbone(model: PreTrainedModel, lora_layers: int) -> HFBackbone:
    backbone = HFBackbone(model, lora_layers=lora_layers)
    generator = torch.Generator().manual_seed(2)
    for parameter in backbone.draft_parameters():  # non-zero LoRA: the draft cache matters
        parameter.data = 0.3 * torch.randn(parameter.shape, generator=generator,
                                           dtype=parameter.dtype)
    return backbone


def _fresh(backbone: HFBackbone, tokens: list[int]) -> tuple[HFBackbone, torch.Tensor,
                                                             torch.Tensor]:
    """A fresh backbone with the same LoRA weights, prefilled with ``tokens`` alone."""
    fresh = HFBackbone(backbone.model, lora_layers=backbone.lora_layers)
    fresh.draft_layers.load_state_dict(backbone.draft_layers.state_dict())
    step = fresh.extend(torch.tensor([tokens]))
    return fresh, step.verifier_logits[0], step.draft_hidden[0]


def _assert_row_cache(ragged: RaggedCache, row: int, tokens: list[int]) -> None:
    """The keys and values at the slots ``row`` holds equal a fresh prefill of ``tokens``."""
    fresh, _, _ = _fresh(ragged.backbone, tokens)
    slots = ragged.row_slots(row)
    assert slots.numel() == len(tokens)
    pairs = [(ragged.backbone.verifier_cache, fresh.verifier_cache),
             (ragged.backbone.draft_cache, fresh.draft_cache)]
    compared = 0
    for batch_cache, alone in pairs:
        for mine, theirs in zip(batch_cache.layers, alone.layers, strict=True):
            if not getattr(theirs, "is_initialized", True) or theirs.keys is None:
                continue
            torch.testing.assert_close(mine.keys[row][:, slots], theirs.keys[0], atol=ATOL, rtol=0)
            torch.testing.assert_close(mine.values[row][:, slots], theirs.values[0], atol=ATOL,
                                       rtol=0)
            compared += 1
    assert compared == ragged.backbone.num_layers + ragged.backbone.lora_layers


@pytest.mark.parametrize("lora_layers", [0, 1])
@pytest.mark.parametrize("name", list(ZOO))
def test_rows_roll_back_alone_and_match_a_fresh_prefill(name: str, lora_layers: int) -> None:
    backbone = _backbone(ZOO[name], lora_layers)
    ragged = RaggedCache(backbone, min_slack=3, slack_fraction=0.0)  # compacts often
    sequences = [[3, 4, 5, 6, 7, 8], [], [9, 10]]
    hidden = ragged.start(sequences)
    for b, tokens in enumerate(sequences):
        if tokens:
            torch.testing.assert_close(hidden[b], _fresh(backbone, tokens)[2][-1], atol=ATOL,
                                       rtol=0)
        else:
            assert not hidden[b].any()
    generator = torch.Generator().manual_seed(7)
    for round_ in range(7):
        width = 1 + round_ % 3
        block = torch.randint(2, V, (len(sequences), width), generator=generator)
        step = ragged.extend(block)
        for b, tokens in enumerate(sequences):
            _, logits, draft = _fresh(backbone, tokens + block[b].tolist())
            torch.testing.assert_close(step.verifier_logits[b], logits[-width:], atol=ATOL, rtol=0)
            torch.testing.assert_close(step.draft_hidden[b], draft[-width:], atol=ATOL, rtol=0)
        counts = torch.randint(1, width + 1, (len(sequences),), generator=generator).tolist()
        ragged.keep(counts)
        for b, count in enumerate(counts):
            sequences[b] = sequences[b] + block[b, :count].tolist()
        assert ragged.lengths == [len(tokens) for tokens in sequences]
        for b, tokens in enumerate(sequences):
            _assert_row_cache(ragged, b, tokens)
        if round_ == 4:  # the first row finishes and leaves; the others swap places
            ragged.select([2, 1])
            sequences = [sequences[2], sequences[1]]
            for b, tokens in enumerate(sequences):
                _assert_row_cache(ragged, b, tokens)
    assert ragged.compactions > 0
    # the caches hold no slot beyond the longest row's, up to the slack
    assert backbone.length <= max(ragged.lengths) + 3


def test_compaction_keeps_the_cache_within_the_slack() -> None:
    """Each round one row keeps its 4 tokens and the others 1 (a different row each time):
    every row has holes, which are compacted away, so the caches stay within the slack of the
    longest row."""
    backbone = _backbone(ZOO["llama"], 0)
    ragged = RaggedCache(backbone, min_slack=4, slack_fraction=0.125)
    ragged.start([[2, 3], [4], [5, 6, 7]])
    for round_ in range(12):
        ragged.extend(torch.full((3, 4), 9))
        ragged.keep([4 if b == round_ % 3 else 1 for b in range(3)])
        longest = max(ragged.lengths)
        assert backbone.length <= longest + max(4, int(0.125 * longest))
    assert ragged.lengths == [26, 25, 27]
    assert ragged.compactions > 0
    _assert_row_cache(ragged, 1, [4] + [9] * 24)


def test_all_rows_leave_and_rows_of_one_token() -> None:
    backbone = _backbone(ZOO["gpt2"], 1)
    ragged = RaggedCache(backbone)
    assert not ragged.start([[], []]).any() and backbone.length == 0
    step = ragged.extend(torch.tensor([[5, 6], [7, 8]]))
    _, logits, _ = _fresh(backbone, [7, 8])
    torch.testing.assert_close(step.verifier_logits[1], logits, atol=ATOL, rtol=0)
    ragged.keep([1, 2])
    _assert_row_cache(ragged, 0, [5])
    ragged.select([])
    assert backbone.length == 0 and ragged.lengths == []


def test_what_has_no_per_row_layout_is_refused() -> None:
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=3)).eval()
    with pytest.raises(UnsupportedModelError, match="sliding window of 3"):
        ragged_backbone(HFBackbone(mistral))
    with pytest.raises(UnsupportedModelError, match="dynamic KV cache"):
        ragged_backbone(HFBackbone(ZOO["gpt2"], compile=True))
    with pytest.raises(UnsupportedModelError, match="ragged"):
        ragged_backbone(object())
    with pytest.raises(ValueError, match=r"one count in 1\.\.2"):
        ragged = RaggedCache(_backbone(ZOO["gpt2"], 0))
        ragged.start([[1, 2]])
        ragged.extend(torch.tensor([[3, 4]]))
        ragged.keep([3])
    assert context_length(HFBackbone(ZOO["gpt2"])) == 96
    assert context_length(object()) is None
