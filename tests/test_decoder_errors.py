"""Every bad input to the decoders is one clear DecoderError (a ValueError) naming the problem."""

from __future__ import annotations

import math

import pytest
import torch
from toy import ToyHead, ToyLM
from transformers import GPT2Config, GPT2LMHeadModel

from circuits_llm.decoding.decoder import AutoregressiveDecoder, DecoderError, SpeculativeDecoder
from circuits_llm.decoding.hf_generate import speculative_generate
from circuits_llm.decoding.warping import SamplingConfig, SamplingError, warp_logits


@pytest.fixture
def decoder() -> SpeculativeDecoder:
    lm = ToyLM(3)
    return SpeculativeDecoder(lm, ToyHead("cp", 3, 2, lm.hidden_size, 3))


@pytest.mark.parametrize(("prompt", "message"), [
    ([], "prompt is empty"),
    (torch.zeros(1, 0, dtype=torch.long), "prompt is empty"),
    ([0, 3], "token id 3 is outside the vocabulary 0..2"),
    ([-1, 0], "token id -1 is outside"),
    (torch.tensor([[0.0, 1.0]]), "integer token ids"),
    ([0, 1.0], "integer token ids"),
    ("01", "integer token ids"),
    (torch.zeros(2, 3, dtype=torch.long), r"shape \(L,\) or \(1, L\)"),
])
def test_bad_prompts(decoder: SpeculativeDecoder, prompt: object, message: str) -> None:
    with pytest.raises(DecoderError, match=message):
        decoder.generate(prompt, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize(("options", "message"), [
    ({"temperature": -0.5}, "temperature must be a finite float >= 0"),
    ({"temperature": math.nan}, "temperature must be a finite float >= 0"),
    ({"temperature": math.inf}, "temperature must be a finite float >= 0"),
    ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be a float in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be a float in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": math.nan}, r"top_p must be a float in \(0, 1\]"),
    ({"temperature": 1.0, "top_k": 0}, "top_k must be an int >= 1"),
    ({"temperature": 1.0, "top_k": 2.5}, "top_k must be an int >= 1"),
    ({"max_new_tokens": -1}, "max_new_tokens must be an int >= 0"),
    ({"max_new_tokens": 2.0}, "max_new_tokens must be an int >= 0"),
])
def test_bad_generation_options(decoder: SpeculativeDecoder, options: dict[str, object],
                                message: str) -> None:
    kwargs: dict[str, object] = {"max_new_tokens": 4, **options}
    with pytest.raises(DecoderError, match=message):
        decoder.generate([0, 1], **kwargs)  # type: ignore[arg-type]


def test_sampling_errors_are_decoder_errors() -> None:
    assert issubclass(SamplingError, DecoderError) and issubclass(DecoderError, ValueError)
    with pytest.raises(SamplingError, match="greedy decoding"):
        warp_logits(torch.zeros(3), SamplingConfig(0.0))


@pytest.mark.parametrize(("head_args", "message"), [
    ({"vocab_size": 4}, "vocab_size 4 differs from the backbone's 3"),
    ({"hidden_size": 5}, "hidden states of size 5 but the backbone's are 6"),
    ({"window": 1}, "window must be >= 2"),
])
def test_head_backbone_mismatch(head_args: dict[str, int], message: str) -> None:
    lm = ToyLM(3, hidden_size=6)
    args = {"window": 3, "hidden_size": 6, "vocab_size": 3, **head_args}
    head = ToyHead("cp", args["window"], 2, args["hidden_size"], args["vocab_size"])
    with pytest.raises(DecoderError, match=message):
        SpeculativeDecoder(lm, head)


def test_not_a_backbone_or_head_or_policy() -> None:
    lm = ToyLM(3)
    head = ToyHead("ff", 2, 1, lm.hidden_size, 3)
    with pytest.raises(DecoderError, match=r"must implement circuits_llm\.protocols\.Backbone"):
        AutoregressiveDecoder(object())
    with pytest.raises(DecoderError, match=r"must implement circuits_llm\.protocols\.DraftHead"):
        SpeculativeDecoder(lm, object())  # type: ignore[arg-type]
    with pytest.raises(DecoderError, match="policy must be a CorrectionPolicy"):
        SpeculativeDecoder(lm, head, policy="exact")  # type: ignore[arg-type]


def test_hosted_generate_rejects_what_changes_the_law() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2,
                                       n_positions=32)).eval()
    from circuits_llm.heads import MTPHead
    decoder = SpeculativeDecoder(model, MTPHead.from_name("ff", 2, 1, 8, 16))
    prompt = torch.tensor([[1, 2, 3]])
    # classifier-free guidance runs a second, unconditional model call per step: its state is not
    # the prefix alone (repetition penalty is accepted: it depends on the prefix only)
    with pytest.raises(DecoderError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor"):
        model.generate(prompt, custom_generate=speculative_generate, decoder=decoder,
                       guidance_scale=1.5, max_new_tokens=3, pad_token_id=0)
    with pytest.raises(DecoderError, match="pass decoder="):
        model.generate(prompt, custom_generate=speculative_generate, max_new_tokens=3,
                       pad_token_id=0)
    other = GPT2LMHeadModel(model.config)
    with pytest.raises(DecoderError, match="does not wrap the model"):
        other.generate(prompt, custom_generate=speculative_generate, decoder=decoder,
                       max_new_tokens=3, pad_token_id=0)
