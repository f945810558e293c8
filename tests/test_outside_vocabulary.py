"""Proposals that carry tokens outside the head's draft vocabulary under the head x constraint
product (:class:`~circuits_llm.decoding.lookup.SequentialCopy`, ``ContextLookup.outside_vocabulary``).

* :func:`~circuits_llm.decoding.acceptance.round_decisions` with an extra column of ``q`` against
  :func:`~circuits_llm.decoding.acceptance.round_law` on the same rows over the whole vocabulary
  (hypothesis: ids outside the draft vocabulary and inside it, every uniform);
* the drafter's sampled drafts (with and without a stand-in for ``c``, at a state with no
  draftable token and at one with some) follow the law the enumerator assigns them, with a
  negative control (the law of another copy weight); greedy drafts copy to the proposal's end;
* exact output laws by enumeration on the toy LM (FF, HMM, BTree; greedy, sampling, top-k; the
  copy and the constraint's walk), with proposals checked to leave the vocabulary; two negative
  controls: the product's own ``q``, and the mixture's row where the drafter has no draftable
  token (instead of the point mass at the proposal's token);
* real decodes: greedy output is constrained AR's, eager and compiled, and a chi-square test of
  sampled output against the enumerated law, with the outside path checked to run;
* ``outside_vocabulary`` off cuts the proposal as before; a bad value is refused.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_constraint_path import (
    AUTOMATON,
    LM_SEED,
    WALK_ONLY,
    WORDS,
    assert_greedy_is_constrained_autoregressive,
)
from toy import ToyHead, ToyLM, law_p_value, total_variation
from toy_constrained import (
    _product_drafts,
    constrained_decoder_law,
    constrained_target_law,
    drafted_rows,
)

from circuits_llm.decoding import lookup as lookup_module
from circuits_llm.decoding.acceptance import round_decisions, round_law
from circuits_llm.decoding.constrained import ConstrainedDrafting, ProductDrafter
from circuits_llm.decoding.decoder import DecoderError, SpeculativeDecoder
from circuits_llm.decoding.lookup import (
    ContextLookup,
    SequentialCopy,
    outside_entry,
    proposal_component,
)
from circuits_llm.decoding.warping import SamplingConfig

EXACT_TV = 1e-9
PRODUCT = ConstrainedDrafting.PRODUCT
VOCAB = len(WORDS)
#: without ``a`` and ``ab``: the automaton's start allows neither (no draftable token there)
NO_A = (0, 3, 4, 5)
#: without ``ab``: after ``ab ``, ``c`` stays draftable
NO_AB = (0, 1, 3, 4, 5)
COPY_AND_WALK = ContextLookup((0.4, 0.7), constraint_weight=0.5)
CONFIGS = {"sampling": SamplingConfig(1.0), "greedy": SamplingConfig(0.0),
           "top_k": SamplingConfig(1.0, top_k=2)}
CPU = torch.device("cpu")


# ---------------------------------------------------------------------- the accept decisions
@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), length=st.integers(0, 3))
def test_round_decisions_with_an_extra_column_match_the_round_law(seed: int, length: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    vocab, drafts = 7, 3
    draft_tokens = torch.tensor([1, 4, 5])
    position = torch.full((vocab,), -1, dtype=torch.long)
    position[draft_tokens] = torch.arange(3)
    p = torch.rand(drafts + 1, vocab, generator=generator, dtype=torch.float64) ** 3
    p[:, 0] = 0.0  # one id the target never emits
    p = p / p.sum(-1, keepdim=True)
    # per row: an extra id outside the draft vocabulary, or inside it (its own column then 0)
    extra = torch.tensor([[0, 2, 3, 6, 1, 4][int(i)] for i in
                          torch.randint(6, (drafts,), generator=generator)])
    q = torch.rand(drafts, 4, generator=generator, dtype=torch.float64)
    q[torch.rand(drafts, generator=generator) < 0.3, :3] = 0.0  # rows that are the extra id alone
    inside = position[extra] >= 0
    q[inside, position[extra].clamp(min=0)[inside]] = 0.0
    q = q / q.sum(-1, keepdim=True)
    full = torch.zeros(drafts, vocab, dtype=torch.float64)
    full[:, draft_tokens] = q[:, :3]
    full[torch.arange(drafts), extra] += q[:, 3]
    tokens = torch.multinomial(full, 1, generator=generator)[:, 0]
    tests = torch.rand(drafts, generator=generator, dtype=torch.float64)
    law = round_law(p[:length + 1], full[:length], tokens[:length])
    accepted, row = round_decisions(p, q, tokens, tests, length, position, draft_tokens, extra)
    want = int(torch.cumprod((tests[:length] < law.accept).long(), 0).sum())
    assert int(accepted) == want
    torch.testing.assert_close(row, law.fallback[want], rtol=0, atol=1e-12)


# ---------------------------------------------------------------------- the drafter's draws
def _drafter_case(draft_tokens: tuple[int, ...], output: list[int], seed: int = 4
                  ) -> tuple[ProductDrafter, Any, int]:
    lm = ToyLM(VOCAB, seed=LM_SEED, draft_branch=True)
    head = ToyHead("btree", 4, 2, 6, VOCAB, seed=seed, draft_tokens=draft_tokens)
    drafter = ProductDrafter(head, AUTOMATON)
    state = AUTOMATON.initial_state
    for token in output:
        state = AUTOMATON.advance(state, token)
    hidden = lm.extend(torch.tensor([[1, 2, 4, *output]])).draft_hidden[:, -1]
    with torch.no_grad():
        params = head.circuit.log_parameters(head(hidden))
    return drafter, params, state


def _component(drafter: ProductDrafter, proposal: list[int], weight: float) -> torch.Tensor:
    return proposal_component(proposal, weight, drafter.position.tolist(), drafter.window - 1, CPU,
                              beyond=True)


#: (case, draft vocabulary, output before the round, c, proposal): at the start no draft is
#: possible (neither ``a`` nor ``ab`` is draftable); after ``ab `` ``c`` is; after ``ab`` the
#: known token ``c`` is itself outside the vocabulary (a stand-in is drawn first)
CASES = [("no-draftable-token", NO_A, [], 4, [2, 4, 2]),
         ("draftable-beside", NO_A, [2, 4], 4, [2, 4, 5]),
         ("stand-in", NO_AB, [2], 2, [4, 2, 5])]


@pytest.mark.parametrize(("draft_tokens", "output", "c", "proposal"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_sampled_drafts_follow_the_enumerated_law(draft_tokens: tuple[int, ...], output: list[int],
                                                  c: int, proposal: list[int]) -> None:
    """4,000 draws of :meth:`ProductDrafter.draft` against :func:`_product_drafts`' law of
    (tokens, conditionals) leaves; the law of a copy weighted 0.3 instead of 0.6 is rejected."""
    drafter, params, state = _drafter_case(draft_tokens, output)
    component = _component(drafter, proposal, 0.6)
    assert (component[:-2] < 0).any()
    leaves = _product_drafts(drafter, params, c, state, False, component)
    assert abs(sum(w for *_, w in leaves) - 1) < 1e-12
    outside = [k for k, (tokens, _, verified, _) in enumerate(leaves)
               if verified == len(proposal) and tokens[:verified].tolist() == proposal]
    assert outside  # some draft follows the proposal out of the draft vocabulary
    other = _product_drafts(drafter, params, c, state, False, _component(drafter, proposal, 0.3))
    law = {(k,): w for k, (*_, w) in enumerate(leaves)}
    other_law = {(k,): w for k, (*_, w) in enumerate(other)}
    generator = torch.Generator().manual_seed(7)
    samples, seen = [], Counter()
    for _ in range(4000):
        uniforms = torch.rand(drafter.window, generator=generator, dtype=torch.float64)
        result, _ = drafter.draft(params, c, state, uniforms[:-1], None, component,
                                  float(uniforms[-1]))
        rows, tokens = drafted_rows(drafter, result), result.tokens.tolist()
        verified = int(result.length)
        matches = [k for k, (t, q, length, _) in enumerate(leaves)
                   if length == verified and t[:verified].tolist() == tokens[:verified]
                   and torch.allclose(rows[:verified], q[:verified], rtol=0, atol=1e-12)]
        assert len(matches) >= 1, (tokens, verified)
        samples.append((matches[0],))
        seen[matches[0] in outside] += 1
    assert seen[True] > 100
    # leaves that tie on everything the round reads are one cell
    merged: dict[tuple[int, ...], float] = Counter()
    merged_other: dict[tuple[int, ...], float] = Counter()
    for (k,), w in law.items():
        first = next(j for j, (t, q, length, _) in enumerate(leaves)
                     if length == leaves[k][2] and torch.equal(t[:length], leaves[k][0][:length])
                     and torch.allclose(q[:length], leaves[k][1][:length], rtol=0, atol=1e-12))
        merged[(first,)] += w
        merged_other[(first,)] += other_law[(k,)] if k < len(other) else 0.0
    assert law_p_value(samples, dict(merged)) > 1e-3
    assert law_p_value(samples, dict(merged_other)) < 1e-3


def test_greedy_drafts_copy_to_the_proposals_end() -> None:
    drafter, params, state = _drafter_case(NO_A, [2, 4])
    result, _ = drafter.draft(params, 4, state, None, None, _component(drafter, [2, 4, 5], 0.9))
    assert result.tokens.tolist() == [2, 4, 5] and int(result.length) == 3
    # a token the constraint forbids after the proposal's outside token cuts it there
    # (``ab c`` ends the text: a second ``c`` is not allowed)
    result, _ = drafter.draft(params, 4, state, None, None, _component(drafter, [2, 5, 5], 0.9))
    assert result.tokens[:2].tolist() == [2, 5] and int(result.length) == 2


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6), st.integers(1, 5), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1),
       st.booleans())
def test_the_rows_drawn_are_the_mixtures_conditionals(size: int, drafts: int, weight: float,
                                                       seed: int, greedy: bool) -> None:
    """The rows ``SequentialCopy`` draws from (kept as it goes, the copy's weight a running sum)
    are :func:`mixed_conditionals` recomputed over the window along the drawn path, and a greedy
    draw takes each row's mode."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.softmax(3 * torch.randn(drafts, size, generator=generator, dtype=torch.float64), -1)
    rows[:, 0] = 0.0  # a zero entry: a copy of it has H(d) = 0 and posterior weight 1 after it
    rows = rows / rows.sum(-1, keepdim=True)
    proposal = torch.randint(0, size, (drafts,), generator=generator).tolist()
    component = proposal_component(proposal, weight, None, drafts, CPU)
    uniforms = None if greedy else torch.rand(drafts, generator=generator, dtype=torch.float64)
    copy = SequentialCopy(component, uniforms)
    for row in rows:
        pick = copy(row)
        assert pick is not None
        if greedy:
            assert pick == int(copy.conditionals()[len(copy.path) - 1].argmax())
    want = lookup_module.mixed_conditionals(rows, torch.tensor(copy.path), component)
    got = copy.conditionals()
    assert torch.allclose(got[:, :size], want, rtol=0, atol=1e-12)
    assert (got[:, size] == 0).all()


def test_greedy_drafts_the_mode_of_the_mixture() -> None:
    """A greedy draft takes the copy's token only where the mixture's conditional is largest
    there: a weak copy gives way to a drafter that is sure of another token, a strong one does
    not; at a proposal token outside the draft vocabulary the draw then leaves the drafter."""
    head = torch.tensor([0.05, 0.9, 0.05], dtype=torch.float64)
    for weight, want in ((0.1, 1), (0.6, 0)):  # rows: 0.9 h + 0.1 [1 0 0]; 0.4 h + 0.6 [1 0 0]
        assert SequentialCopy(proposal_component([0, 2], weight, None, 2, CPU), None)(head) == want
    position = [0, 1, 2] + [-1] * 5  # model id 7 lies outside the draft vocabulary
    for weight, want in ((0.1, 1), (0.6, None)):
        component = proposal_component([7, 2], weight, position, 2, CPU, beyond=True)
        copy = SequentialCopy(component, None, torch.tensor([0, 1, 2]))
        assert copy(head) == want and (copy.outside == 0) == (want is None)


def test_the_outside_entry_round_trips() -> None:
    assert outside_entry(outside_entry(7)) == 7 and outside_entry(0) == -1
    component = proposal_component([3, 2, 4], 0.5, [0, -1, -1, 1, 2, 3], 3, CPU, beyond=True)
    assert component.tolist() == [1, outside_entry(2), 2, 3, 0.5]
    cut = proposal_component([3, 2, 4], 0.5, [0, -1, -1, 1, 2, 3], 3, CPU)
    assert cut.tolist() == [1, 0, 0, 1, 0.5]


# ---------------------------------------------------------------------- exact output laws
@pytest.mark.parametrize("draft_tokens", [NO_A, NO_AB], ids=["no-a", "no-ab"])
@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize(("architecture", "rank"), [("ff", 1), ("hmm", 2), ("btree", 2)])
def test_proposals_outside_the_vocabulary_keep_the_law_exact(
        architecture: str, rank: int, config: SamplingConfig,
        draft_tokens: tuple[int, ...]) -> None:
    """The output law with the walk (alone, and beside the copy) carrying tokens outside the
    draft vocabulary is constrained AR's, enumerated; some round's proposal holds such a token."""
    lm = ToyLM(VOCAB, seed=LM_SEED, draft_branch=True)
    head = ToyHead(architecture, 3, rank, 6, VOCAB, seed=4, draft_tokens=draft_tokens)
    prompt, length = [1, 2, 4], 8 if config.greedy else 5
    want = constrained_target_law(lm, AUTOMATON, prompt, length, config)
    for lookup in (WALK_ONLY, COPY_AND_WALK):
        components: list[torch.Tensor] = []
        law = constrained_decoder_law(lm, head, AUTOMATON, prompt, length, config, PRODUCT,
                                      lookup=lookup, components=components)
        assert total_variation(law, want) <= EXACT_TV
        assert any(bool((c[:-2] < 0).any()) and float(c[-1]) > 0 for c in components)


@pytest.mark.parametrize("point_mass", [True, False], ids=["products-q", "mixture-row"])
def test_negative_controls_are_biased(point_mass: bool) -> None:
    """Verified with the product's own ``q`` (no extra column), or with the mixture's row where
    the drafter has no draftable token (not the point mass at the proposal's token), the law is
    not the target's."""
    lm = ToyLM(VOCAB, seed=LM_SEED, draft_branch=True)
    head = ToyHead("btree", 3, 2, 6, VOCAB, seed=4, draft_tokens=NO_A)
    config = SamplingConfig(1.0)
    want = constrained_target_law(lm, AUTOMATON, [1, 2, 4], 4, config)
    law = constrained_decoder_law(lm, head, AUTOMATON, [1, 2, 4], 4, config, PRODUCT,
                                  lookup=COPY_AND_WALK, mixed_q=point_mass,
                                  free_point_mass=not point_mass)
    assert abs(sum(law.values()) - 1) < 1e-12 and total_variation(law, want) > 1e-3


# ---------------------------------------------------------------------- real decodes
def _count_tails(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the rounds whose draft left the vocabulary with its proposal."""
    calls: list[int] = []
    tail = lookup_module.SequentialCopy.tail

    def counted(self: lookup_module.SequentialCopy) -> list[int]:
        calls.append(1)
        return tail(self)

    monkeypatch.setattr(lookup_module.SequentialCopy, "tail", counted)
    return calls


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph-double"])
def test_greedy_output_is_constrained_autoregressive(compiled: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_tails(monkeypatch)
    head = ToyHead("btree", 4, 2, 6, VOCAB, seed=4, draft_tokens=NO_A)
    assert_greedy_is_constrained_autoregressive(head, COPY_AND_WALK, compiled)
    assert calls


def test_sampled_output_matches_the_law(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chi-square of 400 real decodes (HMM head without ``a`` and ``ab``, walk and copy) against
    constrained AR's enumerated law."""
    calls = _count_tails(monkeypatch)
    decoder = SpeculativeDecoder(ToyLM(VOCAB, seed=LM_SEED, draft_branch=True),
                                 ToyHead("hmm", 3, 2, 6, VOCAB, seed=4, draft_tokens=NO_A),
                                 lookup=COPY_AND_WALK)
    law = constrained_target_law(ToyLM(VOCAB, seed=LM_SEED, draft_branch=True), AUTOMATON,
                                 [1, 2, 4], 4, SamplingConfig(1.0))
    generator = torch.Generator().manual_seed(5)
    samples = [tuple(decoder.generate([1, 2, 4], 4, 1.0, generator=generator,
                                      constraint=AUTOMATON).tokens.tolist())
               for _ in range(400)]
    assert law_p_value(samples, law) > 1e-3
    assert len(calls) > 20


def test_off_cuts_proposals_at_the_draft_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """``outside_vocabulary=False``: no draft leaves the vocabulary, and the law stays exact."""
    calls = _count_tails(monkeypatch)
    cut = ContextLookup((0.4, 0.7), constraint_weight=0.5, outside_vocabulary=False)
    assert cut.describe() == "lookup 0.4/0.7, constraint 0.5, cut at the draft vocabulary"
    lm = ToyLM(VOCAB, seed=LM_SEED, draft_branch=True)
    head = ToyHead("btree", 3, 2, 6, VOCAB, seed=4, draft_tokens=NO_A)
    components: list[torch.Tensor] = []
    law = constrained_decoder_law(lm, head, AUTOMATON, [1, 2, 4], 5, SamplingConfig(1.0), PRODUCT,
                                  lookup=cut, components=components)
    want = constrained_target_law(lm, AUTOMATON, [1, 2, 4], 5, SamplingConfig(1.0))
    assert total_variation(law, want) <= EXACT_TV
    assert all(not bool((c[:-2] < 0).any()) for c in components)
    decoder = SpeculativeDecoder(ToyLM(VOCAB, seed=LM_SEED, draft_branch=True), head, lookup=cut)
    decoder.generate([1, 2, 4], 12, constraint=AUTOMATON)
    assert not calls


def test_a_bad_outside_vocabulary_is_refused() -> None:
    with pytest.raises(DecoderError, match="outside_vocabulary must be a bool"):
        ContextLookup(outside_vocabulary="yes")  # type: ignore[arg-type]
