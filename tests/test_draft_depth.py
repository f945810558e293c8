"""Each round's depth chosen from earlier rounds (:mod:`circuits_llm.decoding.draft_depth`).

* the pieces against brute force: a tracker's estimates and choice (hypothesis), the cost table's
  extrapolation, what a round observes (``sum min(p, q)`` when sampling, the prefix greedy) and
  the costs ``RoundCosts.measure`` derives from a fake clock;
* the decoder: greedy equals ``model.generate`` with a recursive block (with and without the
  copy of the context), a circuit on the block and rounds forced to depth 0 (plain steps, the
  block's cache still following the verifier), eager and compiled (the CUDA-graph double);
* the law: the real ``generate`` under the adaptive rule and under forced depths 0 and 1 samples
  the target's law (chi-square), and the same samples reject a shifted law (the negative
  control); the depth really varied in the adaptive run.
"""

from __future__ import annotations

import math

import pytest
import torch
from cuda_graph_double import CudaGraphDouble
from draft_block_models import (
    NextTokenLogits,
    assert_cache_is_a_fresh_prefill,
    block_circuit_head,
    greedy_generate,
    perturbed_block,
    tiny_llama,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from toy import law_p_value, target_law

from circuits_llm.backbone import CacheKind, HFBackbone
from circuits_llm.decoding import draft_depth
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.decoding.draft_depth import (
    AdaptiveDepth,
    DepthTracker,
    RoundCosts,
    observed_acceptance,
)
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.metrics import RoundKind
from circuits_llm.decoding.warping import DecoderError, SamplingConfig, warp_logits
from circuits_llm.draft_block import BlockCircuitDrafter, BlockDrafter, BlockStepMode
from circuits_llm.runtime.compiling import use_compiler

MODEL = tiny_llama(vocab=48, seed=0, scale=3.0)
SMALL = tiny_llama(vocab=4, scale=3.0)
CPU_COSTS = RoundCosts.for_device(torch.device("cpu"))


def forced(depth: int, window: int) -> AdaptiveDepth:
    """A rule whose costs make ``depth`` the only choice (every other round costs 1,000 steps)."""
    return AdaptiveDepth(RoundCosts(tuple(1.0 if w == depth + 1 else 1000.0
                                          for w in range(1, window + 1)), 0.0))


# ---------------------------------------------------------------------- the pieces
def test_cost_table_extrapolates_and_rounds_add_their_drafting() -> None:
    costs = RoundCosts((1.0, 1.4, 1.5), 0.1, 0.05)
    assert costs.block(2) == 1.4 and costs.block(5) == pytest.approx(1.7)
    assert costs.round(0) == pytest.approx(1.0 + 0.05 + 0.1)  # a plain step and the probe
    assert costs.round(3) == pytest.approx(costs.block(4) + 0.05 + 0.3)
    assert RoundCosts((1.0,), 0.0).block(7) == 1.0


@pytest.mark.parametrize("bad", [dict(verify=()), dict(verify=(1.0, -1.0)),
                                 dict(verify=[1.0]), dict(verify=(1.0, math.nan)),
                                 dict(verify=(1.0,), draft_step=-0.1),
                                 dict(verify=(1.0,), draft_step=True),
                                 dict(verify=(1.0,), draft_fixed=math.inf)])
def test_bad_costs_are_refused(bad: dict[str, object]) -> None:
    arguments: dict[str, object] = {"verify": (1.0,), "draft_step": 0.0, **bad}
    with pytest.raises(DecoderError, match="RoundCosts"):
        RoundCosts(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [dict(costs="cpu"), dict(memory=0.5), dict(prior=1.5),
                                 dict(prior=True), dict(prior_weight=0)])
def test_bad_rules_are_refused(bad: dict[str, object]) -> None:
    arguments: dict[str, object] = {"costs": CPU_COSTS, **bad}
    with pytest.raises(DecoderError, match="AdaptiveDepth"):
        AdaptiveDepth(**arguments)  # type: ignore[arg-type]


def test_measured_costs_are_relative_to_one_token(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(draft_depth.time, "perf_counter", lambda: clock[0])

    def extend(width: int) -> None:
        clock[0] += 0.050 + 0.010 * (width - 1)

    def step() -> None:
        clock[0] += 0.002

    costs = RoundCosts.measure(extend, step, 3, repeats=3)
    assert costs.verify == pytest.approx((1.0, 1.2, 1.4)) and costs.draft_step == pytest.approx(0.04)
    with pytest.raises(DecoderError, match="widths"):
        RoundCosts.measure(extend, step, 0)


def _brute_estimates(rule: AdaptiveDepth, rounds: list[list[float]], most: int) -> list[float]:
    keep = 1 - 1 / rule.memory
    sums, counts = [0.0] * most, [0.0] * most
    for seen in rounds:
        sums = [s * keep for s in sums]
        counts = [c * keep for c in counts]
        for j, value in enumerate(seen):
            sums[j] += value
            counts[j] += 1
    out, above = [], rule.prior
    for s, c in zip(sums, counts, strict=True):
        above = (s + rule.prior_weight * above) / (c + rule.prior_weight)
        out.append(above)
    return out


@settings(max_examples=60, deadline=None)
@given(most=st.integers(1, 6), memory=st.floats(1.0, 20.0), prior=st.floats(0.0, 1.0),
       data=st.data())
def test_the_tracker_chooses_the_depth_with_the_most_tokens_per_cost(
        most: int, memory: float, prior: float, data: st.DataObject) -> None:
    verify = tuple(data.draw(st.lists(st.floats(0.5, 3.0), min_size=1, max_size=8)))
    rule = AdaptiveDepth(RoundCosts(verify, data.draw(st.floats(0.0, 0.2))), memory=memory,
                         prior=prior)
    tracker = rule.start(most)
    rounds = data.draw(st.lists(st.lists(st.floats(0.0, 1.0), max_size=most), max_size=12))
    for seen in rounds:
        tracker.observe(False, seen)
    estimates = _brute_estimates(rule, rounds, most)
    assert tracker.estimates(False) == pytest.approx(estimates, abs=1e-12)
    assert tracker.estimates(True) == pytest.approx([prior] * most, abs=1e-12)  # kept apart
    values = []
    for depth in range(most + 1):
        tokens = 1 + sum(math.prod(estimates[:i]) for i in range(1, depth + 1))
        values.append(tokens / rule.costs.round(depth))
    chosen = tracker.choose(False)
    assert values[chosen] == pytest.approx(max(values), rel=1e-12)
    assert all(values[d] < values[chosen] * (1 + 1e-12) for d in range(chosen))
    assert tracker.depths == [chosen]


def test_acceptance_drives_the_depth_to_either_end() -> None:
    tracker = AdaptiveDepth(CPU_COSTS).start(7)
    for _ in range(20):
        tracker.observe(True, [1.0] * 7)
        tracker.observe(False, [0.0])
    assert tracker.choose(True) == 7 and tracker.choose(False) == 0
    with pytest.raises(DecoderError, match="at most 7"):
        tracker.observe(False, [1.0] * 8)
    with pytest.raises(DecoderError, match="most >= 1"):
        DepthTracker(AdaptiveDepth(CPU_COSTS), 0)


def test_a_round_observes_the_overlap_when_sampling_and_the_prefix_when_greedy() -> None:
    torch.manual_seed(0)
    vocab, ids = 6, torch.tensor([0, 2, 3, 5])
    logits = torch.randn(4, vocab, dtype=torch.float64)
    q = torch.softmax(torch.randn(3, 4, dtype=torch.float64), -1)
    drafts = ids[q.argmax(-1)]
    config = SamplingConfig(0.8, top_k=3)
    p = torch.softmax(warp_logits(logits, config).double(), -1)[:, ids]
    overlap = torch.minimum(p[:3], q).sum(-1).tolist()
    assert observed_acceptance(logits, config, drafts, q, ids, 3, 1) == pytest.approx(overlap[:2])
    assert observed_acceptance(logits, config, drafts, q, ids, 3, 3) == pytest.approx(overlap)
    assert observed_acceptance(logits, config, drafts, q, ids, 0, 0) == pytest.approx(overlap[:1])
    greedy = SamplingConfig(0.0)
    assert observed_acceptance(logits, greedy, drafts, None, ids, 3, 1) == [1.0, 0.0]
    assert observed_acceptance(logits, greedy, drafts, None, ids, 2, 2) == [1.0, 1.0]
    best = int(logits[0].argmax())
    probe = observed_acceptance(logits, greedy, torch.tensor([best, 0, 0]), None, None, 0, 0)
    assert probe == [1.0]
    # a q the verifier's columns cannot be read against (a stand-in's extra column): the coins
    assert observed_acceptance(logits, config, drafts, torch.ones(3, 5), ids, 2, 0) == [0.0]


# ---------------------------------------------------------------------- the decoder
def _drafters() -> dict[str, object]:
    block = perturbed_block(MODEL, steps=3, draft_vocab=list(range(40)), noise=0.1)
    return {"recursive": BlockDrafter(block),
            "circuit": BlockCircuitDrafter(block, block_circuit_head(MODEL, "btree", 4,
                                                                      list(range(40))))}


@pytest.mark.parametrize("name", ["recursive", "circuit"])
@pytest.mark.parametrize("copy", [False, True], ids=["alone", "copy"])
def test_greedy_with_adaptive_depth_equals_generate(name: str, copy: bool) -> None:
    drafter = _drafters()[name]
    rule = AdaptiveDepth(CPU_COSTS, memory=2.0)
    lookup = ContextLookup((0.5,)) if copy else None
    decoder = SpeculativeDecoder(MODEL, drafter, lookup=lookup, draft_depth=rule)
    prompt = [3, 5, 7, 9, 3, 5, 7, 9, 3, 5]
    result = decoder.generate(prompt, 24, eos_token_id=())
    assert result.tokens.tolist() == greedy_generate(MODEL, prompt, 24)
    assert decoder.depths is not None and len(decoder.depths.depths) == len(result.rounds)
    assert len(set(decoder.depths.depths)) > 1  # the depth moved with what was accepted
    for stats, depth in zip(result.rounds, decoder.depths.depths, strict=True):
        assert stats.drafted <= depth


def test_depth_zero_rounds_are_plain_steps_and_the_block_keeps_following() -> None:
    drafter = _drafters()["recursive"]
    assert isinstance(drafter, BlockDrafter)
    decoder = SpeculativeDecoder(MODEL, drafter, draft_depth=forced(0, drafter.window))
    prompt = [4, 8, 15, 16, 23]
    result = decoder.generate(prompt, 10, eos_token_id=())
    assert result.tokens.tolist() == greedy_generate(MODEL, prompt, 10)
    assert all(stats.drafted == 0 and stats.emitted == 1 for stats in result.rounds)
    assert decoder.depths is not None and set(decoder.depths.depths) == {0}
    sequence = prompt + result.tokens.tolist()
    assert_cache_is_a_fresh_prefill(drafter, MODEL, sequence, drafter.window)


def test_compiled_rounds_with_adaptive_depth_equal_generate() -> None:
    double = CudaGraphDouble()
    drafter = _drafters()["recursive"]
    assert isinstance(drafter, BlockDrafter)
    drafter.step_mode = BlockStepMode.COMPILED
    with use_compiler(double):
        backbone = HFBackbone(MODEL, cache=CacheKind.STATIC, max_cache_len=64, compile=True,
                              compiled_lengths=(1,))
        decoder = SpeculativeDecoder(backbone, drafter, compile=True,
                                     draft_depth=AdaptiveDepth(CPU_COSTS, memory=2.0))
    assert set(backbone.compiled_lengths) >= {1, 2, 3, 4}  # every depth's verify block
    prompt = [3, 5, 7, 9, 3, 5, 7, 9, 3, 5]
    result = decoder.generate(prompt, 20, eos_token_id=())
    assert result.tokens.tolist() == greedy_generate(MODEL, prompt, 20)
    assert double.calls["draft block step"] > 0


def test_a_draft_depth_that_is_not_a_rule_is_refused() -> None:
    with pytest.raises(DecoderError, match="draft_depth must be None or"):
        SpeculativeDecoder(MODEL, _drafters()["recursive"], draft_depth="adaptive")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the law
@pytest.mark.parametrize("rule", ["adaptive", "depth 0", "depth 1"])
def test_sampled_law_is_the_targets_under_every_depth(rule: str) -> None:
    config = SamplingConfig(1.0)
    block = perturbed_block(SMALL, steps=2, draft_vocab=[0, 2, 3], noise=0.3)
    drafter = BlockDrafter(block)
    depth = {"adaptive": AdaptiveDepth(RoundCosts((1.0, 1.5, 1.75), 0.0), memory=2.0),
             "depth 0": forced(0, 3), "depth 1": forced(1, 3)}[rule]
    decoder = SpeculativeDecoder(SMALL, drafter, draft_depth=depth)
    generator = torch.Generator().manual_seed(0)
    samples, depths = [], set()
    for _ in range(800):
        result = decoder.generate([1, 2], 3, temperature=1.0, generator=generator, eos_token_id=())
        samples.append(tuple(result.tokens.tolist()))
        assert decoder.depths is not None
        depths.update(decoder.depths.depths)
        if rule == "depth 0":
            assert all(stats.kind is RoundKind.SPECULATIVE and stats.drafted == 0
                       for stats in result.rounds)
    target = target_law(NextTokenLogits(SMALL), [1, 2], 3, config)  # type: ignore[arg-type]
    assert law_p_value(samples, target) > 1e-3
    shifted = {((x[0] + 1) % 4, *x[1:]): p for x, p in target.items()}
    assert law_p_value(samples, shifted) < 1e-6
    if rule == "adaptive":
        assert len(depths) > 1
