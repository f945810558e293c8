"""Greedy drafts respelled the way the tokenizer spells their text (decoding/respelling.py).

The respeller is checked on a tiny BPE tokenizer whose one merge makes ``a b`` the token ``ab``:
it returns the tokenizer's spelling of the drafts' text, cut to the window, and nothing when
there is no other spelling, when a special token or a split character is drafted, or when the
automaton forbids the result. In decoding, greedy output stays constrained AR's with respelling
on (eager and compiled through the CUDA-graph double, with a copy of the context and without),
the respelling is checked to fire, and sampling rounds never respell.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_graph_double import CudaGraphDouble
from test_constraint_automaton import StubTokenizer, byte_level_tokenizer
from toy import ToyHead, ToyLM

from circuits_llm.constraints import Regex, TokenAutomaton
from circuits_llm.decoding.decoder import AutoregressiveDecoder, DecoderError, SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.respelling import DraftRespeller
from circuits_llm.runtime.compiling import use_compiler

#: ``a`` then ``b`` merges into ``ab``: the tokenizer never writes ``a``, ``b`` side by side
WORDS = {"<eos>": 0, "a": 1, "ab": 2, "b": 3, " ": 4, "c": 5}
A, AB, B, SPACE, C = 1, 2, 3, 4, 5


def _bpe_tokenizer() -> Any:
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.BPE(vocab=WORDS, merges=[("a", "b")]))
    backend.add_special_tokens([AddedToken("<eos>", special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


TOKENIZER = _bpe_tokenizer()
AUTOMATON = TokenAutomaton.build(Regex("(ab ?)+c"), TOKENIZER)
START = AUTOMATON.initial_state


def test_the_drafts_text_is_spelled_as_the_tokenizer_spells_it() -> None:
    respeller = DraftRespeller(TOKENIZER)
    assert respeller.respell([A, B, SPACE, A, B], AUTOMATON, START, 7) == [AB, SPACE, AB]
    assert respeller.respell([A, B, A, B, C], AUTOMATON, START, 7) == [AB, AB, C]
    # from the state after ``a``: ``b a b`` is ``b ab``
    assert respeller.respell([B, A, B], AUTOMATON, AUTOMATON.advance(START, A), 7) == [B, AB]


def test_the_respelling_is_cut_to_the_window() -> None:
    assert DraftRespeller(TOKENIZER).respell([A, B, A, B, A, B], AUTOMATON, START, 2) == [AB, AB]


@pytest.mark.parametrize(("drafts", "why"), [
    ([AB, SPACE, AB], "already the tokenizer's spelling"),
    ([], "nothing drafted"),
    ([A, B, 0], "a special token"),
    ([A, B, 99], "an id outside the vocabulary"),
])
def test_nothing_to_respell(drafts: list[int], why: str) -> None:
    assert DraftRespeller(TOKENIZER).respell(drafts, AUTOMATON, START, 7) is None, why


def test_a_respelling_the_automaton_forbids_is_not_used() -> None:
    after_a = AUTOMATON.advance(START, A)  # ``a a b`` is not a prefix of ``(ab ?)+c``
    assert DraftRespeller(TOKENIZER).respell([A, B], AUTOMATON, after_a, 7) is None


def test_a_character_split_at_the_window_end_is_not_respelled() -> None:
    tokenizer = byte_level_tokenizer()
    automaton = TokenAutomaton.build(Regex("[a-z\u00e9]+"), tokenizer)
    respeller = DraftRespeller(tokenizer)
    a, b = (tokenizer.convert_tokens_to_ids(letter) for letter in "ab")
    first_byte = tokenizer.convert_tokens_to_ids("\u00c3")  # the first byte of ``é``
    assert respeller.respell([a, b], automaton, automaton.initial_state, 7) == \
        [tokenizer.convert_tokens_to_ids("ab")]
    assert respeller.respell([a, b, first_byte], automaton, automaton.initial_state, 7) is None


def test_a_tokenizer_that_cannot_encode_respells_nothing() -> None:
    stub = StubTokenizer({word: token for word, token in WORDS.items()}, [0])
    automaton = TokenAutomaton.build(Regex("(ab ?)+c"), stub, eos_token_id=0)
    respeller = DraftRespeller(stub)
    assert not respeller.usable and respeller.respell([A, B], automaton, START, 7) is None
    decoder = SpeculativeDecoder(ToyLM(len(WORDS), seed=5, draft_branch=True),
                                 ToyHead("btree", 4, 2, 6, len(WORDS), seed=4))
    reference = AutoregressiveDecoder(ToyLM(len(WORDS), seed=5, draft_branch=True))
    assert decoder.generate([1, 2, 4], 12, constraint=automaton, tokenizer=stub).tokens.tolist() \
        == reference.generate([1, 2, 4], 12, constraint=automaton).tokens.tolist()


def _count_respellings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spy on :meth:`DraftRespeller.respell`: [calls, calls that changed the draft]."""
    counts = [0, 0]
    original = DraftRespeller.respell

    def spy(self: DraftRespeller, *args: Any) -> list[int] | None:
        ids = original(self, *args)
        counts[0] += 1
        counts[1] += ids is not None
        return ids

    monkeypatch.setattr(DraftRespeller, "respell", spy)
    return counts


@pytest.mark.parametrize("lookup", [None, ContextLookup()], ids=["head", "copy"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph-double"])
def test_greedy_with_respelled_drafts_is_constrained_autoregressive(
        monkeypatch: pytest.MonkeyPatch, compiled: bool, lookup: ContextLookup | None) -> None:
    counts = _count_respellings(monkeypatch)
    vocab = len(WORDS)
    reference = AutoregressiveDecoder(ToyLM(vocab, seed=5, draft_branch=True))
    with use_compiler(CudaGraphDouble()):
        decoder = SpeculativeDecoder(ToyLM(vocab, seed=5, draft_branch=True),
                                     ToyHead("btree", 4, 2, 6, vocab, seed=4), lookup=lookup,
                                     compile=compiled, draft_length=DraftLength.confident(0.1))
    for prompt in ([1], [1, 2, 4], [2, 2, 2], [3, 1]):
        got = decoder.generate(prompt, 16, constraint=AUTOMATON, tokenizer=TOKENIZER)
        want = reference.generate(prompt, 16, constraint=AUTOMATON, tokenizer=TOKENIZER)
        assert got.tokens.tolist() == want.tokens.tolist()
    assert counts[1] > 0, "no draft was respelled: the test does not reach the respelling"


def test_sampling_and_a_decoder_without_respelling_never_respell(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_respellings(monkeypatch)
    vocab = len(WORDS)
    decoder = SpeculativeDecoder(ToyLM(vocab, seed=5, draft_branch=True),
                                 ToyHead("btree", 4, 2, 6, vocab, seed=4))
    generator = torch.Generator().manual_seed(0)
    decoder.generate([1, 2, 4], 16, 1.0, generator=generator, constraint=AUTOMATON,
                     tokenizer=TOKENIZER)
    decoder.generate([1, 2, 4], 16, constraint=AUTOMATON)  # no tokenizer: nothing to respell with
    plain = SpeculativeDecoder(ToyLM(vocab, seed=5, draft_branch=True),
                               ToyHead("btree", 4, 2, 6, vocab, seed=4),
                               respell_greedy_drafts=False)
    plain.generate([1, 2, 4], 16, constraint=AUTOMATON, tokenizer=TOKENIZER)
    assert counts == [0, 0]
    decoder.generate([1, 2, 4], 16, constraint=AUTOMATON, tokenizer=TOKENIZER)
    assert counts[0] > 0  # the control: a greedy round with the tokenizer does call it


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_bad_respell_flag_is_refused(value: object) -> None:
    with pytest.raises(DecoderError, match="respell_greedy_drafts must be a bool"):
        SpeculativeDecoder(ToyLM(len(WORDS), seed=5, draft_branch=True),
                           ToyHead("btree", 4, 2, 6, len(WORDS), seed=4),
                           respell_greedy_drafts=value)  # type: ignore[arg-type]
