"""Batched decoding on Hugging Face models: every row's greedy output is ``model.generate`` on
that row alone, with one backbone call per round for the whole batch.

Float64 tiny Llama, GPT-2 and OPT models (so the padded, multi-row forwards and HF's one-row steps
agree on every argmax); prompts of different lengths (one of one token), given as lists, as a
left- or right-padded tensor with an attention mask, each row with its own ``max_new_tokens`` and
stop condition; the autoregressive and the speculative decoder (heads of every kind, with and
without a LoRA draft branch, a compressed draft vocabulary, the context copy, a dynamic draft
length). Bad input gets one error naming the row; options a batch does not support say so.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedModel,
)

from circuits_llm.backbone import HFBackbone
from circuits_llm.constraints import Regex
from circuits_llm.decoding.autoregressive import AutoregressiveDecoder
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.metrics import BatchResult, DecodeResult
from circuits_llm.decoding.stopping import StopCondition
from circuits_llm.decoding.warping import DecoderError
from circuits_llm.heads import MTPHead

VOCAB, HIDDEN, EOS = 48, 32, 47
HEADS = [("ff", 1), ("cp", 2), ("hmm", 2), ("btree", 2)]
PROMPTS = [[5, 9, 5, 9, 3, 5, 9], [7], [12, 30, 4], [21, 22]]
LIMITS = [14, 9, 11, 6]


def _zoo() -> dict[str, PreTrainedModel]:
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=True))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4,
                                      n_positions=64, bos_token_id=0, eos_token_id=EOS,
                                      pad_token_id=0))
    opt = OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                   ffn_dim=64, num_attention_heads=4, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=EOS, pad_token_id=1))
    return {name: model.double().eval() for name, model in
            {"llama": llama, "gpt2": gpt2, "opt": opt}.items()}


ZOO = _zoo()


def _reference(model: PreTrainedModel, prompt: list[int], limit: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=limit,
                         pad_token_id=0, eos_token_id=EOS)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def _backbone(model: PreTrainedModel, lora_layers: int) -> HFBackbone:
    backbone = HFBackbone(model, lora_layers=lora_layers)
    generator = torch.Generator().manual_seed(1)
    for parameter in backbone.draft_parameters():
        parameter.data = 0.3 * torch.randn(parameter.shape, generator=generator,
                                           dtype=parameter.dtype)
    return backbone


def _head(model: PreTrainedModel, architecture: str, rank: int, window: int = 3,
          **options: object) -> MTPHead:
    return MTPHead.from_name(architecture, window, rank, HIDDEN, VOCAB,
                             lm_head_weight=model.get_output_embeddings().weight.detach(),
                             dtype=torch.float64, sum_init_std=0.5, **options)


def _check(model: PreTrainedModel, result: BatchResult, prompts: list[list[int]],
           limits: list[int]) -> None:
    assert isinstance(result, BatchResult) and len(result.rows) == len(prompts)
    for prompt, limit, tokens in zip(prompts, limits, result.tokens, strict=True):
        assert tokens == _reference(model, prompt, limit)
    assert result.summary.new_tokens == sum(len(t) for t in result.tokens)
    assert result.summary.backbone_calls == result.summary.rounds + 1


@pytest.mark.parametrize("name", list(ZOO))
def test_autoregressive_batch_equals_generate_per_row(name: str) -> None:
    model = ZOO[name]
    decoder = AutoregressiveDecoder(model)
    result = decoder.generate(PROMPTS, LIMITS)
    _check(model, result, PROMPTS, LIMITS)
    assert result.summary.rounds == max(LIMITS)  # one call per round for the whole batch
    assert [r.rows for r in result.rounds] == [4] * 6 + [3] * 3 + [2] * 2 + [1] * 3


@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_tensor_with_attention_mask(padding: str) -> None:
    model = ZOO["llama"]
    width = max(len(p) for p in PROMPTS)
    ids = torch.full((len(PROMPTS), width), 3)
    mask = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    for b, prompt in enumerate(PROMPTS):
        span = slice(width - len(prompt), width) if padding == "left" else slice(0, len(prompt))
        ids[b, span] = torch.tensor(prompt)
        mask[b, span] = 1
    result = AutoregressiveDecoder(model).generate(ids, 8, attention_mask=mask)
    _check(model, result, PROMPTS, [8] * 4)
    tensors = AutoregressiveDecoder(model).generate([torch.tensor(p) for p in PROMPTS], 8)
    assert tensors.tokens == result.tokens


@pytest.mark.parametrize("lora_layers", [0, 1])
@pytest.mark.parametrize(("architecture", "rank"), HEADS, ids=[h for h, _ in HEADS])
@pytest.mark.parametrize("name", list(ZOO))
def test_speculative_batch_equals_generate_per_row(name: str, architecture: str, rank: int,
                                                   lora_layers: int) -> None:
    model = ZOO[name]
    decoder = SpeculativeDecoder(_backbone(model, lora_layers), _head(model, architecture, rank))
    result = decoder.generate(PROMPTS, LIMITS, eos_token_id=EOS)
    _check(model, result, PROMPTS, LIMITS)
    assert result.summary.drafted > 0
    for row, prompt in zip(result.rows, PROMPTS, strict=True):  # the one-token row: AR first
        assert row.rounds[0].drafted == (0 if len(prompt) == 1 else 2)


def test_speculative_batch_options_and_different_acceptance() -> None:
    """Window 4, a compressed draft vocabulary (with a head that reads the verified token), the
    context copy and a dynamic draft length: rows verify and accept different numbers of drafts in
    the same round; greedy rows are generate's, sampled rows what each draws alone."""
    model = ZOO["gpt2"]
    prompts = [[5, 9, 5, 9, 3, 5, 9, 5], [7], [12, 30, 4, 12, 30], [21, 22, 23]]
    limits = [20, 12, 16, 9]
    ragged_rounds = 0
    embedding = model.get_input_embeddings().weight.detach()
    for options, decoder_options in [
            ({"draft_vocab": list(range(1, 40))}, {}),
            ({"draft_vocab": list(range(1, 40)), "token_embedding": embedding}, {}),
            ({}, {"lookup": ContextLookup((0.3, 0.6))}),
            ({}, {"draft_length": DraftLength.confident(0.2, minimum=0)})]:
        head = _head(model, "btree", 2, window=4, **options)
        decoder = SpeculativeDecoder(_backbone(model, 1), head, **decoder_options)
        result = decoder.generate(prompts, limits, eos_token_id=EOS)
        _check(model, result, prompts, limits)
        sampled = decoder.generate(prompts, limits, 1.0, eos_token_id=EOS,  # each row as alone
                                   generator=[torch.Generator().manual_seed(b) for b in range(4)])
        assert sampled.tokens == [
            decoder.generate(prompt, limit, 1.0, generator=torch.Generator().manual_seed(b),
                             eos_token_id=EOS).tokens.tolist()
            for b, (prompt, limit) in enumerate(zip(prompts, limits, strict=True))]
        for index in range(result.summary.rounds):  # rows join at round 0 and stay till done
            accepted = {row.rounds[index].accepted for row in result.rows
                        if index < len(row.rounds)}
            ragged_rounds += len(accepted) > 1
    assert ragged_rounds > 0


def test_rows_stop_on_their_own() -> None:
    """Per-row max_new_tokens and stop conditions; EOS stops a row where generate stops; a row
    with max_new_tokens 0 never enters a round."""
    model = ZOO["llama"]
    decoder = SpeculativeDecoder(model, _head(model, "cp", 2))
    plain = decoder.generate(PROMPTS, 12, eos_token_id=())
    stop_at = plain.tokens[0][4]
    stops = [StopCondition(50, (stop_at,)), None, StopCondition(3), None]
    result = decoder.generate(PROMPTS, [12, 12, 12, 0], eos_token_id=(), stop=stops)
    first = plain.tokens[0]
    assert result.tokens[0] == first[:first.index(stop_at) + 1]
    assert result.tokens[1] == plain.tokens[1]
    assert result.tokens[2] == plain.tokens[2][:3]
    assert result.tokens[3] == [] and result.rows[3].summary.rounds == 0


def test_batch_of_one_is_the_single_prompt_path() -> None:
    model = ZOO["gpt2"]
    decoder = SpeculativeDecoder(model, _head(model, "hmm", 2))
    single = decoder.generate(PROMPTS[0], 10, eos_token_id=EOS)
    assert isinstance(single, DecodeResult)
    batch = decoder.generate([PROMPTS[0]], 10, eos_token_id=EOS)
    assert isinstance(batch, BatchResult) and batch.tokens == [single.tokens.tolist()]
    assert batch.summary.rounds == single.summary.rounds
    assert decoder.backbone.length == len(PROMPTS[0]) + 10 - 1  # the single path's invariant
    one_row = decoder.generate(torch.tensor([PROMPTS[0]]), 10, eos_token_id=EOS)
    assert isinstance(one_row, DecodeResult)  # (1, L) without a mask: one prompt, as before


def test_bad_batches_name_the_row() -> None:
    model = ZOO["gpt2"]
    decoder = SpeculativeDecoder(model, _head(model, "cp", 2))
    with pytest.raises(DecoderError, match="row 1: the prompt is empty"):
        decoder.generate([[1, 2], []], 4)
    with pytest.raises(DecoderError, match="row 2: prompt token id 99 is outside"):
        decoder.generate([[1], [2], [3, 99]], 4)
    with pytest.raises(DecoderError, match="row 1 is of type Tensor but row 0 is of type list"):
        decoder.generate([[1, 2], torch.tensor([3])], 4)
    with pytest.raises(DecoderError, match="row 1 is of type int but row 0 is of type list"):
        decoder.generate([[1, 2], 3], 4)
    with pytest.raises(DecoderError, match=r"row 1: a prompt tensor in a batch has shape \(L,\)"):
        decoder.generate([torch.tensor([1]), torch.tensor([[2]])], 4)
    with pytest.raises(DecoderError, match=r"row 1: prompt 60 \+ max_new_tokens 4 \+ 2 drafted "
                                           r"ahead = 66 positions, past the model's context "
                                           r"length 64"):
        decoder.generate([[1, 2], [3] * 60], 4)
    with pytest.raises(DecoderError, match="row 0: its attention_mask has holes"):
        decoder.generate(torch.ones(2, 3, dtype=torch.long), 4,
                         attention_mask=torch.tensor([[1, 0, 1], [1, 1, 1]]))
    with pytest.raises(DecoderError, match="row 1: the prompt is empty"):
        decoder.generate(torch.ones(2, 3, dtype=torch.long), 4,
                         attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))
    with pytest.raises(DecoderError, match="max_new_tokens: 3 values for a batch of 2"):
        decoder.generate([[1], [2]], [1, 2, 3])
    with pytest.raises(DecoderError, match="row 1: max_new_tokens must be an int"):
        decoder.generate([[1], [2]], [1, -2])
    with pytest.raises(DecoderError, match=r"generator of row 0 must be a torch\.Generator"):
        decoder.generate([[1], [2]], 3, temperature=1.0, generator=[1, 2])
    with pytest.raises(DecoderError, match="not supported for a batch of prompts yet"):
        decoder.generate([[1], [2]], 3, constraint=Regex("a"))


def test_a_static_backbone_says_what_to_do() -> None:
    model = ZOO["gpt2"]
    decoder = AutoregressiveDecoder(model, compile=True)
    with pytest.raises(Exception, match="dynamic KV cache"):
        decoder.generate([[1, 2], [3]], 2)
