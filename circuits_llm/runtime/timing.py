"""Timing on noisy, shared machines, and the record of the machine a timing was taken on.

The one home of the project's timing loop and machine record: ``circuits-llm demo | bench``
(:mod:`circuits_llm.app.demo`) and every benchmark (``benchmarks/``) use them.

On a machine shared with other jobs absolute times drift from one second to the next, so numbers
taken minutes apart are never compared: :func:`interleaved` runs every candidate once per round,
round after round, and reports each candidate's per-call seconds of every round
(:class:`Timing`: median, best, spread). Ratios of medians are what the benchmarks report.
:class:`ModuleTimer` measures the time spent inside selected modules. :func:`machine_info` says
where the numbers were measured; they mean little without it. :func:`count_ops` counts the
torch operators a function dispatches (dispatch, not arithmetic, sets the cost of small-tensor
work). :func:`publish` prints a benchmark's table and writes its JSON record.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from circuits.files import atomic_write_json


class GradMode(Enum):
    """The autograd mode candidates are timed under.

    ``INFERENCE``: ``torch.inference_mode`` (the cheapest); ``NO_GRAD``: ``torch.no_grad`` (for
    queries that use autograd internally, e.g. circuit conditionals); ``GRAD``: as the caller left
    it (for forward + backward candidates).
    """

    INFERENCE = "inference"
    NO_GRAD = "no_grad"
    GRAD = "grad"

    def context(self) -> contextlib.AbstractContextManager[Any]:
        if self is GradMode.INFERENCE:
            return torch.inference_mode()
        if self is GradMode.NO_GRAD:
            return torch.no_grad()
        return contextlib.nullcontext()


@dataclass
class Timing:
    """Per-call seconds of one candidate over the rounds of an :func:`interleaved` run."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        """The fastest round: the least disturbed by other jobs on a shared machine."""
        return min(self.samples)

    @property
    def spread(self) -> float:
        """Relative interquartile range (0 when fewer than 4 rounds): a noise indicator."""
        if len(self.samples) < 4:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples, n=4)
        return (q3 - q1) / self.median if self.median > 0 else 0.0


def synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on a CUDA ``device`` (asynchronous launches time as nothing
    otherwise); nothing for the CPU or None."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], calls: int, device: torch.device | None) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn`` (synchronised on CUDA)."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / calls


def interleaved(candidates: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 1,
                target_round_s: float = 0.02, max_calls: int = 200,
                grad_mode: GradMode = GradMode.INFERENCE,
                device: torch.device | None = None) -> dict[str, Timing]:
    """Time every candidate round-robin; returns per-call seconds for each round.

    Args:
        candidates: name -> zero-argument callable (its result is discarded).
        rounds: how many rounds (each candidate is timed once per round).
        warmup: untimed calls of each candidate first (allocator and thread-pool warm-up,
            triton compilation).
        target_round_s: a fast candidate is called several times per round so one timed
            sample lasts about this long (beats timer resolution and per-call jitter); one
            timed calibration call per candidate decides how many.
        max_calls: cap on the calls per round (1: every sample is one call).
        grad_mode: the autograd mode of every call (:class:`GradMode`).
        device: a CUDA device to synchronise around every timed sample (None: no
            synchronisation, right for the CPU).
    """
    with grad_mode.context():
        for fn in candidates.values():
            for _ in range(warmup):
                fn()
        calls = {name: max(1, min(max_calls, int(target_round_s / max(_timed(fn, 1, device), 1e-7))))
                 for name, fn in candidates.items()}
        result = {name: Timing() for name in candidates}
        for _ in range(rounds):
            for name, fn in candidates.items():
                result[name].samples.append(_timed(fn, calls[name], device))
    return result


def medians(timings: Mapping[str, Timing]) -> dict[str, float]:
    """``{name: median seconds per call}`` of an :func:`interleaved` result."""
    return {name: timing.median for name, timing in timings.items()}


class ModuleTimer:
    """Wall time spent inside the ``forward`` of selected modules (via forward hooks).

    Torch CPU kernels run synchronously, so wall time between the pre- and post-hook is the
    module's compute time. Use as a context manager; :attr:`total` accumulates seconds.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.total = 0.0
        self._start = 0.0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _pre(self, *_: object) -> None:
        self._start = time.perf_counter()

    def _post(self, *_: object) -> None:
        self.total += time.perf_counter() - self._start

    def __enter__(self) -> ModuleTimer:
        for module in self.modules:
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._post))
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@dataclass(frozen=True)
class OpCount:
    """Torch operators dispatched per call of a function (see :func:`count_ops`).

    Attributes:
        per_call: operators per call (every ``aten`` op that reaches dispatch, views included:
            on small tensors each costs a few microseconds of dispatch whatever it computes).
        by_op: ``aten`` op name -> calls per call, most frequent first.
    """

    per_call: float
    by_op: dict[str, float]

    def top(self, count: int = 8) -> dict[str, float]:
        """The ``count`` most frequent ops."""
        return dict(list(self.by_op.items())[:count])


def count_ops(fn: Callable[[], object], calls: int = 3) -> OpCount:
    """Count the torch operators ``fn`` dispatches, averaged over ``calls`` calls (no gradients).

    Per-op dispatch, not arithmetic, sets the cost of a speculative round's small-tensor work, so
    benchmarks report ops beside milliseconds. Counted with a ``TorchDispatchMode``: the ops that
    reach the ``aten`` dispatcher, which is what eager execution pays for. Compiled graphs run
    under it too (an infrastructure mode) and show only their extern calls (a fused kernel
    never reaches the dispatcher: :func:`count_kernels` counts those).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Counter[str] = Counter()

    class _Counter(TorchDispatchMode):
        @classmethod
        def is_infra_mode(cls) -> bool:  # lets compiled frames run (and be counted) under it
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            counts[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), _Counter():
        for _ in range(calls):
            fn()
    total = sum(counts.values())
    return OpCount(total / calls, {name: n / calls for name, n in counts.most_common()})


def count_kernels(fn: Callable[[], object], calls: int = 3) -> OpCount:
    """Count what ``fn`` launches, averaged over ``calls`` calls (no gradients): generated kernels
    (inductor's ``cpp_fused_*`` and ``triton_*``) plus the top-level ``aten`` ops (extern kernels
    such as ``addmm``, and every op of eager code). The measure that compares a compiled round to
    an eager one, since a compiled graph's fused kernels never reach the dispatcher that
    :func:`count_ops` watches. CPU kernels are visible only in code compiled while
    ``torch._inductor.config.cpp.enable_kernel_profile`` is set (:func:`profile_compiled_kernels`).
    On CUDA the launched device kernels are counted instead.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with torch.no_grad(), profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
    counts: Counter[str] = Counter()
    for event in prof.events():
        name = event.name
        if cuda:
            if event.device_type == torch.autograd.DeviceType.CUDA:
                counts[name[:60]] += 1
            continue
        generated = "cpp_fused" in name or name.startswith("triton_")
        if generated or (name.startswith("aten::") and not _inside_aten(event)):
            counts[name[:60]] += 1
    total = sum(counts.values())
    return OpCount(total / calls, {name: n / calls for name, n in counts.most_common()})


def _inside_aten(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def profile_compiled_kernels() -> None:
    """Make code compiled from now on record its CPU kernels for :func:`count_kernels` (a
    ``RECORD_FUNCTION`` per kernel call: benchmarks only)."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s first ``model name``), else what platform knows."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            name = next((line.split(":", 1)[1].strip() for line in handle
                         if line.startswith("model name")), name)
    except OSError:
        pass
    return name


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info(device: torch.device | None = None, threads: int | None = None) -> dict[str, Any]:
    """Where timings were taken (they mean little without it): one record for every report.

    Keys: ``platform``, ``processor`` (the CPU model), ``python``, ``torch``, ``transformers``
    (None when not installed), ``cpu_count``, ``torch_threads`` (``threads``, else torch's
    current setting), ``load_average`` (now) and ``device`` (``device`` as
    :func:`circuits_llm.runtime.devices.describe_device` names it; the CPU when None).
    """
    from circuits_llm.runtime.devices import describe_device
    try:
        import transformers
        transformers_version: str | None = transformers.__version__
    except ImportError:  # pragma: no cover - a dependency of circuits_llm
        transformers_version = None
    return {"platform": platform.platform(), "processor": cpu_name(),
            "python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers_version, "cpu_count": os.cpu_count(),
            "torch_threads": threads if threads is not None else torch.get_num_threads(),
            "load_average": load_average(),
            "device": describe_device(device if device is not None else torch.device("cpu"))}


def publish(table: str, record: Mapping[str, Any], path: Path, *, sort_keys: bool = False,
            note: str = "") -> None:
    """Print a benchmark's ``table``, write its ``record`` to ``path`` as JSON atomically (a
    crash leaves the previous file or none), and say where (``note`` appended)."""
    print(table)
    atomic_write_json(path, record, sort_keys=sort_keys)
    print(f"\nwrote {path}{note}")
