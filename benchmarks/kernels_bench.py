"""The fused triton kernels (:mod:`circuits.kernels`) against the torch path, on the same shapes.

Run ``python -m benchmarks.kernels_bench [--quick] [--out PATH] [--device auto|cpu|cuda[:N]]``
(``--device`` default ``auto``: CUDA when available, else the CPU).

Shapes: every sum fold of BTree and HMM (n=16 variables, r=32 units, K=256 categories, batch
256: the shapes :func:`circuits.compile` produces, one timing per distinct shape, summed over the
circuit's folds) and one large fold. Operations per shape: the log-space sum layer forward
(shared ``(F, K, D)`` weights), forward + backward, forward with per-row ``(B, F, K, D)``
weights (circuit folds only), and the Gumbel-max sampling step through the fold. Inputs are
random log-values of the real shapes. Candidates are timed round-robin (medians of rounds; CUDA
calls are synchronised), and on CUDA the two outputs are compared.

The head case times what one speculative round asks of a BTree n=16 r=32 head over V=259 bytes
(per-row logits ``(1, 16, 32, 259)``): the input statistics (log-normalisers and the
log-probabilities of 16 tokens; torch builds the log-softmax table), the prefix-conditional
mixture (16 evidence rows), and the whole head part of a round (``log_parameters``, conditional
sampling of the draft, the exact prefix conditionals of that draft) on each backend.

On a machine without CUDA the triton kernels can only run in triton's (very slow) interpreter,
which says nothing about GPU speed: the torch timings are reported and the triton column says
"no GPU: triton timings not measured". Results are printed as a table and written atomically as
JSON (default ``benchmarks/results/kernels_bench.json``) with the device named.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from circuits import compile
from circuits.compiled.layers import FoldedSum
from circuits.kernels import KernelBackend, log_matmul, resolve_backend, sum_child_choice, use_backend
from circuits.kernels.softmax import softmax_mixture, softmax_stats
from circuits.templates import btree, hmm
from circuits_llm.runtime.devices import DeviceError, add_device_argument, describe_device, resolve_device
from circuits_llm.runtime.timing import GradMode, interleaved, machine_info, medians, publish

SCHEMA_VERSION = 1
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "kernels_bench.json"
NO_GPU = "no GPU: triton timings not measured"
Shape = tuple[int, int, int, int]  # (F, B, K, D)


def sum_fold_shapes(circuit_name: str, batch: int) -> Counter[Shape]:
    """How many sum folds of each ``(F, B, K, D)`` the n=16 r=32 K=256 circuit compiles to."""
    build = {"btree": btree, "hmm": hmm}[circuit_name]
    compiled = compile(build(16, 32, 256))
    return Counter((int(m.raw.shape[0]), batch, int(m.raw.shape[1]), int(m.raw.shape[2]))
                   for m in compiled.folds if isinstance(m, FoldedSum))


def device_line(device: torch.device) -> str:
    """The device of the report: the GPU's name, or the CPU's model with its cores and threads."""
    if device.type == "cuda":
        return describe_device(device)
    machine = machine_info(device)
    return (f"cpu: {machine['processor']} ({machine['cpu_count']} logical CPUs, torch threads "
            f"{machine['torch_threads']})")


def timed_rounds(candidates: dict[str, Callable[[], object]], device: torch.device,
                 rounds: int) -> dict[str, float]:
    """Median seconds per call of each candidate, timed round-robin (grad mode stays on: the
    backward candidates need it; CUDA calls are synchronised)."""
    return medians(interleaved(candidates, rounds, grad_mode=GradMode.GRAD, device=device))


def operations(shape: Shape, device: torch.device, dtype: torch.dtype, per_row: bool,
               gen: torch.Generator) -> dict[str, Callable[[KernelBackend], Callable[[], Any]]]:
    """Operation name -> (backend -> zero-argument call) on random inputs of ``shape``."""
    fold, batch, units, width = shape

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=dtype).to(device)

    x, w = rand(fold, batch, width), torch.log_softmax(rand(fold, units, width), -1)
    x_grad, w_grad = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    unit = torch.randint(0, units, (fold, batch), generator=gen).to(device)
    uniforms = torch.rand(fold, batch, width, generator=gen, dtype=torch.float64).to(device)
    ops: dict[str, Callable[[KernelBackend], Callable[[], Any]]] = {
        "forward": lambda b: lambda: log_matmul(x, w, backend=b),
        "forward+backward": lambda b: lambda: log_matmul(x_grad, w_grad, backend=b).sum().backward(),
        "sample step": lambda b: lambda: sum_child_choice(w, unit, x, uniforms, backend=b),
    }
    if per_row:
        w_rows = torch.log_softmax(rand(batch, fold, units, width), -1)
        ops["forward per-row"] = lambda b: lambda: log_matmul(x, w_rows, backend=b)
    return ops


HEAD_SHAPE = (16, 16, 32, 259)  # input folds F, evidence rows B, units K, vocabulary C


def head_operations(device: torch.device, dtype: torch.dtype, gen: torch.Generator
                    ) -> dict[str, Callable[[KernelBackend], Callable[[], Any]]]:
    """The head part of a speculative round on a BTree n=16 r=32 V=259 circuit (batch 1)."""
    fold, rows, units, size = HEAD_SHAPE
    compiled = compile(btree(fold, units, size), dtype=dtype).to(device)
    params = {name: torch.randn(1, *shape, generator=gen, dtype=dtype).to(device)
              for name, shape in compiled.parameter_shapes().items()}
    logits = torch.randn(fold * units, size, generator=gen, dtype=dtype).to(device)
    tokens = torch.randint(0, size, (fold * units, rows), generator=gen).to(device)
    weights = torch.rand(fold, rows, units, generator=gen, dtype=dtype).to(device)
    table = logits.view(1, fold, units, size)
    lse = torch.logsumexp(table, -1)
    evidence = torch.randint(0, size, (rows, fold), generator=gen).to(device)
    observed = torch.arange(fold, device=device) == 0

    def stats(backend: KernelBackend) -> Callable[[], Any]:
        if backend is KernelBackend.TORCH:  # the reference path: the whole log-softmax table
            return lambda: torch.log_softmax(logits, -1).gather(1, tokens)
        return lambda: softmax_stats(logits, tokens, backend=backend).log_probs

    def head_round(backend: KernelBackend) -> Callable[[], Any]:
        def call() -> Any:
            with use_backend(backend):
                prepared = compiled.log_parameters(params)
                compiled.conditional_sample(evidence[:1], observed,
                                            torch.Generator(device).manual_seed(0), prepared)
                return compiled.log_prefix_conditionals(evidence[:1], None, prepared)
        return call

    return {"input stats": stats,
            "conditional mixture": lambda b: lambda: softmax_mixture(weights, table, lse,
                                                                     backend=b),
            "head part of a round": head_round}


def check_agreement(op: Callable[[KernelBackend], Callable[[], Any]]) -> float | None:
    """Largest |torch - triton| of an operation's output (None for backward-only results)."""
    torch_out, triton_out = op(KernelBackend.TORCH)(), op(KernelBackend.TRITON)()
    if torch_out is None:
        return None
    finite = torch.isfinite(torch_out)
    if not torch.equal(finite, torch.isfinite(triton_out)):
        return float("inf")
    diff = (torch_out.double() - triton_out.double())[finite].abs()
    return float(diff.max()) if diff.numel() else 0.0


def run(quick: bool, device: torch.device, log: Callable[[str], None]) -> dict[str, Any]:
    dtype = torch.float32
    batch = 256
    rounds = 3 if quick else 7
    probe = torch.zeros(1, device=device)
    triton_measured = resolve_backend(probe) is KernelBackend.TRITON
    cases: list[tuple[str, Counter[Shape] | None, bool]] = [
        ("BTree n=16 r=32 K=256", sum_fold_shapes("btree", batch), True),
        ("HMM n=16 r=32 K=256", sum_fold_shapes("hmm", batch), True),
        ("large fold", Counter({(8 if quick else 16, batch, 128, 256): 1}), False),
    ]
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for title, shapes, per_row in [*cases, ("BTree head n=16 r=32 V=259", None, False)]:
        if shapes is None:
            ops = head_operations(device, dtype, gen)
            log(f"{title}: logits (F, B, K, C) = {HEAD_SHAPE}")
            for op_name, op in ops.items():
                candidates = {"torch": op(KernelBackend.TORCH)}
                if triton_measured:
                    candidates["triton"] = op(KernelBackend.TRITON)
                medians = timed_rounds(candidates, device, rounds)
                rows.append({"case": title, "op": op_name, "shape_FBKD": list(HEAD_SHAPE),
                             "folds": HEAD_SHAPE[0], "torch_ms": 1e3 * medians["torch"],
                             "triton_ms": 1e3 * medians["triton"] if triton_measured else None,
                             "max_abs_diff": check_agreement(op) if triton_measured else None})
            continue
        totals: dict[str, dict[str, float]] = {}
        for shape, count in sorted(shapes.items()):
            log(f"{title}: {count} x fold (F, B, K, D) = {shape}")
            for op_name, op in operations(shape, device, dtype, per_row, gen).items():
                candidates = {"torch": op(KernelBackend.TORCH)}
                if triton_measured:
                    candidates["triton"] = op(KernelBackend.TRITON)
                medians = timed_rounds(candidates, device, rounds)
                entry = {"case": title, "op": op_name, "shape_FBKD": list(shape), "folds": count,
                         "torch_ms": 1e3 * medians["torch"],
                         "triton_ms": 1e3 * medians["triton"] if triton_measured else None,
                         "max_abs_diff": check_agreement(op) if triton_measured else None}
                rows.append(entry)
                total = totals.setdefault(op_name, {"torch_ms": 0.0, "triton_ms": 0.0})
                total["torch_ms"] += count * entry["torch_ms"]
                if triton_measured:
                    total["triton_ms"] += count * entry["triton_ms"]
        for op_name, total in totals.items():
            rows.append({"case": title, "op": f"{op_name} (all folds)", "shape_FBKD": None,
                         "folds": sum(shapes.values()), "torch_ms": total["torch_ms"],
                         "triton_ms": total["triton_ms"] if triton_measured else None,
                         "max_abs_diff": None})
    return {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "kernels_bench",
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device": device_line(device),
        "dtype": str(dtype),
        "batch": batch,
        "torch": torch.__version__,
        "triton_measured": triton_measured,
        "note": None if triton_measured else NO_GPU,
        "timing": ("medians of round-robin rounds; on a shared CPU only ratios within one run "
                   "mean anything. max_abs_diff: largest |torch - triton| output difference "
                   "(sample step: child indices, 0 = identical choices)"),
        "quick": quick,
        "rows": rows,
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [f"device: {report['device']}  dtype: {report['dtype']}  batch: {report['batch']}"]
    if report["note"]:
        lines.append(report["note"])
    header = f"{'case':<22} {'op':<30} {'(F, B, K, D)':<22} {'torch ms':>10} {'triton ms':>10} " \
             f"{'speedup':>8} {'max|diff|':>10}"
    lines += [header, "-" * len(header)]
    for row in report["rows"]:
        folds = f"{row['folds']} fold{'s' if row['folds'] != 1 else ''}"
        shape = "x".join(map(str, row["shape_FBKD"])) if row["shape_FBKD"] else folds
        if row["triton_ms"] is None:
            triton_ms, speedup = "n/a", "n/a"
        else:
            triton_ms = f"{row['triton_ms']:.3f}"
            speedup = f"{row['torch_ms'] / row['triton_ms']:.2f}x" if row["triton_ms"] > 0 else "inf"
        diff = "" if row["max_abs_diff"] is None else f"{row['max_abs_diff']:.2e}"
        lines.append(f"{row['case']:<22} {row['op']:<30} {shape:<22} {row['torch_ms']:>10.3f} "
                     f"{triton_ms:>10} {speedup:>8} {diff:>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, a smaller large fold")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except DeviceError as error:
        parser.error(str(error))
    current = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with current:  # triton launches on the current device: make it the one asked for
        report = run(args.quick, device, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    publish(format_table(report), report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
