"""Tiny Llama targets and draft blocks for the draft-block tests (float64, so that the block's
multi-row calls and one-row steps agree to rounding)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from circuits_llm.draft_block import BlockInit, DraftBlock


def tiny_llama(vocab: int = 48, seed: int = 0, scale: float = 1.0) -> LlamaForCausalLM:
    """A 2-layer Llama of width 32 (logits scaled by ``scale`` through the LM head's weight)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=vocab - 1, pad_token_id=0, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model.double().eval()


def perturbed_block(model: LlamaForCausalLM, *, steps: int = 3, layers: int = 1,
                    init: BlockInit = BlockInit.LAST_LAYER, draft_vocab: list[int] | None = None,
                    noise: float = 0.1, seed: int = 1) -> DraftBlock:
    """A block moved away from its identity start by random noise (so that its attention, its
    token input and its cache all matter)."""
    block = DraftBlock(model, steps=steps, layers=layers, init=init, draft_vocab=draft_vocab)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.add_(noise * torch.randn(parameter.shape, generator=generator,
                                               dtype=parameter.dtype))
    return block.eval()


class NextTokenLogits:
    """An HF causal LM seen as the toy LMs are (``vocab_size``, ``next_token_logits(ids)`` (V,)),
    so :func:`toy.target_law` enumerates its exact law."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.vocab_size: int = model.config.vocab_size

    def next_token_logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0, -1]
