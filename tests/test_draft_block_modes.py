"""The draft block's drafters with the decoder's other modes (issue 44, item 2(b)): the context copy
(``lookup``), every ``draft_length`` rule and a constraint (``FREE`` and ``PRODUCT`` drafting).

* the circuit on the block (:class:`BlockCircuitDrafter`) takes all of them, as a head does (the
  product of its circuit on the block's output and the automaton, forced runs included);
* the recursive block (:class:`BlockDrafter`) takes all of them too: the copy mixed into the
  recursion (its proposal fed to the block), the rule reading the recursion's laws, and under
  ``PRODUCT`` each step's law restricted to the tokens the automaton allows.

For every combination: greedy decoding equals ``model.generate`` (under a constraint: constrained
autoregressive decoding), on a dynamic cache and on a static one, eager and compiled (the CUDA-
graph replay double, the block's own calls compiled too); the exact law of the first tokens,
enumerated on a tiny-vocabulary Llama (float64) with the block's output taken from a fresh prefill
of the block for each history (independently of the decoder's cache following), equals the
target's, and a wrong ``q`` is detected; the real ``generate`` samples that law (chi-square); the
block's cache equals a fresh prefill after several rounds, the block having run exactly once a
round. What still refuses (a batch of prompts with a copy or rule, a context drafter without
``decoding_problem`` given them) says so.

The enumerators of the laws live in ``tests/block_enumeration.py``, the models, heads and shared
checks in ``tests/draft_block_models.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from block_enumeration import (
    circuit_constrained_law,
    circuit_law,
    copy_fires,
    pooled,
    recursive_law,
    state_after,
)
from cuda_graph_double import CudaGraphDouble
from draft_block_models import (
    NextTokenLogits,
    assert_cache_is_a_fresh_prefill,
    block_circuit_head,
    count_first_steps,
    fresh_first_step,
    perturbed_block,
    tiny_llama,
    word_tokenizer,
)
from toy import law_p_value, target_law, total_variation
from toy_constrained import constrained_target_law
from transformers import LlamaForCausalLM

from circuits_llm.backbone import CacheKind, HFBackbone
from circuits_llm.constraints import Regex, TokenAutomaton
from circuits_llm.decoding.constrained import ConstrainedDrafting, ConstraintTracker
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.warping import DecoderError, SamplingConfig, warp_logits
from circuits_llm.draft_block import (
    BlockCircuitDrafter,
    BlockDrafter,
    BlockStepMode,
    DraftBlockError,
)
from circuits_llm.draft_block import batch as block_batch
from circuits_llm.draft_block import drafter as drafter_module
from circuits_llm.draft_block.drafter import BlockRoundProgram
from circuits_llm.runtime.compiling import use_compiler

PRODUCT, FREE = ConstrainedDrafting.PRODUCT, ConstrainedDrafting.FREE
SAMPLING, TOP_K = SamplingConfig(1.0), SamplingConfig(0.7, top_k=2)
EXACT_TV, BIASED_TV = 1e-9, 1e-3
CONFIDENT = DraftLength.confident(0.3)
RULES = {"fixed-1": DraftLength.fixed(1), "confident": CONFIDENT}
#: the recursive block's laws on the small Llama are flatter: a threshold at which L varies
RECURSIVE_RULES = {"fixed-1": DraftLength.fixed(1), "confident": DraftLength.confident(0.15)}


def _generate(model: LlamaForCausalLM, prompt: list[int], count: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=count,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


# =========================================================================== without a constraint
MODEL = tiny_llama(scale=8.0)
COMPRESSED = list(range(0, 48, 2))
#: (prompt, max_new_tokens): a one-token prompt takes the autoregressive first step; the last
#: repeats n-grams, so that the copy proposes from the first round on
CASES = [([1], 12), ([1, 5], 9), ([1, 5, 7, 9, 3], 15), ([4, 2, 2], 1), ([3, 8, 3, 8, 3], 14)]
LOOKUP = ContextLookup((0.5, 0.9))


def _circuit_drafter(vocab: list[int] | None = None, kind: str = "btree") -> BlockCircuitDrafter:
    block = perturbed_block(MODEL, draft_vocab=list(range(0, 48, 3)))
    head = block_circuit_head(MODEL, kind, 4, vocab, token=vocab is not None)
    return BlockCircuitDrafter(block, head)


@pytest.mark.parametrize("vocab", [None, COMPRESSED], ids=["full", "compressed"])
@pytest.mark.parametrize("mode", ["lookup", "fixed-1", "confident", "lookup-confident"])
def test_circuit_on_the_block_greedy_equals_generate(mode: str, vocab: list[int] | None) -> None:
    drafter = _circuit_drafter(vocab)
    rule = RULES.get(mode.removeprefix("lookup-"))
    decoder = SpeculativeDecoder(MODEL, drafter, draft_length=rule,
                                 lookup=LOOKUP if mode.startswith("lookup") else None)
    for prompt, count in CASES:
        result = decoder.generate(prompt, count, eos_token_id=())
        assert result.tokens.tolist() == _generate(MODEL, prompt, count)
        assert decoder.backbone.length == len(prompt) + count - 1
        if mode == "fixed-1":
            assert all(r.drafted <= 1 for r in result.rounds)


@pytest.mark.parametrize("mode", ["fixed-1", "confident", "lookup", "lookup-confident"])
def test_recursive_block_greedy_equals_generate(mode: str) -> None:
    block = perturbed_block(MODEL, steps=3, draft_vocab=COMPRESSED)
    # the perturbed block's laws over 24 tokens are flat: a low threshold lets lengths vary
    rule = {"fixed-1": RULES["fixed-1"], "lookup": None}.get(mode, DraftLength.confident(0.03))
    decoder = SpeculativeDecoder(MODEL, BlockDrafter(block), draft_length=rule,
                                 lookup=LOOKUP if mode.startswith("lookup") else None)
    drafted = set()
    for prompt, count in CASES:
        result = decoder.generate(prompt, count, eos_token_id=())
        assert result.tokens.tolist() == _generate(MODEL, prompt, count)
        drafted |= {r.drafted for r in result.rounds}
    assert drafted <= ({0, 1} if mode == "fixed-1" else {0, 1, 2, 3})
    if mode.endswith("confident"):  # the rule really chose different lengths
        assert len(drafted - {0}) >= 2, drafted


@pytest.mark.parametrize("lookup", [None, LOOKUP], ids=["alone", "lookup"])
def test_a_greedy_exit_stops_unsure_rounds_and_keeps_the_output(lookup: ContextLookup | None
                                                                 ) -> None:
    """With ``greedy_exit`` a greedy round stops drafting after a draft whose law gives its argmax
    less than the threshold: fewer drafts in some rounds, the same tokens as ``generate``, and a
    threshold no law reaches drafts no deeper than the first draft (a negative control: without
    the exit the rounds draft the whole window)."""
    block = perturbed_block(MODEL, steps=3, draft_vocab=COMPRESSED)
    depths = {}
    for exit_below in (None, 0.2, 0.999):
        decoder = SpeculativeDecoder(MODEL, BlockDrafter(block, greedy_exit=exit_below),
                                     lookup=lookup)
        drafted = []
        for prompt, count in CASES:
            result = decoder.generate(prompt, count, eos_token_id=())
            assert result.tokens.tolist() == _generate(MODEL, prompt, count)
            drafted += [r.drafted for r in result.rounds if r.drafted]
        depths[exit_below] = drafted
    assert max(depths[None]) == 3 and max(depths[0.2]) <= 3
    assert sum(depths[0.2]) < sum(depths[None])
    if lookup is None:  # every round's first draft is its own: the exit stops after it
        assert set(depths[0.999]) == {1}
    with pytest.raises(DraftBlockError, match="greedy_exit must be None or a probability"):
        BlockDrafter(block, greedy_exit=1.0)
    with pytest.raises(DraftBlockError, match="greedy_exit must be None or a probability"):
        BlockDrafter(block, greedy_exit=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("batch", [False, True], ids=["one-prompt", "batch"])
def test_greedy_copied_drafts_skip_the_readout_and_draft_the_same(
        batch: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy drafts the copy proposes are not read out (no logits) and, when the proposal fills
    the round, not run through the block either; the drafts are those of the same rounds with
    every readout made (a rule with threshold 0 reads every law, so nothing is skipped there,
    and it verifies every draft). A skip that broke the chain of block outputs after a proposal
    would change the drafts after it."""
    block = perturbed_block(MODEL, steps=3, draft_vocab=COMPRESSED)
    calls, drafts = {"logits": 0}, []
    logits = type(block).logits
    one, rows = BlockRoundProgram._recurse, block_batch.RaggedBlockRows._recursive

    def counted(self: Any, output: Any) -> Any:
        calls["logits"] += 1
        return logits(self, output)

    def recorded_one(*args: Any, **kwargs: Any) -> Any:
        made = one(*args, **kwargs)
        drafts.append(made.block.tolist())
        return made

    def recorded_rows(*args: Any, **kwargs: Any) -> Any:
        made = rows(*args, **kwargs)
        drafts.extend(draft.block.tolist() for draft in made)
        return made

    monkeypatch.setattr(type(block), "logits", counted)
    monkeypatch.setattr(BlockRoundProgram, "_recurse", recorded_one)
    monkeypatch.setattr(block_batch.RaggedBlockRows, "_recursive", recorded_rows)
    runs = {}
    prompts, counts = [case[0] for case in CASES], [case[1] for case in CASES]
    for name, rule in (("skipping", None), ("reading", DraftLength.confident(0.0))):
        calls["logits"], drafts[:] = 0, []
        decoder = SpeculativeDecoder(MODEL, BlockDrafter(block), draft_length=rule, lookup=LOOKUP)
        if batch:
            tokens = decoder.generate(prompts, counts, eos_token_id=()).tokens
        else:
            tokens = [decoder.generate(p, n, eos_token_id=()).tokens.tolist()
                      for p, n in zip(prompts, counts, strict=True)]
        runs[name] = (list(drafts), tokens, calls["logits"])
    assert runs["skipping"][0] == runs["reading"][0]
    assert runs["skipping"][1] == runs["reading"][1] == [
        _generate(MODEL, p, n) for p, n in CASES]
    assert runs["skipping"][2] < runs["reading"][2]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
@pytest.mark.parametrize("mode", ["circuit-lookup-confident", "circuit-fixed-1",
                                  "recursive-confident", "recursive-lookup-fixed-1"])
def test_the_cache_equals_a_fresh_prefill_after_rounds(mode: str, temperature: float) -> None:
    if mode.startswith("circuit"):
        drafter: BlockCircuitDrafter | BlockDrafter = _circuit_drafter(COMPRESSED)
    else:
        drafter = BlockDrafter(perturbed_block(MODEL, layers=2, draft_vocab=COMPRESSED))
    rule = RULES["confident" if mode.endswith("confident") else "fixed-1"]
    decoder = SpeculativeDecoder(MODEL, drafter, draft_length=rule,
                                 lookup=LOOKUP if "lookup" in mode else None)
    for prompt in ([3], [3, 8, 3, 8]):
        result = decoder.generate(prompt, 17, temperature=temperature, eos_token_id=(),
                                  generator=torch.Generator().manual_seed(2))
        assert len(result.rounds) > 3
        assert_cache_is_a_fresh_prefill(drafter, MODEL, prompt + result.tokens.tolist(),
                                        drafter.window)


# --------------------------------------------------------------------------- the exact law
VOCAB = 4
SMALL = tiny_llama(vocab=VOCAB, scale=3.0)
PROMPT = [1, 2, 3, 1, 2]  # ends in a repeated n-gram: the copy proposes from the first round
DRAFT_VOCAB = [0, 2, 3]  # c = 1 lies outside: the round drafts after a stand-in for it


def _small_circuit_drafter() -> BlockCircuitDrafter:
    block = perturbed_block(SMALL, steps=2, noise=0.3)
    head = block_circuit_head(SMALL, "btree", 3, DRAFT_VOCAB, token=True, seed=3)
    return BlockCircuitDrafter(block, head)


@pytest.mark.parametrize("config", [SAMPLING, TOP_K], ids=["temperature", "top_k"])
@pytest.mark.parametrize("mode", ["lookup", "confident", "lookup-confident"])
def test_circuit_on_the_block_law_is_exact_and_a_wrong_q_is_detected(
        mode: str, config: SamplingConfig) -> None:
    drafter = _small_circuit_drafter()
    lookup = LOOKUP if mode.startswith("lookup") else None
    rule = CONFIDENT if mode.endswith("confident") else None
    assert lookup is None or copy_fires(lookup, PROMPT)
    target = target_law(NextTokenLogits(SMALL), PROMPT, 3, config)  # type: ignore[arg-type]
    lengths: list[int] = []
    exact = circuit_law(drafter, SMALL, PROMPT, 3, config, rule, lookup, lengths=lengths)
    assert abs(sum(exact.values()) - 1) < 1e-12
    assert set(lengths) == {1, 2}  # the rule or the copy's cut verified fewer drafts at times
    assert total_variation(exact, target) <= EXACT_TV
    biased = circuit_law(drafter, SMALL, PROMPT, 3, config, rule, lookup, wrong_q=True)
    assert total_variation(biased, target) > BIASED_TV


# =========================================================================== under a constraint
WORDS = {"<eos>": 0, "a": 1, "b": 2, "c": 3, "d": 4}
NO_C = [1, 2, 4]  # the state after ``b`` allows no draftable token (only ``c``: a forced run)


AUTOMATON = TokenAutomaton.build(Regex("(a|bc)*d"), word_tokenizer(WORDS))
WORDY = tiny_llama(vocab=5, scale=3.0, seed=2)
CPROMPT = [1, 2]


CPROMPT_COPY = [3, 1, 2, 3, 1]  # ends in a repeated n-gram whose continuation ``b c`` is allowed


def _wordy_circuit_drafter(vocab: list[int] | None) -> BlockCircuitDrafter:
    block = perturbed_block(WORDY, steps=2, noise=0.3)
    head = block_circuit_head(WORDY, "btree", 3, vocab, token=vocab is not None, seed=4)
    return BlockCircuitDrafter(block, head)


def _wordy_recursive_drafter(vocab: list[int] | None) -> BlockDrafter:
    return BlockDrafter(perturbed_block(WORDY, steps=2, noise=0.3, draft_vocab=vocab))


@pytest.mark.parametrize("vocab", [None, NO_C], ids=["full", "no-c"])
@pytest.mark.parametrize("mode", ["product", "product-lookup", "free"])
def test_circuit_on_the_block_constrained_law_is_exact(mode: str, vocab: list[int] | None
                                                       ) -> None:
    drafter = _wordy_circuit_drafter(vocab)
    drafting = FREE if mode == "free" else PRODUCT
    lookup = LOOKUP if mode.endswith("lookup") else None
    prompt = CPROMPT_COPY if lookup is not None else CPROMPT
    target = constrained_target_law(NextTokenLogits(WORDY), AUTOMATON, prompt, 3,  # type: ignore[arg-type]
                                    SAMPLING)
    exact = circuit_constrained_law(drafter, WORDY, AUTOMATON, prompt, 3, SAMPLING, drafting,
                                    lookup)
    assert abs(sum(exact.values()) - 1) < 1e-12
    assert total_variation(exact, target) <= EXACT_TV
    if mode != "product":  # the negative controls: the mixture's q, the block's output
        biased = circuit_constrained_law(drafter, WORDY, AUTOMATON, prompt, 3, SAMPLING,
                                         drafting, lookup, wrong_q=True)
        assert total_variation(biased, target) > BIASED_TV


@pytest.mark.parametrize("config", [SAMPLING, TOP_K], ids=["temperature", "top_k"])
@pytest.mark.parametrize("vocab", [None, NO_C], ids=["full", "no-c"])
def test_recursive_block_constrained_law_is_exact_and_a_wrong_q_is_detected(
        vocab: list[int] | None, config: SamplingConfig) -> None:
    """``PRODUCT`` (with and without the copy) and ``FREE`` drafting."""
    drafter = _wordy_recursive_drafter(vocab)
    target = constrained_target_law(NextTokenLogits(WORDY), AUTOMATON, CPROMPT, 3,  # type: ignore[arg-type]
                                    config)
    exact = recursive_law(drafter.block, WORDY, CPROMPT, 3, config, automaton=AUTOMATON)
    assert abs(sum(exact.values()) - 1) < 1e-12
    assert total_variation(exact, target) <= EXACT_TV
    free = recursive_law(drafter.block, WORDY, CPROMPT, 3, config, automaton=AUTOMATON,
                         drafting=FREE)
    assert total_variation(free, target) <= EXACT_TV
    if vocab is None:  # without ``c`` and EOS every restriction is all or nothing: no control
        biased = recursive_law(drafter.block, WORDY, CPROMPT, 3, config, automaton=AUTOMATON,
                               wrong_q=True)
        assert total_variation(biased, target) > BIASED_TV
    copy_target = constrained_target_law(NextTokenLogits(WORDY), AUTOMATON,  # type: ignore[arg-type]
                                         CPROMPT_COPY, 3, config)
    for drafting in (PRODUCT, FREE):  # the copy, cut where the product forbids it
        copied = recursive_law(drafter.block, WORDY, CPROMPT_COPY, 3, config,
                               automaton=AUTOMATON, drafting=drafting, lookup=LOOKUP)
        assert abs(sum(copied.values()) - 1) < 1e-12
        assert total_variation(copied, copy_target) <= EXACT_TV
        biased = recursive_law(drafter.block, WORDY, CPROMPT_COPY, 3, config,
                               automaton=AUTOMATON, drafting=drafting, lookup=LOOKUP,
                               wrong_q=True)
        assert total_variation(biased, copy_target) > BIASED_TV


@pytest.mark.parametrize("config", [SAMPLING, TOP_K], ids=["temperature", "top_k"])
@pytest.mark.parametrize("mode", ["fixed-1", "confident", "lookup", "lookup-confident"])
def test_recursive_block_law_with_a_rule_or_the_copy_is_exact(mode: str,
                                                              config: SamplingConfig) -> None:
    block = perturbed_block(SMALL, steps=2, draft_vocab=[0, 2, 3], noise=0.3)
    rule = RECURSIVE_RULES.get(mode.removeprefix("lookup-"))
    lookup = LOOKUP if mode.startswith("lookup") else None
    assert lookup is None or copy_fires(lookup, PROMPT)
    target = target_law(NextTokenLogits(SMALL), PROMPT, 3, config)  # type: ignore[arg-type]
    lengths: list[int] = []
    exact = recursive_law(block, SMALL, PROMPT, 3, config, rule=rule, lookup=lookup,
                          lengths=lengths)
    assert abs(sum(exact.values()) - 1) < 1e-12
    expected = {1} if mode == "fixed-1" else {2} if mode == "lookup" else {1, 2}
    if config is SAMPLING:  # top-k's laws are peaky enough that the rule always verifies both
        assert set(lengths) == expected
    assert set(lengths) <= expected
    assert total_variation(exact, target) <= EXACT_TV
    biased = recursive_law(block, SMALL, PROMPT, 3, config, rule=rule, lookup=lookup,
                           wrong_q=True)
    assert total_variation(biased, target) > BIASED_TV


def test_the_recursive_rounds_q_is_the_restricted_law_each_draft_was_drawn_from() -> None:
    """What :meth:`BlockRoundProgram.constrained_draft` hands to the accept program is, row by
    row, the block's law restricted to the allowed tokens after the drafts before it."""
    drafter = _wordy_recursive_drafter(NO_C)
    program = drafter.round_program(SAMPLING)
    ids = drafter.draft_tokens
    assert ids is not None
    generator = torch.Generator().manual_seed(5)
    seen_short = False
    for sequence, output in (((1, 2), (2,)), ((1, 2, 1, 1), (1, 1)), ((0, 3, 1), (1,)),
                             ((4, 2), (2,))):
        tracker = ConstraintTracker(AUTOMATON)
        tracker.emit(list(output))
        _, hidden = HFBackbone(WORDY).hidden_states(torch.tensor([list(sequence[:-1])]))
        drafter.begin(hidden[:, :-1], torch.tensor(list(sequence[1:-1]), dtype=torch.long))
        result = program.constrained_draft(hidden[:, -1], torch.tensor([sequence[-1]]),
                                           program.draw_uniforms(generator), tracker)
        assert drafter.length == len(sequence) - 1
        fresh = BlockDrafter(drafter.block)
        first, _, _ = fresh_first_step(drafter.block, WORDY, sequence, fresh)
        state, out, length = tracker.state, first, int(result.length)
        assert result.q is not None
        for k in range(length):
            allowed = torch.isin(ids, AUTOMATON.allowed(state))
            with torch.no_grad():
                logits = drafter.block.logits(out)[0].masked_fill(~allowed, float("-inf"))
            want = torch.softmax(warp_logits(logits, SAMPLING).double(), -1)
            torch.testing.assert_close(result.q[k], want, rtol=1e-9, atol=1e-12)
            token = int(result.tokens[k])
            assert token in AUTOMATON.allowed(state).tolist()
            state = AUTOMATON.advance(state, token)
            if k < length - 1:
                with torch.no_grad():
                    out = fresh.next_step(out, torch.tensor([token]))
        # after ``b`` only ``c`` is allowed, outside the draft vocabulary: the recursion stops
        seen_short |= length < drafter.window - 1
        if length < drafter.window - 1:
            assert not bool(torch.isin(ids, AUTOMATON.allowed(state)).any())
    assert seen_short


@pytest.mark.parametrize("mode", ["circuit-product-lookup", "recursive-product",
                                  "recursive-product-lookup", "recursive-confident"])
def test_sampled_generate_follows_the_law(mode: str) -> None:
    """The real ``generate`` against the target law (chi-square)."""
    generator = torch.Generator().manual_seed(0)
    if mode == "recursive-confident":
        block = perturbed_block(SMALL, steps=2, draft_vocab=[0, 2, 3], noise=0.3)
        decoder = SpeculativeDecoder(SMALL, BlockDrafter(block),
                                     draft_length=RECURSIVE_RULES["confident"])
        samples = [tuple(decoder.generate(PROMPT, 2, temperature=1.0, generator=generator,
                                          eos_token_id=()).tokens.tolist()) for _ in range(600)]
        law = target_law(NextTokenLogits(SMALL), PROMPT, 2, SAMPLING)  # type: ignore[arg-type]
        assert law_p_value(*pooled(samples, law)) > 1e-3
        return
    lookup = LOOKUP if mode.endswith("lookup") else None
    drafter = _wordy_circuit_drafter(NO_C) if mode.startswith("circuit") \
        else _wordy_recursive_drafter(NO_C)
    prompt = CPROMPT_COPY if lookup is not None else CPROMPT
    decoder = SpeculativeDecoder(WORDY, drafter, lookup=lookup)
    samples = [tuple(decoder.generate(prompt, 3, temperature=1.0, generator=generator,
                                      eos_token_id=(), constraint=AUTOMATON).tokens.tolist())
               for _ in range(600)]
    law = constrained_target_law(NextTokenLogits(WORDY), AUTOMATON, prompt, 3,  # type: ignore[arg-type]
                                 SAMPLING)
    assert law_p_value(*pooled(samples, law)) > 1e-3


@pytest.mark.parametrize("lookup", [None, LOOKUP], ids=["plain", "copy"])
def test_sampled_steps_cap_sampled_rounds_only_and_keep_the_law(
        lookup: ContextLookup | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``BlockDrafter(sampled_steps=1)`` on a block of 3 steps: greedy rounds still draft 3 (and
    equal ``generate``), sampled rounds draft at most 1 and are, draw for draw, the rounds of a
    1-step drafter on the same block, and the sampled output follows the target law
    (chi-square, 600 decodes); handing the accept test a wrong ``q`` (the drawn law to the fourth
    power, renormalised) is caught (negative control)."""
    block = perturbed_block(SMALL, steps=3, draft_vocab=[0, 2, 3], noise=0.3)
    decoder = SpeculativeDecoder(SMALL, BlockDrafter(block, sampled_steps=1), lookup=lookup)
    greedy = decoder.generate(PROMPT, 8, eos_token_id=())
    assert greedy.tokens.tolist() == _generate(SMALL, PROMPT, 8)
    assert max(r.drafted for r in greedy.rounds) == 3
    law = target_law(NextTokenLogits(SMALL), PROMPT, 2, SAMPLING)  # type: ignore[arg-type]

    def sampled(count: int) -> list[tuple[int, ...]]:
        generator = torch.Generator().manual_seed(4)
        out = []
        for _ in range(count):
            result = decoder.generate(PROMPT, 2, temperature=1.0, generator=generator,
                                      eos_token_id=())
            assert all(r.drafted <= 1 for r in result.rounds)
            out.append(tuple(result.tokens.tolist()))
        return out

    assert law_p_value(*pooled(sampled(600), law)) > 1e-3
    shallow = SpeculativeDecoder(SMALL, BlockDrafter(block, steps=1), lookup=lookup)
    for seed in range(5):  # a sampled round is a round of the 1-step drafter, draw for draw
        outputs = [d.generate(PROMPT, 6, temperature=1.0, eos_token_id=(),
                              generator=torch.Generator().manual_seed(seed)).tokens.tolist()
                   for d in (decoder, shallow)]
        assert outputs[0] == outputs[1]
    draw_step = drafter_module.draw_step

    def wrong_q(*args: Any, **kwargs: Any) -> Any:
        index, token, drawn = draw_step(*args, **kwargs)
        if drawn is not None:
            drawn = drawn ** 4 / (drawn ** 4).sum(-1, keepdim=True)
        return index, token, drawn

    monkeypatch.setattr(drafter_module, "draw_step", wrong_q)
    assert law_p_value(*pooled(sampled(1000), law)) < 1e-3
    for bad in (0, 4, True):
        with pytest.raises(DraftBlockError, match=r"sampled_steps must be an int in 1\.\.3"):
            BlockDrafter(block, sampled_steps=bad)


# --------------------------------------------------------------------------- the decoder
DRAFTERS: dict[str, Callable[[], BlockCircuitDrafter | BlockDrafter]] = {
    "circuit-full": lambda: _wordy_circuit_drafter(None),
    "circuit-no-c": lambda: _wordy_circuit_drafter(NO_C),
    "recursive-full": lambda: _wordy_recursive_drafter(None),
    "recursive-no-c": lambda: _wordy_recursive_drafter(NO_C),
}


@pytest.mark.parametrize("drafting", [PRODUCT, FREE], ids=["product", "free"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_constrained_greedy_equals_constrained_generate_and_the_cache_follows(
        name: str, drafting: ConstrainedDrafting) -> None:
    """Greedy is constrained autoregressive decoding (alone, with a draft-length rule, with the
    copy and the constraint's walk); sampling and greedy both leave the block's cache equal to a
    fresh prefill, the block having run exactly once in every round that drafted (forced runs
    included)."""
    reference = AutoregressiveDecoder(WORDY)
    options: list[dict[str, object]] = [
        {}, {"draft_length": CONFIDENT}, {"lookup": ContextLookup((0.5, 0.9), constraint_weight=0.5)}]
    for option in options:
        drafter = DRAFTERS[name]()
        calls = count_first_steps(drafter)
        decoder = SpeculativeDecoder(WORDY, drafter, constrained_drafting=drafting,
                                     **option)  # type: ignore[arg-type]
        for prompt, temperature in (([1, 2], 0.0), ([3], 0.0), (CPROMPT_COPY, 0.0),
                                    ([1, 2], 1.0), (CPROMPT_COPY, 1.0)):
            calls[0] = 0
            result = decoder.generate(prompt, 12, temperature=temperature, eos_token_id=(),
                                      constraint=AUTOMATON,
                                      generator=torch.Generator().manual_seed(3))
            tokens = result.tokens.tolist()
            state_after(AUTOMATON, tokens)  # every token allowed
            if temperature == 0.0:
                want = reference.generate(prompt, 12, eos_token_id=(), constraint=AUTOMATON)
                assert tokens == want.tokens.tolist(), (option, prompt)
            assert calls[0] == len(result.rounds) - (len(prompt) == 1)
            assert_cache_is_a_fresh_prefill(drafter, WORDY, prompt + tokens, drafter.window)


# --------------------------------------------------------------------------- static and compiled
@pytest.mark.parametrize("backbone", ["static", "compiled"])
@pytest.mark.parametrize("name", ["circuit-no-c", "recursive-full"])
def test_on_a_static_or_compiled_backbone(name: str, backbone: str) -> None:
    """On a static KV cache, eager or compiled (through the CUDA-graph replay double, with the
    round programs compiled too): greedy is ``generate`` (constrained: constrained autoregressive
    decoding) with a draft-length rule, the copy (circuit) and the constraint product, and the
    block's cache equals a fresh prefill after every decode."""
    double = CudaGraphDouble()
    compiled = backbone == "compiled"
    options: list[dict[str, object]] = [{"draft_length": CONFIDENT}, {"lookup": LOOKUP}]
    reference = AutoregressiveDecoder(WORDY)
    for option in options:
        drafter = DRAFTERS[name]()
        drafter.step_mode = BlockStepMode.COMPILED  # on the CPU too (AUTO compiles on a GPU)
        with use_compiler(double):
            model = HFBackbone(WORDY, cache=CacheKind.STATIC, max_cache_len=64, compile=compiled,
                               compiled_lengths=(1, 2, 3) if compiled else None)
            decoder = SpeculativeDecoder(model, drafter, compile=compiled,
                                         **option)  # type: ignore[arg-type]
        for prompt, constraint in (([1, 2], None), (CPROMPT_COPY, None), ([1, 2], AUTOMATON),
                                   (CPROMPT_COPY, AUTOMATON)):
            result = decoder.generate(prompt, 12, eos_token_id=(), constraint=constraint)
            tokens = result.tokens.tolist()
            want = _generate(WORDY, prompt, 12) if constraint is None else \
                reference.generate(prompt, 12, eos_token_id=(), constraint=constraint).tokens.tolist()
            assert tokens == want, (option, prompt, constraint)
            assert_cache_is_a_fresh_prefill(drafter, WORDY, prompt + tokens, drafter.window)
    if compiled:  # the compiled path ran: backbone steps, the block's, the accept and the head's
        kinds = ("accept program", "backbone step", "draft block step") + \
            (("draft program",) if name.startswith("circuit") else ())
        for kind in kinds:
            assert sum(n for key, n in double.calls.items() if key.startswith(kind)) > 0, kind


# --------------------------------------------------------------------------- what refuses
class _PlainDrafter:
    """A ContextDrafter without ``decoding_problem``: the decoder gives it neither a copy nor a
    rule."""

    def __init__(self, drafter: BlockDrafter) -> None:
        self.drafter = drafter
        self.window, self.vocab_size = drafter.window, drafter.vocab_size
        self.hidden_size = drafter.hidden_size

    def begin(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        self.drafter.begin(hidden, tokens)

    def follow(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        self.drafter.follow(hidden, tokens)

    def round_program(self, config: SamplingConfig, *, compile: bool = False,
                      compiler: object | None = None) -> object:
        return self.drafter.round_program(config, compile=compile)


def test_what_still_refuses_says_what_was_wrong() -> None:
    """Nothing of the modes refuses a draft block any more; what refuses is a bad rule, a copy
    component without a lookup (or none with one), and a copy or rule given to a context drafter
    that says nothing about them (no ``decoding_problem``), which decodes as before otherwise."""
    drafter = BlockDrafter(perturbed_block(MODEL))
    with pytest.raises(DraftBlockError, match=r"DraftLength.fixed\(4\) asks for more drafts"):
        drafter.round_program(SAMPLING, draft_length=DraftLength.fixed(4))
    with pytest.raises(DecoderError, match=r"DraftLength.fixed\(4\) asks for more drafts"):
        SpeculativeDecoder(MODEL, drafter, draft_length=DraftLength.fixed(4))
    with pytest.raises(DraftBlockError, match="lookup must be None or a ContextLookup"):
        drafter.round_program(SAMPLING, lookup=(0.5,))  # type: ignore[arg-type]
    program = drafter.round_program(SamplingConfig(0.0))
    _, hidden = HFBackbone(MODEL).hidden_states(torch.tensor([[1, 5, 7]]))
    drafter.begin(hidden[:, :-1], torch.tensor([5, 7], dtype=torch.long))
    with pytest.raises(DraftBlockError, match="drafts with a copy component, and only then"):
        program.draft(hidden[:, -1], torch.tensor([9]), None,
                      torch.zeros(drafter.window + 1, dtype=torch.float64))
    assert drafter.length == 0  # refused before the block ran
    with pytest.raises(DecoderError, match=r"_PlainDrafter: it takes neither lookup nor a "
                                           r"draft_length rule"):
        SpeculativeDecoder(MODEL, _PlainDrafter(drafter), draft_length=CONFIDENT)
    with pytest.raises(DecoderError, match=r"_PlainDrafter: it takes neither lookup"):
        SpeculativeDecoder(MODEL, _PlainDrafter(drafter), lookup=LOOKUP)
    # without decoding_problem it decodes as before: all drafts, free under a constraint
    plain = SpeculativeDecoder(WORDY, _PlainDrafter(_wordy_recursive_drafter(None)))
    reference = AutoregressiveDecoder(WORDY)
    got = plain.generate([1, 2], 8, eos_token_id=(), constraint=AUTOMATON)
    want = reference.generate([1, 2], 8, eos_token_id=(), constraint=AUTOMATON)
    assert got.tokens.tolist() == want.tokens.tolist()
