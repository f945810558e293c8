"""Stopping exactly where ``model.generate`` stops, and ``generate``'s own processors when hosted.

``model.generate`` is the reference: a tiny random Llama with the tiny BPE tokenizer of
``test_tokens`` samples a continuation (seeded), and the same call with EOS ids or stop strings
must stop after exactly the token :meth:`StopCondition.keep_length` names on the unstopped output.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_tokens import tiny_subword_model, tiny_tokenizer
from transformers import (
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.logits_process import (
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.decoder import DecoderError, SpeculativeDecoder
from circuits_llm.decoding.hf_generate import ProcessedBackbone, speculative_generate
from circuits_llm.decoding.stopping import StopCondition, StopConditionError, eos_ids, unescape_stop
from circuits_llm.heads import MTPHead
from circuits_llm.text.tokens import TextTokenizer

PROMPT = "def decode(self, s):\n    "
NEW = 40


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    return tiny_subword_model(len(tokenizer), seed=3)


def _prompt(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    return tokenizer(PROMPT).input_ids


def _sample(model: PreTrainedModel, prompt: list[int], seed: int, **options: object) -> list[int]:
    """``generate``'s seeded sample (new tokens only)."""
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([prompt]), do_sample=True, max_new_tokens=NEW,
                         pad_token_id=0, **options)
    return out[0, len(prompt):].tolist()


def _spanning_stops(tokenizer: PreTrainedTokenizerFast, prompt: list[int], output: list[int]
                    ) -> list[str]:
    """Stop strings made of the end of one token and the start of the next (ASCII only), at a few
    places of the output, one of them starting in the prompt."""
    pieces = [tokenizer.decode([t]) for t in [*prompt, *output]]
    found = []
    for index in (len(prompt) - 1, len(prompt) + 3, len(prompt) + 11, len(prompt) + 25):
        if index + 1 >= len(pieces):
            break
        left, right = pieces[index], pieces[index + 1]
        text = left[-2:] + right[:2]
        if left and right and text.isascii() and text.strip():
            found.append(text)
    return found


# ---------------------------------------------------------------------------- the condition alone
def test_keep_length_eos_and_max_new_tokens() -> None:
    stop = StopCondition(6, eos_token_ids=(9, 4))
    assert stop.keep_length([1, 2, 3]) is None
    assert stop.keep_length([1, 2, 4, 9, 5]) == 3  # the first EOS, kept
    assert stop.keep_length([1, 2, 3, 5, 6, 7, 8]) == 6  # a round can overshoot max_new_tokens
    assert stop.keep_length([1, 2, 3, 5, 6, 4, 9]) == 6
    assert stop.keep_length([4, 1], start=1) is None  # tokens before start are not checked
    assert StopCondition(0).keep_length([]) == 0
    with pytest.raises(StopConditionError, match="max_new_tokens"):
        StopCondition(-1)
    with pytest.raises(StopConditionError, match="need the model's tokenizer"):
        StopCondition(4, stop_strings=("x",))
    with pytest.raises(StopConditionError, match="non-empty"):
        StopCondition(4, stop_strings=("",), tokenizer=TextTokenizer.byte_level())
    assert unescape_stop(r"\n\nend é") == "\n\nend é"


@given(st.lists(st.integers(0, 5), min_size=0, max_size=30),
       st.lists(st.integers(1, 6), min_size=1, max_size=30), st.integers(1, 25))
def test_scanner_over_rounds_equals_the_whole_check(output: list[int], rounds: list[int],
                                                    limit: int) -> None:
    """Checking round by round stops at the same token as checking the whole output at once."""
    stop = StopCondition(limit, eos_token_ids=(0,), stop_strings=("ab",),
                         tokenizer=TextTokenizer.byte_level())
    ids = [97 + t for t in output]  # bytes a..f: "ab" spans two tokens
    expected = stop.keep_length(ids, [98, 97])
    scanner = stop.scanner([98, 97])
    length, result = 0, None
    for size in rounds:
        length = min(len(ids), length + size)
        result = scanner.keep(ids[:length])
        if result is not None or length == len(ids):
            break
    assert result == expected
    if result is not None:
        assert result <= length


def test_eos_ids_come_from_the_generation_config(model: PreTrainedModel) -> None:
    assert eos_ids(model) == (2,)
    model.generation_config.eos_token_id = [7, 2, 7]
    try:
        assert eos_ids(model) == (7, 2)
        assert StopCondition.for_model(model, 5).eos_token_ids == (7, 2)
    finally:
        model.generation_config.eos_token_id = 2
    assert StopCondition.for_model(model, 5, eos_token_ids=()).eos_token_ids == ()


# ---------------------------------------------------------------------------- against generate
@pytest.mark.parametrize("seed", range(6))
def test_eos_ids_stop_where_generate_stops(seed: int, model: PreTrainedModel,
                                           tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = _prompt(tokenizer)
    free = _sample(model, prompt, seed, eos_token_id=None)
    assert len(free) == NEW
    eos = [free[9], free[4]]  # several EOS ids: the first one sampled stops
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        stopped = _sample(model, prompt, seed)
        keep = StopCondition.for_model(model, NEW).keep_length(free, prompt)
    finally:
        model.generation_config.eos_token_id = saved
    assert keep == len(stopped) <= 5 and stopped == free[:keep]


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_cut_where_generate_cuts(seed: int, model: PreTrainedModel,
                                              tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = _prompt(tokenizer)
    free = _sample(model, prompt, seed)  # the model's own EOS (2) still stops
    full = StopCondition.for_model(model, NEW, (), tokenizer)
    assert full.keep_length(free, prompt) == (len(free) if len(free) == NEW or free[-1] == 2
                                              else None)
    stops = _spanning_stops(tokenizer, prompt, free)
    assert stops, "the sample has no ASCII token boundary to put a stop string on"
    for text in stops:
        stopped = _sample(model, prompt, seed, stop_strings=[text], tokenizer=tokenizer)
        condition = StopCondition.for_model(model, NEW, [text], TextTokenizer.wrap(tokenizer, "t"))
        assert condition.keep_length(free, prompt) == len(stopped), text
        assert stopped == free[:len(stopped)]
    both = _sample(model, prompt, seed, stop_strings=stops, tokenizer=tokenizer)
    assert StopCondition.for_model(model, NEW, stops, tokenizer).keep_length(free, prompt) == \
        len(both)


# ---------------------------------------------------------------------------- hosted generate
def _decoder(model: PreTrainedModel) -> SpeculativeDecoder:
    head = MTPHead.from_name("cp", 4, 2, model.config.hidden_size, model.config.vocab_size, seed=1)
    return SpeculativeDecoder(model, head.eval())


def test_hosted_generate_stops_and_processes_like_generate(
        model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = torch.tensor([_prompt(tokenizer)])
    decoder = _decoder(model)
    options = [{},
               {"repetition_penalty": 1.6, "no_repeat_ngram_size": 2},
               {"min_new_tokens": 6, "repetition_penalty": 1.3, "eos_token_id": [2, 5]},
               {"sequence_bias": {(17,): -5.0}, "suppress_tokens": [3, 4]}]
    for option in options:
        expected = model.generate(prompt, do_sample=False, max_new_tokens=24, pad_token_id=0,
                                  **option)
        hosted = model.generate(prompt, custom_generate=speculative_generate, decoder=decoder,
                                do_sample=False, max_new_tokens=24, pad_token_id=0, **option)
        assert hosted.tolist() == expected.tolist(), option
    varied = {"repetition_penalty": 1.6, "no_repeat_ngram_size": 2}  # greedy alone repeats
    free = model.generate(prompt, do_sample=False, max_new_tokens=24, pad_token_id=0, **varied)
    stops = _spanning_stops(tokenizer, prompt[0].tolist(), free[0, prompt.shape[1]:].tolist())
    assert stops, "the greedy output has no ASCII token boundary to put a stop string on"
    expected = model.generate(prompt, do_sample=False, max_new_tokens=24, pad_token_id=0,
                              stop_strings=stops, tokenizer=tokenizer, **varied)
    # transformers drops generate's tokenizer= for a custom_generate callable: pass the criterion
    criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, stops)])
    hosted = model.generate(prompt, custom_generate=speculative_generate, decoder=decoder,
                            do_sample=False, max_new_tokens=24, pad_token_id=0,
                            stopping_criteria=criteria, **varied)
    assert hosted.tolist() == expected.tolist() and expected.shape[1] < free.shape[1]


def test_processed_rows_use_their_own_prefix(model: PreTrainedModel) -> None:
    """Row k of a verified block is processed with the prefix ending at its k-th token, also
    after a rollback."""
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.7),
                                      NoRepeatNGramLogitsProcessor(2)])
    wrapped = ProcessedBackbone(HFBackbone(model), processors)
    tokens = [5, 9, 5, 9, 12, 7, 5, 9, 30, 5]
    wrapped.reset()
    wrapped.extend(torch.tensor([tokens[:4]]))
    wrapped.extend(torch.tensor([[44, 45]]))
    wrapped.crop(4)  # the draft [44, 45] was rejected
    step = wrapped.extend(torch.tensor([tokens[4:]]))
    assert wrapped.tokens == tokens and step.verifier_logits.dtype == torch.float32
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    for k in range(4, len(tokens)):
        prefix = torch.tensor([tokens[:k + 1]])
        expected = processors(prefix, logits[k:k + 1].clone())
        assert torch.allclose(step.verifier_logits[0, k - 4], expected[0], atol=1e-4), k


def test_hosted_generate_rejects_stateful_processors(model: PreTrainedModel,
                                                     tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = torch.tensor([_prompt(tokenizer)])
    with pytest.raises(DecoderError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor"):
        model.generate(prompt, custom_generate=speculative_generate, decoder=_decoder(model),
                       guidance_scale=1.5, max_new_tokens=3, pad_token_id=0)
    with pytest.raises(DecoderError, match="MaxTimeCriteria"):
        model.generate(prompt, custom_generate=speculative_generate, decoder=_decoder(model),
                       max_time=5.0, max_new_tokens=3, pad_token_id=0)
