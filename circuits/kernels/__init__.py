"""Fused kernels for the hot paths of the compiled circuits, with an always-exact torch fallback.

Backends (:class:`KernelBackend`): ``TORCH`` (the reference, always available), ``TRITON`` (fused
kernels; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and ``AUTO`` (triton on CUDA
tensors when ``import triton`` works, torch otherwise; never triton on the CPU). Force one
globally (:func:`set_backend`, or the environment variable ``CIRCUITS_KERNELS=torch|triton``),
in a block (``with use_backend("torch"): ...``) or per call (``backend=`` arguments).
Triton is optional: importing this package never imports it. Under ``AUTO`` a kernel that does
not compile with the installed triton or GPU falls back to torch with one
:class:`KernelFallbackWarning` (:func:`run_triton`); releases older than
:data:`OLDEST_TESTED_TRITON` are left to torch.

Operations (:mod:`circuits.kernels.ops`): :func:`log_matmul` (the log-space sum layer, forward
and backward: one dispatch between :func:`torch_log_matmul` and the fused kernel; the compiled
sum folds call it) and
:func:`sum_child_choice` (the Gumbel-max top-down step through a sum fold, used by the sampler
through :func:`choose_sum_children`). :mod:`circuits.kernels.softmax`:
:func:`~circuits.kernels.softmax.softmax_stats` (log-normalisers, selected log-probabilities and
Gumbel-max draws of categorical logits in one pass) and
:func:`~circuits.kernels.softmax.softmax_mixture` (``weights @ softmax(logits)`` without the
softmax table), which the queries use for input folds held as
:class:`~circuits.compiled.layers.SoftmaxParts`.
"""

from circuits.kernels.backend import (
    ENV_VAR,
    OLDEST_TESTED_TRITON,
    KernelBackend,
    KernelBackendError,
    KernelFallbackWarning,
    TritonKernel,
    failed_kernels,
    interpreter_enabled,
    interpreter_usable,
    parse_backend,
    requested_backend,
    reset_triton_import_cache,
    resolve_backend,
    run_triton,
    set_backend,
    triton_available,
    triton_import_error,
    triton_version,
    use_backend,
    use_triton,
)
from circuits.kernels.ops import (
    ExpWeights,
    GumbelChooser,
    TritonLogMatmul,
    choose_sum_children,
    exp_weights,
    gumbel_argmax,
    log_matmul,
    log_matmul_backward,
    rows_of,
    rows_per_set,
    sum_child_choice,
    torch_log_matmul,
    triton_log_matmul,
)

__all__ = [
    "ENV_VAR", "OLDEST_TESTED_TRITON", "ExpWeights", "GumbelChooser", "KernelBackend",
    "KernelBackendError", "KernelFallbackWarning", "TritonKernel", "TritonLogMatmul",
    "choose_sum_children", "exp_weights", "failed_kernels", "gumbel_argmax", "interpreter_enabled",
    "interpreter_usable", "log_matmul", "log_matmul_backward", "parse_backend",
    "requested_backend", "reset_triton_import_cache", "resolve_backend", "rows_of",
    "rows_per_set", "run_triton", "set_backend", "sum_child_choice", "torch_log_matmul",
    "triton_available", "triton_import_error", "triton_log_matmul", "triton_version",
    "use_backend", "use_triton",
]
