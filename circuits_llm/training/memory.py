"""The peak memory of one training step, on CUDA or on the CPU.

``train-head`` reports it per step (progress bar, history, ``training.json``) so that a user sees
what a head's loss costs before a larger run runs out of memory.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path

import torch


class MemoryKind(Enum):
    """What :class:`StepMemory` measures.

    ``CUDA_ALLOCATED``: ``torch.cuda.max_memory_allocated`` during the step (tensors only).
    ``CPU_PEAK_RSS``: the process's peak resident memory during the step (Linux ``VmHWM``, reset
    before the step through ``/proc/self/clear_refs``): weights, tensors and everything else.
    ``CPU_PEAK_RSS_LIFETIME``: where the peak cannot be reset, the process's peak so far
    (``getrusage``), an upper bound of the step's.
    """

    CUDA_ALLOCATED = "cuda_max_allocated"
    CPU_PEAK_RSS = "cpu_peak_rss"
    CPU_PEAK_RSS_LIFETIME = "cpu_peak_rss_lifetime"


class StepMemory:
    """The peak memory of one step on ``device``: :meth:`start` before it, :meth:`peak` after."""

    _STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.kind = MemoryKind.CUDA_ALLOCATED
        elif self._resettable():
            self.kind = MemoryKind.CPU_PEAK_RSS
        else:
            self.kind = MemoryKind.CPU_PEAK_RSS_LIFETIME

    def _resettable(self) -> bool:
        try:
            self._CLEAR.write_text("5")
            return self._status("VmHWM") is not None
        except OSError:
            return False

    def _status(self, field: str) -> int | None:
        """A ``kB`` field of ``/proc/self/status`` in bytes."""
        for line in self._STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return None

    def start(self) -> None:
        if self.kind is MemoryKind.CUDA_ALLOCATED:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind is MemoryKind.CPU_PEAK_RSS:
            self._CLEAR.write_text("5")  # VmHWM := the current resident size

    def peak(self) -> int:
        """Bytes (see :class:`MemoryKind`)."""
        if self.kind is MemoryKind.CUDA_ALLOCATED:
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.kind is MemoryKind.CPU_PEAK_RSS:
            return self._status("VmHWM") or 0
        import resource  # POSIX only: imported where it is needed
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, else kB
