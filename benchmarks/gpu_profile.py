"""What one call does on a CUDA device: kernels run, launches, device busy time, and where the host
spends its time (``torch.profiler``), plus how many compiled graphs inductor refused to run as
CUDA graphs. Used by the speed rows of :mod:`benchmarks.gpu_check` to count ops per call, not
only milliseconds: a step whose kernels are launched one by one (no CUDA graph) is bound by the
host, whatever the GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

#: host-side events listed per profile (by self time), and kernels (by summed device time)
TOP_HOST_EVENTS, TOP_KERNELS = 10, 12


def cudagraph_skips() -> int:
    """Compiled graphs inductor has run without a CUDA graph so far in this process (its
    ``cudagraph_skips`` counter; the reasons are logged under ``TORCH_LOGS=cudagraphs``)."""
    from torch._dynamo.utils import counters
    return int(counters["inductor"]["cudagraph_skips"])


def device_activity(call: Callable[[], object], device: torch.device) -> dict[str, Any]:
    """Profile one call of ``call`` (already warmed up) on ``device``.

    Returns ``{}`` off CUDA; else ``kernels`` (device kernels run), ``kernel_ms`` (their summed
    duration), ``wall_ms`` (the call, synchronised), ``graph_launches`` and ``kernel_launches``
    (host API calls), ``memcpy`` (copies issued), ``host_top`` ([name, self ms] of the
    busiest host events) and ``kernel_top`` ([name, device ms] of the costliest kernels). A
    profiler failure is reported as ``{"error": ...}``, never raised: this is a diagnostic beside a
    measurement.
    """
    if device.type != "cuda":
        return {}
    try:
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize(device)
        events = list(prof.events())
        on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = [e for e in on_device if "memcpy" not in e.name.lower()
                   and "memset" not in e.name.lower()]
        names = Counter(e.name for e in events)
        host: Counter[str] = Counter()
        by_kernel: Counter[str] = Counter()
        for kernel in kernels:
            by_kernel[kernel.name[:90]] += kernel.time_range.elapsed_us() / 1e3
        for event in events:
            if event.device_type == torch.autograd.DeviceType.CPU:
                host[event.name] += event.self_cpu_time_total / 1e3
        return {
            "kernels": len(kernels),
            "kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3,
            "wall_ms": start.elapsed_time(end),
            "graph_launches": sum(n for name, n in names.items() if "GraphLaunch" in name),
            "kernel_launches": sum(n for name, n in names.items() if "LaunchKernel" in name),
            "memcpy": sum(1 for e in on_device if "memcpy" in e.name.lower()),
            "host_top": [[name, round(ms, 3)] for name, ms in host.most_common(TOP_HOST_EVENTS)],
            "kernel_top": [[name, round(ms, 3)] for name, ms in by_kernel.most_common(TOP_KERNELS)],
        }
    except Exception as error:  # a diagnostic must not fail the measured row
        return {"error": f"{type(error).__name__}: {error}"}


def describe(activity: dict[str, Any]) -> str:
    """A short text of :func:`device_activity`'s result ("" off CUDA)."""
    if not activity:
        return ""
    if "error" in activity:
        return f"profile failed: {activity['error']}"
    return (f"{activity['kernels']:.0f} kernels {activity['kernel_ms']:.2f} ms busy of "
            f"{activity['wall_ms']:.2f} ms, {activity['graph_launches']:.1f} graph + "
            f"{activity['kernel_launches']:.1f} kernel launches")
