"""circuits_llm.runtime.timing: the one timing loop and the one machine record of demo, bench and
benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from circuits_llm.runtime.timing import (
    GradMode,
    count_kernels,
    count_ops,
    interleaved,
    machine_info,
    medians,
    publish,
)


def test_one_call_per_sample_and_the_grad_mode_of_every_call() -> None:
    seen: dict[str, list[tuple[bool, bool]]] = {"a": [], "b": []}

    def record(name: str) -> None:
        seen[name].append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))

    timings = interleaved({"a": lambda: record("a"), "b": lambda: record("b")}, rounds=4,
                          max_calls=1, grad_mode=GradMode.NO_GRAD)
    assert all(len(t.samples) == 4 for t in timings.values())
    assert len(seen["a"]) == len(seen["b"]) == 1 + 1 + 4  # warm-up, calibration, rounds
    assert set(seen["a"]) == {(False, False)}
    interleaved({"a": lambda: record("a")}, rounds=1, grad_mode=GradMode.GRAD, target_round_s=0.0)
    assert seen["a"][-1] == (True, False)
    interleaved({"a": lambda: record("a")}, rounds=1, target_round_s=0.0)
    assert seen["a"][-1] == (False, True)  # the default: inference mode
    assert set(medians(timings)) == {"a", "b"}


def test_machine_record_names_the_device_and_threads() -> None:
    record = machine_info(torch.device("cpu"), threads=3)
    assert {"platform", "processor", "python", "torch", "transformers", "cpu_count",
            "torch_threads", "load_average", "device"} <= set(record)
    assert record["device"] == "cpu" and record["torch_threads"] == 3
    assert machine_info()["torch_threads"] == torch.get_num_threads()
    json.dumps(record)


def test_publish_prints_the_table_and_writes_the_record(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "out" / "bench.json"
    publish("the table", {"b": 1, "a": 2}, path, sort_keys=True, note=" (1 s)")
    assert json.loads(path.read_text()) == {"a": 2, "b": 1}
    assert list(path.parent.iterdir()) == [path]
    out = capsys.readouterr().out
    assert out.startswith("the table\n") and f"wrote {path} (1 s)" in out


def test_count_ops_counts_the_aten_ops_of_a_call() -> None:
    x = torch.ones(3)
    counted = count_ops(lambda: (x + 1) * 2, calls=4)
    assert counted.per_call == 2.0
    assert counted.by_op == {"add": 1.0, "mul": 1.0}
    views = count_ops(lambda: x.view(3, 1).transpose(0, 1), calls=2)
    assert views.per_call == 2.0 and views.top(1) in ({"view": 1.0}, {"transpose": 1.0})


def test_count_kernels_counts_top_level_ops_not_their_insides() -> None:
    """An eager ``(a @ b).sum()`` launches two top-level ops (``matmul`` and ``sum``); ops called
    inside them (``mm``, ``resolve_conj``...) are not counted again."""
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    counted = count_kernels(lambda: (a @ b).sum(), calls=2)
    assert counted.per_call == 2
    assert set(counted.by_op) == {"aten::matmul", "aten::sum"}
