"""Density estimation on scikit-learn's digits: EM against Adam, this project against libcirkit.

Run ``python -m benchmarks.learning_bench [--quick] [--no-cirkit] [--out PATH] [--plot PATH]``.

The data: scikit-learn's ``load_digits`` (shipped with the package, nothing is downloaded), 1,797
images of 8x8 pixels with values 0..16: 64 categorical variables with 17 categories; the first
1,500 images train, the last 297 test. Three circuits with 32 units (CP layers: Hadamard products
under ``32 x 32`` sum layers), all built by this project and compiled with one seed:

* ``quad_tree``: the 8x8 quad tree (55,328 parameters, the shape of libcirkit's ``cp-t``);
* ``random_binary_tree``: a RAT-SPN tree over the 64 pixels (one repetition, depth 6);
* ``hclt``: the hidden Chow-Liu tree learned from the training images
  (:func:`circuits.templates.hclt`).

Each circuit is trained by two optimisers, mini-batch EM (``circuits.learn.EM``, step 0.1,
pseudocount 0.01) and Adam (lr 0.01), in two libraries: this project (:func:`circuits.learn.fit`)
and libcirkit, which gets the *same* circuit with the *same* initial distribution, translated
layer by layer (for Adam the softmax logits of :func:`benchmarks.cirkit_bridge.translate`; for its
EM optimiser, which updates probabilities in place, the probabilities themselves). One full-batch
EM step with step 1 and no pseudocount gives the same model in both libraries
(``tests/test_learning_bench_smoke.py``), so the two EMs are one algorithm; they differ in the
smoothing only: this project adds the pseudocount to every expected count, libcirkit spreads it
over a row (``pseudocount / D`` per entry). Same budget for all: 20 epochs, batches of 100 in the
same shuffled order, one torch thread.

Every epoch of every run is interleaved round-robin with the others (epoch 1 of each run, then
epoch 2 of each, ...), so a machine that slows down during the benchmark slows every run alike.
Reported per run: test bits per dimension after every epoch (and before the first), training
bits/dim (as ``fit`` measures it: each batch before its update), and seconds per epoch (training
only, median over epochs). The table is printed, the record written as JSON, and a PNG shows test
bits/dim against epochs and against seconds.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # before torch (and its OpenMP runtime) is loaded: see circuits_bench
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
from torch import Tensor

from benchmarks import cirkit_bridge
from circuits import Circuit, CompiledCircuit, compile, learn, templates
from circuits.files import atomic_write
from circuits.region_graphs import SumProductPattern, build_circuit, quad_tree, random_binary_tree
from circuits.symbolic import InputLayer, ProductKind, ProductLayer, SumLayer
from circuits_llm.app.report import jsonable
from circuits_llm.runtime.timing import machine_info, publish

SCHEMA_VERSION = 1
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "learning_bench.json"
DEFAULT_PLOT = RESULTS / "learning_bench.png"
QUICK_OUT = RESULTS / "learning_bench_quick.json"
QUICK_PLOT = RESULTS / "learning_bench_quick.png"

TRAIN_ROWS, TEST_ROWS = 1500, 297
IMAGE_SIDE, CATEGORIES = 8, 17
UNITS, EPOCHS, BATCH_SIZE = 32, 20, 100
QUICK_UNITS, QUICK_EPOCHS = 4, 2
EM_STEP_SIZE, EM_PSEUDOCOUNT, ADAM_LR = 0.1, 0.01, 0.01
RANDOM_TREE_DEPTH = 6
#: the issue's count for the 8x8 quad tree with 32 CP units (libcirkit's ``cp-t`` has the same)
QUAD_TREE_PARAMETERS = 55_328
#: what the libcirkit EM runs call per batch: the gradient of the summed log-likelihood is the
#: expected counts, to which cirkit adds the pseudocount (with ``ll.mean()`` the counts shrink by
#: the batch size and the same pseudocount smooths 100 times harder: 2.11 instead of 2.07 bits/dim
#: on the quad tree); this reproduces the issue's libcirkit ``cp-t`` figure (2.069)
CIRKIT_EM_USAGE = "ll.sum().backward(); EM(lr=0.1, pseudocount=0.01).step()"


class Optimizer(Enum):
    """How a run learns."""

    EM = "em"
    ADAM = "adam"


class Library(Enum):
    """Whose code runs the training."""

    CIRCUITS = "circuits"
    LIBCIRKIT = "libcirkit"


def load_digits_split() -> tuple[Tensor, Tensor]:
    """(train (1500, 64), test (297, 64)) int64 pixels 0..16 of scikit-learn's digits."""
    from sklearn.datasets import load_digits

    pixels = torch.from_numpy(load_digits().data.astype(np.int64))
    if pixels.shape != (TRAIN_ROWS + TEST_ROWS, IMAGE_SIDE * IMAGE_SIDE) or int(pixels.max()) >= CATEGORIES:
        raise RuntimeError(f"unexpected digits data: shape {tuple(pixels.shape)}, max {int(pixels.max())}")
    return pixels[:TRAIN_ROWS], pixels[TRAIN_ROWS:]


def bits_per_dim(log_likelihood: float, num_variables: int) -> float:
    """Mean log-likelihood per row (nats) as bits per variable (lower is better)."""
    return -log_likelihood / (num_variables * math.log(2))


@dataclass(frozen=True)
class CircuitCase:
    """One benchmark circuit: ``key``, a ``title`` with its sizes, and how to ``build`` it."""

    key: str
    title: str
    build: Callable[[], Circuit]


def cases(train: Tensor, units: int) -> list[CircuitCase]:
    """The three circuits with ``units`` units (the HCLT learned from ``train``)."""
    variables = IMAGE_SIDE * IMAGE_SIDE
    return [
        CircuitCase("quad_tree", f"QuadTree 8x8 r={units}",
                    lambda: build_circuit(quad_tree(IMAGE_SIDE, IMAGE_SIDE), SumProductPattern.CP,
                                          units, units, num_categories=CATEGORIES)),
        CircuitCase("random_binary_tree", f"RandomBinaryTree depth={RANDOM_TREE_DEPTH} r={units}",
                    lambda: build_circuit(random_binary_tree(variables, RANDOM_TREE_DEPTH, 1, seed=0),
                                          SumProductPattern.CP, units, units,
                                          num_categories=CATEGORIES)),
        CircuitCase("hclt", f"HCLT r={units}", lambda: templates.hclt(train, units, CATEGORIES)),
    ]


# --------------------------------------------------------------------------- libcirkit's side
def translate_probabilities(circuit: Circuit, compiled: CompiledCircuit) -> Any:
    """The cirkit symbolic circuit of ``circuit`` whose parameters are the *probabilities* of
    ``compiled`` (no activation), which is what cirkit's EM optimiser updates in place.

    The same distribution as :func:`benchmarks.cirkit_bridge.translate` (softmax logits, for
    gradient training); CP circuits only (Categorical inputs, single-input sums, Hadamard
    products), which is what this benchmark builds.
    """
    from cirkit.symbolic.circuit import Circuit as CirkitCircuit
    from cirkit.symbolic.initializers import ConstantTensorInitializer
    from cirkit.symbolic.layers import CategoricalLayer, HadamardLayer
    from cirkit.symbolic.layers import SumLayer as CirkitSum
    from cirkit.symbolic.parameters import Parameter, TensorParameter
    from cirkit.utils.scope import Scope

    def probabilities(raw: Tensor) -> Any:
        value = torch.softmax(raw.detach().double(), dim=-1).numpy()
        return Parameter.from_input(TensorParameter(*value.shape,
                                                    initializer=ConstantTensorInitializer(value)))

    raws = cirkit_bridge.raw_parameters(compiled)
    made: dict[int, Any] = {}
    layers: list[Any] = []
    in_layers: dict[Any, list[Any]] = {}
    for layer in circuit.layers:
        if isinstance(layer, InputLayer):
            new = CategoricalLayer(Scope([layer.variable]), layer.num_units,
                                   num_categories=layer.num_categories,
                                   probs=probabilities(raws[layer.uid]))
        elif isinstance(layer, SumLayer) and len(layer.inputs) == 1:
            new = CirkitSum(layer.inputs[0].num_units, layer.num_units, arity=1,
                            weight=probabilities(raws[layer.uid]))
        elif isinstance(layer, ProductLayer) and layer.kind is ProductKind.HADAMARD:
            new = HadamardLayer(layer.inputs[0].num_units, arity=len(layer.inputs))
        else:
            raise ValueError(f"cannot translate {layer.describe()} for cirkit's EM")
        made[layer.uid] = new
        layers.append(new)
        in_layers[new] = [made[i.uid] for i in layer.inputs]
    return CirkitCircuit(layers, in_layers, [made[circuit.output.uid]])


def _cirkit_test_ll(model: Any, test: Tensor) -> float:
    with torch.no_grad():
        return float(cirkit_bridge.log_likelihood(model, test).double().mean())


def _cirkit_epoch(model: Any, step: Callable[[Tensor], Tensor], train: Tensor,
                  seed: int) -> tuple[float, float]:
    """One epoch in fit's batch order for ``seed``: (mean train log-likelihood, seconds)."""
    started = time.perf_counter()
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    total = 0.0
    for start in range(0, len(train), BATCH_SIZE):
        total += float(step(train[order[start:start + BATCH_SIZE]]).detach().double().sum())
    return total / len(train), time.perf_counter() - started


# --------------------------------------------------------------------------- one training run
@dataclass
class Run:
    """One (circuit, optimiser, library) run: its per-epoch record and how to advance it."""

    circuit: str
    optimizer: Optimizer
    library: Library
    num_parameters: int
    epoch: Callable[[int], tuple[float, float, float]]  # seed -> (train ll, seconds, test ll)
    test_ll: list[float] = field(default_factory=list)  # before training, then after each epoch
    train_ll: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def record(self, num_variables: int) -> dict[str, Any]:
        test = [bits_per_dim(v, num_variables) for v in self.test_ll]
        return {"circuit": self.circuit, "optimizer": self.optimizer.value,
                "library": self.library.value, "num_parameters": self.num_parameters,
                "test_bpd": test, "train_bpd": [bits_per_dim(v, num_variables) for v in self.train_ll],
                "epoch_seconds": self.seconds, "final_test_bpd": test[-1], "best_test_bpd": min(test),
                "seconds_per_epoch": statistics.median(self.seconds) if self.seconds else None}


def ours(case: CircuitCase, circuit: Circuit, optimizer: Optimizer, train: Tensor, test: Tensor,
         seed: int) -> Run:
    """A run of this project: ``learn.fit`` one epoch at a time on a fresh compile."""
    model = compile(circuit, seed=seed)
    torch_optimizer: torch.optim.Optimizer = (
        learn.EM(model, step_size=EM_STEP_SIZE, pseudocount=EM_PSEUDOCOUNT)
        if optimizer is Optimizer.EM else torch.optim.Adam(model.parameters(), lr=ADAM_LR))

    def epoch(epoch_seed: int) -> tuple[float, float, float]:
        history = learn.fit(model, train, optimizer=torch_optimizer, epochs=1, batch_size=BATCH_SIZE,
                            valid=test, seed=epoch_seed, progress=False, restore_best=False)
        return history.train_ll[0], history.epoch_seconds[0], history.valid_ll[0]

    run = Run(case.key, optimizer, Library.CIRCUITS, sum(p.numel() for p in model.parameters()), epoch)
    with torch.no_grad():
        run.test_ll.append(float(learn.normalised_log_likelihood(model, test).double().mean()))
    return run


def theirs(case: CircuitCase, circuit: Circuit, optimizer: Optimizer, train: Tensor, test: Tensor,
           seed: int) -> tuple[Run, dict[str, Any]]:
    """A libcirkit run on ``circuit`` with the initial distribution of ``compile(circuit, seed)``,
    and what was checked of the translation (parameter count, log-likelihoods)."""
    from cirkit.backend.torch.em_optimizer import EM as CirkitEM

    reference = compile(circuit, seed=seed)
    if optimizer is Optimizer.EM:
        model = cirkit_bridge.compile_circuit(translate_probabilities(circuit, reference))
        model.train()
        cirkit_em = CirkitEM(model, lr=EM_STEP_SIZE, pseudocount=EM_PSEUDOCOUNT)

        def step(batch: Tensor) -> Tensor:
            cirkit_em.zero_grad()
            log_likelihood = cirkit_bridge.log_likelihood(model, batch)
            log_likelihood.sum().backward()
            cirkit_em.step()
            return log_likelihood
    else:
        model = cirkit_bridge.compile_circuit(cirkit_bridge.translate(circuit, reference))
        adam = torch.optim.Adam(model.parameters(), lr=ADAM_LR)

        def step(batch: Tensor) -> Tensor:
            adam.zero_grad()
            log_likelihood = cirkit_bridge.log_likelihood(model, batch)
            (-log_likelihood.mean()).backward()
            adam.step()
            return log_likelihood

    def epoch(epoch_seed: int) -> tuple[float, float, float]:
        train_ll, seconds = _cirkit_epoch(model, step, train, epoch_seed)
        return train_ll, seconds, _cirkit_test_ll(model, test)

    with torch.no_grad():
        ours_ll = reference.log_likelihood(test)
        theirs_ll = cirkit_bridge.log_likelihood(model, test)
    count = cirkit_bridge.num_parameters(model)
    check = {"num_parameters": count,
             "parameters_match": count == sum(p.numel() for p in reference.parameters()),
             "initial_loglik_max_abs_diff": float((ours_ll - theirs_ll).abs().max())}
    run = Run(case.key, optimizer, Library.LIBCIRKIT, count, epoch)
    run.test_ll.append(float(theirs_ll.double().mean()))
    return run, check


# --------------------------------------------------------------------------- the benchmark
def run(*, quick: bool = False, with_cirkit: bool = True, epochs: int | None = None,
        units: int | None = None, seed: int = 0, threads: int = 1, only: list[str] | None = None,
        log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Train every (circuit, optimiser, library) run, epochs interleaved; the JSON-ready report."""
    torch.set_num_threads(threads)
    epochs = epochs if epochs is not None else (QUICK_EPOCHS if quick else EPOCHS)
    units = units if units is not None else (QUICK_UNITS if quick else UNITS)
    train, test = load_digits_split()
    num_variables = train.shape[1]
    use_cirkit = with_cirkit and cirkit_bridge.available()
    runs: list[Run] = []
    circuits_info: list[dict[str, Any]] = []
    for case in cases(train, units):
        if only and case.key not in only:
            continue
        started = time.perf_counter()
        circuit = case.build()
        info: dict[str, Any] = {"key": case.key, "title": case.title,
                                "num_parameters": circuit.num_parameters(),
                                "num_layers": len(circuit.layers), "depth": circuit.depth()}
        if case.key == "quad_tree" and units == UNITS:
            info["issue_parameters"] = QUAD_TREE_PARAMETERS
            info["parameters_match_issue"] = circuit.num_parameters() == QUAD_TREE_PARAMETERS
        info["cirkit"] = {}
        for optimizer in Optimizer:
            runs.append(ours(case, circuit, optimizer, train, test, seed))
            if use_cirkit:
                cirkit_run, check = theirs(case, circuit, optimizer, train, test, seed)
                runs.append(cirkit_run)
                info["cirkit"][optimizer.value] = check
        info["setup_seconds"] = time.perf_counter() - started
        circuits_info.append(info)
        if log:
            log(f"... {case.title}: {info['num_parameters']} parameters, set up in "
                f"{info['setup_seconds']:.1f} s")
    for epoch in range(epochs):
        for item in runs:
            train_ll, seconds, test_ll = item.epoch(seed * 1000 + epoch)
            item.train_ll.append(train_ll)
            item.seconds.append(seconds)
            item.test_ll.append(test_ll)
        if log:
            log(f"... epoch {epoch + 1}/{epochs} done")
    return {
        "schema_version": SCHEMA_VERSION,
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": {**machine_info(threads=threads),
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                    "note": ("shared machine: the epochs of all runs are interleaved, but absolute "
                             "seconds drift with the load; compare ratios of one run")},
        "torch_version": torch.__version__, "num_threads": torch.get_num_threads(), "quick": quick,
        "dataset": {"name": "scikit-learn load_digits", "train_rows": len(train),
                    "test_rows": len(test), "variables": num_variables, "categories": CATEGORIES},
        "budget": {"epochs": epochs, "batch_size": BATCH_SIZE, "units": units, "seed": seed},
        "optimizers": {"em": {"step_size": EM_STEP_SIZE, "pseudocount": EM_PSEUDOCOUNT},
                       "adam": {"lr": ADAM_LR}},
        "libcirkit": {"installed": cirkit_bridge.available(), "version": cirkit_bridge.version(),
                      "used": use_cirkit, "em_usage": CIRKIT_EM_USAGE},
        "circuits": circuits_info,
        "runs": [item.record(num_variables) for item in runs],
    }


# --------------------------------------------------------------------------- table and plot
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:{spec}}"


def format_table(report: dict[str, Any]) -> str:
    """The runs as a fixed-width table: test bits/dim (last and best epoch) and s/epoch, with
    this project's speed relative to libcirkit on the same circuit and optimiser."""
    by_key = {(r["circuit"], r["optimizer"], r["library"]): r for r in report["runs"]}
    head = (f"{'circuit':<34} {'optimizer':<9} {'library':<10} {'params':>7} {'test bpd':>9} "
            f"{'best bpd':>9} {'s/epoch':>8} {'vs cirkit':>9}")
    lines = [head, "-" * len(head)]
    titles = {c["key"]: c["title"] for c in report["circuits"]}
    for r in report["runs"]:
        speed = "-"
        other = by_key.get((r["circuit"], r["optimizer"], Library.LIBCIRKIT.value))
        if r["library"] == Library.CIRCUITS.value and other and r["seconds_per_epoch"]:
            speed = f"{r['seconds_per_epoch'] / other['seconds_per_epoch']:.2f}x"
        lines.append(f"{titles[r['circuit']]:<34} {r['optimizer']:<9} {r['library']:<10} "
                     f"{r['num_parameters']:>7} {_fmt(r['final_test_bpd'], '.3f'):>9} "
                     f"{_fmt(r['best_test_bpd'], '.3f'):>9} "
                     f"{_fmt(r['seconds_per_epoch'], '.3f'):>8} {speed:>9}")
    budget, optimizers = report["budget"], report["optimizers"]
    lines.append("")
    lines.append(f"digits: {report['dataset']['train_rows']} train / {report['dataset']['test_rows']} "
                 f"test rows, {report['dataset']['variables']} variables x "
                 f"{report['dataset']['categories']} categories; {budget['epochs']} epochs, batch "
                 f"{budget['batch_size']}, {report['num_threads']} thread(s), torch "
                 f"{report['torch_version']}.")
    lines.append(f"EM: step {optimizers['em']['step_size']}, pseudocount "
                 f"{optimizers['em']['pseudocount']}; Adam: lr {optimizers['adam']['lr']}. s/epoch: "
                 "median over epochs, training only; 'vs cirkit': our s/epoch over libcirkit's "
                 "(below 1: faster).")
    cirkit = report["libcirkit"]
    if not cirkit["installed"]:
        lines.append("libcirkit not installed (pip install -c constraints.txt libcirkit): its runs "
                     "are skipped.")
    elif not cirkit["used"]:
        lines.append("libcirkit runs skipped (--no-cirkit).")
    else:
        lines.append(f"libcirkit {cirkit['version']}: the same circuits and initial distributions, "
                     f"translated; its EM runs as `{cirkit['em_usage']}`.")
    for info in report["circuits"]:
        notes = [f"{info['num_layers']} layers, depth {info['depth']}"]
        if "parameters_match_issue" in info:
            notes.append(f"{info['num_parameters']} parameters (the issue's {info['issue_parameters']}: "
                         f"{'match' if info['parameters_match_issue'] else 'MISMATCH'})")
        for name, check in info["cirkit"].items():
            notes.append(f"cirkit {name}: params match {check['parameters_match']}, initial LL "
                         f"max |diff| {check['initial_loglik_max_abs_diff']:.1e}")
        lines.append(f"  {info['key']}: " + "; ".join(notes))
    lines.append(f"machine: {report['machine']['processor']}, load {report['machine']['load_average']}; "
                 f"{report['machine']['note']}.")
    return "\n".join(lines)


_STYLE = {(Optimizer.EM.value, Library.CIRCUITS.value): ("#1f77b4", "-", "o"),
          (Optimizer.EM.value, Library.LIBCIRKIT.value): ("#1f77b4", "--", "x"),
          (Optimizer.ADAM.value, Library.CIRCUITS.value): ("#d62728", "-", "o"),
          (Optimizer.ADAM.value, Library.LIBCIRKIT.value): ("#d62728", "--", "x")}


def write_plot(report: dict[str, Any], path: Path) -> Path:
    """Test bits/dim against epochs (left) and against cumulative training seconds (right), one
    row per circuit; written atomically as PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    keys = [c["key"] for c in report["circuits"]]
    titles = {c["key"]: c["title"] for c in report["circuits"]}
    figure = Figure(figsize=(11, 3.2 * len(keys)), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(keys), 2, squeeze=False)
    for row, key in zip(axes, keys, strict=True):
        for r in (r for r in report["runs"] if r["circuit"] == key):
            color, line, marker = _STYLE[(r["optimizer"], r["library"])]
            label = f"{r['optimizer'].upper() if r['optimizer'] == 'em' else 'Adam'}, {r['library']}"
            bpd = r["test_bpd"]
            seconds = np.concatenate([[0.0], np.cumsum(r["epoch_seconds"])])
            for ax, xs in ((row[0], np.arange(len(bpd))), (row[1], seconds)):
                ax.plot(xs, bpd, color=color, linestyle=line, marker=marker, markersize=3,
                        linewidth=1.2, label=label)
        mine = [r for r in report["runs"] if r["circuit"] == key]
        low = min(min(r["test_bpd"]) for r in mine)
        high = max(r["test_bpd"][-1] for r in mine)
        for ax, xlabel in ((row[0], "epoch"), (row[1], "training seconds (cumulative)")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel("test bits/dim")
            ax.set_title(titles[key], fontsize=10)
            ax.set_ylim(low - 0.05, high + 0.5)  # every run's end, not the random start
            ax.grid(alpha=0.3)
        row[0].xaxis.set_major_locator(MaxNLocator(integer=True))
        row[0].legend(fontsize=8)
    figure.suptitle(f"digits, {report['budget']['epochs']} epochs, batch "
                    f"{report['budget']['batch_size']}, {report['num_threads']} thread(s)", fontsize=10)
    figure.tight_layout()
    return atomic_write(path, lambda tmp: figure.savefig(tmp, format="png"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_EPOCHS} epochs, {QUICK_UNITS} units (a smoke test; libcirkit "
                             "still runs unless --no-cirkit)")
    parser.add_argument("--no-cirkit", action="store_true", help="skip the libcirkit runs")
    parser.add_argument("--epochs", type=int, default=None, help=f"epochs (default {EPOCHS})")
    parser.add_argument("--units", type=int, default=None, help=f"units per layer (default {UNITS})")
    parser.add_argument("--only", nargs="*", default=None,
                        help="circuit keys to run (quad_tree random_binary_tree hclt)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON output (default {DEFAULT_OUT.name}, {QUICK_OUT.name} with --quick)")
    parser.add_argument("--plot", type=Path, default=None,
                        help=f"PNG output (default {DEFAULT_PLOT.name}, {QUICK_PLOT.name} with --quick)")
    args = parser.parse_args(argv)
    for name in ("epochs", "units", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    report = run(quick=args.quick, with_cirkit=not args.no_cirkit, epochs=args.epochs,
                 units=args.units, threads=args.threads, only=args.only,
                 log=lambda msg: print(msg, file=sys.stderr, flush=True))
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    picture = write_plot(report, args.plot or (QUICK_PLOT if args.quick else DEFAULT_PLOT))
    publish(format_table(report), jsonable(report), out, note=f" and {picture}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
