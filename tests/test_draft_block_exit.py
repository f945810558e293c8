"""A recursive block's round that stops drafting after an unsure draft (``BlockDrafter(
greedy_exit=, sampled_exit=)``), and verifies only what it drafted.

* The sampled exit keeps the law exact: the decoder's law of the first tokens, enumerated on a
  tiny-vocabulary Llama (``block_enumeration.recursive_law`` with ``exit_below``; each mixture
  component's mass ends where its round stops), equals the target's with and without the copy of
  the context, under a constraint too. The negative control: an exit that spares the drafts the
  copy *chose* (rather than the drafts that follow its proposal) reads which component drew them,
  and its law is detected as biased.
* The real ``generate`` samples that law (chi-square, eager and through the CUDA-graph replay
  double), its rounds verify fewer drafts at times, and a shifted law is rejected.
* A round that stops early verifies only its drafts: the verify blocks are shorter (greedy output
  unchanged), and a compiled backbone is prepared for every length.
"""

from __future__ import annotations

import pytest
import torch
from block_enumeration import copy_fires, recursive_law
from cuda_graph_double import CudaGraphDouble
from draft_block_models import NextTokenLogits, perturbed_block, tiny_llama, word_tokenizer
from toy import law_p_value, target_law, total_variation
from toy_constrained import constrained_target_law

from circuits_llm.constraints import Regex, TokenAutomaton
from circuits_llm.decoding.acceptance import SampledAccept
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.draft_block import BlockDrafter, BlockStepMode, DraftBlockError
from circuits_llm.runtime.compiling import use_compiler

SAMPLING, TOP_K = SamplingConfig(1.0), SamplingConfig(0.7, top_k=2)
EXACT_TV, BIASED_TV = 1e-9, 1e-3
VOCAB = 4
SMALL = tiny_llama(vocab=VOCAB, scale=3.0)
PROMPT = [1, 2, 3, 1, 2]  # ends in a repeated n-gram: the copy proposes from the first round
LOOKUP = ContextLookup((0.5, 0.9))
#: the block's first law gives its argmax under 0.4 in some histories only: rounds of 1 and 2
#: drafts both occur (at 0.5 every round of its own stops after its first draft)
EXIT = 0.4


def _block() -> object:
    return perturbed_block(SMALL, steps=2, draft_vocab=[0, 2, 3], noise=0.3)


@pytest.mark.parametrize("config", [SAMPLING, TOP_K], ids=["temperature", "top_k"])
@pytest.mark.parametrize("lookup", [None, LOOKUP], ids=["alone", "lookup"])
def test_the_sampled_exit_keeps_the_law_exact(lookup: ContextLookup | None,
                                              config: SamplingConfig) -> None:
    block = _block()
    assert lookup is None or copy_fires(lookup, PROMPT)
    target = target_law(NextTokenLogits(SMALL), PROMPT, 3, config)  # type: ignore[arg-type]
    lengths: list[int] = []
    exact = recursive_law(block, SMALL, PROMPT, 3, config, lookup=lookup,  # type: ignore[arg-type]
                          lengths=lengths, exit_below=EXIT)
    assert abs(sum(exact.values()) - 1) < 1e-12
    assert set(lengths) == {1, 2}  # some rounds stopped after their first draft
    assert total_variation(exact, target) <= EXACT_TV


def test_an_exit_that_reads_which_component_drew_the_drafts_is_biased() -> None:
    """The negative control: with the copy mixed in, an exit that never stops a round the copy
    chose (but stops the recursion's own rounds) makes the next draft's law the mixture's
    posterior given that the round went on, not the ``q`` it is accepted with. The drafter's rule
    (never while the drafts follow the proposal, whoever drew them) is exact at the same
    threshold."""
    block = _block()
    target = target_law(NextTokenLogits(SMALL), PROMPT, 3, SAMPLING)  # type: ignore[arg-type]
    by_drafts = recursive_law(block, SMALL, PROMPT, 3, SAMPLING, lookup=LOOKUP,  # type: ignore[arg-type]
                              exit_below=0.5)
    by_component = recursive_law(block, SMALL, PROMPT, 3, SAMPLING, lookup=LOOKUP,  # type: ignore[arg-type]
                                 exit_below=0.5, exit_by_component=True)
    assert total_variation(by_drafts, target) <= EXACT_TV
    assert total_variation(by_component, target) > BIASED_TV


WORDS = {"<eos>": 0, "a": 1, "b": 2, "c": 3, "d": 4}
AUTOMATON = TokenAutomaton.build(Regex("(a|bc)*d"), word_tokenizer(WORDS))
WORDY = tiny_llama(vocab=5, scale=3.0, seed=2)


@pytest.mark.parametrize("prompt", [[1, 2], [3, 1, 2, 3, 1]], ids=["alone", "lookup"])
def test_the_sampled_exit_under_a_constraint_keeps_the_law_exact(prompt: list[int]) -> None:
    """``PRODUCT`` drafting: the exit reads each step's law restricted to the allowed tokens."""
    block = perturbed_block(WORDY, steps=2, noise=0.3)
    lookup = LOOKUP if len(prompt) > 2 else None
    target = constrained_target_law(NextTokenLogits(WORDY), AUTOMATON, prompt, 3,  # type: ignore[arg-type]
                                    SAMPLING)
    lengths: list[int] = []
    exact = recursive_law(block, WORDY, prompt, 3, SAMPLING, automaton=AUTOMATON, lookup=lookup,
                          lengths=lengths, exit_below=0.6)
    assert abs(sum(exact.values()) - 1) < 1e-12
    assert 1 in lengths and max(lengths) == 2
    assert total_variation(exact, target) <= EXACT_TV


@pytest.mark.parametrize("way", ["eager", "eager-lookup", "compiled"])
def test_sampled_generate_with_the_exit_follows_the_law(way: str) -> None:
    """The real decoder with ``sampled_exit``: the chi-square against the target law, rounds of
    both lengths, and a negative control (the same samples against a law whose first token is
    shifted). ``compiled``: the block's calls and the whole-window accept through the CUDA-graph
    replay double, the backbone prepared for every verify length."""
    lookup = LOOKUP if way == "eager-lookup" else None
    double = CudaGraphDouble()
    compiled = way == "compiled"
    drafter = BlockDrafter(_block(), sampled_exit=EXIT,  # type: ignore[arg-type]
                           step_mode=BlockStepMode.COMPILED if compiled else BlockStepMode.EAGER)
    with use_compiler(double):
        decoder = SpeculativeDecoder(
            SMALL, drafter, lookup=lookup, compile=compiled,
            sampled_accept=SampledAccept.WHOLE_WINDOW if compiled else SampledAccept.AUTO)
    if compiled:
        assert decoder.backbone.compiled_lengths == (1, 2, 3)  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(0)
    samples, drafted = [], set()
    for _ in range(600):
        result = decoder.generate(PROMPT, 2, temperature=1.0, generator=generator,
                                  eos_token_id=())
        samples.append(tuple(result.tokens.tolist()))
        drafted |= {r.drafted for r in result.rounds}
    assert {1, 2} <= drafted
    if compiled:
        assert double.calls["draft block step"] > 0
    target = target_law(NextTokenLogits(SMALL), PROMPT, 2, SAMPLING)  # type: ignore[arg-type]
    assert law_p_value(samples, target) > 1e-3
    shifted = {((x[0] + 1) % VOCAB, *x[1:]): p for x, p in target.items()}
    assert law_p_value(samples, shifted) < 1e-6


def _generate(prompt: list[int], count: int) -> list[int]:
    out = SMALL.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=count,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_round_that_stops_early_verifies_only_its_drafts(mode: str) -> None:
    """Every verify block is ``[c, d_1..d_L]``: with an exit no law reaches, each round verifies
    its one draft (2 tokens); without the exit (the negative control), the whole window (4; the
    last rounds draft only what is left to decode). Greedy output is ``generate``'s either way."""
    block = perturbed_block(SMALL, steps=3, draft_vocab=[0, 2, 3], noise=0.3)
    greedy = mode == "greedy"
    widths = {}
    for exit_below in (None, 0.999):
        drafter = BlockDrafter(block, greedy_exit=exit_below if greedy else None,
                               sampled_exit=None if greedy else exit_below)
        assert drafter.stops_early is (exit_below is not None)
        decoder = SpeculativeDecoder(SMALL, drafter)
        seen: list[int] = []
        extend = decoder.backbone.extend

        def recording(tokens: torch.Tensor, extend=extend, seen=seen) -> object:
            seen.append(tokens.shape[1])
            return extend(tokens)

        decoder.backbone.extend = recording  # type: ignore[method-assign]
        result = decoder.generate([1, 2, 3], 10, temperature=0.0 if greedy else 1.0,
                                  generator=torch.Generator().manual_seed(1), eos_token_id=())
        if greedy:
            assert result.tokens.tolist() == _generate([1, 2, 3], 10)
        widths[exit_below] = set(seen)
    assert max(widths[None]) == 4 and widths[0.999] == {2}


def test_bad_exits_are_refused() -> None:
    block = _block()
    for name in ("greedy_exit", "sampled_exit"):
        for bad in (0.0, 1.0, True, "0.3"):
            with pytest.raises(DraftBlockError, match=f"{name} must be None or a probability"):
                BlockDrafter(block, **{name: bad})  # type: ignore[arg-type]
