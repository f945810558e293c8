"""What every triton launcher shares: block sizes, jitting per interpreter mode, and the launch.

Each launcher in :mod:`circuits.kernels._triton` and :mod:`circuits.kernels._triton_softmax`
describes its call as a :class:`KernelLaunch` (kernel, grid, runtime arguments, compile-time
constants) and hands it to :func:`launch`. Keeping that description separate from running it lets
the tests collect the exact calls the launchers make for many shapes, strides and dtypes and
compile each one for a GPU (``tests/test_kernels_cubin.py``), with no GPU present.

Imported only when a triton path actually runs (it imports triton).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton

from circuits.kernels.backend import interpreter_enabled

Blocks = dict[str, int]


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel call.

    Attributes:
        kernel: the plain (un-jitted) kernel function.
        grid: the launch grid (every kernel flattens its grid into axis 0).
        args: the runtime arguments in order: tensors and Python ints.
        constants: the ``tl.constexpr`` arguments by name (block sizes, feature switches).
    """

    kernel: Callable[..., None]
    grid: tuple[int]
    args: tuple[object, ...]
    constants: dict[str, object] = field(default_factory=dict)


_JITTED: dict[tuple[bool, Callable[..., None]], object] = {}


def jitted(kernel: Callable[..., None]) -> object:
    """``triton.jit(kernel)`` for the current interpreter mode, built once per mode.

    ``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps a function, so a kernel wrapped
    outside the interpreter cannot run inside it and the other way round.
    """
    key = (interpreter_enabled(), kernel)
    if key not in _JITTED:
        _JITTED[key] = triton.jit(kernel)
    return _JITTED[key]


def launch(call: KernelLaunch) -> None:
    """Run ``call`` (compiling its kernel for these argument types on first use)."""
    jitted(call.kernel)[call.grid](*call.args, **call.constants)  # type: ignore[index]


def block(n: int, low: int, high: int) -> int:
    """A power of two in ``[low, high]`` covering ``n`` where possible."""
    return max(low, min(high, triton.next_power_of_2(max(n, 1))))


def uses_dot(dtype: torch.dtype) -> bool:
    """Whether tiled products use ``tl.dot`` (float32) or a broadcast product and sum (float64).

    ``tl.dot`` on float64 operands fails to compile for a GPU with triton 3.6 and 3.7 (the
    versions torch 2.11 and 2.13 pin), so float64 kernels never use it: the broadcast form is
    exact in float64 and compiles everywhere (``tests/test_kernels_cubin.py``).
    """
    return dtype != torch.float64
