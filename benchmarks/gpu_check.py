"""One GPU check: is everything exact on the device, and how fast is the compiled round there?

Run ``make gpu-check`` (= ``python -m benchmarks.gpu_check``; ``--device`` defaults to ``cuda``)
on a CUDA machine; it needs no network and no model package, and is sized to finish within 8
minutes on an H100 (``--budget-s``: a row that would start later is skipped, and says so).
``python -m benchmarks.gpu_check --device cpu --quick`` is the CPU smoke run (tiny shapes, fewer
samples; under 2 minutes; the decoder's programs are compiled with ``aot_eager`` there, see
:class:`~benchmarks.gpu_check_core.CompilerChoice`). It prints ONE table, writes it as JSON
(default ``benchmarks/results/gpu_check.json``, atomically) and exits non-zero when a row FAILs.

Rows, each PASS / FAIL / SKIP (with the reason), its numbers and its seconds:

* **circuit queries, sampling, MAP** (:mod:`benchmarks.gpu_check_circuits`), for both kernel
  backends (torch, triton) and both dtypes: log-likelihood, marginals, ``log Z``, conditionals,
  prefix marginals and conditionals (also under external per-row parameters), unconditional and
  conditional sampling (G-test against the exact law, and a biased negative control the same test
  must reject) and MAP, on the four named templates, against a CPU float64 reference;
* **learn.fit EM**: EM on the device against the same run on the CPU in float64;
* **decoder law** (:mod:`benchmarks.gpu_check_decoder`): the decoder's exact output law on the toy
  LM, enumerated on the device and sampled end to end (each with a biased control), and compiled
  decoding equal to eager decoding seed by seed;
* **greedy = generate**: greedy speculative decoding equals ``model.generate`` on tiny Llama and
  GPT-2 models, eager and compiled, with a circuit head, and on Llama with the draft blocks
  (recursive, and a BTree head on the block);
* **SmolLM2-shaped speed** (:mod:`benchmarks.gpu_check_speed`): compiled AR against the compiled
  speculative round with forced acceptance (FF and BTree, the shipped heads' shapes), and the
  speed-up predicted from the acceptance measured on the real model;
* **draft-block speed** (:mod:`benchmarks.gpu_check_blocks`): the same forced compiled round with
  random draft blocks of the shipped shapes (recursive, 5 drafts; a BTree head on the block), what
  of the round runs eager said in the row, and the speed-up predicted from the tokens per round
  the shipped blocks reached on the real model (``make demo``);
* **batched decoding** (:mod:`benchmarks.gpu_check_batch`): greedy batched speculative decoding of
  a ragged batch equals ``model.generate`` row by row (circuit head, draft block; tiny float64
  Llama), and batched AR against batched speculative decoding with the draft block at batch 1 to
  16 on the SmolLM2-shaped model: the rounds' phases, the speed-up predicted from the per-row
  tokens per round measured on the real model, and the batch size where it falls below 1;
* **vs libcirkit**: rows/s of log-likelihood, a training step and sampling at batch 256 and 4,096
  (SKIP when libcirkit is not importable: the GPU machine has no network, carry its wheel).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # before torch loads its OpenMP runtime (see benchmarks.circuits_bench)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from benchmarks.gpu_check_batch import batch_rows
from benchmarks.gpu_check_blocks import block_rows
from benchmarks.gpu_check_circuits import circuit_rows, cirkit_rows, learn_rows
from benchmarks.gpu_check_core import (
    CompilerChoice,
    Group,
    Outcome,
    Row,
    Settings,
    SkipReason,
    Status,
    run_row,
)
from benchmarks.gpu_check_decoder import greedy_rows, law_rows
from benchmarks.gpu_check_speed import SpeedBench, speed_rows
from circuits.kernels import failed_kernels, triton_version
from circuits_llm.runtime.compiling import compile_fallbacks
from circuits_llm.runtime.devices import DeviceError, add_device_argument, resolve_device
from circuits_llm.runtime.timing import machine_info, publish

SCHEMA_VERSION = 1
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_check.json"
#: seconds after which no new row starts: the full run must end within 8 minutes on an H100, and
#: its last rows (a forced round compiles two programs) may take a minute
FULL_BUDGET_S, QUICK_BUDGET_S = 380.0, 300.0
RowSpec = tuple[Group, str, Callable[[], Outcome]]


def row_specs(settings: Settings) -> list[RowSpec]:
    """Every row of the check, in :class:`Group` order (the speed, draft-block and batch rows
    share one SmolLM2-shaped model and compiled backbone)."""
    speed = SpeedBench(settings)
    return [*circuit_rows(settings), *learn_rows(settings), *law_rows(settings),
            *greedy_rows(settings), *speed_rows(settings, speed), *block_rows(settings, speed),
            *batch_rows(settings, speed), *cirkit_rows(settings)]


def run_check(settings: Settings, log: Callable[[str], None],
              groups: frozenset[Group] | None = None) -> list[Row]:
    """Run every row of ``groups`` (``None``: all; on CUDA with the device made current); a row
    that would start after ``settings.budget_s`` seconds is a SKIP that says so."""
    if settings.cuda:
        torch.cuda.set_device(settings.device)
    start = time.perf_counter()
    rows: list[Row] = []
    for group, name, check in row_specs(settings):
        if groups is not None and group not in groups:
            continue
        elapsed = time.perf_counter() - start
        if elapsed > settings.budget_s:
            detail = f"{elapsed:.0f} s > {settings.budget_s:.0f} s"
            row = run_row(group, name, lambda d=detail: Outcome.skipped(SkipReason.BUDGET, d),
                          settings.device)
        else:
            row = run_row(group, name, check, settings.device)
        rows.append(row)
        log(f"[{time.perf_counter() - start:6.1f} s] {row.status.value} {group.value}: {name}"
            + (f" ({row.reason})" if row.reason else ""))
    return rows


def format_table(record: dict[str, Any]) -> str:
    """The one table of a :func:`run` record."""
    config, machine = record["config"], record["machine"]
    counts = record["counts"]
    lines = [f"GPU check on {machine['device']} (torch {machine['torch']}, triton "
             f"{record['triton'] or 'absent'}, compiler {config['compiler']}"
             f"{', --quick' if config['quick'] else ''}): {len(record['rows'])} rows, "
             f"{counts.get('PASS', 0)} PASS, {counts.get('FAIL', 0)} FAIL, {counts.get('SKIP', 0)} "
             f"SKIP, {record['wall_s']:.0f} s",
             f"{'group':<21}{'check':<36}{'status':<7}{'sec':>7}  numbers / reason",
             "-" * 110]
    for row in record["rows"]:
        text = row["numbers"] + (" | " if row["numbers"] and row["reason"] else "") + row["reason"]
        lines.append(f"{row['group']:<21}{row['name']:<36}{row['status']:<7}{row['seconds']:>7.1f}  "
                     f"{text}")
    for key, title in (("kernel_fallbacks", "triton kernels replaced by torch (AUTO)"),
                       ("compile_fallbacks", "compiled programs run eager")):
        if record[key]:
            lines.append(f"{title}: " + "; ".join(record[key]))
    return "\n".join(lines)


def run(settings: Settings, log: Callable[[str], None] = print,
        groups: frozenset[Group] | None = None) -> dict[str, Any]:
    """Run the check (the rows of ``groups``, ``None``: all); the JSON-ready record (``rows``,
    ``counts``, ``passed``, machine, config)."""
    start = time.perf_counter()
    rows = run_check(settings, log, groups)
    records = [row.record() for row in rows]
    counts = Counter(row.status.value for row in rows)
    version = triton_version()
    return {
        "schema_version": SCHEMA_VERSION, "benchmark": "gpu_check",
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "config": {"device": str(settings.device), "quick": settings.quick,
                   "compiler": settings.compiler.value, "seed": settings.seed,
                   "budget_s": settings.budget_s,
                   "groups": None if groups is None else sorted(g.name.lower() for g in groups)},
        "machine": machine_info(settings.device),
        "triton": None if version is None else ".".join(map(str, version)),
        "rows": records, "counts": dict(counts), "passed": counts.get(Status.FAIL.value, 0) == 0,
        "kernel_fallbacks": [f"{kernel.name} {dtype} {device}: {why}"
                             for (kernel, dtype, device), why in failed_kernels().items()],
        "compile_fallbacks": [f"{f.program}: {f.error}" for f in compile_fallbacks()],
        "wall_s": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> int:
    """The command: 0 when no row FAILs, 1 otherwise, 2 for a device this machine lacks."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_device_argument(parser, default="cuda",
                        note="Without CUDA, pass --device cpu (with --quick for the smoke run).")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes and fewer samples (the CPU smoke run, < 2 minutes)")
    parser.add_argument("--compiler", choices=[c.value for c in CompilerChoice], default=None,
                        help="what compiles the decoder's programs (default: inductor, the shipped "
                             "torch.compile; aot_eager for --quick on the CPU)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"start no row after this many seconds (default {FULL_BUDGET_S:.0f}, "
                             f"{QUICK_BUDGET_S:.0f} with --quick)")
    parser.add_argument("--groups", nargs="+", choices=[g.name.lower() for g in Group],
                        default=None, help="run only these row groups (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="seeds every random choice")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except DeviceError as error:
        print(f"gpu_check: {error}; add --quick for the short CPU smoke run", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    compiler = CompilerChoice(args.compiler) if args.compiler else (
        CompilerChoice.AOT_EAGER if args.quick and device.type == "cpu" else CompilerChoice.INDUCTOR)
    budget = args.budget_s if args.budget_s is not None else (
        QUICK_BUDGET_S if args.quick else FULL_BUDGET_S)
    settings = Settings(device, args.quick, compiler, args.seed, budget)
    groups = None if args.groups is None else frozenset(Group[g.upper()] for g in args.groups)
    record = run(settings, log=lambda line: print(line, file=sys.stderr, flush=True),
                 groups=groups)
    publish(format_table(record), record, args.out, note=f" ({record['wall_s']:.0f} s)")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
