"""Dynamic draft length (:mod:`circuits_llm.decoding.draft_length`): a round verifies ``L <= n-1``
drafts and the output law is still exactly the target's.

* exact laws by enumeration (``toy.decoder_law`` with the decoder's own rule, conditionals,
  ``round_law`` and ``transition``) for the confident rules (both estimates, with and without
  rounds that verify nothing) and a fixed shorter length, several heads and warps, windows 3 and
  4, a compressed draft vocabulary; the rules are checked to really vary ``L``;
* negative controls: a rule that reads the target ``p``, and one that uses the head's
  probability of the draft ``q_k(d_k)`` to decide whether ``d_k`` is verified, are biased;
* the accept program with ``L < n-1`` equals ``round_law`` on the first ``L`` positions; the draft
  program's ``L`` is the rule's; both programs stay one graph;
* greedy decoding is token-identical to autoregressive decoding, eager and compiled (the CUDA
  graph double and ``torch.compile``), on the toy and on a tiny GPT-2 against ``model.generate``;
  the compiled backbone gets a compiled forward for every block length the rule can choose;
* compiled sampling draws what eager sampling draws from the same generator; a chi-square check
  of the real ``generate`` against the brute-force target law;
* per-round metrics record the verified length.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from cuda_graph_double import CudaGraphDouble
from hypothesis import given, settings
from hypothesis import strategies as st
from toy import LengthRule, ToyHead, ToyLM, decoder_law, law_p_value, target_law, total_variation
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.acceptance import round_law, usable_conditionals
from circuits_llm.decoding.decoder import AutoregressiveDecoder, DecoderError, SpeculativeDecoder
from circuits_llm.decoding.draft_length import Confidence, DraftLength, DraftLengthKind
from circuits_llm.decoding.metrics import RoundKind
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.heads import MTPHead
from circuits_llm.runtime.compiling import use_compiler

EXACT_TV = 1e-9
BIASED_TV = 1e-3
VOCAB = 4
DRAFT_TOKENS = (2, 0, 3)  # token 1 is outside the draft vocabulary
WARPS = {
    "temperature": SamplingConfig(1.0),
    "top_k": SamplingConfig(0.7, top_k=2),
    "top_p": SamplingConfig(1.3, top_p=0.75),
}


class RecordedLength(DraftLength):
    """A :class:`DraftLength` that records every ``L`` it chooses (to check a rule really varies)."""

    def decide(self, q: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor:
        length = super().decide(q, drafts)
        self.__dict__.setdefault("chosen", Counter())[int(length)] += 1
        return length

    @property
    def chosen(self) -> Counter[int]:
        return self.__dict__.setdefault("chosen", Counter())


def _recorded(rule: DraftLength) -> RecordedLength:
    return RecordedLength(rule.kind, rule.length, rule.threshold, rule.confidence, rule.minimum)


# ---------------------------------------------------------------------- exact laws
RULES = {
    "drafted-0.35": DraftLength.confident(0.35),
    "peak-0.5-min0": DraftLength.confident(0.5, Confidence.PEAK, minimum=0),
    "drafted-0.2-min0": DraftLength.confident(0.2, minimum=0),
    "fixed-1": DraftLength.fixed(1),
}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("warp", list(WARPS))
@pytest.mark.parametrize(("architecture", "rank"), [("ff", 1), ("cp", 2), ("hmm", 2), ("btree", 2)])
def test_dynamic_length_law_is_exact(architecture: str, rank: int, warp: str, rule: str) -> None:
    lm = ToyLM(3, draft_branch=True, seed=0)
    head = ToyHead(architecture, 3, rank, lm.hidden_size, 3, seed=0)
    config = WARPS[warp]
    recorded = _recorded(RULES[rule])
    law = decoder_law(lm, head, [0, 1], 3, config, draft_length=recorded)
    assert abs(sum(law.values()) - 1) < 1e-12
    assert total_variation(law, target_law(lm, [0, 1], 3, config)) <= EXACT_TV
    if recorded.kind is DraftLengthKind.CONFIDENT:  # the rule chose several lengths
        assert len(recorded.chosen) >= 2, recorded.chosen


@pytest.mark.parametrize(("rule", "prompt"), [
    (DraftLength.confident(0.3), [0, 2]),
    (DraftLength.confident(0.4, Confidence.PEAK, minimum=0), [2, 1]),  # ends outside the vocabulary
    (DraftLength.fixed(2), [3, 0]),
], ids=["drafted", "peak", "fixed-2"])
@pytest.mark.parametrize(("architecture", "rank"), [("cp", 2), ("btree", 2)])
def test_dynamic_length_law_is_exact_with_a_compressed_vocabulary(
        architecture: str, rank: int, rule: DraftLength, prompt: list[int]) -> None:
    """Window 4 (three drafts), the head drafts over 3 of the 4 tokens."""
    lm = ToyLM(VOCAB, draft_branch=True, seed=2)
    head = ToyHead(architecture, 4, rank, lm.hidden_size, VOCAB, seed=2, draft_tokens=DRAFT_TOKENS)
    config = SamplingConfig(1.0, top_k=3)
    recorded = _recorded(rule)
    law = decoder_law(lm, head, prompt, 3, config, draft_length=recorded)
    assert total_variation(law, target_law(lm, prompt, 3, config)) <= EXACT_TV
    if recorded.kind is DraftLengthKind.CONFIDENT:
        assert len(recorded.chosen) >= 2, recorded.chosen


def _peeks_at_own_draft(threshold: float) -> LengthRule:
    """Stop before position k when ``q_1(d_1) ... q_k(d_k) < threshold``: reads ``q_k(d_k)`` to
    decide whether ``d_k`` is verified (biased, although it reads only the head's side)."""
    def rule(q: torch.Tensor, drafts: torch.Tensor, p: torch.Tensor) -> int:
        drafted = q.gather(1, drafts[:, None])[:, 0]
        return int(torch.cumprod((torch.cumprod(drafted, 0) >= threshold).long(), 0).sum())
    return rule


def _peeks_at_target(q: torch.Tensor, drafts: torch.Tensor, p: torch.Tensor) -> int:
    """Verify drafts while the target gives them at least the head's probability (reads p)."""
    rows = torch.arange(drafts.shape[0])
    likes = p[rows, drafts] >= q[rows, drafts]
    return int(torch.cumprod(likes.long(), 0).sum())


@pytest.mark.parametrize(("architecture", "rank"), [("ff", 1), ("cp", 2), ("hmm", 2), ("btree", 2)])
def test_rules_that_peek_are_biased(architecture: str, rank: int) -> None:
    """Negative controls: the enumeration detects a rule that reads the target, and one that
    reads the value ``q_k(d_k)`` of the very draft it decides about (measured TV 0.05 .. 0.16)."""
    lm = ToyLM(3, draft_branch=True, seed=0)
    head = ToyHead(architecture, 3, rank, lm.hidden_size, 3, seed=0)
    config = SamplingConfig(1.0)
    target = target_law(lm, [0, 1], 3, config)
    for rule in (_peeks_at_target, _peeks_at_own_draft(0.35)):
        law = decoder_law(lm, head, [0, 1], 3, config, draft_length=rule)
        assert abs(sum(law.values()) - 1) < 1e-12  # a law, just not the target's
        assert total_variation(law, target) > BIASED_TV


# ---------------------------------------------------------------------- the programs
@settings(max_examples=60)
@given(seed=st.integers(0, 2**31 - 1), compressed=st.booleans(), length=st.integers(0, 3))
def test_accept_with_a_shorter_length_is_the_round_law_of_the_prefix(
        seed: int, compressed: bool, length: int) -> None:
    """``L < n-1``: the decision and the emitted token's law are ``round_law(p[:L+1], q[:L],
    d[:L])``'s: later positions are never accepted and the bonus row is ``p_{L+1}``."""
    generator = torch.Generator().manual_seed(seed)
    vocab, window = 9, 4
    tokens = (4, 0, 7, 2, 8) if compressed else None
    program = RoundProgram(ToyHead("ff", window, 1, 3, vocab, seed=seed % 97, draft_tokens=tokens),
                           SamplingConfig(1.0))
    size = program.draft_size
    p = torch.softmax(3 * torch.randn(window, vocab, dtype=torch.float64, generator=generator), -1)
    q = torch.softmax(3 * torch.randn(window - 1, size, dtype=torch.float64, generator=generator), -1)
    index = torch.randint(0, size, (window - 1,), generator=generator)
    drafts = index if tokens is None else torch.tensor(tokens)[index]
    tests = torch.rand(window - 1, generator=generator, dtype=torch.float64)
    accepted, row = program._decide(p, q, drafts, tests, torch.tensor(length))
    q_full = q if tokens is None else \
        p.new_zeros(window - 1, vocab).index_copy(1, torch.tensor(tokens), q)
    law = round_law(p[:length + 1], q_full[:length], drafts[:length])
    expected = int(torch.cumprod((tests[:length] < law.accept).long(), 0).sum())
    assert int(accepted) == expected <= length
    torch.testing.assert_close(row, law.fallback[expected], rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling"])
def test_the_draft_programs_length_is_the_rule_and_accept_reads_only_the_verified_rows(
        greedy: bool) -> None:
    lm = ToyLM(VOCAB, seed=3)
    head = ToyHead("btree", 4, 2, lm.hidden_size, VOCAB, seed=3, draft_tokens=DRAFT_TOKENS)
    rule = DraftLength.confident(0.3, minimum=0)
    program = RoundProgram(head, SamplingConfig(0.0 if greedy else 1.0), draft_length=rule)
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for trial in range(12):
        hidden = torch.randn(1, lm.hidden_size, dtype=torch.float64, generator=generator)
        c = int(DRAFT_TOKENS[trial % 3])
        uniforms = None if greedy else program.draw_uniforms(generator)
        draft = program.draft(hidden, torch.tensor([c]), uniforms)
        index = program.position[draft.tokens]  # type: ignore[index]
        q = usable_conditionals(program.conditionals(hidden, c, index[None])[0])
        assert int(draft.length) == int(rule.decide(q, index)) == program.verified(draft)
        length = program.verified(draft)
        seen.add(length)
        logits = torch.randn(length + 1, VOCAB, dtype=torch.float64, generator=generator)
        outcome = program.outcome(program.accept(logits, draft, uniforms))
        assert outcome.draft == tuple(draft.tokens[:length].tolist())
        assert outcome.accepted <= length and outcome.verifier_ok
        # the padding rows are never read: non-finite logits there change nothing
        padded = torch.cat([logits, torch.full((3 - length, VOCAB), float("nan"),
                                               dtype=torch.float64)])
        assert program.outcome(program._accept(padded, draft.tokens, draft.q, draft.head_ok,
                                               draft.possible, uniforms, draft.length)) == outcome
    assert len(seen) >= 2, seen


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling"])
def test_programs_with_a_dynamic_length_trace_to_one_graph(greedy: bool) -> None:
    lm = ToyLM(VOCAB, seed=2)
    head = ToyHead("cp", 4, 2, lm.hidden_size, VOCAB, seed=2, draft_tokens=DRAFT_TOKENS)
    program = RoundProgram(head, SamplingConfig(0.0 if greedy else 0.9, top_k=3),
                           draft_length=DraftLength.confident(0.3, Confidence.PEAK))
    hidden = torch.randn(1, lm.hidden_size, dtype=torch.float64)
    c = torch.tensor([2])
    uniforms = None if greedy else program.draw_uniforms(torch.Generator().manual_seed(0))
    with torch.no_grad():
        explained = torch._dynamo.explain(program._draft_program)(hidden, c, uniforms)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        draft = program.draft(hidden, c, uniforms)
        args = (torch.randn(4, VOCAB, dtype=torch.float64), draft.tokens, draft.q, draft.head_ok,
                draft.possible, uniforms, draft.length)
        explained = torch._dynamo.explain(program._accept_program)(*args)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


# ---------------------------------------------------------------------- greedy = AR
TOY_RULES = [DraftLength.confident(0.3), DraftLength.confident(0.5, Confidence.PEAK, minimum=0),
             DraftLength.fixed(1), DraftLength.fixed(0)]


@pytest.mark.parametrize("draft_tokens", [None, DRAFT_TOKENS], ids=["full", "compressed"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph-double"])
def test_greedy_with_a_dynamic_length_is_autoregressive(
        compiled: bool, draft_tokens: tuple[int, ...] | None) -> None:
    head = ToyHead("btree", 4, 2, 6, VOCAB, seed=1, draft_tokens=draft_tokens)
    reference = AutoregressiveDecoder(ToyLM(VOCAB, draft_branch=True, seed=1))
    double = CudaGraphDouble()
    for rule in TOY_RULES:
        with use_compiler(double):
            decoder = SpeculativeDecoder(ToyLM(VOCAB, draft_branch=True, seed=1), head,
                                         compile=compiled, draft_length=rule)
        for prompt in ([0, 2], [1], [2, 1, 3]):
            result = decoder.generate(prompt, 14)
            assert result.tokens.tolist() == reference.generate(prompt, 14).tokens.tolist()
            assert decoder.backbone.length == len(prompt) + 14 - 1
            lengths = {r.drafted for r in result.rounds if r.kind is RoundKind.SPECULATIVE}
            assert lengths <= set(rule.lengths(4)), (rule, lengths)
    if compiled:
        assert double.calls and all(n > 0 for n in double.calls.values())


def _gpt2() -> PreTrainedModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=48, n_embd=32, n_layer=2, n_head=4,
                                       n_positions=128, bos_token_id=0, eos_token_id=47,
                                       pad_token_id=0))
    return model.double().eval()


MODEL = _gpt2()


def _mtp_head(window: int = 4) -> MTPHead:
    return MTPHead.from_name("btree", window, 2, 32, 48,
                             lm_head_weight=MODEL.get_output_embeddings().weight.detach(),
                             dtype=torch.float64, sum_init_std=0.5)


def test_compiled_hf_backbone_compiles_every_block_length_the_rule_can_choose() -> None:
    """Greedy = ``model.generate``; the backbone's compiled step runs every block length it sees
    (no eager fall back), through the CUDA-graph double. (The random GPT-2's head is flat: its
    estimates are about 0.027, 7e-4 and 2e-5 at positions 1, 2, 3.)"""
    head = _mtp_head()
    double = CudaGraphDouble()
    with use_compiler(double):
        short = SpeculativeDecoder(MODEL, head, compile=True,  # L in {0, 1}
                                   draft_length=DraftLength.confident(0.03, minimum=0))
        long = SpeculativeDecoder(MODEL, head, compile=True,  # L in {1, 2}
                                  draft_length=DraftLength.confident(1e-3))
        fixed = SpeculativeDecoder(MODEL, head, compile=True, draft_length=DraftLength.fixed(2))
        given = SpeculativeDecoder(HFBackbone(MODEL, compile=True), head,
                                   draft_length=DraftLength.confident(0.1))
    assert short.backbone.compiled_lengths == (1, 2, 3, 4)
    assert long.backbone.compiled_lengths == (1, 2, 3, 4)
    assert fixed.backbone.compiled_lengths == (1, 3)
    assert given.backbone.compiled_lengths == (1, 2, 3, 4)
    seen: set[int] = set()
    for decoder in (short, long, fixed):
        blocks: set[int] = set()
        for prompt in (torch.tensor([[5, 9, 5, 9, 3]]), torch.tensor([[4, 4]])):
            want = MODEL.generate(prompt, do_sample=False, max_new_tokens=14, pad_token_id=0)
            result = decoder.generate(prompt, 14)  # both stop at the EOS id 47 by default
            assert result.tokens.tolist() == want[0, prompt.shape[1]:].tolist()
            blocks |= {r.drafted + 1 for r in result.rounds}
        step = decoder.backbone._compiled_step
        graphs = {key[0][0][1] for key in step._compiled.graphs}  # the (1, m) block of each graph
        assert graphs >= blocks and not step.fallbacks, (graphs, blocks)
        seen |= blocks
    assert seen == {1, 2, 3}, seen


# ---------------------------------------------------------------------- sampling
@pytest.mark.parametrize(("architecture", "rule"), [
    ("btree", DraftLength.confident(0.3)),
    ("cp", DraftLength.confident(0.4, Confidence.PEAK, minimum=0)),
    ("hmm", DraftLength.fixed(2)),
])
def test_compiled_sampling_draws_what_eager_draws(architecture: str, rule: DraftLength) -> None:
    """Same generator, same tokens, lengths and acceptances: the compiled law is the eager law,
    which the enumeration shows is the target's."""
    head = ToyHead(architecture, 4, 2, 6, VOCAB, seed=5, draft_tokens=DRAFT_TOKENS)
    eager = SpeculativeDecoder(ToyLM(VOCAB, draft_branch=True, seed=5), head, draft_length=rule)
    double = CudaGraphDouble()
    with use_compiler(double):
        compiled = SpeculativeDecoder(ToyLM(VOCAB, draft_branch=True, seed=5), head, compile=True,
                                      draft_length=rule)
    for seed in range(3):
        want = eager.generate([1, 2, 0], 16, 1.0, top_k=3, generator=torch.Generator().manual_seed(seed))
        got = compiled.generate([1, 2, 0], 16, 1.0, top_k=3, generator=torch.Generator().manual_seed(seed))
        assert got.tokens.tolist() == want.tokens.tolist()
        assert [(r.drafted, r.accepted) for r in got.rounds] == \
            [(r.drafted, r.accepted) for r in want.rounds]
    assert double.calls


def test_torch_compiled_dynamic_rounds_draw_what_eager_draws() -> None:
    """The real ``torch.compile`` (inductor on the CPU), sampling, one tiny head (greedy compiled
    runs through the double above)."""
    head = ToyHead("cp", 3, 2, 6, VOCAB, seed=6, draft_tokens=DRAFT_TOKENS)
    rule = DraftLength.confident(0.3, minimum=0)
    eager = SpeculativeDecoder(ToyLM(VOCAB, draft_branch=True, seed=6), head, draft_length=rule)
    compiled = SpeculativeDecoder(ToyLM(VOCAB, draft_branch=True, seed=6), head, compile=True,
                                  draft_length=rule)
    lengths: set[int] = set()
    for seed in range(3):
        want = eager.generate([1, 2, 0], 12, 1.0, generator=torch.Generator().manual_seed(seed))
        got = compiled.generate([1, 2, 0], 12, 1.0, generator=torch.Generator().manual_seed(seed))
        assert got.tokens.tolist() == want.tokens.tolist()
        assert [(r.drafted, r.accepted) for r in got.rounds] == \
            [(r.drafted, r.accepted) for r in want.rounds]
        lengths |= {r.drafted for r in got.rounds}
    assert len(lengths) >= 2, lengths
    assert all(not program._draft.fallbacks and not program._accept.fallbacks  # type: ignore[union-attr]
               for program in compiled._programs.values())


def test_sampled_generate_with_a_dynamic_length_matches_the_target_law() -> None:
    """Chi-square of 400 real two-token decodes (eager) against the brute-force target law."""
    lm = ToyLM(VOCAB, draft_branch=True, seed=5)
    head = ToyHead("btree", 4, 2, lm.hidden_size, VOCAB, seed=5, draft_tokens=DRAFT_TOKENS)
    decoder = SpeculativeDecoder(lm, head, draft_length=DraftLength.confident(0.3, minimum=0))
    law = target_law(ToyLM(VOCAB, draft_branch=True, seed=5), [1, 2], 2, SamplingConfig(1.0))
    generator = torch.Generator().manual_seed(7)
    samples = [tuple(decoder.generate([1, 2], 2, 1.0, generator=generator).tokens.tolist())
               for _ in range(400)]
    assert set(samples) <= set(law)
    assert law_p_value(samples, law) > 1e-3


# ---------------------------------------------------------------------- metrics and errors
def test_round_stats_record_the_verified_length() -> None:
    lm = ToyLM(VOCAB, draft_branch=True, seed=1)
    head = ToyHead("btree", 4, 2, lm.hidden_size, VOCAB, seed=1)
    decoder = SpeculativeDecoder(lm, head, draft_length=DraftLength.confident(0.3, minimum=0))
    calls = lm.calls
    result = decoder.generate([0, 2], 40, 1.0, generator=torch.Generator().manual_seed(3))
    rounds, summary = result.rounds, result.summary
    assert lm.calls - calls == summary.backbone_calls == len(rounds) + 1
    assert {r.drafted for r in rounds} >= {0, 1}  # the rule varied L, down to plain AR rounds
    for r in rounds:
        assert 0 <= r.accepted <= r.drafted <= 3 and 1 <= r.emitted <= r.drafted + 1
    assert summary.drafted == sum(r.drafted for r in rounds)
    assert summary.accepted == sum(r.accepted for r in rounds)
    assert summary.tokens_per_round == 40 / len(rounds)
    depth = max(r.drafted for r in rounds)
    assert len(summary.acceptance_by_position) == depth
    for k in range(1, depth + 1):  # a position counts only in the rounds that verified it
        reached = [r for r in rounds if r.drafted >= k and r.accepted >= k - 1]
        hits = sum(r.accepted >= k for r in rounds)
        assert summary.conditional_acceptance_by_position[k - 1] == hits / len(reached)


def test_bad_draft_lengths_are_one_clear_error() -> None:
    lm = ToyLM(3)
    head = ToyHead("cp", 3, 2, lm.hidden_size, 3)
    with pytest.raises(DecoderError, match="more drafts"):
        SpeculativeDecoder(lm, head, draft_length=DraftLength.fixed(3))
    with pytest.raises(DecoderError, match="more drafts"):
        SpeculativeDecoder(lm, head, draft_length=DraftLength.confident(0.5, minimum=3))
    with pytest.raises(DecoderError, match="DraftLength"):
        SpeculativeDecoder(lm, head, draft_length="fixed")  # type: ignore[arg-type]
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(DecoderError, match="threshold"):
            DraftLength.confident(bad)
    with pytest.raises(DecoderError, match="length"):
        DraftLength.fixed(-1)
    with pytest.raises(DecoderError, match="Confidence"):
        DraftLength.confident(0.5, "peak")  # type: ignore[arg-type]
    assert DraftLength() == DraftLength.fixed() and DraftLength.fixed().lengths(5) == (4,)
    assert DraftLength.confident(0.5, minimum=0).lengths(4) == (0, 1, 2, 3)
