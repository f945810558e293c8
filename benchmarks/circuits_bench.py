"""Throughput of the folded circuit layers: log-likelihood and sampling, against references.

Run ``python -m benchmarks.circuits_bench [--quick] [--out PATH] [--no-cirkit]``.

For each of four circuits (batch 256, float32, 2 torch threads) it reports, from ONE run with
the candidates timed round-robin (medians of repeats; see :mod:`circuits_llm.runtime.timing`):

(a) folded vs the naive unfolded evaluation of the same circuit (``compile(c, fold=False)``,
    same parameters), for log-likelihood and for sampling;
(b) the folded sum layers' achieved GFLOP/s vs ``torch.bmm`` on exactly the same shapes
    (``2*F*B*K*D`` FLOPs per sum fold, both timed in isolation on the same inputs), and the
    share of the log-likelihood time spent inside the sum layers' forward;
(c) vs libcirkit (optional): the same circuit translated layer by layer into cirkit with the same
    parameters (log-likelihoods compared numerically; parameter counts compared, also against
    cirkit's own builder on the same region graph).

Results are printed as a table and written atomically as JSON (default
``benchmarks/results/circuits_bench.json``).

Run as a script it sets ``OMP_WAIT_POLICY=PASSIVE`` (unless set) before torch loads: on a machine
whose cores are oversubscribed, OpenMP threads that spin at barriers wait for descheduled peers,
which made 2-thread timings 20-60x slower and unrelated to the code being measured. The policy
applies to every candidate alike and is recorded in the JSON.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # before torch (and its OpenMP runtime) is loaded
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from benchmarks import cirkit_bridge
from circuits import Circuit, CompiledCircuit, compile
from circuits.compiled.circuit import Trace
from circuits.compiled.layers import FoldedSum
from circuits.region_graphs import (
    RegionGraph,
    SumProductPattern,
    balanced_binary_tree,
    build_circuit,
    linear,
    quad_tree,
    random_binary_tree,
)
from circuits.templates import btree, hmm
from circuits_llm.runtime.timing import ModuleTimer, Timing, interleaved, machine_info, publish

SCHEMA_VERSION = 1
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "circuits_bench.json"

#: ``--quick`` times the unfolded reference only for circuits with at most this many layers.
QUICK_UNFOLDED_FOLDS = 2000

TARGETS = {"sum_vs_bmm": 0.6, "loglik_vs_cirkit": 3.0, "sampling_vs_cirkit": 10.0}


@dataclass(frozen=True)
class CircuitCase:
    """One benchmark circuit.

    Attributes:
        key: short identifier (JSON key).
        title: human-readable description with the sizes.
        build: makes the symbolic circuit.
        region_graph: the region graph cirkit's own builder gets for the parameter cross-check
            (with cirkit's ``"cp-t"`` pattern: Hadamard products then dense sums, which is this
            library's CP pattern and the BTree/HMM templates).
        units: ``(num_sum_units, num_input_units, num_categories)`` for that builder.
        native_note: what to expect of that cross-check.
    """

    key: str
    title: str
    build: Callable[[], Circuit]
    region_graph: Callable[[], RegionGraph]
    units: tuple[int, int, int]
    native_note: str = "cirkit's builder on the same region graph must give the same count"


def cases(scale: str = "full") -> list[CircuitCase]:
    """The four benchmark circuits; ``scale="tiny"`` gives small versions for smoke tests."""
    if scale == "full":
        n, r, k = 16, 32, 256
        rbt = (64, 6, 64, 2)  # variables, depth, units, categories
        quad = (28, 28, 16, 256)  # height, width, units, categories
    elif scale == "tiny":
        n, r, k = 4, 3, 5
        rbt = (8, 3, 4, 2)
        quad = (4, 4, 2, 3)
    else:
        raise ValueError(f"unknown scale {scale!r}; use 'full' or 'tiny'")
    rbt_n, rbt_depth, rbt_units, rbt_k = rbt
    height, width, quad_units, quad_k = quad

    def rbt_graph() -> RegionGraph:
        return random_binary_tree(rbt_n, rbt_depth, 1, 0)

    def quad_graph() -> RegionGraph:
        return quad_tree(height, width)

    return [
        CircuitCase("btree", f"BTree n={n} r={r} K={k}", lambda: btree(n, r, k),
                    lambda: balanced_binary_tree(n), (r, r, k)),
        CircuitCase("hmm", f"HMM n={n} r={r} K={k}", lambda: hmm(n, r, k),
                    lambda: linear(n), (r, r, k),
                    native_note=("cirkit's linear tree has no transition before the last emission "
                                 "(our template has one): r*r fewer parameters expected; the "
                                 "timed cirkit circuit is the exact layer-by-layer translation")),
        CircuitCase("random_binary_tree",
                    f"RandomBinaryTree n={rbt_n} depth={rbt_depth} r={rbt_units} K={rbt_k}",
                    lambda: build_circuit(rbt_graph(), SumProductPattern.CP, rbt_units,
                                          rbt_units, rbt_k),
                    rbt_graph, (rbt_units, rbt_units, rbt_k)),
        CircuitCase("quad_tree", f"QuadTree {height}x{width} r={quad_units} K={quad_k}",
                    lambda: build_circuit(quad_graph(), SumProductPattern.CP, quad_units,
                                          quad_units, quad_k),
                    quad_graph, (quad_units, quad_units, quad_k)),
    ]


# ---------------------------------------------------------------------------------------- helpers
def copy_parameters(source: CompiledCircuit, target: CompiledCircuit) -> None:
    """Give ``target`` the raw parameters of ``source`` (both compiled from one circuit)."""
    table = cirkit_bridge.raw_parameters(source)
    with torch.no_grad():
        for plan, module in zip(target.plans, target.folds, strict=True):
            raw = getattr(module, "raw", None)
            if raw is None:
                continue
            for slot, layer in enumerate(plan.layers):
                raw[slot].copy_(table[layer.uid])


def bench_machine() -> dict[str, Any]:
    """What the numbers were measured on: :func:`circuits_llm.runtime.timing.machine_info`, the OpenMP
    wait policy and how to read the numbers."""
    return {**machine_info(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "note": "2 CPU cores shared with other jobs: only the ratios of one run are meaningful"}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.inf


def _timing_entry(timing: Timing, rows: int) -> dict[str, float]:
    """Median seconds per call (what the ratios use), rows/s, best round and relative IQR."""
    seconds = timing.median
    return {"seconds": seconds, "rows_per_s": rows / seconds if seconds > 0 else math.inf,
            "best_seconds": timing.best, "spread": timing.spread}


# ------------------------------------------------------------------------------------ sum layers
def sum_layer_benchmark(compiled: CompiledCircuit, x: torch.Tensor, rounds: int,
                        warmup: int = 1) -> dict[str, Any]:
    """The folded sum layers in isolation vs ``torch.bmm`` on the same shapes.

    Every sum fold is run on the inputs and log-weights a real log-likelihood pass gives it; the
    reference multiplies ``(F, B, D) @ (F, D, K)`` float tensors with one ``torch.bmm`` per fold.
    """
    trace = Trace()
    with torch.inference_mode():
        observed = torch.ones_like(x, dtype=torch.bool)
        compiled.evaluate(x, observed, {}, trace=trace)
    work: list[tuple[FoldedSum, torch.Tensor, torch.Tensor]] = []
    operands: list[tuple[torch.Tensor, torch.Tensor]] = []
    folds: list[dict[str, int]] = []
    flops = 0
    generator = torch.Generator().manual_seed(0)
    for plan, module in zip(compiled.plans, compiled.folds, strict=True):
        if not isinstance(module, FoldedSum):
            continue
        inputs, log_weights = trace.sum_inputs[plan.fold_id], trace.log_params[plan.fold_id]
        fold, batch, width = inputs.shape
        units = log_weights.shape[1]
        flops += 2 * fold * batch * units * width
        folds.append({"F": fold, "B": batch, "K": units, "D": width})
        work.append((module, inputs, log_weights))
        operands.append((torch.rand(fold, batch, width, generator=generator, dtype=inputs.dtype),
                         torch.rand(fold, width, units, generator=generator, dtype=inputs.dtype)))

    def run_sums() -> None:
        for module, inputs, log_weights in work:
            module(inputs, log_weights)

    def run_bmm() -> None:
        for left, right in operands:
            torch.bmm(left, right)

    timings = interleaved({"sum_layers": run_sums, "bmm": run_bmm}, rounds=rounds, warmup=warmup)
    t_sum, t_bmm = timings["sum_layers"].median, timings["bmm"].median
    return {"flops": flops, "folds": folds,
            "sum_seconds": t_sum, "bmm_seconds": t_bmm,
            "sum_gflops": flops / t_sum / 1e9, "bmm_gflops": flops / t_bmm / 1e9,
            "ratio_vs_bmm": _ratio(t_bmm, t_sum)}


def sum_share(compiled: CompiledCircuit, x: torch.Tensor, rounds: int) -> dict[str, float]:
    """Median share of one log-likelihood pass spent inside the sum folds' ``forward``."""
    sums = [m for m in compiled.folds if isinstance(m, FoldedSum)]
    shares, totals = [], []
    with torch.inference_mode():
        compiled.log_likelihood(x)
        for _ in range(rounds):
            with ModuleTimer(sums) as timer:
                start = time.perf_counter()
                compiled.log_likelihood(x)
                total = time.perf_counter() - start
            shares.append(timer.total / total)
            totals.append(total)
    shares.sort()
    totals.sort()
    return {"share": shares[len(shares) // 2], "loglik_seconds_with_hooks": totals[len(totals) // 2]}


# ------------------------------------------------------------------------------------ benchmark
def bench_circuit(case: CircuitCase, *, batch: int = 256, rounds: int = 7,
                  with_cirkit: bool = True, seed: int = 0, warmup: int = 1,
                  time_unfolded_up_to: int | None = None) -> dict[str, Any]:
    """All measurements of one circuit (see the module docstring).

    ``warmup`` untimed calls precede each candidate's rounds (one calibration call always does).
    The unfolded reference is always checked numerically, but timed only when it has at most
    ``time_unfolded_up_to`` folds (None: always).
    """
    start = time.perf_counter()
    circuit = case.build()
    folded = compile(circuit, seed=seed)
    unfolded = compile(circuit, fold=False, seed=seed)
    copy_parameters(folded, unfolded)
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        x = folded.sample(batch, generator=generator)
        ll_folded = folded.log_likelihood(x)
        ll_unfolded = unfolded.log_likelihood(x)
        log_z = float(folded.log_partition())
    result: dict[str, Any] = {
        "key": case.key, "title": case.title, "batch_size": batch,
        "num_parameters": sum(p.numel() for p in folded.parameters()),
        "num_layers": len(circuit.layers), "num_folds": len(folded.plans),
        "num_unfolded_folds": len(unfolded.plans),
        "check": {"folded_vs_unfolded_max_abs_diff": float((ll_folded - ll_unfolded).abs().max()),
                  "folded_vs_unfolded_match": bool(torch.allclose(ll_folded, ll_unfolded,
                                                                  rtol=1e-5, atol=1e-4)),
                  "log_partition": log_z, "mean_loglik": float(ll_folded.mean())},
    }

    cirkit_model = None
    if with_cirkit and cirkit_bridge.available():
        cirkit_info, cirkit_model = cirkit_bridge.setup(circuit, folded, x, case.units,
                                                        case.region_graph, case.native_note)
    elif with_cirkit:
        cirkit_info = {"installed": False, "note": "libcirkit not installed"}
    else:
        cirkit_info = {"installed": cirkit_bridge.available(), "note": "skipped (--no-cirkit/--quick)"}

    # (a)/(c) log-likelihood, all candidates interleaved
    time_unfolded = time_unfolded_up_to is None or len(unfolded.plans) <= time_unfolded_up_to
    ll_candidates: dict[str, Callable[[], object]] = {"folded": lambda: folded.log_likelihood(x)}
    if time_unfolded:
        ll_candidates["unfolded"] = lambda: unfolded.log_likelihood(x)
    if cirkit_model is not None:
        ll_candidates["cirkit"] = lambda: cirkit_bridge.log_likelihood(cirkit_model, x)
    ll = interleaved(ll_candidates, rounds=rounds, warmup=warmup)
    result["loglik"] = {name: _timing_entry(t, batch) for name, t in ll.items()}
    result["loglik"]["folded_vs_unfolded"] = (
        _ratio(ll["unfolded"].median, ll["folded"].median) if time_unfolded else None)

    # (a)/(c) sampling
    sample_gen = torch.Generator().manual_seed(seed + 1)
    s_candidates: dict[str, Callable[[], object]] = {
        "folded": lambda: folded.sample(batch, generator=sample_gen)}
    if time_unfolded:
        s_candidates["unfolded"] = lambda: unfolded.sample(batch, generator=sample_gen)
    cirkit_rows = batch
    if cirkit_model is not None:
        cirkit_rows = cirkit_bridge.sampling_rows(folded, batch)
        draw = cirkit_bridge.sampler(cirkit_model)
        s_candidates["cirkit"] = lambda: draw(cirkit_rows)
        if cirkit_rows != batch:
            s_candidates["folded_at_cirkit_rows"] = lambda: folded.sample(cirkit_rows,
                                                                          generator=sample_gen)
    sampling_rounds = rounds if rounds <= 3 else rounds // 2 + 1  # the unfolded one is slow
    sampling = interleaved(s_candidates, rounds=sampling_rounds, warmup=warmup)
    rows = {"folded": batch, "unfolded": batch, "cirkit": cirkit_rows,
            "folded_at_cirkit_rows": cirkit_rows}
    result["sampling"] = {name: _timing_entry(t, rows[name]) for name, t in sampling.items()}
    result["sampling"]["folded_vs_unfolded"] = (
        _ratio(sampling["unfolded"].median, sampling["folded"].median) if time_unfolded else None)
    if cirkit_model is not None:
        result["loglik"]["folded_vs_cirkit"] = _ratio(ll["cirkit"].median, ll["folded"].median)
        ours = "folded_at_cirkit_rows" if cirkit_rows != batch else "folded"
        cirkit_info["sampling_rows"] = cirkit_rows
        result["sampling"]["folded_vs_cirkit"] = _ratio(sampling["cirkit"].median,
                                                        sampling[ours].median)
    result["cirkit"] = cirkit_info

    # (b) sum layers
    result["sum_layers"] = sum_layer_benchmark(folded, x, rounds, warmup)
    result["sum_layers"].update(sum_share(folded, x, rounds))
    result["seconds"] = time.perf_counter() - start
    return result


def run(*, quick: bool = False, with_cirkit: bool = True, scale: str = "full",
        batch: int = 256, rounds: int | None = None, threads: int = 2,
        only: list[str] | None = None, log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Benchmark every case; returns the JSON-ready report."""
    torch.set_num_threads(threads)
    rounds = rounds if rounds is not None else (1 if quick else 9)
    warmup = 0 if quick else 1
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": bench_machine(), "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(), "dtype": "float32", "batch_size": batch,
        "quick": quick, "scale": scale, "rounds": rounds, "warmup": warmup, "targets": TARGETS,
        "libcirkit": {"installed": cirkit_bridge.available(), "version": cirkit_bridge.version(),
                      "used": with_cirkit and cirkit_bridge.available()},
        "circuits": [],
    }
    for case in cases(scale):
        if only and case.key not in only:
            continue
        if log:
            log(f"... {case.title}")
        report["circuits"].append(bench_circuit(
            case, batch=batch, rounds=rounds, with_cirkit=with_cirkit, warmup=warmup,
            time_unfolded_up_to=QUICK_UNFOLDED_FOLDS if quick else None))
    return report


# ------------------------------------------------------------------------------------------ table
def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:{spec}}{suffix}"


def format_table(report: dict[str, Any]) -> str:
    """The report as a fixed-width text table (ratios are speed-ups: higher is better)."""
    head = (f"{'circuit':<38} {'LL rows/s':>10} {'LLxunf':>7} {'LLxcirk':>8} {'S rows/s':>9} "
            f"{'Sxunf':>6} {'Sxcirk':>7} {'sumGF/s':>8} {'bmmGF/s':>8} {'sum/bmm':>8} {'sum%LL':>7}")
    lines = [head, "-" * len(head)]
    for entry in report["circuits"]:
        ll, s, sums = entry["loglik"], entry["sampling"], entry["sum_layers"]
        lines.append(
            f"{entry['title']:<38} {_fmt(ll['folded']['rows_per_s'], '.0f'):>10} "
            f"{_fmt(ll['folded_vs_unfolded'], '.1f', 'x'):>7} "
            f"{_fmt(ll.get('folded_vs_cirkit'), '.1f', 'x'):>8} "
            f"{_fmt(s['folded']['rows_per_s'], '.0f'):>9} "
            f"{_fmt(s['folded_vs_unfolded'], '.1f', 'x'):>6} "
            f"{_fmt(s.get('folded_vs_cirkit'), '.1f', 'x'):>7} "
            f"{_fmt(sums['sum_gflops'], '.2f'):>8} {_fmt(sums['bmm_gflops'], '.2f'):>8} "
            f"{_fmt(sums['ratio_vs_bmm'], '.2f'):>8} {_fmt(100 * sums['share'], '.0f', '%'):>7}")
    lines.append("")
    lines.append(f"batch {report['batch_size']}, {report['dtype']}, {report['num_threads']} threads, "
                 f"torch {report['torch_version']}; {report['machine']['note']}.")
    lines.append("Ratios are medians of interleaved repeats within this run (higher = ours faster); "
                 f"targets: sum/bmm >= {TARGETS['sum_vs_bmm']}, LLxcirk >= "
                 f"{TARGETS['loglik_vs_cirkit']}, Sxcirk >= {TARGETS['sampling_vs_cirkit']}.")
    cirkit = report["libcirkit"]
    if not cirkit["installed"]:
        lines.append("libcirkit not installed (pip install -c constraints.txt libcirkit): "
                     "cirkit columns skipped.")
    elif not cirkit["used"]:
        lines.append("libcirkit comparison skipped.")
    for entry in report["circuits"]:
        info = entry["cirkit"]
        check = entry["check"]
        notes = [f"folded==unfolded: {check['folded_vs_unfolded_match']} "
                 f"(max |diff| {check['folded_vs_unfolded_max_abs_diff']:.1e}), "
                 f"log Z = {check['log_partition']:.1e}"]
        if "num_parameters" in info:
            counts = info["num_parameters"]
            notes.append(f"params ours {counts['circuits']} / cirkit translated "
                         f"{counts['cirkit_translated']} / cirkit builder "
                         f"{counts['cirkit_native_builder']}; LL match {info['loglik_match']} "
                         f"(max |diff| {info['loglik_max_abs_diff']:.1e})")
            if info["rows_clamped_by_cirkit"]:
                notes.append(f"cirkit clamps log-values at {cirkit_bridge.LOG_CLAMP_MIN:.1f} "
                             f"({info['rows_clamped_by_cirkit']}/{entry['batch_size']} rows; the "
                             "LL check lifts the clamp)")
            if not info["native_parameters_match"]:
                notes.append(f"builder count differs: {info['native_note']}")
            if info.get("sampling_rows", entry["batch_size"]) != entry["batch_size"]:
                notes.append(f"cirkit sampled {info['sampling_rows']} rows per call (its sampler "
                             "pads to (folds, units, rows, variables) int64: batch "
                             f"{entry['batch_size']} would not fit in memory); Sxcirk compares "
                             "both at that size")
        if entry["loglik"]["folded_vs_unfolded"] is None:
            notes.append(f"unfolded reference ({entry['num_unfolded_folds']} layers) not timed "
                         "in --quick")
        lines.append(f"  {entry['key']}: " + "; ".join(notes))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one round, no warm-up, no libcirkit, unfolded reference timed "
                             f"only up to {QUICK_UNFOLDED_FOLDS} layers (finishes in < 60 s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    parser.add_argument("--no-cirkit", action="store_true", help="skip the libcirkit comparison")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per candidate")
    parser.add_argument("--only", nargs="*", default=None,
                        help="circuit keys to run (btree hmm random_binary_tree quad_tree)")
    parser.add_argument("--scale", choices=("full", "tiny"), default="full",
                        help="'tiny' runs small versions of the circuits (smoke tests)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    report = run(quick=args.quick, with_cirkit=not (args.quick or args.no_cirkit),
                 rounds=args.rounds, only=args.only, scale=args.scale, threads=args.threads,
                 log=lambda msg: print(msg, file=sys.stderr, flush=True))
    publish(format_table(report), report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
