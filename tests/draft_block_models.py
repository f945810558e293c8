"""Tiny Llama targets, draft blocks and circuit heads on them for the draft-block tests (float64,
so that the block's multi-row calls and one-row steps agree to rounding), and the checks the
draft-block tests share: a fresh prefill of the block, the cache against it, a call counter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from circuits_llm.backbone import HFBackbone
from circuits_llm.draft_block import BlockCacheFollower, BlockInit, DraftBlock
from circuits_llm.draft_block.training import BlockFeatures, prefill_features
from circuits_llm.heads import MTPHead


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
                    noise: float = 0.1, seed: int = 1, fused_layers: Sequence[int] = ()
                    ) -> DraftBlock:
    """A block moved away from its identity start by random noise (so that its attention, its
    token input, its cache and its fusion of ``fused_layers``' outputs all matter)."""
    block = DraftBlock(model, steps=steps, layers=layers, init=init, draft_vocab=draft_vocab,
                       fused_layers=fused_layers)
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


def block_circuit_head(model: LlamaForCausalLM, kind: str, window: int,
                       vocab: Sequence[int] | None, *, token: bool = False, seed: int = 0
                       ) -> MTPHead:
    """A float64 circuit head of architecture ``kind`` on the block's outputs of ``model``'s width
    (draft vocabulary ``vocab``, None: the full one; ``token``: with the token input), its sums
    moved off the context-free start."""
    embedding = model.get_input_embeddings().weight
    head = MTPHead.from_name(kind, window, 1 if kind == "ff" else 2, embedding.shape[1],
                             embedding.shape[0], lm_head_weight=model.lm_head.weight,
                             draft_vocab=list(vocab) if vocab else "full", dtype=torch.float64,
                             sum_init_std=0.5, init_noise=0.3, seed=seed,
                             token_embedding=embedding if token else None)
    return head.eval()


def word_tokenizer(words: dict[str, int]) -> Any:
    """A word-level fast tokenizer over ``words`` (word -> id; ``"<eos>"`` is its EOS and unknown
    token), for building a :class:`~circuits_llm.constraints.TokenAutomaton` over a tiny model."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def fresh_first_step(block: DraftBlock, model: LlamaForCausalLM, sequence: Sequence[int],
                     follower: BlockCacheFollower | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, BlockCacheFollower]:
    """``(o_1 (1, d), h (1, d), follower)``: the block's output for the round after ``sequence``
    from a fresh prefill of the block (independent of the decoder's cache following), the
    backbone's seed feature, and the follower (``follower``, else a new one) holding that prefill
    and the round's first pair."""
    backbone = HFBackbone(model, feature_layers=block.fused_layers)
    _, hidden = backbone.hidden_states(torch.tensor([list(sequence[:-1])]))
    fresh = BlockCacheFollower(block) if follower is None else follower
    fresh.begin(hidden[:, :-1], torch.tensor(list(sequence[1:-1]), dtype=torch.long))
    with torch.no_grad():
        output = fresh.first_step(hidden[:, -1], torch.tensor([sequence[-1]]))
    return output, hidden[:, -1], fresh


def assert_cache_is_a_fresh_prefill(follower: BlockCacheFollower, model: LlamaForCausalLM,
                                    sequence: list[int], window: int) -> None:
    """After a decode of ``sequence`` (prompt and output): the block's cache, flushed, equals a
    fresh prefill of the block over ``sequence``'s pairs, on every position both hold."""
    assert follower.cache.get_seq_length() >= follower.length
    follower.flush()
    assert follower.cache.get_seq_length() == follower.length
    backbone = HFBackbone(model, feature_layers=follower.block.fused_layers)
    _, hidden = backbone.hidden_states(torch.tensor([sequence[:-1]]))
    fresh = BlockCacheFollower(follower.block)
    fresh.begin(hidden[:, :-1], torch.tensor(sequence[1:-1], dtype=torch.long))
    fresh.flush()
    # the last round may have emitted more than max_new_tokens kept: compare what both hold
    held = min(follower.length, fresh.length)
    assert held >= len(sequence) - 2 - (window - 1) - window  # forced runs may add a window
    for mine, theirs in zip(follower.cache.layers, fresh.cache.layers, strict=True):
        torch.testing.assert_close(mine.keys[..., :held, :], theirs.keys[..., :held, :],
                                   rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(mine.values[..., :held, :], theirs.values[..., :held, :],
                                   rtol=1e-9, atol=1e-11)


def count_first_steps(follower: BlockCacheFollower) -> list[int]:
    """Count the block's first-step calls of ``follower`` (one a round that drafts): the returned
    one-element list holds the count, and the caller may reset it."""
    calls = [0]
    first_step = follower.first_step

    def counted(hidden: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return first_step(hidden, c)

    follower.first_step = counted  # type: ignore[method-assign]
    return calls


def greedy_generate(model: LlamaForCausalLM, prompt: list[int], count: int) -> list[int]:
    """``count`` tokens of ``model``'s plain greedy continuation of ``prompt`` (the reference
    every greedy decoder must equal)."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=count,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def greedy_continuation_features(model: LlamaForCausalLM) -> BlockFeatures:
    """Prefill features of ``model``'s own greedy continuations of 16 random 3-token prompts
    (20 tokens each): training data on which a block learns the model's greedy law."""
    prompts = torch.randint(0, 48, (16, 3), generator=torch.Generator().manual_seed(0))
    ids = model.generate(prompts, do_sample=False, max_new_tokens=20, pad_token_id=0,
                         eos_token_id=None)
    return prefill_features(HFBackbone(model), ids)
