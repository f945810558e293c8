"""The head study on the embedded model: the structure of the MTPC paper's Tables 5-7.

Run ``python -m benchmarks.study [--grid paper|full] [--phase train|decode|all] [--out DIR]
[--device auto|cpu|cuda[:N]]``. ``--device`` (default ``cpu``, the device of the recorded study)
is where the model and the heads train and decode; every cell records the resolved device in its
``machine.device``, and ``study.json`` in ``device``.

Every *cell* is a window ``n`` and a number ``k`` of LoRA draft layers. In each cell the heads
are trained (or loaded from the study's head cache) on the embedded byte-level Llama with the
same wall-clock budget per head kind, then the autoregressive decoder and one speculative decoder
per head decode the same held-out prompts, greedy and sampling, interleaved prompt by prompt
(:func:`circuits_llm.app.compare.compare_decoders`), so every speed-up is a ratio measured in one run.

Grids:

* ``paper`` (default): the paper's own design. Table 6: FF, CP r=8, CP r=32, HMM r=32, BTree
  r=8 and BTree r=32 at ``k = 0`` for ``n`` in {8, 16}; Table 7: FF and BTree r=32 at ``k`` in
  {1, 2}. (BTree r=8 is ours: a BTree whose round costs about as much as FF's on a CPU.)
* ``full``: every head at every ``(n, k)`` (36 heads; about twice the CPU time).

The run is resumable: a finished cell is written to ``<out>/cells/n<n>-k<k>.json`` and skipped
when the study runs again; heads are cached in ``--heads`` (default ``runs/study/heads``, outside
version control; keyed by model fingerprint and training configuration). ``--phase train`` only
trains (useful as a background job); ``decode`` then finds every head in the cache. At the end
``<out>/study.json``, ``<out>/study.md`` (the table of ``docs/journal.md`` section 5) and
``<out>/study-tradeoff.png`` are written atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from circuits.files import atomic_write, atomic_write_text
from circuits_llm.app import demo
from circuits_llm.app import report as rep
from circuits_llm.app.compare import compare_decoders
from circuits_llm.app.head_cache import ReadyHead, obtain_head
from circuits_llm.app.report import DecodeMode, DecoderRow
from circuits_llm.app.rows import format_optional
from circuits_llm.runtime.devices import DeviceError, add_device_argument, describe_device, resolve_device
from circuits_llm.runtime.timing import machine_info
from circuits_llm.text.byte_level import evaluation_prompts
from circuits_llm.text.models import EMBEDDED, LoadedModel, load_byte_model


class Grid(Enum):
    PAPER = "paper"
    FULL = "full"


class Phase(Enum):
    TRAIN = "train"
    DECODE = "decode"
    ALL = "all"


@dataclass(frozen=True)
class HeadSpec:
    """One head of the study: its display name, template and rank."""

    name: str
    architecture: str
    rank: int


ALL_HEADS = (HeadSpec("ff", "ff", 1), HeadSpec("cp-r8", "cp", 8), HeadSpec("cp-r32", "cp", 32),
             HeadSpec("hmm", "hmm", 32), HeadSpec("btree-r8", "btree", 8),
             HeadSpec("btree", "btree", 32))
LORA_HEADS = (ALL_HEADS[0], ALL_HEADS[-1])
WINDOWS = (8, 16)
LORA_LAYERS = (0, 1, 2)


@dataclass(frozen=True)
class Cell:
    window: int
    lora_layers: int
    heads: tuple[HeadSpec, ...]

    @property
    def key(self) -> str:
        return f"n{self.window}-k{self.lora_layers}"


def cells(grid: Grid) -> list[Cell]:
    """The study's cells in run order (k = 0 first: it holds the most heads)."""
    result = []
    for k in LORA_LAYERS:
        for n in WINDOWS:
            heads = ALL_HEADS if grid is Grid.FULL or k == 0 else LORA_HEADS
            result.append(Cell(n, k, heads))
    return result


@dataclass(frozen=True)
class StudySettings:
    """Budgets shared by every cell.

    Attributes:
        ff_seconds, circuit_seconds: training wall-clock per FF head / per other head (an FF step
            is far cheaper, so it converges in less time).
        prompts, new_tokens, prompt_bytes, temperature, seed: as in
            :class:`circuits_llm.app.demo.ComparisonConfig`.
    """

    ff_seconds: float = 90.0
    circuit_seconds: float = 360.0
    prompts: int = 8
    new_tokens: int = 128
    prompt_bytes: int = 128
    temperature: float = 1.0
    seed: int = 0

    def budget(self, head: HeadSpec) -> float:
        return self.ff_seconds if head.architecture == "ff" else self.circuit_seconds


def head_training(cell: Cell, head: HeadSpec) -> Any:
    """The :class:`~circuits_llm.training.HeadTrainingConfig` of ``head`` in ``cell``."""
    base = demo.ComparisonConfig(window=cell.window, rank=head.rank, lora_layers=cell.lora_layers)
    return demo.training_config(replace(base, rank=head.rank), head.architecture)


def obtain(loaded: LoadedModel, cell: Cell, head: HeadSpec, cache: Path,
           settings: StudySettings, log: Any) -> ReadyHead:
    ready = obtain_head(loaded, head_training(cell, head), cache, settings.budget(head))
    r = ready.record
    log(f"[{cell.key}] {head.name}: {'cached' if r['cached'] else 'trained'}, {r['steps']} steps, "
        f"validation bits/byte {r['validation_bits_before']:.3f} -> "
        f"{r['validation_bits_after']:.3f}")
    return ready


def decode_cell(loaded: LoadedModel, cell: Cell, ready: list[tuple[HeadSpec, Any]],
                settings: StudySettings) -> dict[str, Any]:
    """Decode the prompts with AR and every head of the cell (on the model's device); its record."""
    from circuits_llm.backbone import HFBackbone
    from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
    prompts = evaluation_prompts(settings.prompts, settings.prompt_bytes)
    decoders: dict[str, Any] = {rep.BASELINE: AutoregressiveDecoder(HFBackbone(loaded.model))}
    decoders.update({spec.name: SpeculativeDecoder(r.backbone, r.head) for spec, r in ready})
    start = time.perf_counter()
    comparison = compare_decoders(decoders, prompts, settings.new_tokens,
                                       settings.temperature, settings.seed)
    rows = comparison.rows()
    heads = {spec.name: {"architecture": spec.architecture, "rank": spec.rank,
                         "parameters": r.record["parameters"], "steps": r.record["steps"],
                         "train_wall_s": r.record["train_wall_s"],
                         "validation_bits_after": r.record["validation_bits_after"]}
             for spec, r in ready}
    return {"window": cell.window, "lora_layers": cell.lora_layers, "heads": heads,
            "rows": [row.to_json() for row in rows],
            "greedy_identical": comparison.greedy_identical(),
            "decode_wall_s": time.perf_counter() - start,
            "machine": machine_info(loaded.model.device)}


def markdown_table(records: list[dict[str, Any]]) -> str:
    """One line per (mode, n, k, decoder): the paper's columns, speed-ups, and the head's training
    (steps, validation bits per byte averaged over the window positions)."""
    lines = ["| mode | n | k | decoder | params | train steps | val bits | mu_lat (ms) | mu_acc "
             "| bytes/s | x AR | x FF |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode in DecodeMode:
        for record in records:
            rows = [DecoderRow.from_json(row) for row in record["rows"]]
            for row in rows:
                if row.mode is not mode:
                    continue
                head = record["heads"].get(row.decoder, {})
                params = f"{head['parameters'] / 1e6:.2f}M" if head else "-"
                bits = head.get("validation_bits_after")
                lines.append(
                    f"| {mode.value} | {record['window']} | {record['lora_layers']} | "
                    f"{row.decoder} | {params} | {head.get('steps', '-')} | "
                    f"{'-' if bits is None else format(bits, '.2f')} | "
                    f"{row.mean_latency_s * 1e3:.2f} | {row.tokens_per_round:.2f} | "
                    f"{row.throughput:.1f} | {format_optional(row.speedup_vs_ar, '.2f')} | "
                    f"{format_optional(row.speedup_vs_ff, '.2f')} |")
    return "\n".join(lines)


HEAD_COLORS = {rep.BASELINE: "#555555", "ff": "#1f77b4", "cp-r8": "#9ecae1", "cp-r32": "#2ca02c",
               "hmm": "#9467bd", "btree-r8": "#ff9896", "btree": "#d62728"}
WINDOW_MARKERS = {8: "o", 16: "^"}
LORA_SIZES = {0: 70, 1: 120, 2: 180}


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Accepted length vs latency per round, one panel per mode: colour = head, marker = window
    (circle n=8, triangle n=16), size = LoRA layers (larger = more); dotted iso-throughput lines."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.lines import Line2D

    points = [(record, DecoderRow.from_json(row)) for record in records for row in record["rows"]]
    if not points:
        return
    x_max = max(row.mean_latency_s for _, row in points) * 1e3 * 1.1
    y_max = max(row.tokens_per_round for _, row in points) * 1.15
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), dpi=120, sharey=True)
    try:
        for ax, mode in zip(axes, DecodeMode, strict=True):
            for level in rep.iso_levels(row.throughput for _, row in points):
                ax.plot([0, x_max], [0, level * x_max / 1e3], ls=":", lw=0.8, color="grey")
                # label where the line leaves the panel: the top edge, else the right edge
                x_end = min(x_max, y_max / level * 1e3)
                ax.annotate(f"{level:.0f} B/s", (x_end, level * x_end / 1e3), fontsize=7,
                            color="grey", ha="right", va="top")
            for record, row in points:
                if row.mode is not mode:
                    continue
                ax.scatter(row.mean_latency_s * 1e3, row.tokens_per_round,
                           s=LORA_SIZES.get(record["lora_layers"], 200),
                           marker=WINDOW_MARKERS.get(record["window"], "s"),
                           color=HEAD_COLORS.get(row.decoder, "black"), edgecolors="black",
                           linewidths=0.5, alpha=0.85, zorder=3)
            ax.set_xlim(0, x_max)
            ax.set_ylim(0, y_max)
            ax.set_title(mode.value, fontsize=10)
            ax.set_xlabel("mean latency per round (ms)")
            ax.grid(alpha=0.25)
        axes[0].set_ylabel("mean accepted length (tokens per round)")
        handles = [Line2D([], [], ls="", marker="s", color=color, label=name)
                   for name, color in HEAD_COLORS.items()]
        handles += [Line2D([], [], ls="", marker=marker, color="white", markeredgecolor="black",
                           label=f"n={window}") for window, marker in WINDOW_MARKERS.items()]
        handles += [Line2D([], [], ls="", marker="o", color="white", markeredgecolor="black",
                           markersize=size ** 0.5 / 1.3, label=f"k={k} LoRA")
                    for k, size in LORA_SIZES.items()]
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7.5,
                   frameon=False)
        fig.suptitle("head study on the embedded model: accepted length vs latency per round "
                     "(dotted: iso-throughput; up-left is faster)", fontsize=9.5)
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)


def run(grid: Grid, phase: Phase, out: Path, cache: Path, settings: StudySettings,
        device: torch.device | None = None) -> int:
    """Train (or load) and decode every cell of ``grid`` on ``device`` (None: the CPU)."""
    log = print
    device = device if device is not None else torch.device("cpu")
    torch.manual_seed(settings.seed)
    loaded = load_byte_model(EMBEDDED, device)
    log(f"study on {describe_device(device)}")
    cell_dir = out / "cells"
    cell_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for cell in cells(grid):
        done = cell_dir / f"{cell.key}.json"
        if done.is_file() and phase is not Phase.TRAIN:  # decoded earlier: reuse
            records.append(json.loads(done.read_text()))
            log(f"[{cell.key}] done earlier: {done}")
            continue
        ready = [(spec, obtain(loaded, cell, spec, cache, settings, log)) for spec in cell.heads]
        if phase is Phase.TRAIN:
            continue
        record = decode_cell(loaded, cell, ready, settings)
        rep.write_json(record, done)
        log(f"[{cell.key}]\n" + rep.format_table(map(DecoderRow.from_json, record["rows"])))
        records.append(record)
    if phase is Phase.TRAIN:
        return 0
    summary = {"grid": grid.value, "settings": settings.__dict__, "model": loaded.describe(),
               "device": describe_device(device), "cells": records}
    table = markdown_table(records)
    atomic_write_text(out / "study.md", table + "\n")
    plot(records, out / "study-tradeoff.png")
    rep.write_json(rep.jsonable(summary), out / "study.json")
    log("\n" + table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", type=Grid, default=Grid.PAPER, choices=list(Grid))
    parser.add_argument("--phase", type=Phase, default=Phase.ALL, choices=list(Phase))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/study"))
    parser.add_argument("--heads", type=Path, default=Path("runs/study/heads"))
    parser.add_argument("--ff-seconds", type=float, default=StudySettings.ff_seconds)
    parser.add_argument("--circuit-seconds", type=float, default=StudySettings.circuit_seconds)
    parser.add_argument("--prompts", type=int, default=StudySettings.prompts)
    parser.add_argument("--new-tokens", type=int, default=StudySettings.new_tokens)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1, as the demo: the small model's ops gain "
                             "little from a second thread on a shared 2-core machine)")
    add_device_argument(parser, default="cpu",
                        note="cpu by default: the recorded study (docs/journal.md section 5) ran there.")
    args = parser.parse_args(argv)
    if min(args.threads, args.prompts, args.new_tokens) < 1:
        parser.error("--threads, --prompts and --new-tokens must be >= 1")
    try:
        device = resolve_device(args.device)
    except DeviceError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    settings = StudySettings(ff_seconds=args.ff_seconds, circuit_seconds=args.circuit_seconds,
                             prompts=args.prompts, new_tokens=args.new_tokens)
    return run(args.grid, args.phase, args.out, args.heads, settings, device)


if __name__ == "__main__":
    sys.exit(main())
