"""Helpers shared by the kernel tests: a chi-square p-value and lowering a kernel to Triton IR."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor


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


def lower_to_cuda_ir(fn: Callable[..., object], pointers: Mapping[str, str],
                     constants: Mapping[str, object]) -> str:
    """The Triton IR of kernel ``fn`` for an sm_90 target (no GPU needed): the GPU front end's
    type checks and dot shapes run. Arguments not in ``pointers`` or ``constants`` are i32."""
    import triton
    from triton._C.libtriton import ir as ir_module
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    jitted = triton.jit(fn)
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32")
                 for name in jitted.arg_names}
    context = ir_module.context()
    ir_module.load_dialects(context)
    backend.load_dialects(context)
    module = ASTSource(jitted, signature, dict(constants)).make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
        context)
    return str(module)
