"""Smoke test of benchmarks/batch_bench.py's ``--quick`` run (embedded model, random head): the
record's schema, the table, and the facts that hold whatever the timings (greedy rows identical,
one entry per batch size and mode). No timing assertions: the machine is shared."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` is not installed

from benchmarks import batch_bench


def test_quick_run_writes_the_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "batch.json"
    try:
        assert batch_bench.main(["--quick", "--batch-sizes", "1,3", "--new-tokens", "6",
                                 "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    record = json.loads(out.read_text())
    assert record["benchmark"] == "batch_bench" and record["config"]["batch_sizes"] == [1, 3]
    assert [(r["batch_size"], r["mode"]) for r in record["results"]] == [
        (1, "greedy"), (1, "sampling"), (3, "greedy"), (3, "sampling")]
    for entry in record["results"]:
        assert set(entry["decoders"]) == set(batch_bench.DECODERS)
        spec = entry["decoders"]["speculative"]
        assert spec["tok_s"] > 0 and spec["kv_bytes"] > 0 and spec["kv_over_ar"] > 0
        assert set(spec["ms_per_round_phase"]) == {"draft", "verify", "accept"}
        assert entry.get("greedy_identical", True)
    assert set(record["crossover"]) == {"greedy", "sampling"}
    printed = capsys.readouterr().out
    assert "hf_generate" in printed and f"wrote {out}" in printed
