"""Greedy speculative decoding is token-identical to greedy autoregressive decoding.

On tiny random Llama and GPT-2 models (float64, so that the multi-token verify forward and HF's
one-token steps agree on every argmax), with every head shape and with a LoRA draft branch whose
adapters are random and non-zero (so drafts differ from the shared-state ones), the decoder's
output equals ``model.generate(do_sample=False)``, also when hosted by ``model.generate`` through
``custom_generate``; the backbone then holds exactly ``prompt + output[:-1]``.
"""

from __future__ import annotations

import pytest
import torch
from toy import ToyHead, ToyLM
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.hf_generate import speculative_generate
from circuits_llm.heads import MTPHead

VOCAB, HIDDEN, EOS = 48, 32, 47
HEADS = [("ff", 1), ("cp", 2), ("hmm", 2), ("btree", 2)]
#: (prompt length, max_new_tokens): one-token prompts take the autoregressive first step
CASES = [(1, 12), (2, 5), (5, 9), (3, 1)]


def _models() -> dict[str, PreTrainedModel]:
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=True))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4,
                                      n_positions=128, bos_token_id=0, eos_token_id=EOS,
                                      pad_token_id=0))
    return {"llama": llama.double().eval(), "gpt2": gpt2.double().eval()}


MODELS = _models()


def _backbone(model: PreTrainedModel, lora_layers: int) -> HFBackbone:
    backbone = HFBackbone(model, lora_layers=lora_layers)
    generator = torch.Generator().manual_seed(1)
    for parameter in backbone.draft_parameters():  # random, non-zero LoRA: drafts differ
        parameter.data = 0.3 * torch.randn(parameter.shape, generator=generator,
                                           dtype=parameter.dtype)
    return backbone


def _head(model: PreTrainedModel, architecture: str, rank: int, window: int = 3) -> MTPHead:
    return MTPHead.from_name(architecture, window, rank, HIDDEN, VOCAB,
                             lm_head_weight=model.get_output_embeddings().weight.detach(),
                             dtype=torch.float64, sum_init_std=0.5)


def _reference(model: PreTrainedModel, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    out = model.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("lora_layers", [0, 1])
@pytest.mark.parametrize(("architecture", "rank"), HEADS, ids=[h for h, _ in HEADS])
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_equals_hf_generate(name: str, architecture: str, rank: int,
                                   lora_layers: int) -> None:
    model = MODELS[name]
    backbone = _backbone(model, lora_layers)
    decoder = SpeculativeDecoder(backbone, _head(model, architecture, rank))
    seed = 100 * list(MODELS).index(name) + 10 * HEADS.index((architecture, rank)) + lora_layers
    generator = torch.Generator().manual_seed(seed)
    for length, max_new in CASES:
        prompt = torch.randint(1, VOCAB - 1, (1, length), generator=generator)
        result = decoder.generate(prompt, max_new, eos_token_id=EOS)
        assert result.tokens.tolist() == _reference(model, prompt, max_new)
        assert backbone.length == length + len(result.tokens) - 1


def test_greedy_exercises_accept_and_reject_and_window_four() -> None:
    model = MODELS["gpt2"]
    decoder = SpeculativeDecoder(_backbone(model, 0), _head(model, "btree", 2, window=4))
    prompt = torch.tensor([[5, 9, 5, 9, 3]])
    result = decoder.generate(prompt, 20, eos_token_id=EOS)
    assert result.tokens.tolist() == _reference(model, prompt, 20)
    assert 0 < result.summary.accepted < result.summary.drafted


def test_model_is_wrapped_and_hosted_by_generate() -> None:
    model = MODELS["llama"]
    decoder = SpeculativeDecoder(model, _head(model, "cp", 2), lora_layers=1)
    assert isinstance(decoder.backbone, HFBackbone) and decoder.backbone.lora_layers == 1
    prompt = torch.tensor([[3, 14, 15, 9, 2]])
    expected = model.generate(prompt, do_sample=False, max_new_tokens=10, pad_token_id=0)
    hosted = model.generate(prompt, custom_generate=speculative_generate, decoder=decoder,
                            do_sample=False, max_new_tokens=10, pad_token_id=0)
    assert hosted.tolist() == expected.tolist()
    sampled = model.generate(prompt, custom_generate=speculative_generate, decoder=decoder,
                             generator=torch.Generator().manual_seed(3), do_sample=True,
                             temperature=0.7, top_k=10, top_p=0.9, max_new_tokens=8,
                             pad_token_id=0)
    direct = decoder.generate(prompt, 8, 0.7, 10, 0.9, torch.Generator().manual_seed(3), EOS)
    assert sampled[0, 5:].tolist() == direct.tokens.tolist()
    baseline = AutoregressiveDecoder(model)
    assert baseline.generate(prompt, 10).tokens.tolist() == expected[0, 5:].tolist()


@pytest.mark.parametrize("draft_branch", [False, True])
@pytest.mark.parametrize(("architecture", "rank"), HEADS, ids=[h for h, _ in HEADS])
def test_greedy_equals_autoregressive_on_toy(architecture: str, rank: int,
                                             draft_branch: bool) -> None:
    lm = ToyLM(4, draft_branch=draft_branch, order=2, seed=5, logit_scale=3.0)
    decoder = SpeculativeDecoder(lm, ToyHead(architecture, 3, rank, lm.hidden_size, 4, seed=5))
    baseline = AutoregressiveDecoder(lm)
    for prompt in ([1], [0, 3], [2, 2, 1, 0]):
        expected = baseline.generate(prompt, 15).tokens.tolist()
        assert decoder.generate(prompt, 15).tokens.tolist() == expected
        assert lm.tokens == [*prompt, *expected][:-1]


@pytest.mark.parametrize(("architecture", "variant"), [("btree", "lean"), ("cp", "full")])
def test_compiled_greedy_equals_hf_generate(architecture: str, variant: str) -> None:
    """``compile=True`` on both sides (static cache + compiled forwards, compiled round) keeps
    greedy output token-identical to ``model.generate``; after an in-place update of the head
    (an optimiser step), the compiled round reads the new parameters, not stale cached maps."""
    model = MODELS["gpt2"]  # float64 GPT-2: compiled and eager forwards agree on every argmax
    head = MTPHead.from_name(architecture, 4, 2, HIDDEN, VOCAB, variant=variant,
                             lm_head_weight=model.get_output_embeddings().weight.detach(),
                             dtype=torch.float64, sum_init_std=0.5)
    eager = SpeculativeDecoder(HFBackbone(model), head)
    decoder = SpeculativeDecoder(model, head, compile=True)
    assert decoder.backbone.compiled and decoder.backbone.compiled_lengths == (1, 4)
    prompts = [torch.tensor([[5, 9, 5, 9, 3]]), torch.tensor([[7]])]
    for prompt in prompts:  # the eager decoder fills the head's caches first
        want = eager.generate(prompt, 14, eos_token_id=EOS).tokens.tolist()
        assert decoder.generate(prompt, 14, eos_token_id=EOS).tokens.tolist() == want == \
            _reference(model, prompt, 14)
    with torch.no_grad():  # an optimiser-like in-place step: cached derived tensors go stale
        for parameter in head.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    for prompt in prompts:  # the compiled decoder first: nothing eager refreshes the caches
        got = decoder.generate(prompt, 14, eos_token_id=EOS)
        want = eager.generate(prompt, 14, eos_token_id=EOS)
        assert got.tokens.tolist() == want.tokens.tolist() == _reference(model, prompt, 14)
        assert got.summary.accepted == want.summary.accepted  # the same drafts were proposed
    baseline = AutoregressiveDecoder(model, compile=True)
    assert baseline.generate(prompts[0], 14).tokens.tolist() == _reference(model, prompts[0], 14)
