"""benchmarks.study (the head study grid and its table) and the head case of kernels_bench."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks import kernels_bench, study
from circuits.kernels import KernelBackend
from circuits_llm.app.report import DecodeMode, DecoderRow


def test_paper_grid_is_tables_6_and_7() -> None:
    cells = study.cells(study.Grid.PAPER)
    assert [(c.window, c.lora_layers) for c in cells] == [(8, 0), (16, 0), (8, 1), (16, 1),
                                                          (8, 2), (16, 2)]
    assert sum(len(c.heads) for c in cells) == 20
    assert {h.name for h in cells[0].heads} == {"ff", "cp-r8", "cp-r32", "hmm", "btree-r8",
                                                "btree"}
    assert all({h.name for h in c.heads} == {"ff", "btree"} for c in cells if c.lora_layers)
    assert sum(len(c.heads) for c in study.cells(study.Grid.FULL)) == 36


def test_head_training_configs_follow_the_cell() -> None:
    cell = study.Cell(16, 2, study.ALL_HEADS)
    configs = {spec.name: study.head_training(cell, spec) for spec in cell.heads}
    assert {name: c.rank for name, c in configs.items()} == {
        "ff": 1, "cp-r8": 8, "cp-r32": 32, "hmm": 32, "btree-r8": 8, "btree": 32}
    assert all(c.window == 16 and c.lora_layers == 2 for c in configs.values())
    settings = study.StudySettings(ff_seconds=3.0, circuit_seconds=7.0)
    assert settings.budget(study.ALL_HEADS[0]) == 3.0 and settings.budget(study.ALL_HEADS[5]) == 7.0


def row(decoder: str, mode: DecodeMode, throughput: float) -> DecoderRow:
    return DecoderRow(decoder=decoder, mode=mode, prompts=2, new_tokens=20, rounds=10,
                      mean_latency_s=0.01, tokens_per_round=2.0, tokens_per_call=1.8,
                      acceptance_rate=0.5, acceptance_by_position=(0.5,), throughput=throughput,
                      speedup_vs_ar=throughput / 100.0, speedup_vs_ff=None)


def test_markdown_table_and_plot(tmp_path: Path) -> None:
    rows = [row(name, mode, 100.0 + i) for mode in DecodeMode
            for i, name in enumerate(("autoregressive", "ff", "btree"))]
    record = {"window": 8, "lora_layers": 1, "rows": [r.to_json() for r in rows],
              "heads": {"ff": {"parameters": 30000, "steps": 12},
                        "btree": {"parameters": 2_700_000, "steps": 5,
                                  "validation_bits_after": 4.123}}}
    lines = study.markdown_table([record]).splitlines()
    assert len(lines) == 2 + 6
    assert "| greedy | 8 | 1 | btree | 2.70M | 5 | 4.12 | 10.00 | 2.00 | 102.0 | 1.02 | - |" in lines
    assert any(line.startswith("| greedy | 8 | 1 | autoregressive | - | - | - | 10.00 |")
               for line in lines)
    study.plot([record], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_kernels_bench_head_case_runs_on_the_torch_path() -> None:
    ops = kernels_bench.head_operations(torch.device("cpu"), torch.float32,
                                        torch.Generator().manual_seed(0))
    fold, rows, units, size = kernels_bench.HEAD_SHAPE
    stats = ops["input stats"](KernelBackend.TORCH)()
    assert stats.shape == (fold * units, rows) and bool((stats <= 0).all())
    mixture = ops["conditional mixture"](KernelBackend.TORCH)()
    assert mixture.shape == (fold, rows, size)
    conditionals = ops["head part of a round"](KernelBackend.TORCH)()
    torch.testing.assert_close(conditionals.exp().sum(-1), torch.ones(1, fold))
