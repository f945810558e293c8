"""The constraint's walk (:mod:`circuits_llm.decoding.constraint_path`): what it proposes, and that
mixing it into the head x automaton product keeps the constrained law exactly.

* :meth:`ConstraintSteps.fixed_token` against its definition at every state of an automaton whose
  tokens spell prefixes of each other (``a``, ``ab``);
* :class:`ConstraintPath` fed round by round against a brute-force walk over the whole output
  (hypothesis over outputs the automaton allows and over how rounds split them);
* a JSON-like example: after one key the walk proposes the output's own spacing for the next;
* exact laws by enumeration on the toy LM (walk only, and walk with the copy; FF, HMM and BTree
  heads; greedy, sampling, top-k; the whole and a compressed draft vocabulary), with the walk
  checked to fire; a negative control (the same draws verified with the product's own ``q``) is
  biased; greedy decoding with the walk is constrained AR's, eager and compiled; a chi-square
  check of real sampled decodes; ``constraint_weight`` errors;
* ``experiments.constraint_walk_positions``' counts on a hand-checked output.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_graph_double import CudaGraphDouble
from hypothesis import given, settings
from hypothesis import strategies as st
from toy import ToyHead, ToyLM, law_p_value, total_variation
from toy_constrained import constrained_decoder_law, constrained_target_law

from circuits_llm.constraints import Regex, TokenAutomaton
from circuits_llm.decoding.constrained import ConstrainedDrafting
from circuits_llm.decoding.constraint_path import ConstraintPath, ConstraintSteps
from circuits_llm.decoding.decoder import AutoregressiveDecoder, DecoderError, SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.runtime.compiling import use_compiler

EXACT_TV = 1e-9
BIASED_TV = 1e-3
#: ``ab`` spells a prefix chain with ``a``; after ``ab`` the output chooses among four tokens
WORDS = {"<eos>": 0, "a": 1, "ab": 2, "b": 3, " ": 4, "c": 5}
PRODUCT = ConstrainedDrafting.PRODUCT
#: a toy LM whose greedy output repeats a choice of the automaton (so the walk has habits)
LM_SEED = 5
WALK_ONLY = ContextLookup((0.0, 0.0), constraint_weight=0.7)
CONFIGS = {"sampling": SamplingConfig(1.0), "greedy": SamplingConfig(0.0),
           "top_k": SamplingConfig(1.0, top_k=2)}


def _tokenizer(words: dict[str, int]) -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


AUTOMATON = TokenAutomaton.build(Regex("(ab ?)+c"), _tokenizer(WORDS))
SPELLED = {token: word.encode() for word, token in WORDS.items() if token != 0}


def _brute_fixed(state: int) -> int | None:
    allowed = AUTOMATON.allowed(state).tolist()
    if not allowed or any(token not in SPELLED for token in allowed):
        return None
    longest = max(allowed, key=lambda token: len(SPELLED[token]))  # the first of the longest
    return longest if all(SPELLED[longest].startswith(SPELLED[t]) for t in allowed) else None


def test_the_fixed_token_is_the_longest_of_a_prefix_chain() -> None:
    steps = ConstraintSteps(AUTOMATON)
    seen = {steps.fixed_token(state) for state in range(AUTOMATON.num_states)}
    for state in range(AUTOMATON.num_states):
        assert steps.fixed_token(state) == _brute_fixed(state)
    assert WORDS["ab"] in seen and WORDS["b"] in seen and None in seen  # each case occurs
    start = AUTOMATON.initial_state
    assert AUTOMATON.allowed(start).tolist() == [1, 2] and steps.fixed_token(start) == 2


@st.composite
def _outputs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """An output the automaton allows (without EOS) and cut points splitting it into rounds."""
    state, output = AUTOMATON.initial_state, []
    for _ in range(draw(st.integers(0, 14))):
        allowed = [t for t in AUTOMATON.allowed(state).tolist() if t != AUTOMATON.eos_token_id]
        if not allowed:
            break
        token = draw(st.sampled_from(allowed))
        output.append(token)
        state = AUTOMATON.advance(state, token)
    cuts = sorted(draw(st.lists(st.integers(0, len(output)), max_size=4)))
    return output, cuts


def _brute_walk(output: list[int], limit: int) -> list[int]:
    """The walk from its definition: the fixed token, else the output's last choice among the
    same allowed tokens."""
    habits: dict[tuple[int, ...], int] = {}
    state = AUTOMATON.initial_state
    for token in output:
        habits[tuple(AUTOMATON.allowed(state).tolist())] = token
        state = AUTOMATON.advance(state, token)
    proposal: list[int] = []
    while len(proposal) < limit:
        token = _brute_fixed(state)
        if token is None:
            token = habits.get(tuple(AUTOMATON.allowed(state).tolist()))
        if token is None or token == AUTOMATON.eos_token_id:
            break
        proposal.append(token)
        state = AUTOMATON.advance(state, token)
    return proposal


@settings(max_examples=150, deadline=None)
@given(case=_outputs(), limit=st.integers(1, 6))
def test_the_walk_fed_round_by_round_is_the_walk_of_the_whole_output(
        case: tuple[list[int], list[int]], limit: int) -> None:
    output, cuts = case
    path = ConstraintPath(ConstraintSteps(AUTOMATON))
    state = AUTOMATON.initial_state
    for start, end in zip([0, *cuts], [*cuts, len(output)], strict=True):
        path.record(state, output[start:end])
        for token in output[start:end]:
            state = AUTOMATON.advance(state, token)
    assert path.propose(state, limit) == _brute_walk(output, limit)


def test_after_one_key_the_walk_proposes_the_outputs_own_spacing() -> None:
    words = {"<eos>": 0, "{": 1, '"': 2, '"k': 3, "k": 4, '":': 5, ":": 6, " ": 7, ' "': 8,
             "x": 9, "}": 10, ",": 11, '",': 12}
    automaton = TokenAutomaton.build(Regex('\\{"k": ?"x"(, ?"k": ?"x")*\\}'), _tokenizer(words))
    path = ConstraintPath(ConstraintSteps(automaton))
    state = automaton.initial_state
    assert path.propose(state, 8) == [1, 3, 5]  # fixed text; the space after ':' is a choice
    output = [1, 3, 5, 8, 9, 12]  # {"k": "x",
    path.record(state, output)
    for token in output:
        state = automaton.advance(state, token)
    assert path.propose(state, 8) == []  # ' ', ' "', '"' or '"k' after ',': not chosen before
    path.record(state, [8])
    state = automaton.advance(state, 8)
    # the fixed 'k' and '":', the output's habit ' "' after a colon, the fixed 'x' and '",', then
    # its habit ' "' after a comma (just recorded), and again
    assert path.propose(state, 8) == [4, 5, 8, 9, 12, 8, 4, 5]


@pytest.mark.parametrize("draft_tokens", [None, (0, 1, 3, 4, 5)], ids=["full", "no-ab"])
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize(("architecture", "rank"), [("ff", 1), ("hmm", 2), ("btree", 2)])
def test_the_walk_mixed_into_the_product_is_exact(architecture: str, rank: int,
                                                 config: SamplingConfig,
                                                 draft_tokens: tuple[int, ...] | None) -> None:
    """The output law with the walk (alone, and beside the copy) is constrained AR's, enumerated;
    the walk proposes in some round (a component with weight above 0 while the copy's weights are
    0)."""
    vocab = len(WORDS)
    lm = ToyLM(vocab, seed=LM_SEED, draft_branch=True)
    head = ToyHead(architecture, 3, rank, 6, vocab, seed=4, draft_tokens=draft_tokens)
    prompt, length = [1, 2, 4], 8 if config.greedy else 5  # one greedy path: longer
    want = constrained_target_law(lm, AUTOMATON, prompt, length, config)
    components: list[torch.Tensor] = []
    law = constrained_decoder_law(lm, head, AUTOMATON, prompt, length, config, PRODUCT,
                                  lookup=WALK_ONLY, components=components)
    assert total_variation(law, want) <= EXACT_TV
    assert any(float(component[-1]) > 0 for component in components)
    both = constrained_decoder_law(lm, head, AUTOMATON, prompt, length, config, PRODUCT,
                                   lookup=ContextLookup((0.4, 0.7), constraint_weight=0.5))
    assert total_variation(both, want) <= EXACT_TV


def test_the_walk_verified_with_the_products_conditionals_is_biased() -> None:
    """Negative control: the same mixture draws, accepted against the product's own ``q``."""
    vocab = len(WORDS)
    lm = ToyLM(vocab, seed=LM_SEED, draft_branch=True)
    head = ToyHead("btree", 3, 2, 6, vocab, seed=4)
    config = SamplingConfig(1.0)
    law = constrained_decoder_law(lm, head, AUTOMATON, [1, 2, 4], 4, config, PRODUCT,
                                  lookup=WALK_ONLY, mixed_q=False)
    want = constrained_target_law(lm, AUTOMATON, [1, 2, 4], 4, config)
    assert abs(sum(law.values()) - 1) < 1e-12 and total_variation(law, want) > BIASED_TV


def assert_greedy_is_constrained_autoregressive(head: ToyHead, lookup: ContextLookup,
                                                compiled: bool) -> None:
    """Greedy output with ``head`` and ``lookup`` (eager, or compiled through the CUDA-graph
    double, with a confident draft-length rule) equals constrained AR's on three prompts."""
    vocab = len(WORDS)
    reference = AutoregressiveDecoder(ToyLM(vocab, seed=LM_SEED, draft_branch=True))
    with use_compiler(CudaGraphDouble()):
        decoder = SpeculativeDecoder(ToyLM(vocab, seed=LM_SEED, draft_branch=True), head,
                                     lookup=lookup, compile=compiled,
                                     draft_length=DraftLength.confident(0.2))
    for prompt in ([1], [1, 2, 4], [2, 2, 2]):
        got = decoder.generate(prompt, 16, constraint=AUTOMATON).tokens.tolist()
        assert got == reference.generate(prompt, 16, constraint=AUTOMATON).tokens.tolist()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph-double"])
def test_greedy_with_the_walk_is_constrained_autoregressive(compiled: bool) -> None:
    assert_greedy_is_constrained_autoregressive(ToyHead("btree", 4, 2, 6, len(WORDS), seed=4),
                                                WALK_ONLY, compiled)


def test_sampled_generate_with_the_walk_matches_the_law() -> None:
    """Chi-square of 400 real decodes through the product with the walk against constrained AR's
    enumerated law."""
    vocab = len(WORDS)
    decoder = SpeculativeDecoder(ToyLM(vocab, seed=LM_SEED, draft_branch=True),
                                 ToyHead("hmm", 3, 2, 6, vocab, seed=4), lookup=WALK_ONLY)
    law = constrained_target_law(ToyLM(vocab, seed=LM_SEED, draft_branch=True), AUTOMATON, [1, 2, 4], 4,
                                 SamplingConfig(1.0))
    generator = torch.Generator().manual_seed(5)
    samples = [tuple(decoder.generate([1, 2, 4], 4, 1.0, generator=generator,
                                      constraint=AUTOMATON).tokens.tolist())
               for _ in range(400)]
    assert law_p_value(samples, law) > 1e-3


@pytest.mark.parametrize("weight", [-0.1, 1.5, True, "0.5"])
def test_a_bad_constraint_weight_is_refused(weight: object) -> None:
    with pytest.raises(DecoderError, match="constraint_weight must be a number in \\[0, 1\\]"):
        ContextLookup(constraint_weight=weight)  # type: ignore[arg-type]


def test_the_position_benchmark_counts_what_each_proposal_gets_right() -> None:
    """``experiments.constraint_walk_positions.count_positions`` on a hand-checked output: ``ab ab
    ab c`` (ids 2 4 2 4 2 5) after the prompt ``a``, with ``ab`` outside the draft vocabulary."""
    from experiments.constraint_walk_positions import count_positions, draftable, matched
    assert matched([2, 4, 1], [2, 4, 2]) == 2 and matched([], [2]) == 0
    assert draftable([1, 2, 3], {1, 3}) == [1]
    output = [2, 4, 2, 4, 2, 5]
    counts = count_positions(output, [1], AUTOMATON, {1, 3, 4, 5})
    # the walk: 'ab' is fixed only at the start (after 'ab ', 'c' may end the text); after that
    # it replays the output's choices once made: position 3 proposes ' ' 'ab' ' ' ... (2 right),
    # position 4 'ab' ' ' ... (1 right), position 5 ' ' (wrong: 'c'); positions 1 and 2 meet a
    # choice not made before
    assert counts["positions"] == 6 and counts["outside_vocabulary"] == 3
    assert counts["walk_first"] == 3 and counts["walk_tokens"] == 4
    assert counts["walk_draftable"] == 1  # only position 3's ' ', before its 'ab'
    assert counts["either_tokens"] >= max(counts["walk_tokens"], counts["copy_tokens"])
