"""Helpers shared by the kernel tests: a chi-square p-value, and compiling a kernel for a GPU."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from circuits.kernels._triton_launch import KernelLaunch


def chi_square_p(choices: Tensor, probs: Tensor) -> float:
    """p-value of Pearson's chi-square test of ``choices`` against ``probs`` (zero cells: 0 counts)."""
    counts = torch.bincount(choices, minlength=probs.numel()).double()
    support = probs > 0
    if (counts[~support] > 0).any():
        return 0.0
    expected = probs[support] * choices.numel()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = torch.tensor((int(support.sum()) - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


class Specialization(Enum):
    """How the runtime arguments of a kernel call are typed for compilation.

    ``JIT``: exactly what ``triton.jit`` derives on a GPU (triton's own specialiser: an int equal
    to 1 becomes a constant, ``tt.divisibility`` 16 on pointers aligned to 16 bytes and on ints
    that are multiples of 16). ``ALL_DIVISIBLE``: as JIT, plus divisibility on every pointer and
    int (every size and stride a multiple of 16). ``PLAIN``: no hints at all, ones included (as
    with ``do_not_specialize``).
    """

    JIT = "jit"
    ALL_DIVISIBLE = "all-divisible"
    PLAIN = "plain"


def compile_for_cuda(call: KernelLaunch, arch: int, specialization: Specialization) -> object:
    """Compile ``call``'s kernel for ``sm_{arch}`` through every stage (ttir, ttgir, llir, ptx,
    cubin; ptxas ships in the triton wheel), with its arguments specialised as ``specialization``
    says. No GPU is needed. Raises whatever triton raises when a stage fails."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, native_specialize_impl

    fn = JITFunction(call.kernel)  # not triton.jit: that would pick the interpreter if enabled
    runtime = [name for name in fn.arg_names if name not in call.constants]
    assert len(runtime) == len(call.args), (fn.arg_names, len(call.args))
    signature: dict[str, str] = {}
    constexprs: dict[str, object] = dict(call.constants)
    attrs: dict[tuple[int, ...], list] = {}
    for name, value in zip(runtime, call.args, strict=True):
        kind, hint = native_specialize_impl(CUDABackend, value, False, True, True)
        if specialization is Specialization.PLAIN:
            hint = ""
            if kind == "constexpr":
                kind = "i32"
        elif specialization is Specialization.ALL_DIVISIBLE and kind[0] in "*i":
            hint = "D"
        if kind == "constexpr":
            constexprs[name] = value
            hint = ""
        signature[name] = kind
        if hint:
            attrs[(fn.arg_names.index(name),)] = CUDABackend.parse_attr(hint)
    for name in call.constants:
        signature[name] = "constexpr"
    signature = {name: signature[name] for name in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs),
                          target=GPUTarget("cuda", arch, 32))
