"""Timing helpers for noisy, shared machines: interleaved candidates and medians of repeats.

On a machine shared with other jobs absolute times drift from one second to the next, so the
benchmarks never compare numbers taken minutes apart: :func:`interleaved` runs every candidate
once per round, round after round, and reports the median of each candidate's rounds. Ratios of
those medians are what the benchmark reports. :func:`write_json_atomic` is how every benchmark
saves its result file.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from circuits.files import atomic_write_json


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


def _calls_per_round(fn: Callable[[], object], target_s: float, max_calls: int) -> int:
    """How many back-to-back calls make one round last about ``target_s`` (at least one)."""
    start = time.perf_counter()
    fn()
    elapsed = max(time.perf_counter() - start, 1e-7)
    return max(1, min(max_calls, int(target_s / elapsed)))


def interleaved(candidates: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 1,
                target_round_s: float = 0.02, max_calls: int = 200) -> dict[str, Timing]:
    """Time every candidate round-robin; returns per-call seconds for each round.

    Args:
        candidates: name -> zero-argument callable (its result is discarded).
        rounds: how many rounds (each candidate is timed once per round).
        warmup: untimed calls of each candidate first (allocator and thread-pool warm-up).
        target_round_s: a fast candidate is called several times per round so one timed
            sample lasts about this long (beats timer resolution and per-call jitter).
        max_calls: cap on the calls per round.
    """
    with torch.inference_mode():
        for fn in candidates.values():
            for _ in range(warmup):
                fn()
        calls = {name: _calls_per_round(fn, target_round_s, max_calls)
                 for name, fn in candidates.items()}
        result = {name: Timing() for name in candidates}
        for _ in range(rounds):
            for name, fn in candidates.items():
                n = calls[name]
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                result[name].samples.append((time.perf_counter() - start) / n)
    return result


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


def median(values: list[float]) -> float:
    """The median of a non-empty list."""
    return statistics.median(values)


def write_json_atomic(path: Path, payload: Mapping[str, Any], sort_keys: bool = False) -> None:
    """Write ``payload`` as indented JSON to ``path`` through a temporary file in the same folder
    and ``os.replace``: a crash leaves the previous file (or none), never half of one."""
    atomic_write_json(path, payload, sort_keys=sort_keys)
