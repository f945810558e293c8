"""``python -m benchmarks.gpu_check --device cpu --quick``: the GPU check's CPU smoke run.

One run (a subprocess, as ``make gpu-check`` runs it) serves every test: it must exit 0, print its
one table, write its JSON, hold every row group with no FAIL, SKIP only where libcirkit is absent
or CUDA is genuinely needed (each saying why), and its negative controls must have been rejected
(so the exactness rows can fail). The forced rounds (heads and draft blocks) must accept every
draft, the batch rows must match ``model.generate`` row by row and predict every batch size, the
predictions' measured acceptance must be the one recorded (docs/journal.md, the demo's and the
batch benchmark's JSON), and asking for CUDA without one is one clear error.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check_batch import QUICK_BATCHES, measured_rates
from benchmarks.gpu_check_blocks import (
    BlockKind,
    BlockShapes,
    measured_tokens_per_round,
    shipped_block_shapes,
)
from benchmarks.gpu_check_circuits import TOLERANCES, make_pairs, query_errors
from benchmarks.gpu_check_core import ALPHA, Group, SkipReason, Status
from benchmarks.gpu_check_speed import MEASURED_TOKENS_PER_ROUND, Mode
from circuits.kernels import KernelBackend, use_backend
from circuits.kernels.backend import requested_backend

ROOT = Path(__file__).resolve().parents[1]
ALLOWED_SKIPS = {SkipReason.NO_CIRKIT.name, SkipReason.NEEDS_CUDA.name}
#: the run's time budget (``--budget-s``): the quick default (300 s) fits the GPU machine's window,
#: and a row past it is skipped; on a CPU shared by three suites the run took 307 s, so the smoke
#: run gets room enough that no row is skipped for time (this test is not a timing)
SMOKE_BUDGET_S = 3000.0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run's exit code, stdout and JSON record (how long it took is the check's own business:
    a time bound here failed whenever the machine was shared)."""
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu",
                           "--quick", "--threads", "1", "--budget-s", str(SMOKE_BUDGET_S),
                           "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=2 * SMOKE_BUDGET_S)
    return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
            "record": json.loads(out.read_text()) if out.exists() else None}


def rows(smoke: dict[str, Any], group: Group) -> list[dict[str, Any]]:
    """The JSON rows of ``group``."""
    return [r for r in smoke["record"]["rows"] if r["group"] == group.value]


def test_exits_zero_with_one_table_and_the_json(smoke: dict[str, Any]) -> None:
    assert smoke["rc"] == 0, smoke["stdout"][-3000:] + smoke["stderr"][-3000:]
    record = smoke["record"]
    assert record["schema_version"] == gpu_check.SCHEMA_VERSION and record["passed"]
    assert record["config"] == {"device": "cpu", "quick": True, "compiler": "aot_eager", "seed": 0,
                                "budget_s": SMOKE_BUDGET_S, "groups": None}
    assert smoke["stdout"].count("GPU check on cpu") == 1
    for row in record["rows"]:  # every row is a line of the table
        assert f"{row['group']:<21}{row['name']:<36}{row['status']}" in smoke["stdout"]


def test_every_group_runs_and_nothing_fails(smoke: dict[str, Any]) -> None:
    record = smoke["record"]
    assert [g.value for g in Group] == list(dict.fromkeys(r["group"] for r in record["rows"]))
    failed = [r for r in record["rows"] if r["status"] == Status.FAIL.value]
    assert not failed, failed
    for group in Group:
        if group is not Group.CIRKIT:  # libcirkit is optional
            assert any(r["status"] == Status.PASS.value for r in rows(smoke, group)), group
    assert not record["compile_fallbacks"]


def test_skips_are_allowed_and_say_why(smoke: dict[str, Any]) -> None:
    for row in smoke["record"]["rows"]:
        if row["status"] != Status.SKIP.value:
            continue
        assert row["skip"] in ALLOWED_SKIPS, row
        assert row["reason"].startswith(SkipReason[row["skip"]].value), row
        if row["skip"] == SkipReason.NEEDS_CUDA.name:
            assert row["name"].startswith("triton"), row  # only the triton kernel backend


def test_the_negative_controls_were_rejected(smoke: dict[str, Any]) -> None:
    sampling = [r for r in rows(smoke, Group.SAMPLING) if r["status"] == Status.PASS.value]
    assert sampling
    for row in sampling:
        for template in row["values"].values():
            assert template["p_control"] < ALPHA < template["p_sample"]
            assert template["control_tv"] == pytest.approx(0.05)
    law = {r["name"]: r["values"] for r in rows(smoke, Group.DECODER_LAW)}
    assert law["sampled generate, eager"]["p_control"] <= ALPHA < law["sampled generate, eager"]["p_exact"]
    for head in law["enumerated, eager"].values():
        assert head["tv_exact"] < 1e-9 < 1e-3 < head["tv_biased_control"]


def test_speed_rows_forced_every_draft_and_predicted(smoke: dict[str, Any]) -> None:
    speed = {r["name"]: r["values"] for r in rows(smoke, Group.SPEED)}
    forced = [v for name, v in speed.items() if name.startswith("forced")]
    predicted = [v for name, v in speed.items() if name.startswith("predicted")]
    assert len(forced) == len(predicted) == 4
    for values in forced:
        assert values["tokens_per_round"] == 8
        assert set(values["phases_ms"]) >= {"draft", "verify", "accept"}
    assert {v["tokens_per_round"] for v in predicted} == set(MEASURED_TOKENS_PER_ROUND.values())


def test_block_speed_rows_forced_every_draft_and_predicted(smoke: dict[str, Any]) -> None:
    blocks = {r["name"]: r["values"] for r in rows(smoke, Group.BLOCK_SPEED)}
    forced = [v for name, v in blocks.items() if name.startswith("forced")]
    predicted = [v for name, v in blocks.items() if name.startswith("predicted")]
    assert len(forced) == len(predicted) == 4
    for values in forced:  # a window of 6 (5 recursive drafts) or 4 (the BTree on the block)
        assert values["window"] in (6, 4) and values["accepted"] == values["drafted"] > 0
        assert values["tokens_per_round"] >= values["window"] / 2
        assert set(values["phases_ms"]) >= {"draft", "verify", "accept"}
        assert "eager" in values["compiled"]  # what of the round is not compiled is said
    assert {v["tokens_per_round"] for v in predicted} == set(measured_tokens_per_round().values())


def test_block_shapes_and_acceptance_are_the_shipped_and_measured_ones() -> None:
    """The shipped manifests' shapes, and ``make demo``'s block rows (6 prompts): block greedy
    3.71 / T=1 1.92 tokens per round, BTree on the block 2.69 / 1.65."""
    assert shipped_block_shapes() == BlockShapes(1, 8192, 5, 4, 16, "lean", 8, 4096)
    measured = {key: round(value, 2) for key, value in measured_tokens_per_round().items()}
    assert measured == {(BlockKind.RECURSIVE, Mode.GREEDY): 3.71,
                        (BlockKind.RECURSIVE, Mode.SAMPLING): 1.92,
                        (BlockKind.BTREE, Mode.GREEDY): 2.69, (BlockKind.BTREE, Mode.SAMPLING): 1.65}
    assert {size for _, size in measured_rates()} == {1, 2, 4, 8}


def test_batch_rows_exact_and_predicted(smoke: dict[str, Any]) -> None:
    batch = {r["name"]: r["values"] for r in rows(smoke, Group.BATCH)}
    exact = [v for name, v in batch.items() if name.startswith("greedy = generate")]
    assert len(exact) == 2
    for values in exact:  # both paths ran: some drafts accepted, some rejected
        assert values["mismatches"] == 0 and 0 < values["accepted"] < values["drafted"]
    sizes = [v for name, v in batch.items() if name.startswith("throughput")]
    assert [v["batch_size"] for v in sizes] == list(QUICK_BATCHES)
    for values in sizes:
        for mode in Mode:
            entry = values[mode.value]
            assert entry["ar_ms_per_step"] > 0 and entry["round_ms"] > 0
            assert set(entry["phases_ms"]) >= {"draft", "verify", "accept"}
            assert entry["predicted_speedup"] == pytest.approx(
                entry["rate_per_row"] * entry["ar_ms_per_step"] / entry["round_ms"])
    crossover = batch["predicted crossover"]["crossover"]
    assert set(crossover) == {m.value for m in Mode}


def test_measured_acceptance_is_the_recorded_one() -> None:
    """:data:`MEASURED_TOKENS_PER_ROUND` is the ``acc.len`` column of the latest ``make demo``
    text table of docs/journal.md section 6 (the shipped heads', every round verifying a draft;
    the later ``--draft-minimum 0`` run is a markdown table)."""
    text = (ROOT / "docs" / "journal.md").read_text()
    section = text[text.index("## 6."):text.index("## 7.")]
    for (architecture, mode), tokens in MEASURED_TOKENS_PER_ROUND.items():
        matches = re.findall(rf"^{mode.value}\s+{architecture.value}\s+[\d.]+ms\s+([\d.]+)\s",
                             section, re.MULTILINE)
        assert matches and float(matches[-1]) == tokens, (architecture, mode)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_requested_without_cuda_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main([]) == 2  # --device cuda is the default
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "--device cpu" in error and "CUDA" in error


class _BackendRecorder:
    """A compiled circuit's stand-in that records the kernel backend asked for at each query and
    answers with the wrapped circuit on the torch backend (no triton on this CPU)."""

    def __init__(self, circuit: Any, seen: list[str]) -> None:
        self.circuit, self.seen = circuit, seen

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.circuit, name)
        if not callable(attribute) or not name.startswith("log_"):
            return attribute

        def query(*args: Any, **kwargs: Any) -> Any:
            self.seen.append(requested_backend().value)
            with use_backend(KernelBackend.TORCH):
                return attribute(*args, **kwargs)
        return query


def test_query_references_run_on_the_torch_backend() -> None:
    """The triton rows force the triton backend for the checked circuit only: the CPU float64
    reference is computed with torch kernels (forced triton on CPU tensors is an error; it made
    both triton query rows FAIL on the first H100 run)."""
    pair = make_pairs(torch.device("cpu"), torch.float64, 0)[0]
    model_seen: list[str] = []
    reference_seen: list[str] = []
    recorded = replace(pair, model=_BackendRecorder(pair.model, model_seen),
                       reference=_BackendRecorder(pair.reference, reference_seen))
    with use_backend(KernelBackend.TRITON):
        errors = query_errors(recorded, TOLERANCES[torch.float64], 0)
    assert len(errors) == 8 and all(ratio <= 1.0 for _, ratio in errors.values())
    assert set(model_seen) == {"triton"} and len(model_seen) == 8
    assert set(reference_seen) == {"torch"} and len(reference_seen) >= 7
