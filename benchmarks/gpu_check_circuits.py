"""The circuit rows of :mod:`benchmarks.gpu_check`: every query, the samplers and MAP on the device
against a CPU float64 reference, EM on the device against the CPU, and throughput against
libcirkit.

Circuits: the four named templates (:func:`circuits.templates.build`: ``ff``, ``cp``, ``hmm``,
``btree``) over :data:`NUM_VARIABLES` variables of :data:`NUM_CATEGORIES` categories (81 states:
small enough to enumerate), with random parameters. One float32 initialisation is copied to the
CPU in float64 (the reference) and to the device in the checked dtype, so both hold the same
values. Queries compare log-values within :data:`TOLERANCES` (``|got - want| <= atol + rtol
|want|``, never NaN); samplers are G-tested against the exact probabilities of every state (the
reference's likelihoods), with a negative control of known total variation that the same test
must reject.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

import circuits
from benchmarks import circuits_bench, cirkit_bridge
from benchmarks.gpu_check_core import (
    ALPHA,
    Group,
    Outcome,
    Settings,
    SkipReason,
    g_test,
    total_variation,
)
from circuits import CompiledCircuit
from circuits.kernels import KernelBackend, interpreter_usable, triton_import_error, use_backend
from circuits.learn import EM, fit
from circuits.templates import Architecture, build
from circuits_llm.runtime.timing import GradMode, interleaved, medians

NUM_VARIABLES, NUM_CATEGORIES = 4, 3
TEMPLATES: tuple[tuple[Architecture, int], ...] = (
    (Architecture.FF, 1), (Architecture.CP, 3), (Architecture.HMM, 3), (Architecture.BTREE, 3))
#: the planted total variation of the samplers' negative control (uniform states mixed in)
CONTROL_TV = 0.05
CIRKIT_BATCHES = (256, 4096)
RowSpec = tuple[Group, str, Callable[[], Outcome]]


@dataclass(frozen=True)
class Tolerance:
    """``|got - want| <= atol + rtol |want|`` for log-values."""

    atol: float
    rtol: float


TOLERANCES = {torch.float32: Tolerance(1e-4, 1e-5), torch.float64: Tolerance(1e-9, 1e-9)}


@dataclass(frozen=True)
class Pair:
    """One template's circuit twice: ``reference`` (CPU, float64) and ``model`` (the device, the
    checked dtype), same parameter values; ``states`` (S, V) every assignment, ``probs`` (S,) their
    exact probabilities (the reference's)."""

    name: str
    reference: CompiledCircuit
    model: CompiledCircuit
    states: Tensor
    probs: np.ndarray


@cache
def _states() -> Tensor:
    """(S, V) long: every assignment, the last variable varying fastest (S = C ** V)."""
    grid = itertools.product(range(NUM_CATEGORIES), repeat=NUM_VARIABLES)
    return torch.tensor(list(grid), dtype=torch.long)


def state_index(samples: Tensor) -> np.ndarray:
    """Index into :func:`_states` of each sample row (S, V) (the last variable varies fastest)."""
    places = NUM_CATEGORIES ** torch.arange(NUM_VARIABLES - 1, -1, -1)
    return (samples.cpu().long() * places).sum(1).numpy()


def make_pairs(device: torch.device, dtype: torch.dtype, seed: int) -> list[Pair]:
    """The :class:`Pair` of every template in :data:`TEMPLATES`."""
    pairs = []
    for offset, (architecture, rank) in enumerate(TEMPLATES):
        base = circuits.compile(build(architecture, NUM_VARIABLES, NUM_CATEGORIES, rank),
                                seed=seed + offset)
        reference = copy.deepcopy(base).to(torch.float64)
        model = copy.deepcopy(base).to(device=device, dtype=dtype)
        with torch.no_grad():
            probs = reference.log_likelihood(_states()).exp().numpy()
        pairs.append(Pair(architecture.value, reference, model, _states(), probs))
    return pairs


def log_error(got: Tensor, want: Tensor, tol: Tolerance) -> tuple[float, float]:
    """(max |got - want|, max error / allowed) of log-values; NaN or a different ``-inf`` pattern
    gives ``inf``."""
    got, want = got.detach().double().cpu(), want.detach().double()
    if got.shape != want.shape or torch.isnan(got).any() \
            or not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        return float("inf"), float("inf")
    finite = torch.isfinite(want)
    diff = (got - want).abs()[finite]
    if diff.numel() == 0:
        return 0.0, 0.0
    return float(diff.max()), float((diff / (tol.atol + tol.rtol * want.abs()[finite])).max())


def query_errors(pair: Pair, tol: Tolerance, seed: int) -> dict[str, tuple[float, float]]:
    """:func:`log_error` of every query of ``pair.model`` against ``pair.reference``: complete
    likelihood, marginals under random masks, ``log Z``, conditionals, prefix marginals and prefix
    conditionals, and likelihood and prefix conditionals under external per-row parameters (the
    decoder's path, where the triton softmax kernels run)."""
    model, ref = pair.model, pair.reference
    device, dtype = model.device, model.dtype
    gen = torch.Generator().manual_seed(seed)
    x = pair.states
    xd = x.to(device)
    mask = torch.rand(x.shape, generator=gen) < 0.5
    observed = torch.arange(NUM_VARIABLES) < NUM_VARIABLES // 2
    queried = list(range(NUM_VARIABLES // 2, NUM_VARIABLES))
    params = {name: (2 * torch.randn(len(x), *shape, generator=gen)).to(dtype)
              for name, shape in ref.parameter_shapes().items()}
    on_device = {name: value.to(device) for name, value in params.items()}
    as_f64 = {name: value.double() for name, value in params.items()}
    with use_backend(KernelBackend.TORCH):  # the CPU reference, whatever backend the row forces
        expected = {
            "log_likelihood": ref.log_likelihood(x), "marginal": ref.log_marginal(x, mask),
            "log_partition": torch.logsumexp(ref.log_likelihood(x), 0)[None],
            "conditional": ref.log_conditional(x, observed, queried),
            "prefix_marginals": ref.log_prefix_marginals(x),
            "prefix_conditionals": ref.log_prefix_conditionals(x),
            "external_log_likelihood": ref.log_likelihood(x, as_f64),
            "external_prefix_conditionals": ref.log_prefix_conditionals(x, params=as_f64)}
    actual = {
        "log_likelihood": model.log_likelihood(xd),
        "marginal": model.log_marginal(xd, mask.to(device)),
        "log_partition": model.log_partition()[None],
        "conditional": model.log_conditional(xd, observed.to(device), queried),
        "prefix_marginals": model.log_prefix_marginals(xd),
        "prefix_conditionals": model.log_prefix_conditionals(xd),
        "external_log_likelihood": model.log_likelihood(xd, on_device),
        "external_prefix_conditionals": model.log_prefix_conditionals(xd, params=on_device)}
    return {query: log_error(actual[query], expected[query], tol) for query in expected}


def triton_obstacle(device: torch.device) -> tuple[SkipReason | None, str]:
    """Why the triton backend cannot run on ``device``: (SKIP reason, text) on a CPU without
    triton's interpreter; (None, text) on CUDA without triton (a FAIL); (None, "") when it can."""
    if device.type == "cpu" and not interpreter_usable():
        return SkipReason.NEEDS_CUDA, ("triton kernels run on CUDA (on the CPU only under "
                                       "TRITON_INTERPRET=1, set before triton is imported)")
    error = triton_import_error()
    return (None, f"triton is not importable: {error}") if error else (None, "")


def _pairs_for(settings: Settings) -> Callable[[torch.dtype], list[Pair]]:
    """dtype -> its pairs, made once (the torch and triton rows check the same circuits)."""
    made: dict[torch.dtype, list[Pair]] = {}

    def pairs(dtype: torch.dtype) -> list[Pair]:
        if dtype not in made:
            made[dtype] = make_pairs(settings.device, dtype, settings.seed)
        return made[dtype]
    return pairs


def _queries_row(pairs: list[Pair], dtype: torch.dtype, seed: int) -> Outcome:
    """Every query of every template within the dtype's tolerance (:func:`query_errors`)."""
    tol = TOLERANCES[dtype]
    table = {pair.name: query_errors(pair, tol, seed) for pair in pairs}
    worst = max(((r, a, name, q) for name, errors in table.items() for q, (a, r) in errors.items()))
    ratio, absolute, name, query = worst
    numbers = (f"{len(table)} templates x {len(next(iter(table.values())))} queries; worst "
               f"{absolute:.1e} = {ratio:.2f} of tol ({query}, {name}); atol {tol.atol:g} rtol {tol.rtol:g}")
    values = {name: {q: {"max_abs": a, "over_tol": r} for q, (a, r) in errors.items()}
              for name, errors in table.items()}
    return Outcome.verdict(ratio <= 1.0, numbers, values, f"{query} of {name} off by {absolute:.3g}")


def _sampling_row(pairs: list[Pair], settings: Settings, samples: int) -> Outcome:
    """Unconditional and conditional samples G-tested against the exact law; the negative control
    (the same samples with uniform states mixed in at total variation :data:`CONTROL_TV`) must be
    rejected by the same test."""
    values: dict[str, Any] = {}
    failures: list[str] = []
    rng = np.random.default_rng(settings.seed)
    states = _states()
    for offset, pair in enumerate(pairs):
        gen = settings.generator(100 + offset)
        counts = np.bincount(state_index(pair.model.sample(samples, generator=gen)),
                             minlength=len(states))
        evidence = torch.zeros(samples, NUM_VARIABLES, dtype=torch.long, device=settings.device)
        evidence[:, 0] = 1
        observed = (torch.arange(NUM_VARIABLES) == 0).to(settings.device)
        drawn = pair.model.conditional_sample(evidence, observed, generator=gen)
        keep = (states[:, 0] == 1).numpy()
        conditional = np.bincount(state_index(drawn), minlength=len(states))
        uniform_tv = 0.5 * float(np.abs(1.0 / len(states) - pair.probs).sum())
        eps = min(1.0, CONTROL_TV / uniform_tv)
        control = counts.copy()
        moved = rng.binomial(counts, eps)  # each moved sample becomes a uniform state
        control -= moved
        control += np.bincount(rng.integers(0, len(states), int(moved.sum())), minlength=len(states))
        entry = {"p_sample": g_test(counts, pair.probs), "tv_sample": total_variation(counts, pair.probs),
                 "p_conditional": g_test(conditional[keep], pair.probs[keep])
                 if conditional[~keep].sum() == 0 else 0.0,
                 "p_control": g_test(control, pair.probs), "control_tv": eps * uniform_tv}
        values[pair.name] = entry
        failures += [f"{pair.name} {k} p={entry[k]:.2g}" for k in ("p_sample", "p_conditional")
                     if entry[k] <= ALPHA]
        if entry["p_control"] > ALPHA:
            failures.append(f"{pair.name} biased control (TV {entry['control_tv']:.3f}) not rejected")
    least = min(min(e["p_sample"], e["p_conditional"]) for e in values.values())
    control_p = max(e["p_control"] for e in values.values())
    numbers = (f"{samples} draws x {len(pairs)} templates, uncond+cond: min p={least:.3f}; biased "
               f"control TV {CONTROL_TV}: max p={control_p:.1e} (reject < {ALPHA:g})")
    return Outcome.verdict(not failures, numbers, values, "; ".join(failures))


def _map_row(pairs: list[Pair], dtype: torch.dtype, seed: int) -> Outcome:
    """Max-product states and values under random evidence against the CPU reference."""
    tol = TOLERANCES[dtype]
    gen = torch.Generator().manual_seed(seed)
    values: dict[str, Any] = {}
    for pair in pairs:
        rows = torch.randint(0, len(pair.states), (32,), generator=gen)
        x = pair.states[rows]
        observed = torch.rand(x.shape, generator=gen) < 0.5
        state, value = pair.model.map_state(x.to(pair.model.device), observed.to(pair.model.device))
        want_state, want_value = pair.reference.map_state(x, observed)
        absolute, ratio = log_error(value, want_value, tol)
        values[pair.name] = {"max_abs": absolute, "over_tol": ratio,
                             "state_mismatches": int((state.cpu() != want_state).any(1).sum())}
    ratio = max(v["over_tol"] for v in values.values())
    mismatches = sum(v["state_mismatches"] for v in values.values())
    numbers = (f"32 evidence rows x {len(pairs)} templates: value worst {ratio:.2f} of tol, "
               f"{mismatches} state mismatches")
    return Outcome.verdict(ratio <= 1.0 and mismatches == 0, numbers, values,
                           f"value {ratio:.2f} of tol, {mismatches} states differ")


def circuit_rows(settings: Settings) -> list[RowSpec]:
    """Queries, sampling and MAP rows for both kernel backends and both dtypes."""
    pairs = _pairs_for(settings)
    samples = 20_000 if settings.quick else 50_000
    specs: list[RowSpec] = []
    for group in (Group.QUERIES, Group.SAMPLING, Group.MAP):
        for backend in (KernelBackend.TORCH, KernelBackend.TRITON):
            for dtype in (torch.float32, torch.float64):
                name = f"{backend.value} {str(dtype).removeprefix('torch.')}"

                def check(group: Group = group, backend: KernelBackend = backend,
                          dtype: torch.dtype = dtype) -> Outcome:
                    if backend is KernelBackend.TRITON:
                        skip, why = triton_obstacle(settings.device)
                        if skip is not None:
                            return Outcome.skipped(skip, why)
                        if why:
                            return Outcome.verdict(False, "", {}, why)
                    with use_backend(backend):
                        if group is Group.QUERIES:
                            return _queries_row(pairs(dtype), dtype, settings.seed)
                        if group is Group.SAMPLING:
                            return _sampling_row(pairs(dtype), settings, samples)
                        return _map_row(pairs(dtype), dtype, settings.seed)
                specs.append((group, name, check))
    return specs


# ------------------------------------------------------------------ learning
def _fit_row(settings: Settings, dtype: torch.dtype) -> Outcome:
    """EM (``circuits.learn.fit``) on the device against the same run on the CPU in float64: the
    per-epoch training log-likelihoods and the final one must agree within the dtype's tolerance,
    and the log-likelihood must increase."""
    rows, epochs, batch = (1000, 2, 250) if settings.quick else (4000, 3, 500)
    circuit = build(Architecture.BTREE, 6, 4, rank=4)
    teacher = circuits.compile(circuit, seed=settings.seed + 7, dtype=torch.float64)
    data = teacher.sample(rows, generator=torch.Generator().manual_seed(settings.seed))
    base = circuits.compile(circuit, seed=settings.seed + 1)
    runs: dict[str, Any] = {}
    for key, model in (("cpu_float64", copy.deepcopy(base).to(torch.float64)),
                       ("device", copy.deepcopy(base).to(device=settings.device, dtype=dtype))):
        with torch.no_grad():
            before = float(model.log_likelihood(data.to(model.device)).mean())
        history = fit(model, data, optimizer=EM(model, step_size=0.5, pseudocount=0.01),
                      epochs=epochs, batch_size=batch, seed=settings.seed, progress=False)
        with torch.no_grad():
            after = float(model.log_likelihood(data.to(model.device)).mean())
        runs[key] = {"before": before, "after": after, "train_ll": list(history.train_ll)}
    ref, dev = runs["cpu_float64"], runs["device"]
    tol = 1e-3 if dtype == torch.float32 else 1e-8
    gap = max(abs(a - b) for a, b in zip([*dev["train_ll"], dev["after"]],
                                         [*ref["train_ll"], ref["after"]], strict=True))
    rises = dev["after"] > dev["before"] and dev["train_ll"][-1] > dev["train_ll"][0]
    numbers = (f"{rows} rows, {epochs} epochs: mean LL {dev['before']:.4f} -> {dev['after']:.4f} "
               f"(CPU f64 -> {ref['after']:.4f}); max |diff| {gap:.1e} (tol {tol:g})")
    return Outcome.verdict(gap <= tol and rises, numbers, {**runs, "max_abs_diff": gap},
                           f"differs from the CPU run by {gap:.3g}" if gap > tol
                           else "the log-likelihood did not increase")


def learn_rows(settings: Settings) -> list[RowSpec]:
    """EM on the device in float32 and float64 (:func:`_fit_row`)."""
    return [(Group.LEARN, f"btree n=6 r=4 {str(d).removeprefix('torch.')}",
             lambda d=d: _fit_row(settings, d)) for d in (torch.float32, torch.float64)]


# ------------------------------------------------------------------ libcirkit
def _rows_per_s(candidates: dict[str, Callable[[], object]], rows: dict[str, int], settings: Settings,
                grad_mode: GradMode) -> dict[str, float]:
    """Rows per second of each candidate (``rows[name]`` rows per call), timed round-robin."""
    seconds = medians(interleaved(candidates, 2 if settings.quick else 5, grad_mode=grad_mode,
                                  device=settings.device))
    return {name: rows[name] / s for name, s in seconds.items()}


def _train_step(model: torch.nn.Module, loglik: Callable[[], Tensor]) -> Callable[[], None]:
    """One Adam step on the mean negative log-likelihood ``loglik()`` (B,): the training step."""
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        (-loglik().mean()).backward()
        optimizer.step()
    return step


def cirkit_rows(settings: Settings) -> list[RowSpec]:
    """Rows/s of log-likelihood, an Adam training step and sampling, ours against libcirkit, at
    each batch of :data:`CIRKIT_BATCHES`, on the BTree case of :mod:`benchmarks.circuits_bench`
    (translated layer by layer with the same parameters: the log-likelihoods must match)."""
    made: dict[str, Any] = {}

    def setup() -> dict[str, Any]:
        if not made:
            case = circuits_bench.cases("tiny" if settings.quick else "full")[0]
            circuit = case.build()
            ours = circuits.compile(circuit, seed=settings.seed)
            x = ours.sample(64, generator=torch.Generator().manual_seed(settings.seed))
            info, theirs = cirkit_bridge.setup(circuit, ours, x, case.units, case.region_graph,
                                               case.native_note)
            made.update(case=case, ours=ours.to(settings.device), theirs=theirs.to(settings.device),
                        info=info)
        return made

    def row(batch: int) -> Outcome:
        if not cirkit_bridge.available():
            return Outcome.skipped(SkipReason.NO_CIRKIT)
        parts = setup()
        ours, theirs, info = parts["ours"], parts["theirs"], parts["info"]
        x = ours.sample(batch, generator=settings.generator(batch))
        values: dict[str, Any] = {"case": parts["case"].title, "cirkit_version": info.get("version")}
        notes: list[str] = []
        draw_rows = cirkit_bridge.sampling_rows(ours, batch)
        draw = cirkit_bridge.sampler(theirs)
        jobs = {
            "loglik": ({"ours": lambda: ours.log_likelihood(x),
                        "cirkit": lambda: cirkit_bridge.log_likelihood(theirs, x)},
                       {"ours": batch, "cirkit": batch}, GradMode.INFERENCE),
            "train_step": ({"ours": _train_step(ours, lambda: ours.log_likelihood(x)),
                            "cirkit": _train_step(theirs, lambda: cirkit_bridge.log_likelihood(theirs, x))},
                           {"ours": batch, "cirkit": batch}, GradMode.GRAD),
            "sampling": ({"ours": lambda: ours.sample(draw_rows), "cirkit": lambda: draw(draw_rows)},
                         {"ours": draw_rows, "cirkit": draw_rows}, GradMode.NO_GRAD),
        }
        for job, (candidates, rows, mode) in jobs.items():
            try:
                values[job] = _rows_per_s(candidates, rows, settings, mode)
            except Exception as error:  # a libcirkit failure is reported, not ours to fail
                notes.append(f"{job}: {type(error).__name__}: {str(error)[:120]}")
                values[job] = _rows_per_s({"ours": candidates["ours"]}, rows, settings, mode)
        numbers = ", ".join(
            f"{job} {v['ours']:.3g} rows/s" + (f" ({v['ours'] / v['cirkit']:.2f}x cirkit)"
                                              if "cirkit" in v else " (cirkit failed)")
            for job, v in ((j, values[j]) for j in jobs))
        if draw_rows != batch:
            numbers += f"; sampling at {draw_rows} rows (cirkit's memory)"
        values["notes"] = notes
        return Outcome.verdict(bool(info["loglik_match"]), numbers, values,
                               f"translation log-likelihoods differ by {info['loglik_max_abs_diff']:.3g}")

    return [(Group.CIRKIT, f"btree batch {b}", lambda b=b: row(b)) for b in CIRKIT_BATCHES]
