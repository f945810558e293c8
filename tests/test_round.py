"""The fixed-shape round (:mod:`circuits_llm.decoding.round`): compressed vocabularies, compiled programs.

* exact laws by enumeration with a compressed draft vocabulary (greedy and sampling), the
  paper's biased variant as the negative control;
* the round program's conditionals equal the library's prefix-conditional query;
* no graph breaks: every program traces to one graph (no host synchronisation inside a round);
* compiled programs draw the very tokens the eager ones draw from the same generator, greedy
  and sampling, with and without a compressed vocabulary, and a chi-square check of sampled
  compiled decoding against the exact target law.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from toy import ToyHead, ToyLM, decoder_law, law_p_value, target_law, total_variation

from circuits.compiled.queries import log_prefix_conditionals
from circuits_llm.decoding.acceptance import SampledAccept, greedy_batch_outcomes, round_law
from circuits_llm.decoding.decoder import (
    AutoregressiveDecoder,
    CorrectionPolicy,
    DecoderError,
    SpeculativeDecoder,
)
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.round_data import DraftResult
from circuits_llm.decoding.warping import SamplingConfig

EXACT_TV = 1e-9
VOCAB = 4
DRAFT_TOKENS = (2, 0, 3)  # token 1 is outside the draft vocabulary


def _compressed(architecture: str, rank: int, window: int = 3, seed: int = 0,
                ) -> tuple[ToyLM, ToyHead]:
    lm = ToyLM(VOCAB, draft_branch=True, seed=seed)
    head = ToyHead(architecture, window, rank, lm.hidden_size, VOCAB, seed=seed,
                   draft_tokens=DRAFT_TOKENS)
    return lm, head


@pytest.mark.parametrize("config", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=3),
                                    SamplingConfig(1.2, top_p=0.8)], ids=["t1", "topk", "topp"])
@pytest.mark.parametrize(("architecture", "rank"), [("ff", 1), ("cp", 2), ("btree", 2)])
def test_compressed_vocabulary_law_is_exact(architecture: str, rank: int,
                                            config: SamplingConfig) -> None:
    """q = 0 outside the K draft tokens and the residual covers the rest: the output law is the
    target's, including after prompts that end in a token outside the draft vocabulary."""
    lm, head = _compressed(architecture, rank)
    for prompt in ([0, 2], [2, 1]):
        target = target_law(lm, prompt, 3, config)
        exact = decoder_law(lm, head, prompt, 3, config)
        assert abs(sum(exact.values()) - 1) < 1e-12
        assert total_variation(exact, target) <= EXACT_TV
    biased = decoder_law(lm, head, [0, 2], 3, SamplingConfig(1.0), CorrectionPolicy.DROP_AFTER_ACCEPT)
    assert total_variation(biased, target_law(lm, [0, 2], 3, SamplingConfig(1.0))) > 1e-3


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_compressed_vocabulary_greedy_is_the_target(compile: bool) -> None:
    lm, head = _compressed("btree", 2, window=4, seed=1)
    reference = AutoregressiveDecoder(ToyLM(VOCAB, draft_branch=True, seed=1)).generate([0, 2], 14)
    result = SpeculativeDecoder(lm, head, compile=compile).generate([0, 2], 14)
    assert torch.equal(result.tokens, reference.tokens)
    assert any(r.accepted > 0 for r in result.rounds)  # drafts from the compressed vocabulary


def test_outside_token_drafts_with_a_stand_in_drawn_from_the_head() -> None:
    """After a ``c`` outside the draft vocabulary the round still drafts: the draft program draws
    ``X_0`` with the drafts from the head (a stand-in ``s`` for ``c``) and its ``q`` is the
    conditionals given that stand-in. On 6,000 draws, the stand-in is read back from ``q`` (the
    one ``s`` whose :meth:`RoundProgram.conditionals` it equals, exactly) and the pairs
    ``(s, drafts)`` follow the head's joint law ``H(s) H(d | s)`` (chi-square); the same test
    rejects a program whose ``q`` would ignore the stand-in (every pair read as ``s = 0``)."""
    lm, head = _compressed("btree", 2, window=3, seed=3)
    program = RoundProgram(head, SamplingConfig(1.0))
    hidden = lm.extend(torch.tensor([[0, 2, 3]])).draft_hidden[:, -1]
    c = 1  # outside DRAFT_TOKENS
    size = len(DRAFT_TOKENS)
    drafts = torch.cartesian_prod(*[torch.arange(size)] * (program.window - 1))
    marginal = [float(v) for v in _stand_in_law(program, hidden, c)]
    per_stand_in = [program.conditionals(hidden, c, drafts, stand_in=s) for s in range(size)]
    law = {}
    for s, q in enumerate(per_stand_in):
        probs = q.gather(2, drafts[:, :, None])[:, :, 0].prod(1)
        for i, d in enumerate(drafts):
            law[(s, *d.tolist())] = marginal[s] * float(probs[i])
    index = {tuple(d.tolist()): i for i, d in enumerate(drafts)}
    generator = torch.Generator().manual_seed(0)
    pairs, ignored = [], []
    for _ in range(6000):
        draft = program.draft(hidden, torch.tensor([c]), program.draw_uniforms(generator))
        assert bool(draft.possible)
        key = tuple(program.position[draft.tokens].tolist())
        matches = [s for s, q in enumerate(per_stand_in)
                   if torch.allclose(draft.q, q[index[key]], rtol=0, atol=1e-12)]
        assert len(matches) == 1, matches
        pairs.append((matches[0], *key))
        ignored.append((0, *key))
    assert law_p_value(pairs, law) > 1e-4
    assert law_p_value(ignored, law) < 1e-4


def _stand_in_law(program: RoundProgram, hidden: torch.Tensor, c: int) -> torch.Tensor:
    """The head's marginal of ``X_0`` without the token, from the prefix query."""
    raw = program.head_parameters(hidden, torch.tensor([c]))
    size = program.draft_size
    x = torch.arange(size)[:, None].expand(size, program.window).contiguous()
    with torch.no_grad():
        logs = log_prefix_conditionals(program.circuit, x, None,
                                       {k: v.expand(size, *v.shape[1:]) for k, v in raw.items()})
    return logs[0, 0].double().exp()


def test_program_conditionals_equal_the_prefix_query() -> None:
    lm = ToyLM(VOCAB, seed=4)
    head = ToyHead("hmm", 4, 3, lm.hidden_size, VOCAB, seed=4)
    program = RoundProgram(head, SamplingConfig(1.0))
    hidden = torch.randn(1, lm.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    drafts = torch.tensor([[0, 3, 1], [2, 2, 2], [1, 0, 3]])
    ours = program.conditionals(hidden, 1, drafts)
    x = torch.cat([torch.ones(3, 1, dtype=torch.long), drafts], 1)
    with torch.no_grad():
        raw = {k: v.expand(3, *v.shape[1:]) for k, v in head(hidden).items()}
        reference = log_prefix_conditionals(head.circuit, x, None, raw)[:, 1:].exp()
    torch.testing.assert_close(ours, reference.double(), rtol=1e-12, atol=1e-12)


@settings(max_examples=60)
@given(seed=st.integers(0, 2**31 - 1), compressed=st.booleans(), zero_row=st.booleans())
def test_accept_decisions_equal_the_round_law(seed: int, compressed: bool, zero_row: bool) -> None:
    """The accept program builds one fallback row, not all of them: its decision and the law of
    the emitted token equal :func:`round_law`'s, with q = 0 outside a compressed vocabulary, q
    entries of zero (never accepted) and a non-finite q row (impossible evidence)."""
    generator = torch.Generator().manual_seed(seed)
    vocab, window = 9, 4
    tokens = (4, 0, 7, 2, 8) if compressed else None
    program = RoundProgram(ToyHead("ff", window, 1, 3, vocab, seed=seed % 97, draft_tokens=tokens),
                           SamplingConfig(1.0))
    size = program.draft_size
    p = torch.softmax(3 * torch.randn(window, vocab, dtype=torch.float64, generator=generator), -1)
    q = torch.softmax(3 * torch.randn(window - 1, size, dtype=torch.float64, generator=generator), -1)
    q = torch.where(torch.rand(q.shape, generator=generator, dtype=torch.float64) < 0.2, 0.0, q)
    if zero_row:
        q[1] = torch.nan
    index = torch.randint(0, size, (window - 1,), generator=generator)
    drafts = index if tokens is None else torch.tensor(tokens)[index]
    tests = torch.rand(window - 1, generator=generator, dtype=torch.float64)
    accepted, row = program._decide(p, q, drafts, tests)
    q_full = q if tokens is None else \
        p.new_zeros(window - 1, vocab).index_copy(1, torch.tensor(tokens), q)
    law = round_law(p, q_full, drafts)
    expected = int(torch.cumprod((tests < law.accept).long(), 0).sum())
    assert int(accepted) == expected
    torch.testing.assert_close(row, law.fallback[expected], rtol=1e-14, atol=1e-15)


@settings(max_examples=60)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5))
def test_greedy_outcomes_of_a_batch_equal_each_rows_accept(seed: int, rows: int) -> None:
    """A batch's greedy rows decided together (``greedy_batch_outcomes``: one maximum over every row,
    padding columns past a row's ``L + 1``, other rows that do not draft) give each row what
    the single-row accept program gives it alone: ties (the first maximum), non-finite verifier
    rows (only inside ``L + 1`` do they count), impossible drafts, a block wider than ``L``."""
    generator = torch.Generator().manual_seed(seed)
    vocab, window = 6, 4
    program = RoundProgram(ToyHead("ff", window, 1, 3, vocab, seed=seed % 89), SamplingConfig(0))
    batch = rows + 1  # one more row that verifies no draft (an autoregressive row)
    lengths = torch.randint(0, window, (rows,), generator=generator).tolist()
    # a row may verify more drafts than its rule decides on (a batch's fixed width): ``L`` is
    # the draft's length, the row's block the wider one
    blocks = [min(window - 1, length + int(torch.randint(0, 2, (), generator=generator)))
              for length in lengths]
    width = max(blocks) + 1
    logits = torch.randint(0, 3, (batch, width, vocab), generator=generator).double()  # ties
    bad = torch.rand(batch, width, generator=generator) < 0.1
    logits[bad] = torch.nan
    at = torch.randperm(batch, generator=generator)[:rows].tolist()
    drafts = []
    for b, length in zip(at, lengths, strict=True):  # drafts that often match the maximum
        best = logits[b].nan_to_num(-1).argmax(-1)
        tokens = torch.where(torch.rand(window - 1, generator=generator) < 0.7,
                             torch.nn.functional.pad(best[1:], (0, window - width), value=0),
                             torch.randint(0, vocab, (window - 1,), generator=generator))
        possible = torch.tensor(bool(torch.rand((), generator=generator) < 0.9))
        drafts.append(DraftResult(tokens, torch.cat([best[:1], tokens])[None], None,
                                  torch.tensor(True), possible, torch.tensor(length)))
    together = greedy_batch_outcomes(window, logits, at, drafts, blocks)
    for b, draft, block, outcome in zip(at, drafts, blocks, together, strict=True):
        alone = program.outcome(program.accept(logits[b, :block + 1], draft, None))
        assert outcome == alone


def test_greedy_outcomes_read_each_rows_own_logits() -> None:
    """Negative control of the batch's greedy accept: two rows whose drafts match only their
    own verifier rows accept all of them, and none when the rows are swapped."""
    logits = torch.zeros(2, 3, 5, dtype=torch.float64)
    logits[0, :, 1] = logits[1, :, 3] = 1.0  # row 0's maximum is token 1, row 1's token 3
    drafts = [DraftResult(torch.tensor([t, t]), torch.tensor([[0, t, t]]), None,
                          torch.tensor(True), torch.tensor(True)) for t in (1, 3)]
    assert [o.accepted for o in greedy_batch_outcomes(3, logits, [0, 1], drafts, [2, 2])] == [2, 2]
    assert [o.accepted for o in greedy_batch_outcomes(3, logits, [1, 0], drafts, [2, 2])] == [0, 0]


def test_bad_draft_tokens_are_one_clear_error() -> None:
    lm = ToyLM(VOCAB)
    head = ToyHead("cp", 3, 2, lm.hidden_size, VOCAB, draft_tokens=(0, 1, 2))
    head.draft_tokens = torch.tensor([0, 0, 2])
    with pytest.raises(DecoderError, match="distinct ids"):
        SpeculativeDecoder(lm, head)
    head.draft_tokens = torch.tensor([0, 1])
    with pytest.raises(DecoderError, match="2 categories"):
        SpeculativeDecoder(lm, head)


# ---------------------------------------------------------------------- one graph per program
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling"])
@pytest.mark.parametrize(("architecture", "rank", "draft_tokens"), [
    ("ff", 1, None), ("cp", 2, None), ("hmm", 2, DRAFT_TOKENS), ("btree", 2, None)])
def test_programs_trace_to_one_graph(architecture: str, rank: int,
                                     draft_tokens: tuple[int, ...] | None, greedy: bool) -> None:
    """No .item(), no data-dependent shape, no Python branch on a tensor: one graph each."""
    lm = ToyLM(VOCAB, seed=2)
    head = ToyHead(architecture, 4, rank, lm.hidden_size, VOCAB, seed=2, draft_tokens=draft_tokens)
    program = RoundProgram(head, SamplingConfig(0.0 if greedy else 0.9, top_k=3))
    hidden = torch.randn(1, lm.hidden_size, dtype=torch.float64)
    c = torch.tensor([2])
    uniforms = None if greedy else program.draw_uniforms(torch.Generator().manual_seed(0))
    with torch.no_grad():
        explained = torch._dynamo.explain(program._draft_program)(hidden, c, uniforms)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        draft = program._result(*program._draft_program(hidden, c, uniforms))
        logits = torch.randn(4, VOCAB, dtype=torch.float64)
        explained = torch._dynamo.explain(program._accept_eager)(
            logits, draft.tokens, draft.q, draft.possible, uniforms)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


# ---------------------------------------------------------------------- compiled = eager
@pytest.fixture(scope="module")
def compiled_pair() -> tuple[SpeculativeDecoder, SpeculativeDecoder]:
    """One eager and one compiled decoder on the same toy (compiling costs seconds: shared). The
    eager one accepts a sampled round row by row (a CPU's default), the compiled one over the
    whole window in one program (a GPU's): the two implementations must draw the same tokens."""
    lm, head = _compressed("btree", 2, window=4, seed=5)
    return (SpeculativeDecoder(lm, head, sampled_accept=SampledAccept.ROW_BY_ROW),
            SpeculativeDecoder(ToyLM(VOCAB, draft_branch=True, seed=5), head, compile=True,
                               sampled_accept=SampledAccept.WHOLE_WINDOW))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
def test_compiled_round_draws_what_the_eager_round_draws(
        compiled_pair: tuple[SpeculativeDecoder, SpeculativeDecoder], temperature: float) -> None:
    eager, compiled = compiled_pair
    for seed in range(3):
        first = eager.generate([1, 2, 0], 16, temperature, top_k=3 if temperature else None,
                               generator=torch.Generator().manual_seed(seed))
        second = compiled.generate([1, 2, 0], 16, temperature, top_k=3 if temperature else None,
                                   generator=torch.Generator().manual_seed(seed))
        assert torch.equal(first.tokens, second.tokens)
        assert [r.accepted for r in first.rounds] == [r.accepted for r in second.rounds]


def test_compiled_sampling_matches_the_exact_law(
        compiled_pair: tuple[SpeculativeDecoder, SpeculativeDecoder]) -> None:
    """Chi-square of 300 compiled two-token decodes against the brute-force target law."""
    _, compiled = compiled_pair
    lm = ToyLM(VOCAB, draft_branch=True, seed=5)
    law = target_law(lm, [1, 2], 2, SamplingConfig(1.0))
    generator = torch.Generator().manual_seed(99)
    samples = [tuple(compiled.generate([1, 2], 2, 1.0, generator=generator).tokens.tolist())
               for _ in range(300)]
    assert set(samples) <= set(law)
    assert law_p_value(samples, law) > 1e-3


def test_compiled_rounds_over_an_eager_backbone_compile_once() -> None:
    """An eager backbone hands the round hidden states that are views of blocks of different
    lengths (the prefill, then ``L + 1`` tokens), so their strides differ; the round program
    copies them to one layout, so after the first call no round compiles again (it used to
    compile once per block length, seconds each on a CPU)."""
    from torch._dynamo.utils import counters

    head = ToyHead("cp", 3, 2, 6, VOCAB, seed=6)
    decoder = SpeculativeDecoder(ToyLM(VOCAB, draft_branch=True, seed=6), head, compile=True,
                                 draft_length=DraftLength.confident(0.3, minimum=0))
    decoder.generate([1, 2, 0], 12, 1.0, generator=torch.Generator().manual_seed(0))
    graphs = counters["stats"]["unique_graphs"]
    lengths = set()
    for seed, prompt in enumerate(([0, 1], [2, 2, 1, 0, 3], [3, 1, 2, 0])):
        result = decoder.generate(prompt, 12, 1.0, generator=torch.Generator().manual_seed(seed))
        lengths |= {r.drafted for r in result.rounds}
    assert len(lengths) >= 2, lengths
    assert counters["stats"]["unique_graphs"] == graphs
