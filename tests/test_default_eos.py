"""Decoders stop at the model's EOS by default, as ``model.generate`` does.

``SpeculativeDecoder(model, head).generate(prompt, max_new_tokens=64)`` and the autoregressive
decoder read ``generation_config.eos_token_id`` (one id or a list; else ``config.eos_token_id``)
when the backbone is, or wraps, a Hugging Face model; an explicit ``eos_token_id=`` or ``stop=``
wins, and ``eos_token_id=()`` turns EOS stopping off.
"""

from __future__ import annotations

import pytest
import torch
from toy import ToyHead, ToyLM
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.stopping import StopCondition
from circuits_llm.heads import MTPHead

VOCAB, HIDDEN, NEW = 40, 32, 64
PROMPT = torch.tensor([[3, 17, 5, 9]])


def _model() -> PreTrainedModel:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=None, pad_token_id=0)).double().eval()


def _greedy(model: PreTrainedModel, max_new_tokens: int = NEW) -> list[int]:
    out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, PROMPT.shape[1]:].tolist()


@pytest.fixture(scope="module")
def eos_case() -> tuple[PreTrainedModel, list[int], int]:
    """A model whose generation config names an EOS id that greedy decoding reaches after a few
    tokens: ``(model, the free greedy run (no EOS), that id)``."""
    model = _model()
    free = _greedy(model)
    assert len(free) == NEW  # no EOS configured yet
    eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    model.generation_config.eos_token_id = eos
    return model, free, eos


def _head(model: PreTrainedModel, window: int = 3) -> MTPHead:
    return MTPHead.from_name("cp", window, 2, HIDDEN, VOCAB,
                             lm_head_weight=model.get_output_embeddings().weight.detach(),
                             dtype=torch.float64, sum_init_std=0.5)


def test_generate_stops_where_model_generate_stops(eos_case: tuple[PreTrainedModel, list[int], int]
                                                   ) -> None:
    model, free, eos = eos_case
    expected = _greedy(model)
    assert expected == free[:free.index(eos) + 1] and len(expected) < NEW  # generate stops at EOS
    decoders = [SpeculativeDecoder(model, _head(model)), AutoregressiveDecoder(model),
                SpeculativeDecoder(HFBackbone(model), _head(model, 4),
                                   draft_length=DraftLength.confident(0.02)),
                AutoregressiveDecoder(HFBackbone(model))]
    for decoder in decoders:
        assert decoder.default_eos_token_ids() == (eos,)
        result = decoder.generate(PROMPT, max_new_tokens=NEW)
        assert result.tokens.tolist() == expected
        assert decoder.backbone.length == PROMPT.shape[1] + len(expected) - 1


def test_a_list_of_eos_ids_and_the_model_config_fallback(
        eos_case: tuple[PreTrainedModel, list[int], int]) -> None:
    model, free, eos = eos_case
    later = free[free.index(eos) + 1:]
    other = next(t for t in range(VOCAB) if t not in free)  # never generated
    decoder = SpeculativeDecoder(model, _head(model))
    try:
        model.generation_config.eos_token_id = [other, eos]
        assert _greedy(model) == free[:free.index(eos) + 1]
        assert decoder.default_eos_token_ids() == (other, eos)
        assert decoder.generate(PROMPT, NEW).tokens.tolist() == _greedy(model)
        model.generation_config.eos_token_id = None  # falls back to config.eos_token_id
        model.config.eos_token_id = later[2]
        assert decoder.default_eos_token_ids() == (later[2],)
        first = next(i for i, t in enumerate(free) if t == later[2])
        assert decoder.generate(PROMPT, NEW).tokens.tolist() == free[:first + 1]
        model.config.eos_token_id = None
        assert decoder.default_eos_token_ids() == ()
        assert decoder.generate(PROMPT, NEW).tokens.tolist() == free
    finally:
        model.generation_config.eos_token_id = eos
        model.config.eos_token_id = None


def test_explicit_arguments_win_and_eos_can_be_turned_off(
        eos_case: tuple[PreTrainedModel, list[int], int]) -> None:
    model, free, eos = eos_case
    later = free[free.index(eos) + 1]
    for decoder in (SpeculativeDecoder(model, _head(model)), AutoregressiveDecoder(model)):
        assert decoder.generate(PROMPT, NEW, eos_token_id=()).tokens.tolist() == free
        stop_later = free[:free.index(later) + 1]
        assert decoder.generate(PROMPT, NEW, eos_token_id=later).tokens.tolist() == stop_later
        assert decoder.generate(PROMPT, NEW, eos_token_id=[later]).tokens.tolist() == stop_later
        # a stop condition replaces the default: only its own EOS ids count
        assert decoder.generate(PROMPT, NEW, stop=StopCondition(NEW)).tokens.tolist() == free
        assert decoder.generate(PROMPT, NEW, stop=StopCondition(NEW, (later,))).tokens.tolist() \
            == stop_later


def test_sampling_stops_at_the_first_eos(eos_case: tuple[PreTrainedModel, list[int], int]) -> None:
    model, _, eos = eos_case
    decoder = SpeculativeDecoder(model, _head(model))
    for seed in range(4):
        tokens = decoder.generate(PROMPT, 24, temperature=1.0,
                                  generator=torch.Generator().manual_seed(seed)).tokens.tolist()
        assert eos not in tokens[:-1] and (len(tokens) == 24 or tokens[-1] == eos)


def test_other_backbones_have_no_default_eos() -> None:
    lm = ToyLM(3)
    head = ToyHead("cp", 3, 2, lm.hidden_size, 3)
    assert SpeculativeDecoder(lm, head).default_eos_token_ids() == ()
    assert len(AutoregressiveDecoder(lm).generate([0, 1], 20).tokens) == 20
