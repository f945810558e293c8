"""The speculative decoder samples exactly from the (warped) target law.

* exact laws: the law of the first tokens the decoder emits, computed by enumerating every branch
  of the algorithm with the decoder's own round functions (``toy.decoder_law``), is
  compared with the brute-force target law, for every head shape, warp and with or without a
  draft branch; the paper's drop-the-correction variant is the negative control;
* a sampled end-to-end chi-square check of the real ``generate``;
* the round law itself (per-position exactness, edge cases) and the HF warp equivalence;
* the round invariants (cache contents, one backbone call per round, stopping).
"""

from __future__ import annotations

import math

import pytest
import torch
from toy import ToyHead, ToyLM, decoder_law, law_p_value, target_law, total_variation
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from circuits_llm.decoding.acceptance import CorrectionPolicy, round_law
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.metrics import RoundKind, aggregate, speedup
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import SamplingConfig, target_probs, warp_logits

EXACT_TV = 1e-9
BIASED_TV = 1e-3
HEADS = [("ff", 1), ("cp", 2), ("hmm", 2), ("btree", 2)]
WARPS = {
    "temperature": SamplingConfig(1.0),
    "top_k": SamplingConfig(0.7, top_k=2),
    "top_p": SamplingConfig(1.3, top_p=0.75),
}


def _setup(architecture: str, rank: int, window: int = 3, draft_branch: bool = False,
           seed: int = 0, vocab: int = 3) -> tuple[ToyLM, ToyHead]:
    lm = ToyLM(vocab, draft_branch=draft_branch, seed=seed)
    return lm, ToyHead(architecture, window, rank, lm.hidden_size, vocab, seed=seed)


# ---------------------------------------------------------------------- exact laws
@pytest.mark.parametrize("draft_branch", [False, True], ids=["shared", "draft-branch"])
@pytest.mark.parametrize("warp", list(WARPS))
@pytest.mark.parametrize(("architecture", "rank"), HEADS, ids=[h for h, _ in HEADS])
def test_exact_law_equals_target_and_paper_variant_is_biased(
        architecture: str, rank: int, warp: str, draft_branch: bool) -> None:
    lm, head = _setup(architecture, rank, draft_branch=draft_branch)
    config = WARPS[warp]
    target = target_law(lm, [0, 1], 3, config)
    exact = decoder_law(lm, head, [0, 1], 3, config)
    assert abs(sum(exact.values()) - 1) < 1e-12
    assert total_variation(exact, target) <= EXACT_TV
    biased = decoder_law(lm, head, [0, 1], 3, config, CorrectionPolicy.DROP_AFTER_ACCEPT)
    assert total_variation(biased, target) > BIASED_TV  # measured 0.026 .. 0.15


@pytest.mark.parametrize(("architecture", "rank", "window", "prompt", "length", "config"), [
    ("cp", 2, 2, [1, 0], 4, SamplingConfig(1.0)),                       # one draft per round
    ("btree", 2, 4, [2, 0, 1], 4, SamplingConfig(0.9, top_k=2, top_p=0.8)),  # three drafts
    ("hmm", 3, 3, [2], 4, SamplingConfig(1.0, top_p=0.9)),              # one-token prompt
])
def test_exact_law_other_windows_and_prompts(architecture: str, rank: int, window: int,
                                             prompt: list[int], length: int,
                                             config: SamplingConfig) -> None:
    lm, head = _setup(architecture, rank, window, draft_branch=True, seed=3)
    target = target_law(lm, prompt, length, config)
    assert total_variation(decoder_law(lm, head, prompt, length, config), target) <= EXACT_TV


def test_sampled_generate_matches_exact_law_and_rejects_biased_variant() -> None:
    # a toy whose drafts are peaky and often wrong: the paper variant's bias is large here
    # (TV 0.146 on the first two tokens) while every target cell has probability >= 0.075
    lm = ToyLM(3, draft_branch=True, seed=3, logit_scale=0.5)
    head = ToyHead("ff", 3, 1, lm.hidden_size, 3, seed=3, scale=3.0)
    prompt, length, config = [2, 2], 2, SamplingConfig(1.0)
    law = target_law(lm, prompt, length, config)
    p_values = {}
    for policy in CorrectionPolicy:
        decoder = SpeculativeDecoder(lm, head, policy=policy)
        generator = torch.Generator().manual_seed(1234)
        samples = [tuple(decoder.generate(prompt, length, temperature=1.0, generator=generator)
                         .tokens.tolist()) for _ in range(400)]
        p_values[policy] = law_p_value(samples, law)
    assert p_values[CorrectionPolicy.EXACT] > 1e-3
    assert p_values[CorrectionPolicy.DROP_AFTER_ACCEPT] < 1e-4


# ---------------------------------------------------------------------- the round law
def _first_token_law(p: torch.Tensor, q: torch.Tensor, q_used: torch.Tensor) -> torch.Tensor:
    """Law of the first emitted token of a one-draft round: draft ~ q, verified with q_used."""
    law = torch.zeros(p.shape[1], dtype=torch.float64)
    for d in range(p.shape[1]):
        outcome = round_law(p, q_used[None], torch.tensor([d])).outcome_probs()
        law += q[d] * outcome[0]
        law[d] += q[d] * outcome[1].sum()
    return law


@pytest.mark.parametrize("case", ["random", "p-zeros", "q-zeros", "equal", "disjoint"])
def test_one_position_law_is_target(case: str) -> None:
    generator = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(2, 6, generator=generator, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(6, generator=generator, dtype=torch.float64), -1)
    if case == "p-zeros":
        p[0, :3] = 0
    if case == "q-zeros":
        q[3:] = 0
    if case == "equal":
        q = p[0].clone()
    if case == "disjoint":
        p[0, :3], q[3:] = 0, 0
    p, q = p / p.sum(-1, keepdim=True), q / q.sum()
    law = _first_token_law(p, q, q)
    assert torch.isfinite(law).all()
    assert torch.allclose(law, p[0], atol=1e-14, rtol=0)


def test_residual_needs_the_drafts_exact_conditional() -> None:
    generator = torch.Generator().manual_seed(8)
    p = torch.softmax(torch.randn(2, 5, generator=generator, dtype=torch.float64), -1)
    q = torch.softmax(2 * torch.randn(5, generator=generator, dtype=torch.float64), -1)
    wrong = torch.softmax(2 * torch.randn(5, generator=generator, dtype=torch.float64), -1)
    assert (_first_token_law(p, q, wrong) - p[0]).abs().sum() / 2 > 1e-2


def test_round_law_edge_cases() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.0, 1.0, 0.0], [float("nan")] * 3], dtype=torch.float64)
    law = round_law(p, q, torch.tensor([0, 1]))
    assert law.accept.tolist() == [0.0, 0.0]  # q(d) = 0 and an unusable row: always rejected
    assert torch.equal(law.fallback[1], p[1])  # the unusable row's residual is p itself
    same = round_law(p[:2], p[:1].clone(), torch.tensor([2]))  # q == p, p(d) = 0
    assert same.accept.tolist() == [0.0] and torch.isfinite(same.fallback).all()
    assert torch.equal(same.fallback[0], p[0])  # zero-mass residual falls back to p
    assert abs(float(same.outcome_probs().sum()) - 1) < 1e-15


def test_greedy_round_law_accepts_exactly_the_argmax_prefix() -> None:
    p = torch.nn.functional.one_hot(torch.tensor([2, 0, 1, 1]), 3).double()
    q = torch.nn.functional.one_hot(torch.tensor([2, 1, 1]), 3).double()
    law = round_law(p, q, torch.tensor([2, 1, 1]))
    assert law.accept.tolist() == [1.0, 0.0, 1.0]
    # the greedy accept program: the first draft matches the argmax, the second does not
    lm = ToyLM(3)
    program = RoundProgram(ToyHead("cp", 4, 2, lm.hidden_size, 3), SamplingConfig(0.0))
    draft = program.draft(torch.zeros(1, lm.hidden_size, dtype=torch.float64), torch.tensor([0]),
                          None)
    draft = type(draft)(torch.tensor([2, 1, 1]), draft.block, None, draft.head_ok, draft.possible)
    logits = torch.log(p.clamp_min(1e-9))
    outcome = program.outcome(program.accept(logits, draft, None))
    assert (outcome.draft, outcome.accepted, outcome.token) == ((2, 1, 1), 1, 0)


# ---------------------------------------------------------------------- HF warp equivalence
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [
    (1.0, None, None), (0.6, None, None), (1.0, 5, None), (0.8, 1, None), (1.0, 100, None),
    (1.0, None, 0.9), (1.7, None, 0.3), (1.0, None, 1e-4), (0.9, 7, 0.8), (2.0, 3, 0.95),
])
def test_warps_match_transformers(temperature: float, top_k: int | None,
                                  top_p: float | None) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 50, generator=generator)
    logits[::2] = (logits[::2] * 2).round() / 2  # many ties
    chain = LogitsProcessorList()  # the order of GenerationMixin._get_logits_processor
    if temperature != 1.0:
        chain.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        chain.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    expected = chain(torch.zeros(32, 1, dtype=torch.long), logits.clone())
    config = SamplingConfig(temperature, top_k, top_p)
    assert torch.equal(warp_logits(logits, config), expected)
    probs = target_probs(logits, config)
    assert torch.allclose(probs, torch.softmax(expected.double(), -1), atol=1e-15, rtol=0)


def test_greedy_target_is_first_argmax() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    assert target_probs(logits, SamplingConfig(0.0)).tolist() == [[0.0, 1.0, 0.0, 0.0]]


# ---------------------------------------------------------------------- invariants
@pytest.mark.parametrize("prompt", [[1], [0, 1], [2, 0, 1, 1, 2]])
@pytest.mark.parametrize("policy", list(CorrectionPolicy))
def test_round_invariants(prompt: list[int], policy: CorrectionPolicy) -> None:
    lm, head = _setup("btree", 2, window=4, draft_branch=True)
    decoder = SpeculativeDecoder(lm, head, policy=policy)
    for max_new in (0, 1, 6, 13):
        calls = lm.calls
        result = decoder.generate(prompt, max_new, temperature=1.0,
                                  generator=torch.Generator().manual_seed(max_new))
        out = result.tokens.tolist()
        assert len(out) == max_new and result.tokens.dtype == torch.long
        assert lm.tokens == [*prompt, *out][:-1]
        summary = result.summary
        assert lm.calls - calls == summary.backbone_calls == summary.rounds + (len(prompt) > 1)
        for stats in result.rounds:
            assert stats.kind is RoundKind.SPECULATIVE or (len(prompt) == 1 and stats is result.rounds[0])
            assert 0 <= stats.accepted <= stats.drafted
            assert stats.drafted in (0, head.window - 1)
        assert sum(s.emitted for s in result.rounds) >= len(out)


def test_eos_stops_generation_and_truncates_the_round() -> None:
    lm, head = _setup("cp", 2, window=4)
    reference = AutoregressiveDecoder(lm).generate([0, 1], 30).tokens.tolist()
    eos = reference[5]
    expected = reference[: reference.index(eos) + 1]
    result = SpeculativeDecoder(lm, head).generate([0, 1], 30, eos_token_id=[eos])
    assert result.tokens.tolist() == expected
    assert lm.length == 2 + len(expected) - 1


def test_summary_metrics_and_speedup() -> None:
    lm, head = _setup("hmm", 2, window=3, draft_branch=True)
    spec = SpeculativeDecoder(lm, head).generate([0, 1], 12, temperature=0.8,
                                                 generator=torch.Generator().manual_seed(0))
    base = AutoregressiveDecoder(lm).generate([0, 1], 12, temperature=0.8,
                                              generator=torch.Generator().manual_seed(0))
    s = spec.summary
    assert s.new_tokens == 12 and s.rounds == len(spec.rounds)
    assert s.accepted == sum(r.accepted for r in spec.rounds) <= s.drafted == 2 * s.rounds
    assert math.isclose(s.tokens_per_round, 12 / s.rounds)
    assert len(s.acceptance_by_position) == 2
    assert s.acceptance_by_position[1] <= s.acceptance_by_position[0]
    assert base.summary.tokens_per_call == 12 / 13 and base.summary.rounds == 12  # + prefill
    assert speedup(spec, base) > 0 and s.throughput > 0 and set(s.mean_split_s) == {
        "head_s", "draft_s", "conditionals_s", "verify_s", "accept_s"}
    pooled = aggregate([spec, spec])
    assert pooled.new_tokens == 24 and pooled.rounds == 2 * s.rounds
