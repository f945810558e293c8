"""``experiments/acceptance_sweep.py``'s table: one row per head and copy-component setting, the
columns that differ between them."""

from __future__ import annotations

from experiments.acceptance_sweep import table


def _row(run: str, lookup: str, greedy: float) -> dict:
    settings = {"architecture": "ff", "rank": 1, "lean_rank": 8, "lookup": lookup}
    mode = {"tokens_per_round": greedy, "rounds": 10, "accepted_by_position": [0.5, 0.25, 0.0]}
    return {"run": run, "settings": settings, "validation_nll": [4.0, 4.4, 5.3],
            "greedy": mode, "sampling": {**mode, "tokens_per_round": 1.25}}


def test_the_table_has_a_row_per_lookup_setting() -> None:
    heads = {"runs/ff [none]": _row("runs/ff", "none", 1.3),
             "runs/ff [lookup 0.2/0.4]": _row("runs/ff", "lookup 0.2/0.4", 3.0)}
    lines = table(heads).splitlines()
    assert lines[0].startswith("| run | lookup | NLL slot 2 / 3 |")
    assert lines[2].startswith("| ff | none | 4.40 / 5.30 | 1.300 | 1.250 | 50.0% / 25.0%")
    assert lines[3].startswith("| ff | lookup 0.2/0.4 | 4.40 / 5.30 | 3.000 |")
    assert len(lines) == 4
