"""Smoke test of the learning benchmark at tiny sizes: schema, learning happens, files written.

No timing assertions (the machine is shared). Where libcirkit is installed, the comparison itself
is checked: the translated circuits start from the same distribution, one full-batch EM step with
step 1 gives the same model in both libraries, and Adam on the same batches follows the same path.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` is not installed

pytest.importorskip("sklearn", reason="the learning benchmark needs scikit-learn (the bench extra)")

from benchmarks import cirkit_bridge, learning_bench
from circuits import compile, learn

TOP_KEYS = {"schema_version", "timestamp", "machine", "torch_version", "num_threads", "quick",
            "dataset", "budget", "optimizers", "libcirkit", "circuits", "runs"}
RUN_KEYS = {"circuit", "optimizer", "library", "num_parameters", "test_bpd", "train_bpd",
            "epoch_seconds", "final_test_bpd", "best_test_bpd", "seconds_per_epoch"}


@pytest.fixture
def keep_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def report() -> dict:
    threads = torch.get_num_threads()
    try:
        return learning_bench.run(quick=True, with_cirkit=False, epochs=2, units=2, log=None)
    finally:
        torch.set_num_threads(threads)


def test_report_schema_and_learning(report: dict) -> None:
    assert report.keys() >= TOP_KEYS and report["schema_version"] == learning_bench.SCHEMA_VERSION
    assert report["dataset"] == {"name": "scikit-learn load_digits", "train_rows": 1500,
                                 "test_rows": 297, "variables": 64, "categories": 17}
    assert [c["key"] for c in report["circuits"]] == ["quad_tree", "random_binary_tree", "hclt"]
    assert {(r["circuit"], r["optimizer"], r["library"]) for r in report["runs"]} == {
        (c, o, "circuits") for c in ("quad_tree", "random_binary_tree", "hclt") for o in ("em", "adam")}
    for r in report["runs"]:
        assert r.keys() >= RUN_KEYS
        assert len(r["test_bpd"]) == 3 and len(r["train_bpd"]) == len(r["epoch_seconds"]) == 2
        assert all(math.isfinite(v) and 0 < v < 5 for v in r["test_bpd"] + r["train_bpd"])
        assert r["final_test_bpd"] == r["test_bpd"][-1] and r["best_test_bpd"] == min(r["test_bpd"])
        assert all(s > 0 for s in r["epoch_seconds"])
        if r["optimizer"] == "em":  # from a random start, one epoch of EM gains a lot
            assert r["test_bpd"][1] < r["test_bpd"][0] - 0.5
    table = learning_bench.format_table(report)
    for info in report["circuits"]:
        assert info["title"] in table


def test_the_quad_tree_has_the_issues_parameter_count() -> None:
    train, _ = learning_bench.load_digits_split()
    (quad, *_) = learning_bench.cases(train, learning_bench.UNITS)
    assert quad.key == "quad_tree" and quad.build().num_parameters() == 55_328


def test_bits_per_dim() -> None:
    assert learning_bench.bits_per_dim(-64 * math.log(2), 64) == pytest.approx(1.0)
    assert learning_bench.bits_per_dim(-2 * 64 * math.log(2), 64) == pytest.approx(2.0)


def test_plot_and_main_write_their_files(report: dict, tmp_path: Path, keep_threads: None,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    png = learning_bench.write_plot(report, tmp_path / "plots" / "learn.png")
    assert png.read_bytes().startswith(b"\x89PNG")
    out, picture = tmp_path / "learn.json", tmp_path / "learn2.png"
    assert learning_bench.main(["--quick", "--no-cirkit", "--only", "hclt", "--epochs", "1",
                                "--units", "2", "--out", str(out), "--plot", str(picture)]) == 0
    data = json.loads(out.read_text())
    assert data["quick"] is True and [c["key"] for c in data["circuits"]] == ["hclt"]
    assert {r["optimizer"] for r in data["runs"]} == {"em", "adam"}
    assert picture.read_bytes().startswith(b"\x89PNG")
    assert "HCLT r=2" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["learn.json", "learn2.png", "plots"]


# ------------------------------------------------------------------ against libcirkit
needs_cirkit = pytest.mark.skipif(not cirkit_bridge.available(), reason="libcirkit not installed")


@needs_cirkit
def test_one_full_batch_em_step_is_the_same_in_both_libraries(keep_threads: None) -> None:
    from cirkit.backend.torch.em_optimizer import EM as CirkitEM

    torch.set_num_threads(1)
    train, test = learning_bench.load_digits_split()
    train = train[:300]
    circuit = learning_bench.cases(train, 3)[2].build()  # the HCLT
    ours = compile(circuit, seed=3)
    theirs = cirkit_bridge.compile_circuit(learning_bench.translate_probabilities(circuit, ours))
    with torch.no_grad():
        torch.testing.assert_close(cirkit_bridge.log_likelihood(theirs, test), ours.log_likelihood(test),
                                   rtol=1e-5, atol=1e-3)
    with torch.no_grad():
        before = float(ours.log_likelihood(train).mean())
    em = learn.EM(ours, step_size=1.0, pseudocount=0.0)
    em.accumulate(train)
    em.step()
    cirkit_em = CirkitEM(theirs, lr=1.0, pseudocount=0.0)
    cirkit_bridge.log_likelihood(theirs, train).sum().backward()
    cirkit_em.step()
    with torch.no_grad():
        after_ours, after_theirs = ours.log_likelihood(train), cirkit_bridge.log_likelihood(theirs, train)
    assert float(after_ours.mean()) > before + 20  # it moved far from the random start
    torch.testing.assert_close(after_theirs, after_ours, rtol=1e-5, atol=1e-3)


@needs_cirkit
def test_cirkit_runs_start_together_and_adam_follows_the_same_path(keep_threads: None) -> None:
    report = learning_bench.run(quick=True, with_cirkit=True, epochs=1, units=2, only=["quad_tree"],
                                log=None)
    (info,) = report["circuits"]
    for check in info["cirkit"].values():
        assert check["parameters_match"] and check["initial_loglik_max_abs_diff"] < 1e-3
    runs = {(r["optimizer"], r["library"]): r for r in report["runs"]}
    assert len(runs) == 4
    for optimizer in ("em", "adam"):
        assert runs[(optimizer, "circuits")]["test_bpd"][0] == pytest.approx(
            runs[(optimizer, "libcirkit")]["test_bpd"][0], abs=1e-5)
    assert runs[("adam", "circuits")]["test_bpd"][1] == pytest.approx(
        runs[("adam", "libcirkit")]["test_bpd"][1], abs=1e-4)
    assert "vs cirkit" in learning_bench.format_table(report)
