"""Forced runs past the draft (jump-forward): tokens the constraint forces after a product draft
join the verify block and are emitted with it, and the output law stays the constrained model's.

On the toy vocabulary ``<eos> a b c d`` with the regex ``(a|bcbc)*d``, every ``b`` forces ``c b
c``: a run longer than the heads' window (3: two drafts). The tests check the exact law of the
speculative decoder, enumerated with the forced runs (:func:`toy_constrained.constrained_decoder_law`)
against constrained autoregressive decoding's, for ff, hmm and btree heads, greedy, sampling and
top-k; greedy = constrained AR eager and compiled; that real rounds emit more tokens than the window
holds; sampling end to end by chi-square, with a negative control (the token after a forced run
drawn at the wrong temperature) that the same test rejects.
"""

from __future__ import annotations

import pytest
import torch
from test_constrained_decoding import CONFIGS, RANKS, TOKENIZER, aot_eager, head, lm, pooled
from toy import law_p_value, total_variation
from toy_constrained import constrained_decoder_law, constrained_target_law

import circuits_llm.decoding.constrained as constrained_module
from circuits_llm.constraints import Regex, TokenAutomaton
from circuits_llm.decoding.constrained import ConstrainedDrafting
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.warping import SamplingConfig, target_probs
from circuits_llm.runtime.compiling import use_compiler

PRODUCT = ConstrainedDrafting.PRODUCT
RUNS = TokenAutomaton.build(Regex("(a|bcbc)*d"), TOKENIZER)
A, B, C, D, EOS = 1, 2, 3, 4, 0
PROMPTS = ([1, 2], [3], [4, 1, 0], [2, 2, 3])


def _valid(tokens: list[int]) -> None:
    state = RUNS.initial_state
    for token in tokens:
        state = RUNS.advance(state, token)  # raises on a forbidden token


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("architecture", list(RANKS))
def test_enumerated_law_with_forced_runs_is_the_constrained_law(architecture: str,
                                                                config: str) -> None:
    model, draft = lm(), head(architecture)
    cfg = CONFIGS[config]
    for prompt, length in (([1, 2], 6), ([3], 5)):
        want = constrained_target_law(model, RUNS, prompt, length, cfg)
        got = constrained_decoder_law(model, draft, RUNS, prompt, length, cfg, PRODUCT)
        assert abs(sum(got.values()) - 1) < 1e-12
        assert total_variation(got, want) < 1e-9, (prompt, total_variation(got, want))
        if config != "greedy":  # outputs with a forced run (b c b c): the enumerator walked them
            assert any(out[i:i + 4] == (B, C, B, C) for out in want for i in range(len(out)))


def _forced_rounds(decoder: SpeculativeDecoder, prompt: list[int], limit: int,
                   **options: object) -> tuple[list[int], int]:
    """The output and how many rounds emitted a forced run (more than the accepted drafts and
    one token)."""
    result = decoder.generate(prompt, limit, constraint=RUNS, eos_token_id=(), **options)
    tokens = result.tokens.tolist()
    _valid(tokens)
    return tokens, sum(r.emitted > r.accepted + 1 for r in result.rounds)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("architecture", list(RANKS))
def test_greedy_with_forced_runs_is_constrained_autoregressive(architecture: str,
                                                               compiled: bool) -> None:
    reference = AutoregressiveDecoder(lm())
    with use_compiler(aot_eager):
        decoder = SpeculativeDecoder(lm(), head(architecture, scale=3.0), compile=compiled)
    long_rounds = 0
    for prompt in PROMPTS:
        for limit in (4, 14):
            want = reference.generate(prompt, limit, constraint=RUNS, eos_token_id=())
            got, forced = _forced_rounds(decoder, prompt, limit)
            assert got == want.tokens.tolist(), (prompt, limit)
            assert decoder.backbone.length == len(prompt) + len(got) - 1
            long_rounds += forced
    assert long_rounds > 0  # some rounds emitted a forced run past the window


def _samples(decoder: AutoregressiveDecoder, prompt: list[int], length: int,
             config: SamplingConfig, seed: int, count: int) -> tuple[list[tuple[int, ...]], int]:
    """``count`` decodes, and how many of their rounds emitted a forced run."""
    generator = torch.Generator().manual_seed(seed)
    out, forced = [], 0
    for _ in range(count):
        result = decoder.generate(prompt, length, config.temperature, top_k=config.top_k,
                                  generator=generator, constraint=RUNS)
        _valid(result.tokens.tolist())
        out.append(tuple(result.tokens.tolist()))
        forced += sum(r.emitted > r.accepted + 1 for r in result.rounds)
    return out, forced


def test_sampling_with_forced_runs_matches_the_law_and_a_biased_tail_is_rejected(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Real decodes against the enumerated law; then the token after a forced run drawn at
    temperature 3 instead of the decode's (the negative control): the same test rejects it."""
    config = CONFIGS["sampling"]
    decoder = SpeculativeDecoder(lm(), head("btree", scale=3.0))
    law = constrained_target_law(lm(), RUNS, [2, 2], 6, config)
    samples, forced = _samples(decoder, [2, 2], 6, config, seed=3, count=1500)
    assert law_p_value(*pooled(samples, law)) > 1e-3
    assert forced > 100, forced  # the path under test ran

    def hot(row: torch.Tensor, cfg: SamplingConfig, name: str = "") -> torch.Tensor:
        return target_probs(row, SamplingConfig(3.0), name)
    monkeypatch.setattr(constrained_module, "target_probs", hot)  # the draw after a forced run
    biased, _ = _samples(decoder, [2, 2], 6, config, seed=3, count=1500)
    assert law_p_value(*pooled(biased, law)) < 1e-6


def test_a_decoder_without_a_constraint_never_jumps() -> None:
    """Without a constraint (or with FREE drafting) a round emits at most the window."""
    decoder = SpeculativeDecoder(lm(), head("btree", scale=3.0))
    result = decoder.generate([2, 2], 20, eos_token_id=())
    assert all(r.emitted <= decoder.head.window for r in result.rounds)
    free = SpeculativeDecoder(lm(), head("btree", scale=3.0),
                              constrained_drafting=ConstrainedDrafting.FREE)
    result = free.generate([2, 2], 20, constraint=RUNS, eos_token_id=())
    _valid(result.tokens.tolist())
    assert all(r.emitted <= free.head.window for r in result.rounds)
