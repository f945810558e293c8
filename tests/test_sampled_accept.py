"""A sampled round's accept computed row by row (a CPU's default) decides what the whole-window
program decides (:mod:`circuits_llm.decoding.acceptance`, :class:`SampledAccept`).

* :func:`row_by_row_decisions` equals :func:`round_decisions` bit for bit (the accepted count and
  the law of the emitted token) over random targets and drafts: compressed vocabularies, zero and
  non-finite ``q`` rows, shorter ``L``, the extra column of a proposal outside the vocabulary,
  warped targets; and it reads the tests it is given (a negative control with the tests reversed);
* the program's packed outcome is the same in both modes, flags included (non-finite verifier
  rows, impossible evidence, a head that failed);
* :func:`draw_from_row_on_host` draws :func:`draw_from_row`'s token, including the fallback when
  the inverse CDF lands on a zero entry.

The decoder's exact law with the row-by-row accept is what the chi-square tests of
``test_decoder_exact.py``, ``test_draft_block_law.py`` and ``test_batch_law.py`` sample on a CPU
(its default there); ``test_round.py`` checks that it draws the very tokens the compiled
whole-window program draws.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from circuits_llm.decoding.acceptance import (
    SampledAccept,
    draw_from_row,
    draw_from_row_on_host,
    round_decisions,
    row_by_row_decisions,
)
from circuits_llm.decoding.decoder import DecoderError, SpeculativeDecoder
from circuits_llm.decoding.round import AcceptProgram
from circuits_llm.decoding.round_data import DraftResult
from circuits_llm.decoding.warping import SamplingConfig, warp_logits

VOCAB = 9
CONFIGS = (SamplingConfig(1.0), SamplingConfig(0.7, top_k=4), SamplingConfig(1.3, top_p=0.8))


def _case(seed: int, window: int, compressed: bool, extra: bool, config: SamplingConfig
          ) -> dict[str, torch.Tensor | None]:
    """Random verifier logits, draft conditionals (zeros, sometimes a non-finite row), drafts
    biased towards likely tokens (so that rounds accept several), uniforms."""
    generator = torch.Generator().manual_seed(seed)
    tokens_kept = torch.tensor((4, 0, 7, 2, 8)) if compressed else None
    size = VOCAB if tokens_kept is None else tokens_kept.numel()
    logits = 2 * torch.randn(window, VOCAB, dtype=torch.float64, generator=generator)
    q = torch.softmax(2 * torch.randn(window - 1, size + extra, dtype=torch.float64,
                                      generator=generator), -1)
    q = torch.where(torch.rand(q.shape, generator=generator, dtype=torch.float64) < 0.15, 0.0, q)
    if torch.rand((), generator=generator) < 0.2:
        q[int(torch.randint(0, window - 1, (), generator=generator))] = torch.nan
    index = torch.multinomial(q[:, :size].nan_to_num(0.5) + 1e-3, 1, generator=generator)[:, 0]
    drafts = index if tokens_kept is None else tokens_kept[index]
    extras = None
    if extra:  # a proposal's token per row, sometimes one of the drafts, sometimes outside
        extras = torch.where(torch.rand(window - 1, generator=generator) < 0.5, drafts,
                             torch.randint(0, VOCAB, (window - 1,), generator=generator))
    position = None
    if tokens_kept is not None:
        position = torch.full((VOCAB,), -1, dtype=torch.long)
        position[tokens_kept] = torch.arange(size)
    tests = torch.rand(window - 1, generator=generator, dtype=torch.float64) ** 2
    return {"warped": warp_logits(logits, config), "q": q, "tokens": drafts, "tests": tests,
            "position": position, "draft_tokens": tokens_kept, "extra": extras}


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), window=st.integers(2, 5), compressed=st.booleans(),
       extra=st.booleans(), config=st.sampled_from(CONFIGS), data=st.data())
def test_row_by_row_decides_what_the_whole_window_decides(
        seed: int, window: int, compressed: bool, extra: bool, config: SamplingConfig,
        data: st.DataObject) -> None:
    case = _case(seed, window, compressed, extra, config)
    length = data.draw(st.integers(0, window - 1), label="L")
    warped = case["warped"]
    assert warped is not None
    p = torch.softmax(warped.double(), -1)
    whole = round_decisions(p, case["q"], case["tokens"], case["tests"], length,  # type: ignore[arg-type]
                            case["position"], case["draft_tokens"], case["extra"])
    rows = row_by_row_decisions(warped, case["q"], case["tokens"], case["tests"],  # type: ignore[arg-type]
                                length, case["position"], case["draft_tokens"], case["extra"])
    assert rows[0] == int(whole[0])
    assert torch.equal(rows[1], whole[1])


def test_row_by_row_reads_the_tests_it_is_given() -> None:
    """Negative control: with each round's tests reversed the decisions change in some rounds, so
    the comparison above would catch a test read from the wrong row."""
    changed = 0
    for seed in range(60):
        case = _case(seed, 5, compressed=False, extra=False, config=CONFIGS[0])
        arguments = (case["warped"], case["q"], case["tokens"])
        tail = (4, case["position"], case["draft_tokens"], case["extra"])
        straight = row_by_row_decisions(*arguments, case["tests"], *tail)  # type: ignore[arg-type]
        flipped = row_by_row_decisions(*arguments, case["tests"].flip(0), *tail)  # type: ignore[arg-type,union-attr]
        changed += straight[0] != flipped[0]
    assert changed > 0


def _program(mode: SampledAccept, window: int, config: SamplingConfig, compressed: bool
             ) -> AcceptProgram:
    kept = torch.tensor((4, 0, 7, 2, 8)) if compressed else None
    program = AcceptProgram(config, window, VOCAB, kept, torch.device("cpu"))
    program.use_sampled_accept(mode, torch.device("cpu"))
    return program


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), compressed=st.booleans(), config=st.sampled_from(CONFIGS),
       length=st.integers(0, 3), broken=st.sampled_from(["none", "nan row", "head", "impossible"]))
def test_the_program_returns_the_same_outcome_in_both_modes(
        seed: int, compressed: bool, config: SamplingConfig, length: int, broken: str) -> None:
    """The packed outcome (drafts, ``L``, accepted count, token, head / verifier / evidence
    flags) of :meth:`AcceptProgram.accept` is the same row by row as over the whole window, from
    the same uniforms; the verifier's rows after ``L + 1`` are never passed, as in a round."""
    window = 4
    case = _case(seed, window, compressed, False, config)
    generator = torch.Generator().manual_seed(seed + 1)
    logits = 2 * torch.randn(length + 1, VOCAB, generator=generator)
    if broken == "nan row":
        logits[int(torch.randint(0, length + 1, (), generator=generator))] = torch.nan
    tokens, q = case["tokens"], case["q"]
    assert tokens is not None and q is not None
    draft = DraftResult(tokens, torch.cat([tokens[:1], tokens])[None], q,
                        torch.tensor(broken != "head"), torch.tensor(broken != "impossible"),
                        torch.tensor(length))
    uniforms = torch.rand(2 * window, dtype=torch.float64, generator=generator)
    outcomes = {mode: AcceptProgram.outcome(_program(mode, window, config, compressed).accept(
        logits, draft, uniforms)) for mode in (SampledAccept.WHOLE_WINDOW,
                                               SampledAccept.ROW_BY_ROW)}
    whole, rows = outcomes[SampledAccept.WHOLE_WINDOW], outcomes[SampledAccept.ROW_BY_ROW]
    assert rows == whole
    assert rows.verifier_ok == (broken != "nan row")


def test_draw_on_the_host_takes_draw_from_rows_token() -> None:
    """Random rows with zero entries (a zero tail included) and uniforms up to the largest below
    1, where ``uniform x total`` can round up to the total and the fallback (the first maximum)
    decides."""
    generator = torch.Generator().manual_seed(0)
    fallbacks = 0
    for trial in range(400):
        row = torch.rand(37, dtype=torch.float64, generator=generator)
        row = torch.where(torch.rand(37, generator=generator) < 0.4, 0.0, row)
        if trial % 4 == 0:
            row[-5:] = 0.0
        if not bool(row.any()):
            row[3] = 1.0
        uniform = 1 - 2.0**-53 if trial % 3 == 0 else float(torch.rand((), generator=generator))
        token = draw_from_row_on_host(row, uniform)
        assert token == int(draw_from_row(row, torch.tensor(uniform, dtype=torch.float64)))
        assert float(row[token]) > 0
        fallbacks += token == int(row.argmax()) and uniform > 0.99
    assert fallbacks > 0


def test_sampled_accept_resolves_by_device_and_is_checked() -> None:
    assert SampledAccept.AUTO.resolve(torch.device("cpu")) is SampledAccept.ROW_BY_ROW
    assert SampledAccept.AUTO.resolve(torch.device("cuda")) is SampledAccept.WHOLE_WINDOW
    for mode in (SampledAccept.ROW_BY_ROW, SampledAccept.WHOLE_WINDOW):
        assert mode.resolve(torch.device("cuda")) is mode
    program = _program(SampledAccept.AUTO, 3, CONFIGS[0], False)
    assert program.sampled_accept is SampledAccept.ROW_BY_ROW
    with pytest.raises(DecoderError, match="sampled_accept must be a SampledAccept"):
        program.use_sampled_accept("row-by-row", torch.device("cpu"))  # type: ignore[arg-type]
    from toy import ToyHead, ToyLM
    lm = ToyLM(4, draft_branch=True, seed=0)
    head = ToyHead("ff", 3, 1, lm.hidden_size, 4, seed=0)
    with pytest.raises(DecoderError, match="sampled_accept must be a SampledAccept"):
        SpeculativeDecoder(lm, head, sampled_accept="whole-window")  # type: ignore[arg-type]
