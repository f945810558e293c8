"""``benchmarks/acceptance_measures.py``, ``benchmarks/acceptance_speed.py`` and the table and CLI
of ``benchmarks/expected_acceptance.py``: the expected acceptance of a head's first and second
drafts on fixed text, against the head's joint law enumerated on the toy LM, the tempered head it
can measure, and the speed bounds against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.acceptance_measures import (
    Acceptance,
    TemperedHead,
    collect_positions,
    expected_acceptance,
    measure_head,
    position_acceptance,
)
from benchmarks.acceptance_speed import RoundCosts, measure_costs, speed_bounds
from benchmarks.expected_acceptance import main, table
from circuits.compiled.queries import log_marginal
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import SamplingConfig
from tests.toy import ToyHead, ToyLM

VOCAB, WINDOW = 5, 3


def _joint(head: object, hidden: torch.Tensor) -> torch.Tensor:
    """The head's normalised joint law over the window, (K,) * WINDOW, by enumeration."""
    with torch.no_grad():
        raw = head(hidden)  # type: ignore[operator]
    k = head.circuit.category_sizes[0]  # type: ignore[attr-defined]
    x = torch.tensor(list(itertools.product(range(k), repeat=WINDOW)))
    params = {name: value.expand(x.shape[0], *value.shape[1:]) for name, value in raw.items()}
    log_p = log_marginal(head.circuit, x, None, params)  # type: ignore[attr-defined]
    p = log_p.double().exp().view(*([k] * WINDOW))
    return p / p.sum()


def _brute_force(lm: ToyLM, head: object, text: list[int], draft: list[int] | None
                 ) -> tuple[float, float, int, int]:
    """alpha1 and beta2 summed over the text by enumeration, with their position counts."""
    position = None if draft is None else {token: i for i, token in enumerate(draft)}
    ids = list(range(VOCAB)) if draft is None else draft
    first = second = 0.0
    firsts = seconds = 0
    for t in range(len(text) - 3):
        c, after = text[t + 1], text[t + 2]
        cc = c if position is None else position.get(c, -1)
        if cc < 0:
            continue
        hidden = lm.draft_table[lm._context(text[:t + 1])][None]
        joint = _joint(head, hidden)[cc]  # (K, K): X_1, X_2 given X_0 = c
        p1 = torch.softmax(lm.next_token_logits(text[:t + 2]), -1)[ids]
        first += float(torch.minimum(p1, joint.sum(1) / joint.sum()).sum())
        firsts += 1
        second_index = after if position is None else position.get(after, -1)
        if second_index >= 0:
            q2 = joint[second_index] / joint[second_index].sum()
            p2 = torch.softmax(lm.next_token_logits(text[:t + 3]), -1)[ids]
            second += float(torch.minimum(p2, q2).sum())
            seconds += 1
    return first, second, firsts, seconds


@pytest.mark.parametrize(("architecture", "rank", "draft"),
                         [("btree", 2, None), ("ff", 1, None), ("hmm", 2, [4, 0, 2])])
def test_the_measures_equal_the_enumerated_head(architecture: str, rank: int,
                                                draft: list[int] | None) -> None:
    lm = ToyLM(vocab_size=VOCAB, hidden_size=4, order=2, seed=3)
    head = ToyHead(architecture, WINDOW, rank, 4, VOCAB, seed=5, scale=2.0, draft_tokens=draft)
    generator = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, VOCAB, (9,), generator=generator) for _ in range(3)]
    program = RoundProgram(head, SamplingConfig(temperature=1.0))
    positions, skipped = collect_positions(lm, texts, program)
    measured = expected_acceptance(program, positions)
    first = second = 0.0
    firsts = seconds = 0
    for text in texts:
        a, b, n1, n2 = _brute_force(lm, head, text.tolist(), draft)
        first, second, firsts, seconds = first + a, second + b, firsts + n1, seconds + n2
    assert measured["positions"] == firsts and measured["positions_beta2"] == seconds
    assert skipped == sum(len(t) - 3 for t in texts) - firsts
    assert (skipped > 0) == (draft is not None)
    assert measured["alpha1"] == pytest.approx(first / firsts, abs=1e-12)
    assert measured["beta2"] == pytest.approx(second / seconds, abs=1e-12)


def test_a_tempered_head_sharpens_or_flattens_its_inputs_only() -> None:
    head = ToyHead("btree", WINDOW, 2, 4, VOCAB, seed=1, scale=2.0)
    hidden = torch.randn(1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    tempered = TemperedHead(head, 0.5)
    assert tempered.window == WINDOW and tempered.circuit is head.circuit
    raw, hot = head(hidden), tempered(hidden)
    inputs = tempered.inputs
    assert inputs and inputs < set(raw)  # the sum folds are left alone
    for name in raw:
        expected = raw[name] / 0.5 if name in inputs else raw[name]
        assert torch.equal(hot[name], expected)
    # a sharper draft: the joint's largest probability grows
    assert _joint(tempered, hidden).max() > _joint(head, hidden).max()
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="draft temperature"):
            TemperedHead(head, bad)


def test_temperatures_share_positions_and_the_table_compares_heads() -> None:
    lm = ToyLM(vocab_size=VOCAB, hidden_size=4, order=2, seed=3)
    texts = [torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])]
    rows = {name: measure_head(ToyHead(name, WINDOW, rank, 4, VOCAB, seed=7), lm, texts, [1.0, 2.0],
                               greedy=True)
            for name, rank in (("btree", 2), ("ff", 1))}
    for row in rows.values():
        assert set(row["by_temperature"]) == {"1", "2"}
        assert row["by_temperature"]["1"]["alpha1"] != row["by_temperature"]["2"]["alpha1"]
        assert row["greedy"]["positions"] == 5 and row["greedy"]["alpha1"] in {0, 0.2, 0.4, 0.6, 0.8, 1}
        assert row["by_temperature"]["1"]["beta3"] is None  # a window of 3 has no third draft
    lines = table(rows).splitlines()
    assert len(lines) == 2 + 6  # T = 1 at two draft temperatures and greedy, per head
    assert lines[2].startswith("| btree | T = 1 | 5 |") and lines[2].endswith("| - | 1.000 / 1.000 |")
    assert lines[3].startswith("| btree | T = 1, draft temperature 2 | 5 |")
    assert lines[4].startswith("| btree | greedy | 5 |")
    ratio = rows["ff"]["by_temperature"]["2"]["alpha1"] / rows["btree"]["by_temperature"]["2"]["alpha1"]
    assert f"| {ratio:.3f} / " in lines[6]
    greedy = rows["ff"]["greedy"]["alpha1"] / max(rows["btree"]["greedy"]["alpha1"], 1e-12)
    assert lines[7].startswith("| ff | greedy |") and f"| {greedy:.3f} / " in lines[7]


def _speed(alpha1: list[float], verified: list[bool], verify: float, skip: float) -> float:
    tokens = sum(1 + a if v else 1.0 for a, v in zip(alpha1, verified, strict=True))
    return tokens / sum(verify if v else skip for v in verified)


@given(st.lists(st.tuples(st.floats(0, 1), st.sampled_from([0.1, 0.3, 0.5, 0.9])),
                min_size=1, max_size=8),
       st.floats(1.0, 3.0), st.floats(0.0, 0.5))
def test_speed_bounds_equal_brute_force_over_thresholds_and_subsets(
        rows: list[tuple[float, float]], verify: float, head: float) -> None:
    alpha1 = [a for a, _ in rows]
    peak = [q for _, q in rows]
    beta2 = torch.full((len(rows),), float("nan"), dtype=torch.float64)
    acceptance = Acceptance(torch.tensor(alpha1, dtype=torch.float64), beta2,
                            torch.tensor(peak, dtype=torch.float64))
    bounds = speed_bounds(acceptance, RoundCosts(verify=verify, head=head))
    every = _speed(alpha1, [True] * len(rows), verify + head, 1.0)
    assert bounds["always"] == pytest.approx(every, rel=1e-12)
    # DraftLength.confident(tau, minimum=0) verifies the rounds whose peak is >= tau
    confident = {tau: _speed(alpha1, [q >= tau for q in peak], verify + head, 1.0 + head)
                 for tau in [*peak, float("inf")]}
    assert bounds["confident"] == pytest.approx(max(confident.values()), rel=1e-12)
    assert confident[bounds["confident_threshold"]] == pytest.approx(bounds["confident"], rel=1e-12)
    # the oracle is the best of all 2^P choices of rounds to verify (no head where none is)
    best = max(_speed(alpha1, list(chosen), verify + head, 1.0)
               for chosen in itertools.product([False, True], repeat=len(rows)))
    assert bounds["oracle"] == pytest.approx(best, rel=1e-12)
    assert bounds["oracle"] >= bounds["confident"] - 1e-12 and \
        bounds["oracle"] >= max(bounds["always"], 1.0) - 1e-12
    verified = [a >= sorted(alpha1, reverse=True)[round(bounds["oracle_verified"] * len(rows)) - 1]
                for a in alpha1] if bounds["oracle_verified"] > 0 else [False] * len(rows)
    assert _speed(alpha1, verified, verify + head, 1.0) == pytest.approx(best, rel=1e-12)


def test_speed_bounds_refuse_nothing_and_bad_costs() -> None:
    empty = torch.zeros(0, dtype=torch.float64)
    with pytest.raises(ValueError, match="at least one position"):
        speed_bounds(Acceptance(empty, empty, empty), RoundCosts(verify=1.3, head=0.1))
    for verify, head in ((0.0, 0.1), (1.3, -0.1), (float("nan"), 0.1)):
        with pytest.raises(ValueError, match="costs must be"):
            RoundCosts(verify=verify, head=head)


def test_costs_and_bounds_on_the_toy_lm() -> None:
    lm = ToyLM(vocab_size=VOCAB, hidden_size=4, order=2, seed=3)
    head = ToyHead("btree", WINDOW, 2, 4, VOCAB, seed=7)
    text = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    program = RoundProgram(head, SamplingConfig(temperature=1.0))
    costs = measure_costs(lm, program, text, rounds=3)
    assert costs.verify > 0 and costs.head > 0
    assert lm.length == 0 or lm.length == len(text) - 2  # cropped back after every forward
    row = measure_head(head, lm, [text], [1.0, 2.0], costs)
    assert row["costs_in_plain_steps"] == {"verify_2": costs.verify, "head": costs.head}
    positions, _ = collect_positions(lm, [text], program)
    expected = speed_bounds(position_acceptance(program, positions), costs)
    assert row["by_temperature"]["1"]["speed_bounds"] == expected
    assert "speed_bounds" in row["by_temperature"]["2"]
    lines = table({"btree": row}).splitlines()
    assert lines[0].endswith("/ oracle (verified) |") and len(lines) == 2 + 2 + 2
    assert f"{expected['oracle']:.3f}" in lines[2]
    assert lines[-1].startswith("btree: a verify block of 2 tokens costs")


@pytest.mark.parametrize("argv", [["--heads", ""], ["--draft-temperatures", "1,0"],
                                  ["--draft-temperatures", "-1"], ["--head", "run"],
                                  ["--continuations", "-1"], ["--continuations", "inf"],
                                  ["--continuations", "1", "--new-tokens", "0"],
                                  ["--length", "1"]])
def test_bad_arguments_stop_before_the_model_loads(argv: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert any(reason in error for reason in (
        "give --heads", "must all be > 0", "give --block DIR too", "--continuations takes a "
        "temperature >= 0", "--new-tokens must be >= 1", "--length must be >= 2"))
