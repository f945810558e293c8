"""The accept program's one-token draw (:func:`draw_from_row`) and its fallback
(:func:`blockwise_argmax`): the inverse CDF of the row, never a zero-probability token, and an
argmax equal to ``torch.argmax`` (first maximum) for every length and block."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from circuits_llm.decoding.acceptance import blockwise_argmax, draw_from_row

rows = st.lists(st.sampled_from([0.0, 0.0, 1e-300, 0.25, 0.5, 1.0, 3.0]), min_size=1, max_size=700)


@settings(max_examples=200, deadline=None)
@given(values=rows, block=st.integers(1, 300))
def test_blockwise_argmax_is_the_first_maximum(values: list[float], block: int) -> None:
    row = torch.tensor(values, dtype=torch.float64)
    assert int(blockwise_argmax(row, block)) == int(row.argmax())


@settings(max_examples=200, deadline=None)
@given(values=rows, uniform=st.floats(0.0, 1.0, exclude_max=True))
def test_draw_is_the_inverse_cdf(values: list[float], uniform: float) -> None:
    values[len(values) // 2] += 0.5  # some positive entry
    row = torch.tensor(values, dtype=torch.float64)
    token = int(draw_from_row(row, torch.tensor(uniform, dtype=torch.float64)))
    assert row[token] > 0
    cdf = row.cumsum(0)
    target = uniform * float(cdf[-1])
    if target < float(cdf[-1]):  # not the rounding case: the first token whose CDF passes u x total
        assert float(cdf[token]) > target and (token == 0 or float(cdf[token - 1]) <= target)


def test_draw_at_the_top_of_the_cdf_takes_a_positive_token() -> None:
    """``u x total`` rounding up to the total (u just below 1) falls past the last positive token,
    onto zero-probability ones: the fallback takes the most probable token instead."""
    row = torch.tensor([0.0, 0.3, 0.7, 0.0, 0.0], dtype=torch.float64)
    below_one = torch.tensor(1.0, dtype=torch.float64).nextafter(torch.tensor(0.0, dtype=torch.float64))
    assert int(draw_from_row(row, below_one)) in (1, 2)


def test_draw_law_matches_the_row() -> None:
    """Uniform grid of u -> the draw's frequencies equal the normalised row (negative control: a
    shifted row does not)."""
    row = torch.tensor([0.0, 2.0, 0.0, 1.0, 5.0, 0.0, 2.0], dtype=torch.float64)
    grid = (torch.arange(10_000, dtype=torch.float64) + 0.5) / 10_000
    counts = torch.bincount(torch.stack([draw_from_row(row, u) for u in grid]), minlength=7)
    law = row / row.sum()
    assert torch.allclose(counts.double() / len(grid), law, atol=2e-4)
    assert not torch.allclose(counts.double() / len(grid), row.roll(1) / row.sum(), atol=0.05)
