"""Constrained decoding keeps the constrained model's law exactly, whatever the head drafts.

The target is the model's logits masked by the constraint's token automaton (then warped): the
law :class:`AutoregressiveDecoder` samples from with ``constraint=``, enumerated here
(:func:`toy.constrained_target_law`). On a five-token toy vocabulary (``<eos> a b c d``, the
regex ``(a|bc)*d``) the tests check

* the exact law of the speculative decoder, enumerated over every draft (``PRODUCT``: the tree of
  the circuit-times-automaton conditionals the drafter draws from, with its free rows, sink and
  ``L``; ``FREE``: the head's own conditionals) and every accept/reject outcome on the masked
  rows (:func:`toy.constrained_decoder_law`), equals the constrained AR law, for ff, hmm and
  btree heads, greedy, sampling and top-k, with full and compressed draft vocabularies (one that
  leaves a state with no draftable token: the free row; one that makes a state unreachable by
  drafts: autoregressive rounds);
* greedy decoding is token-identical to constrained AR decoding, eager and compiled (the
  CUDA-graph double and ``torch.compile`` with the ``aot_eager`` backend);
* sampling end to end: chi-square of many ``generate`` calls against the enumerated law, with a
  negative control (the biased ``DROP_AFTER_ACCEPT`` policy) that the same test rejects; the
  compiled decoder draws what the eager one draws from the same generator;
* every output is accepted by the automaton (and ends in EOS when it stopped early);
* errors (missing tokenizer, bad constraint, vocabulary mismatch, a regex the tokenizer cannot
  complete) and ``RoundStats.constraint_s``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from cuda_graph_double import CudaGraphDouble
from toy import (
    Law,
    ToyHead,
    ToyLM,
    law_p_value,
    target_law,
    total_variation,
)
from toy_constrained import (
    _product_drafts,
    constrained_decoder_law,
    constrained_target_law,
    drafted_rows,
)

from circuits_llm.constraints import ConstraintError, Regex, TokenAutomaton
from circuits_llm.decoding.acceptance import CorrectionPolicy, SampledAccept
from circuits_llm.decoding.constrained import ConstrainedDrafting, ProductDrafter
from circuits_llm.decoding.decoder import AutoregressiveDecoder, DecoderError, SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.metrics import RoundKind
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.runtime.compiling import Compilation, use_compiler

#: compiled rounds as a GPU runs them: the sampled accept over the whole window, as one program
WHOLE_WINDOW = SampledAccept.WHOLE_WINDOW
V = 5
EOS = 0
WORDS = {"<eos>": 0, "a": 1, "b": 2, "c": 3, "d": 4}
REGEX = Regex("(a|bc)*d")
RANKS = {"ff": 1, "hmm": 2, "btree": 2}
PRODUCT, FREE = ConstrainedDrafting.PRODUCT, ConstrainedDrafting.FREE
SAMPLING, GREEDY, TOP_K = SamplingConfig(1.0), SamplingConfig(0.0), SamplingConfig(1.0, top_k=2)
CONFIGS = {"sampling": SAMPLING, "greedy": GREEDY, "top_k": TOP_K}
#: compressed draft vocabularies: without EOS and ``c`` (the state after ``b`` and the one after
#: ``d`` allow no draftable token: free rows), and without ``b`` (the state after ``b`` is never
#: reached by a draft: those rounds are autoregressive)
NO_C, NO_B = (1, 2, 4), (0, 1, 3, 4)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.WordLevel(vocab=WORDS, unk_token="<eos>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


TOKENIZER = _tokenizer()
AUTOMATON = TokenAutomaton.build(REGEX, TOKENIZER)


def lm() -> ToyLM:
    return ToyLM(vocab_size=V, hidden_size=6, seed=1, draft_branch=True)


def head(architecture: str, draft_tokens: Sequence[int] | None = None, seed: int = 2,
         scale: float = 1.0) -> ToyHead:
    return ToyHead(architecture, 3, RANKS[architecture], 6, V, seed=seed, scale=scale,
                   draft_tokens=draft_tokens)


def state_after(tokens: Sequence[int]) -> int:
    state = AUTOMATON.initial_state
    for token in tokens:
        state = AUTOMATON.advance(state, token)
    return state


def assert_valid(tokens: Sequence[int], max_new_tokens: int) -> None:
    """Every token allowed after the ones before it; EOS only last; a shorter output ends in EOS
    (the automaton's DONE state)."""
    state = state_after(tokens)  # raises ConstraintError on a token the automaton forbids
    assert EOS not in tokens[:-1], tokens
    if len(tokens) < max_new_tokens:
        assert tokens and tokens[-1] == EOS and state == AUTOMATON.done_state, tokens


def pooled(samples: list[tuple[int, ...]], law: Law, minimum: float = 5.0
           ) -> tuple[list[tuple[int, ...]], Law]:
    """``samples`` and ``law`` with the cells whose expected count is below ``minimum`` merged
    into one (what the chi-square approximation needs); samples outside the law fail."""
    assert set(samples) <= set(law), "a sample outside the constrained law's support"
    n = len(samples)
    small = {k for k, p in law.items() if n * p < minimum}
    rest = (-1,)
    merged: Law = {k: p for k, p in law.items() if k not in small}
    if small:
        merged[rest] = sum(law[k] for k in small)
    return [rest if s in small else s for s in samples], merged


def aot_eager(fn: Any, *, name: str, device: torch.device) -> Compilation:
    """``torch.compile`` as the decoder's default compiler calls it, on the cheap CPU backend."""
    del name, device
    return Compilation(torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager"),
                       static_outputs=False)


# ---------------------------------------------------------------------- the toy is non-trivial
def test_the_constrained_law_differs_from_the_model_and_stops_at_eos() -> None:
    model = lm()
    constrained = constrained_target_law(model, AUTOMATON, [1, 2], 4, SAMPLING)
    assert abs(sum(constrained.values()) - 1) < 1e-12
    assert all(state_after(k) is not None for k in constrained)
    stopped = sum(p for k, p in constrained.items() if k and k[-1] == EOS)
    assert 0.05 < stopped < 0.95 and {(4, 0), (1, 4, 0)} <= set(constrained)
    assert total_variation(constrained, target_law(model, [1, 2], 4, SAMPLING)) > 0.3
    # the mask comes before the warping: top-k of the masked logits, not the mask of the top-k
    top = constrained_target_law(model, AUTOMATON, [1, 2], 4, TOP_K)
    assert set(top) <= set(constrained) and len(top) < len(constrained)


# ---------------------------------------------------------------------- enumerated exactness
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("drafting", [PRODUCT, FREE], ids=["product", "free"])
@pytest.mark.parametrize("architecture", list(RANKS))
def test_enumerated_speculative_law_is_the_constrained_law(architecture: str,
                                                           drafting: ConstrainedDrafting,
                                                           config: str) -> None:
    model, draft = lm(), head(architecture)
    cfg = CONFIGS[config]
    for prompt, length in (([1, 2], 4), ([3], 5)):  # [3]: the first round is autoregressive
        want = constrained_target_law(model, AUTOMATON, prompt, length, cfg)
        got = constrained_decoder_law(model, draft, AUTOMATON, prompt, length, cfg, drafting)
        assert abs(sum(got.values()) - 1) < 1e-12
        assert total_variation(got, want) < 1e-9, (prompt, total_variation(got, want))


@pytest.mark.parametrize("config", ["sampling", "greedy"])
@pytest.mark.parametrize("drafting", [PRODUCT, FREE], ids=["product", "free"])
@pytest.mark.parametrize(("architecture", "draft_tokens"),
                         [("btree", NO_C), ("hmm", NO_C), ("btree", NO_B), ("ff", NO_B)])
def test_compressed_draft_vocabulary_keeps_the_constrained_law(
        architecture: str, draft_tokens: tuple[int, ...], drafting: ConstrainedDrafting,
        config: str) -> None:
    model, draft = lm(), head(architecture, draft_tokens)
    cfg = CONFIGS[config]
    want = constrained_target_law(model, AUTOMATON, [1, 2], 5, cfg)
    got = constrained_decoder_law(model, draft, AUTOMATON, [1, 2], 5, cfg, drafting)
    assert total_variation(got, want) < 1e-9, total_variation(got, want)


def test_product_drafter_free_rows_and_states_outside_the_draft() -> None:
    """The compressed vocabularies exercise what they are meant to: without ``c`` the state
    after ``b`` (and the final state, without EOS) lead every category to the free sink; without
    ``b`` the state after ``b`` is never drafted into, yet a round that starts there (after the
    verifier emitted ``b``) drafts its forced ``c``."""
    after_b, after_d = state_after([2]), state_after([4])
    no_c = ProductDrafter(head("btree", NO_C), AUTOMATON)
    for state in (after_b, after_d):
        assert (no_c.table.next_state[no_c.local[state]] == no_c.sink).all()
    assert not (no_c.table.next_state[no_c.local[AUTOMATON.initial_state]] == no_c.sink).any()
    no_b = ProductDrafter(head("btree", NO_B), AUTOMATON)
    row = no_b.table.next_state[no_b.local[after_b]]
    assert (row != no_b.sink).any() and set(AUTOMATON.allowed(after_b).tolist()) == {3}
    draft, _ = no_b.draft(None, 1, after_b, None)
    assert draft.tokens[0] == 3 and int(draft.length) >= 1


@pytest.mark.parametrize("draft_tokens", [None, NO_C, NO_B], ids=["full", "no-c", "no-b"])
@pytest.mark.parametrize("architecture", list(RANKS))
def test_product_drafts_satisfy_the_constraint(architecture: str,
                                               draft_tokens: tuple[int, ...] | None) -> None:
    """Every draft the product can make verifies only allowed tokens (``d_1..d_L``), its
    probabilities sum to 1, and ``L`` stops exactly where a draft would need a token outside
    the draft vocabulary; greedy drafts are the argmax path of the same conditionals."""
    model, draft = lm(), head(architecture, draft_tokens)
    drafter = ProductDrafter(draft, AUTOMATON)
    inside = set(drafter.draft_tokens.tolist())
    for output in ([], [1], [2], [1, 2], [4]):
        state = state_after(output)
        model.reset()
        hidden = model.extend(torch.tensor([[1, 2, *output]])).draft_hidden[:, -1]
        with torch.no_grad():
            params = draft.circuit.log_parameters(draft(hidden))
        for c in (1, 2, 3, 4, 0):
            leaves = _product_drafts(drafter, params, c, state, greedy=False)
            assert abs(sum(w for *_, w in leaves) - 1) < 1e-12
            if state not in drafter.local:  # no draft: an AR round
                assert [leaf[2] for leaf in leaves] == [0]
                continue
            # c outside the draft vocabulary drafts too (after a stand-in for X_0)
            for tokens, _, verified, weight in leaves:
                assert weight > 0
                walk = state
                for token in tokens[:verified].tolist():
                    walk = AUTOMATON.advance(walk, token)  # raises on a forbidden draft
                if verified < draft.window - 1:  # the next state has no draftable token
                    allowed = set(AUTOMATON.allowed(walk).tolist())
                    assert not allowed & inside, (output, c, tokens, verified)
            greedy, = _product_drafts(drafter, params, c, state, greedy=True)
            assert greedy[2] in {leaf[2] for leaf in leaves}


def test_product_stand_in_draws_follow_the_enumerated_law() -> None:
    """After a ``c`` outside the draft vocabulary the product draws ``X_0`` first (a stand-in)
    and drafts given it. On 4,000 sampled drafts of :meth:`ProductDrafter.draft`, the stand-in
    is read back from the returned ``q`` (each equals, exactly, the enumerated ``q`` of one
    stand-in; leaves are told apart by their first conditional, which depends on the stand-in)
    and the pairs (stand-in, drafts) follow the law :func:`_product_drafts` enumerates, which
    weighs every stand-in by the product's marginal; the same test rejects the pairs read as one
    stand-in (a ``q`` that ignores the stand-in drawn)."""
    model, draft = lm(), head("btree", NO_C)
    drafter = ProductDrafter(draft, AUTOMATON)
    state = state_after([])
    model.reset()
    hidden = model.extend(torch.tensor([[1, 2]])).draft_hidden[:, -1]
    c = 0  # outside NO_C
    assert int(drafter.position[c]) < 0 and state in drafter.local
    with torch.no_grad():
        params = draft.circuit.log_parameters(draft(hidden))
    leaves = _product_drafts(drafter, params, c, state, greedy=False)
    assert abs(sum(w for *_, w in leaves) - 1) < 1e-12
    groups: dict[tuple[float, ...], int] = {}
    law: dict[tuple[int, ...], float] = Counter()
    for tokens, q, _, weight in leaves:
        group = groups.setdefault(tuple(q[0].tolist()), len(groups))
        law[(group, *tokens.tolist())] += weight
    assert len(groups) == len(NO_C)  # one first conditional per stand-in
    generator = torch.Generator().manual_seed(3)
    pairs, ignored = [], []
    for _ in range(4000):
        uniforms = torch.rand(drafter.window, generator=generator, dtype=torch.float64)
        result, _ = drafter.draft(params, c, state, uniforms[:-1], None, None, float(uniforms[-1]))
        tokens = tuple(result.tokens.tolist())
        rows = drafted_rows(drafter, result)
        matches = [groups[tuple(q[0].tolist())] for t, q, _, _ in leaves
                   if tuple(t.tolist()) == tokens and torch.allclose(rows, q, rtol=0, atol=1e-12)]
        assert len(matches) == 1, matches
        pairs.append((matches[0], *tokens))
        ignored.append((0, *tokens))
    assert law_p_value(*pooled(pairs, dict(law))) > 1e-3
    assert law_p_value(*pooled(ignored, dict(law))) < 1e-3


# ---------------------------------------------------------------------- greedy = constrained AR
PROMPTS = ([1, 2], [3], [4, 1, 0], [2, 2, 3])


def _greedy_matches_ar(decoder: SpeculativeDecoder, reference: AutoregressiveDecoder) -> int:
    """Both decoders with ``eos_token_id=()``: the automaton's EOS still ends decoding."""
    speculative, stopped = 0, 0
    for prompt in PROMPTS:
        for limit in (3, 12):
            want = reference.generate(prompt, limit, constraint=AUTOMATON, eos_token_id=())
            got = decoder.generate(prompt, limit, constraint=AUTOMATON, eos_token_id=())
            assert got.tokens.tolist() == want.tokens.tolist(), (prompt, limit)
            assert_valid(got.tokens.tolist(), limit)
            speculative += sum(r.accepted for r in got.rounds)
            stopped += len(got.tokens) < limit
            length = len(prompt) + len(got.tokens) - 1
            assert decoder.backbone.length == length
    assert stopped > 0  # some outputs ended at the automaton's EOS
    return speculative


@pytest.mark.parametrize("draft_tokens", [None, NO_C, NO_B], ids=["full", "no-c", "no-b"])
@pytest.mark.parametrize("drafting", [PRODUCT, FREE], ids=["product", "free"])
@pytest.mark.parametrize("architecture", list(RANKS))
def test_greedy_is_constrained_autoregressive(architecture: str, drafting: ConstrainedDrafting,
                                              draft_tokens: tuple[int, ...] | None) -> None:
    reference = AutoregressiveDecoder(lm())
    accepted = 0
    for seed in (2, 7):
        decoder = SpeculativeDecoder(lm(), head(architecture, draft_tokens, seed=seed, scale=3.0),
                                     constrained_drafting=drafting)
        accepted += _greedy_matches_ar(decoder, reference)
    assert accepted > 0  # some drafts were accepted: not a string of AR rounds


@pytest.mark.parametrize("compiler", ["graph-double", "aot_eager"])
@pytest.mark.parametrize("drafting", [PRODUCT, FREE], ids=["product", "free"])
def test_compiled_greedy_is_constrained_autoregressive(drafting: ConstrainedDrafting,
                                                       compiler: str) -> None:
    reference = AutoregressiveDecoder(lm())
    double = CudaGraphDouble()
    with use_compiler(double if compiler == "graph-double" else aot_eager):
        decoder = SpeculativeDecoder(lm(), head("btree", NO_C, scale=3.0), compile=True,
                                     sampled_accept=WHOLE_WINDOW,
                                     constrained_drafting=drafting)
    assert _greedy_matches_ar(decoder, reference) > 0
    programs = list(decoder._programs.values())
    assert programs and all(not p._accept.fallbacks for p in programs)  # type: ignore[union-attr]
    if compiler == "graph-double":
        assert double.calls and all(n > 0 for n in double.calls.values())


# ---------------------------------------------------------------------- sampling end to end
SAMPLES = 1500


def _samples(decoder: AutoregressiveDecoder, prompt: list[int], length: int,
             config: SamplingConfig, seed: int, count: int = SAMPLES) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = decoder.generate(prompt, length, config.temperature, top_k=config.top_k,
                                  generator=generator, constraint=AUTOMATON).tokens.tolist()
        assert_valid(tokens, length)
        out.append(tuple(tokens))
    return out


@pytest.mark.parametrize(("architecture", "draft_tokens", "drafting", "config", "count"), [
    ("ff", None, PRODUCT, "sampling", SAMPLES),
    ("btree", NO_C, PRODUCT, "top_k", SAMPLES),
    ("hmm", None, FREE, "sampling", 800),
], ids=["ff-product", "btree-no-c-product-top-k", "hmm-free"])
def test_sampling_matches_the_constrained_law(architecture: str,
                                              draft_tokens: tuple[int, ...] | None,
                                              drafting: ConstrainedDrafting, config: str,
                                              count: int) -> None:
    cfg = CONFIGS[config]
    decoder = SpeculativeDecoder(lm(), head(architecture, draft_tokens, scale=3.0),
                                 constrained_drafting=drafting)
    samples = _samples(decoder, [1, 2], 4, cfg, seed=11, count=count)
    law = constrained_target_law(lm(), AUTOMATON, [1, 2], 4, cfg)
    assert law_p_value(*pooled(samples, law)) > 1e-3


@pytest.mark.parametrize("architecture", ["btree", "hmm"])
def test_a_draft_length_rule_applies_to_product_drafts(architecture: str) -> None:
    """DraftLength.confident reads the product's own conditionals: greedy output is still
    constrained AR's, sampling still follows the constrained law, and rounds verify fewer
    drafts than the window holds."""
    rule = DraftLength.confident(0.95)
    reference = AutoregressiveDecoder(lm())
    decoder = SpeculativeDecoder(lm(), head(architecture, None, seed=2, scale=3.0),
                                 constrained_drafting=PRODUCT, draft_length=rule)
    _greedy_matches_ar(decoder, reference)
    rounds = [r for prompt in PROMPTS for r in decoder.generate(
        prompt, 12, constraint=AUTOMATON, eos_token_id=()).rounds if r.drafted > 0]
    assert any(r.drafted < decoder.head.window - 1 for r in rounds)
    samples = _samples(decoder, [1, 2], 4, SAMPLING, seed=5, count=1000)
    law = constrained_target_law(lm(), AUTOMATON, [1, 2], 4, SAMPLING)
    assert law_p_value(*pooled(samples, law)) > 1e-3


def test_negative_control_the_same_test_rejects_a_biased_decoder() -> None:
    """``DROP_AFTER_ACCEPT`` under PRODUCT drafting: the enumerator predicts its (biased) law,
    the samples match that law, and the chi-square test above rejects them against the target."""
    draft = head("ff", scale=3.0)
    want = constrained_target_law(lm(), AUTOMATON, [1, 2], 4, SAMPLING)
    biased = constrained_decoder_law(lm(), draft, AUTOMATON, [1, 2], 4, SAMPLING, PRODUCT,
                                     CorrectionPolicy.DROP_AFTER_ACCEPT)
    assert total_variation(biased, want) > 0.1
    decoder = SpeculativeDecoder(lm(), draft, policy=CorrectionPolicy.DROP_AFTER_ACCEPT)
    samples = _samples(decoder, [1, 2], 4, SAMPLING, seed=12)
    assert law_p_value(*pooled(samples, biased)) > 1e-3
    assert law_p_value(*pooled(samples, want)) < 1e-6


@pytest.mark.parametrize("drafting", [PRODUCT, FREE], ids=["product", "free"])
def test_compiled_sampling_draws_what_eager_draws(drafting: ConstrainedDrafting) -> None:
    """Same generator, same tokens and rounds: the compiled law is the eager law (shown exact
    above). Through the CUDA-graph double: a compiled output read late would be poisoned."""
    draft = head("btree", NO_C, scale=3.0)
    eager = SpeculativeDecoder(lm(), draft, constrained_drafting=drafting)
    double = CudaGraphDouble()
    with use_compiler(double):
        compiled = SpeculativeDecoder(lm(), draft, compile=True,
                                      sampled_accept=WHOLE_WINDOW, constrained_drafting=drafting)
    for seed in range(4):
        for config in (SAMPLING, TOP_K):
            runs = [d.generate([1, 2], 10, config.temperature, top_k=config.top_k,
                               generator=torch.Generator().manual_seed(seed), constraint=AUTOMATON)
                    for d in (eager, compiled)]
            assert runs[0].tokens.tolist() == runs[1].tokens.tolist()
            assert [(r.drafted, r.accepted) for r in runs[0].rounds] == \
                [(r.drafted, r.accepted) for r in runs[1].rounds]
            assert_valid(runs[1].tokens.tolist(), 10)
    assert double.calls


def test_product_rounds_verify_fewer_drafts_at_a_free_row() -> None:
    """With the draft vocabulary without ``c``, a round drafting ``b`` verifies only up to it
    (the free part is not verified), and every round is speculative or an AR step."""
    decoder = SpeculativeDecoder(lm(), head("btree", NO_C, scale=3.0))
    generator = torch.Generator().manual_seed(3)
    drafted = Counter()
    for _ in range(60):
        result = decoder.generate([1, 2], 8, 1.0, generator=generator, constraint=AUTOMATON)
        assert_valid(result.tokens.tolist(), 8)
        drafted.update(r.drafted for r in result.rounds if r.kind is RoundKind.SPECULATIVE)
    assert drafted[2] > 0 and (drafted[1] + drafted[0]) > 0, drafted


# ---------------------------------------------------------------------- errors
def test_a_regex_needs_the_tokenizer() -> None:
    for decoder in (AutoregressiveDecoder(lm()), SpeculativeDecoder(lm(), head("btree"))):
        with pytest.raises(DecoderError, match="tokenizer"):
            decoder.generate([1, 2], 4, constraint=REGEX)
        # with it: the automaton built with the tokenizer's EOS, the same output
        built = decoder.generate([1, 2], 8, constraint=REGEX, tokenizer=TOKENIZER)
        assert built.tokens.tolist() == decoder.generate([1, 2], 8, constraint=AUTOMATON).tokens.tolist()
        assert_valid(built.tokens.tolist(), 8)


@pytest.mark.parametrize("bad", ["(a|bc)*d", 3, object()], ids=["string", "int", "object"])
def test_a_bad_constraint_type_is_refused(bad: object) -> None:
    for decoder in (AutoregressiveDecoder(lm()), SpeculativeDecoder(lm(), head("btree"))):
        with pytest.raises(DecoderError, match="constraint must be"):
            decoder.generate([1, 2], 4, constraint=bad, tokenizer=TOKENIZER)


def test_an_automaton_over_another_vocabulary_is_refused() -> None:
    wide = TokenAutomaton.build(REGEX, TOKENIZER, vocab_size=V + 2)
    for decoder in (AutoregressiveDecoder(lm()), SpeculativeDecoder(lm(), head("btree"))):
        with pytest.raises(DecoderError, match=f"covers {V + 2} token ids but the model has {V}"):
            decoder.generate([1, 2], 4, constraint=wide)


@pytest.mark.parametrize("regex", ["ae", "a(x|y)d"])
def test_a_regex_the_tokenizer_cannot_complete_is_refused(regex: str) -> None:
    with pytest.raises(ConstraintError, match="cannot be completed"):
        TokenAutomaton.build(Regex(regex), TOKENIZER)
    for decoder in (AutoregressiveDecoder(lm()), SpeculativeDecoder(lm(), head("btree"))):
        with pytest.raises(DecoderError, match="cannot be completed") as caught:
            decoder.generate([1, 2], 4, constraint=Regex(regex), tokenizer=TOKENIZER)
        assert isinstance(caught.value.__cause__, ConstraintError)


# ---------------------------------------------------------------------- statistics
@pytest.mark.parametrize("kind", ["ar", "product", "free"])
def test_constraint_time_is_counted_only_on_constrained_runs(kind: str) -> None:
    decoder = AutoregressiveDecoder(lm()) if kind == "ar" else SpeculativeDecoder(
        lm(), head("btree"), constrained_drafting=PRODUCT if kind == "product" else FREE)
    for config in (GREEDY, SAMPLING):
        generator = torch.Generator().manual_seed(0)
        free = decoder.generate([1, 2], 6, config.temperature, generator=generator)
        assert free.rounds and all(r.constraint_s == 0.0 for r in free.rounds)
        bound = decoder.generate([1, 2], 6, config.temperature, generator=generator,
                                 constraint=AUTOMATON)
        assert bound.rounds and all(r.constraint_s > 0 for r in bound.rounds)
        assert all(r.constraint_s <= r.total_s for r in bound.rounds)
