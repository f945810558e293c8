"""Batched speculative decoding is exact per row, on the enumerable toy LM of tests/toy.py.

* With one generator per row, every row of a batch (rows of different lengths, one of one
  token) draws exactly the tokens the single-prompt decoder draws from that generator: heads of
  every kind, a compressed draft vocabulary, the context copy, a dynamic draft length, three
  warps. So each row's law is the single-prompt decoder's, which tests/test_decoder_exact.py
  enumerates. The rows draft in one head pass per round (circuits_llm/decoding/batch_draft.py),
  whose every row's block, q, flags and L equal RoundProgram.draft on that row alone.
* With one generator shared by the batch (rows draw in turn), a chi-square test of each row's
  first two tokens against the brute-force target law (tests/toy.py ``target_law``), batch 3; the
  paper's biased correction policy, decoded the same way, is rejected (negative control).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor
from toy import ToyHead, ToyLM, law_p_value, target_law

from circuits_llm.decoding import batch_draft
from circuits_llm.decoding.acceptance import CorrectionPolicy
from circuits_llm.decoding.autoregressive import AutoregressiveDecoder
from circuits_llm.decoding.batch_draft import draft_rows, rows_per_pass
from circuits_llm.decoding.constraint_path import round_component
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup, LookupIndex
from circuits_llm.decoding.metrics import BatchResult
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.protocols import BackboneStep

HEADS = [("ff", 1), ("cp", 2), ("hmm", 2), ("btree", 2)]
PROMPTS = [[2, 2, 1, 0], [1], [0, 3]]
WARPS = {"temperature": SamplingConfig(1.0), "top_k": SamplingConfig(0.7, top_k=2),
         "greedy": SamplingConfig(0.0)}


class RaggedToy:
    """The toy LM holding a batch of sequences (a RaggedBackbone): each row's logits are the toy's
    function of that row's own tokens, so a row that saw another's would change its law."""

    def __init__(self, lm: ToyLM) -> None:
        self.lm = lm
        self.vocab_size, self.hidden_size = lm.vocab_size, lm.hidden_size
        self.rows: list[list[int]] = []
        self.block = 0

    @property
    def lengths(self) -> list[int]:
        return [len(row) for row in self.rows]

    def start(self, rows: Sequence[Sequence[int]]) -> Tensor:
        self.rows = [list(row) for row in rows]
        self.lm.calls += int(any(self.rows))
        hidden = torch.zeros(len(rows), self.hidden_size, dtype=self.lm.draft_table.dtype)
        for b, row in enumerate(self.rows):
            if row:
                hidden[b] = self.lm.draft_table[self.lm._context(row)]
        return hidden

    def extend(self, tokens: Tensor) -> BackboneStep:
        self.lm.calls += 1
        self.block = tokens.shape[1]
        contexts = []
        for row, new in zip(self.rows, tokens.tolist(), strict=True):
            start = len(row)
            row.extend(new)
            contexts.append([self.lm._context(row[:i + 1]) for i in range(start, len(row))])
        index = torch.tensor(contexts)
        return BackboneStep(self.lm.hidden_table[index] @ self.lm.lm_head.T,
                            self.lm.draft_table[index])

    def keep(self, counts: Sequence[int]) -> None:
        for row, count in zip(self.rows, counts, strict=True):
            del row[len(row) - self.block + count:]

    def select(self, rows: Sequence[int]) -> None:
        self.rows = [self.rows[b] for b in rows]


class BatchToyLM(ToyLM):
    """A ToyLM that also decodes batches (``ragged()``)."""

    def ragged(self) -> RaggedToy:
        return RaggedToy(self)


def _decoders(architecture: str, rank: int, **options: object
              ) -> tuple[BatchToyLM, SpeculativeDecoder]:
    lm = BatchToyLM(4, draft_branch=True, seed=5, logit_scale=2.0)
    tokens = options.pop("draft_tokens", None)
    head = ToyHead(architecture, 3, rank, lm.hidden_size, 4, seed=5, scale=2.0,
                   draft_tokens=tokens)  # type: ignore[arg-type]
    return lm, SpeculativeDecoder(lm, head, **options)  # type: ignore[arg-type]


OPTIONS = {
    "plain": {},
    "draft-vocab": {"draft_tokens": [0, 1, 3]},
    "copy": {"lookup": ContextLookup((0.3, 0.6))},
    "dynamic-length": {"draft_length": DraftLength.confident(0.35)},
}


@pytest.mark.parametrize("warp", list(WARPS))
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize(("architecture", "rank"), HEADS, ids=[h for h, _ in HEADS])
def test_each_row_draws_what_it_draws_alone(architecture: str, rank: int, option: str,
                                            warp: str) -> None:
    lm, decoder = _decoders(architecture, rank, **dict(OPTIONS[option]))
    config, limits = WARPS[warp], [9, 12, 7]
    seeds = [11, 12, 13]
    alone = [decoder.generate(prompt, limit, config.temperature, config.top_k, config.top_p,
                              torch.Generator().manual_seed(seed)).tokens.tolist()
             for prompt, limit, seed in zip(PROMPTS, limits, seeds, strict=True)]
    calls = lm.calls
    sizes: list[int] = []  # the head's batch at each forward: one draft pass per round
    hook = decoder.head.register_forward_hook(  # type: ignore[union-attr]
        lambda _module, args, _output: sizes.append(args[0].shape[0]))
    result = decoder.generate(PROMPTS, limits, config.temperature, config.top_k, config.top_p,
                              [torch.Generator().manual_seed(seed) for seed in seeds])
    hook.remove()
    assert isinstance(result, BatchResult)
    assert result.tokens == alone
    assert lm.calls - calls == result.summary.backbone_calls == result.summary.rounds + 1
    assert result.summary.drafted > 0
    assert len(sizes) <= result.summary.rounds and max(sizes) == 3  # every row in one pass


@pytest.mark.parametrize("option", ["copy", "dynamic-length"])
def test_passes_of_fewer_rows_draw_the_same(option: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU a draft pass takes at most rows_per_pass rows (a big head's outputs stay within
    the caches): one row a pass draws exactly what one pass for every row draws."""
    _, decoder = _decoders("btree", 2, **dict(OPTIONS[option]))
    generators = [torch.Generator().manual_seed(seed) for seed in (11, 12, 13)]
    together = decoder.generate(PROMPTS, [9, 12, 7], 1.0, generator=generators)
    assert rows_per_pass(decoder._program(SamplingConfig(1.0))) >= 3  # a toy head: one pass
    monkeypatch.setattr(batch_draft, "CPU_PASS_BYTES", 1)
    sizes: list[int] = []
    hook = decoder.head.register_forward_hook(  # type: ignore[union-attr]
        lambda _module, args, _output: sizes.append(args[0].shape[0]))
    generators = [torch.Generator().manual_seed(seed) for seed in (11, 12, 13)]
    apart = decoder.generate(PROMPTS, [9, 12, 7], 1.0, generator=generators)
    hook.remove()
    assert set(sizes) == {1} and apart.tokens == together.tokens


@pytest.mark.parametrize("greedy", [False, True], ids=["sampling", "greedy"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize(("architecture", "rank"), HEADS, ids=[h for h, _ in HEADS])
def test_the_batched_draft_is_each_rows_draft(architecture: str, rank: int, option: str,
                                              greedy: bool) -> None:
    """draft_rows on 4 rows (one whose c = 2 is outside the compressed vocabulary [0, 1, 3])
    gives every row the block, q, flags and L of RoundProgram.draft on that row alone."""
    _, decoder = _decoders(architecture, rank, **dict(OPTIONS[option]))
    program = decoder._program(SamplingConfig(0.0 if greedy else 1.0))
    hidden = torch.randn(4, decoder.backbone.hidden_size, generator=torch.Generator().manual_seed(3),
                         dtype=torch.float64)
    c = torch.tensor([0, 2, 3, 1])
    uniforms = None if greedy else torch.stack([
        program.draw_uniforms(torch.Generator().manual_seed(b)) for b in range(4)])
    components = None
    if decoder.lookup is not None:
        components = [round_component(decoder.lookup, LookupIndex(2, prompt), None, -1, None, 2,
                                      torch.device("cpu"))
                      for prompt in ([1, 2, 1, 2, 1], [3, 3, 3], [0, 1], [2, 0, 2])]
    batched = draft_rows(program, hidden, c, uniforms, components)
    for b, draft in enumerate(batched):
        alone = program.draft(hidden[b:b + 1], c[b:b + 1], None if uniforms is None else uniforms[b],
                              None if components is None else components[b])
        assert torch.equal(draft.block, alone.block)
        assert bool(draft.head_ok) == bool(alone.head_ok)
        assert bool(draft.possible) == bool(alone.possible)
        assert int(draft.length) == int(alone.length)  # type: ignore[arg-type]
        assert (draft.q is None) == (alone.q is None)
        if draft.q is not None:
            torch.testing.assert_close(draft.q, alone.q, rtol=0, atol=1e-12)


def test_autoregressive_rows_draw_what_they_draw_alone() -> None:
    lm = BatchToyLM(4, seed=5, logit_scale=2.0)
    decoder = AutoregressiveDecoder(lm)
    alone = [decoder.generate(prompt, 8, 1.0, generator=torch.Generator().manual_seed(b))
             .tokens.tolist() for b, prompt in enumerate(PROMPTS)]
    result = decoder.generate(PROMPTS, 8, 1.0,
                              generator=[torch.Generator().manual_seed(b) for b in range(3)])
    assert result.tokens == alone


def test_sampled_rows_follow_the_target_law_and_reject_the_biased_variant() -> None:
    """Batch 3, rows of lengths 2, 1 and 3, one shared generator: each row's first two tokens
    against the enumerated target law; the paper variant (biased) is rejected."""
    lm = BatchToyLM(3, draft_branch=True, seed=3, logit_scale=0.5)
    head = ToyHead("ff", 3, 1, lm.hidden_size, 3, seed=3, scale=3.0)
    prompts, length, config = [[2, 2], [1], [0, 1, 2]], 2, SamplingConfig(1.0)
    laws = [target_law(lm, prompt, length, config) for prompt in prompts]
    p_values: dict[CorrectionPolicy, list[float]] = {}
    for policy in CorrectionPolicy:
        decoder = SpeculativeDecoder(lm, head, policy=policy)
        generator = torch.Generator().manual_seed(1234)
        samples: list[list[tuple[int, ...]]] = [[] for _ in prompts]
        for _ in range(400):
            result = decoder.generate(prompts, length, temperature=1.0, generator=generator)
            for row, tokens in zip(samples, result.tokens, strict=True):
                row.append(tuple(tokens))
        p_values[policy] = [law_p_value(row, law) for row, law in zip(samples, laws, strict=True)]
    assert min(p_values[CorrectionPolicy.EXACT]) > 1e-3
    assert p_values[CorrectionPolicy.DROP_AFTER_ACCEPT][0] < 1e-4
