"""Smoke test of the circuit benchmark at tiny sizes: schema, agreement of the implementations.

No timing assertions: the machine is shared, only the structure and the numbers' agreement are
checked.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` is not installed

from benchmarks import circuits_bench, cirkit_bridge
from circuits.files import atomic_write_json
from circuits_llm.runtime.timing import interleaved

TOP_KEYS = {"schema_version", "timestamp", "machine", "torch_version", "num_threads", "dtype",
            "batch_size", "quick", "scale", "rounds", "targets", "libcirkit", "circuits"}
CIRCUIT_KEYS = {"key", "title", "batch_size", "num_parameters", "num_layers", "num_folds",
                "num_unfolded_folds", "check", "loglik", "sampling", "cirkit", "sum_layers",
                "seconds"}
SUM_KEYS = {"flops", "folds", "sum_seconds", "bmm_seconds", "sum_gflops", "bmm_gflops",
            "ratio_vs_bmm", "share", "loglik_seconds_with_hooks"}


@pytest.fixture(scope="module")
def report() -> dict:
    threads = torch.get_num_threads()
    try:
        return circuits_bench.run(quick=True, with_cirkit=False, scale="tiny", batch=16,
                                  rounds=1, threads=threads, log=None)
    finally:
        torch.set_num_threads(threads)


def test_report_schema(report: dict, tmp_path: Path) -> None:
    assert report.keys() >= TOP_KEYS
    assert report["schema_version"] == circuits_bench.SCHEMA_VERSION
    assert [c["key"] for c in report["circuits"]] == [
        "btree", "hmm", "random_binary_tree", "quad_tree"]
    for entry in report["circuits"]:
        assert entry.keys() >= CIRCUIT_KEYS
        assert entry["sum_layers"].keys() >= SUM_KEYS
        for section in ("loglik", "sampling"):
            for name in ("folded", "unfolded"):
                timing = entry[section][name]
                assert timing["seconds"] > 0 and timing["rows_per_s"] > 0
            assert entry[section]["folded_vs_unfolded"] > 0
        sums = entry["sum_layers"]
        assert sums["flops"] == sum(2 * f["F"] * f["B"] * f["K"] * f["D"] for f in sums["folds"])
        assert 0 <= sums["share"] <= 1
    path = tmp_path / "out" / "bench.json"
    atomic_write_json(path, report)
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    table = circuits_bench.format_table(report)
    for entry in report["circuits"]:
        assert entry["title"] in table


def test_folded_and_unfolded_agree(report: dict) -> None:
    for entry in report["circuits"]:
        check = entry["check"]
        assert check["folded_vs_unfolded_match"], entry["key"]
        assert check["folded_vs_unfolded_max_abs_diff"] < 1e-4
        assert abs(check["log_partition"]) < 1e-4  # normalised circuits
        assert math.isfinite(check["mean_loglik"])


def test_unfolded_copy_has_the_same_parameters() -> None:
    case = circuits_bench.cases("tiny")[3]
    circuit = case.build()
    folded = circuits_bench.compile(circuit, dtype=torch.float64, seed=1)
    unfolded = circuits_bench.compile(circuit, fold=False, dtype=torch.float64, seed=2)
    circuits_bench.copy_parameters(folded, unfolded)
    x = folded.sample(32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(folded.log_likelihood(x), unfolded.log_likelihood(x),
                               rtol=1e-12, atol=1e-12)


def test_interleaved_reports_every_candidate() -> None:
    calls = {"a": 0, "b": 0}

    def bump(name: str) -> None:
        calls[name] += 1

    timings = interleaved({"a": lambda: bump("a"), "b": lambda: bump("b")}, rounds=3,
                          target_round_s=0.0)
    assert set(timings) == {"a", "b"}
    assert all(len(t.samples) == 3 and t.median >= 0 for t in timings.values())
    assert calls["a"] == calls["b"] > 3


def test_main_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "result.json"
    try:
        assert circuits_bench.main(["--quick", "--scale", "tiny", "--rounds", "1", "--only",
                                    "btree", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    assert [c["key"] for c in data["circuits"]] == ["btree"]
    assert data["quick"] is True
    assert "BTree" in capsys.readouterr().out


@pytest.mark.skipif(not cirkit_bridge.available(), reason="libcirkit not installed")
def test_cirkit_translation_matches() -> None:
    threads = torch.get_num_threads()
    try:
        for case in circuits_bench.cases("tiny"):
            entry = circuits_bench.bench_circuit(case, batch=8, rounds=1, with_cirkit=True)
            info = entry["cirkit"]
            assert info["installed"] and info["parameters_match"], case.key
            assert info["loglik_match"], (case.key, info["loglik_max_abs_diff"])
            if case.key != "hmm":  # our HMM template has one more transition than cirkit's
                assert info["native_parameters_match"], (case.key, info["num_parameters"])
            assert entry["loglik"]["folded_vs_cirkit"] > 0
            assert entry["sampling"]["folded_vs_cirkit"] > 0
    finally:
        torch.set_num_threads(threads)
