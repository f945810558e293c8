"""Decoding with a draft block samples exactly the target's (warped) law.

The decoder's law of the first tokens is enumerated on a tiny-vocabulary Llama: every draft path
weighted by the block's own conditionals, computed here from a fresh block prefill of each history
(independently of the decoder's cache following), every accept/reject outcome by
:func:`~circuits_llm.decoding.acceptance.round_law`; it equals the brute-force target law, and a
wrong ``q`` (the first step's law used for the second draft) is detected. The real ``generate``
is then sampled against the target law (chi-square).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from cuda_graph_double import CudaGraphDouble
from draft_block_models import NextTokenLogits, perturbed_block, tiny_llama
from toy import add_outcomes, continuation_law, law_p_value, target_law, total_variation

from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.acceptance import CorrectionPolicy, SampledAccept, round_law
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.decoding.warping import SamplingConfig, target_probs, warp_logits
from circuits_llm.draft_block import BlockDrafter, BlockStepMode, DraftBlock, DraftWeights
from circuits_llm.runtime.compiling import use_compiler

VOCAB = 4
MODEL = tiny_llama(vocab=VOCAB, scale=3.0)
PROMPT = [1, 2]
WARPS = {"temperature": SamplingConfig(1.0), "top_k": SamplingConfig(0.7, top_k=2)}
Law = dict[tuple[int, ...], float]


def _target_law(length: int, config: SamplingConfig) -> Law:
    return target_law(NextTokenLogits(MODEL), PROMPT, length, config)  # type: ignore[arg-type]


def _decoder_law(block: DraftBlock, length: int, config: SamplingConfig,
                 wrong_q: bool = False, weights: DraftWeights = DraftWeights.AS_TRAINED) -> Law:
    """The decoder's law, enumerated (two drafts per round; the drafts' laws read by the block the
    drafter runs, int8 under ``DraftWeights.INT8``)."""
    assert block.window == 3 and block.draft_tokens is not None
    ids = block.draft_tokens
    backbone = HFBackbone(MODEL)

    def law_of(logits: torch.Tensor) -> torch.Tensor:  # over the draft vocabulary, in V columns
        full = torch.zeros(VOCAB, dtype=torch.float64)
        full[ids] = torch.softmax(warp_logits(logits[0], config).double(), -1)
        return full

    def round_outcomes(sequence: tuple[int, ...]) -> Law:
        outcomes: Law = defaultdict(float)
        _, hidden = backbone.hidden_states(torch.tensor([sequence[:-1]]))
        drafter = BlockDrafter(block, weights=weights)
        drafter.begin(hidden[:, :-1], torch.tensor(sequence[1:-1], dtype=torch.long))
        readout = drafter.block.logits
        with torch.no_grad():
            first = drafter.first_step(hidden[:, -1], torch.tensor([sequence[-1]]))
            q1 = law_of(readout(first))
            for d1 in ids.tolist():
                drafter.drop_speculative()
                q2 = law_of(readout(drafter.next_step(first, torch.tensor([d1]))))
                for d2 in ids.tolist():
                    weight = float(q1[d1] * q2[d2])
                    if weight <= 0:
                        continue
                    logits = MODEL(torch.tensor([[*sequence, d1, d2]])).logits[0, -3:]
                    p = target_probs(logits, config)
                    q = torch.stack([q1, q1 if wrong_q else q2])
                    add_outcomes(outcomes, round_law(p, q, torch.tensor([d1, d2])),
                                 torch.tensor([d1, d2]), CorrectionPolicy.EXACT, weight)
        return outcomes

    return continuation_law(round_outcomes, PROMPT, length)


@pytest.mark.parametrize("weights", [DraftWeights.AS_TRAINED, DraftWeights.INT8],
                         ids=["as-trained", "int8"])
@pytest.mark.parametrize("warp", list(WARPS))
def test_enumerated_law_equals_target_and_a_wrong_q_is_detected(warp: str,
                                                                weights: DraftWeights) -> None:
    config = WARPS[warp]
    block = perturbed_block(MODEL, steps=2, draft_vocab=[0, 2, 3], noise=0.3)
    target = _target_law(3, config)
    exact = _decoder_law(block, 3, config, weights=weights)
    assert abs(sum(exact.values()) - 1) < 1e-12
    assert total_variation(exact, target) <= 1e-9
    wrong = _decoder_law(block, 3, config, wrong_q=True, weights=weights)
    assert total_variation(wrong, target) > 1e-3


@pytest.mark.parametrize(("trained", "steps"), [(2, None), (1, 2)],
                         ids=["as-trained", "deeper-than-trained"])
def test_sampled_generate_follows_the_target_law(trained: int, steps: int | None) -> None:
    config = WARPS["temperature"]
    block = perturbed_block(MODEL, steps=trained, draft_vocab=[0, 2, 3], noise=0.3)
    decoder = SpeculativeDecoder(MODEL, BlockDrafter(block, steps=steps))
    generator = torch.Generator().manual_seed(0)
    samples = [tuple(decoder.generate(PROMPT, 2, temperature=1.0, generator=generator,
                                      eos_token_id=()).tokens.tolist()) for _ in range(800)]
    assert law_p_value(samples, _target_law(2, config)) > 1e-3


def test_sampled_generate_with_int8_weights_follows_the_target_law() -> None:
    """The chi-square with the block's projections in int8 (packed kernel: the toy's widths are
    multiples of 16), and its negative control (a shifted first token)."""
    block = perturbed_block(MODEL, steps=2, draft_vocab=[0, 2, 3], noise=0.3)
    drafter = BlockDrafter(block, weights=DraftWeights.INT8)
    assert drafter.weights is DraftWeights.INT8 and drafter.block is not block
    decoder = SpeculativeDecoder(MODEL, drafter)
    generator = torch.Generator().manual_seed(0)
    samples = [tuple(decoder.generate(PROMPT, 2, temperature=1.0, generator=generator,
                                      eos_token_id=()).tokens.tolist()) for _ in range(800)]
    target = _target_law(2, WARPS["temperature"])
    assert law_p_value(samples, target) > 1e-3
    shifted = {((x[0] + 1) % VOCAB, *x[1:]): p for x, p in target.items()}
    assert law_p_value(samples, shifted) < 1e-6


def test_sampled_generate_with_compiled_block_calls_follows_the_target_law() -> None:
    """The same chi-square with the block's calls compiled (through the CUDA-graph replay double,
    with the round programs), and its negative control: the same run is far from a law whose
    first token is shifted, so the test can fail."""
    config = WARPS["temperature"]
    block = perturbed_block(MODEL, steps=2, draft_vocab=[0, 2, 3], noise=0.3)
    double = CudaGraphDouble()
    with use_compiler(double):
        decoder = SpeculativeDecoder(MODEL, BlockDrafter(block, step_mode=BlockStepMode.COMPILED),
                                     compile=True, sampled_accept=SampledAccept.WHOLE_WINDOW)
    generator = torch.Generator().manual_seed(0)
    samples = [tuple(decoder.generate(PROMPT, 2, temperature=1.0, generator=generator,
                                      eos_token_id=()).tokens.tolist()) for _ in range(800)]
    target = _target_law(2, config)
    assert double.calls["draft block step"] > 0
    assert any(name.startswith("accept program") for name in double.calls)  # the GPU's accept
    assert law_p_value(samples, target) > 1e-3
    shifted = {((x[0] + 1) % VOCAB, *x[1:]): p for x, p in target.items()}
    assert law_p_value(samples, shifted) < 1e-6
