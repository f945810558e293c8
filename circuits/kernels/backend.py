"""Which implementation runs the hot paths: torch (always available, the reference) or triton.

Selection, from the most to the least specific:

1. a ``backend=`` argument of a kernel function (:func:`circuits.kernels.log_matmul`, ...);
2. the innermost :func:`use_backend` context;
3. the global :func:`set_backend` setting;
4. the environment variable ``CIRCUITS_KERNELS`` (``auto``, ``torch`` or ``triton``);
5. :attr:`KernelBackend.AUTO`.

``AUTO`` picks triton only for CUDA tensors of a supported dtype when ``import triton`` works, and
torch otherwise: it never picks triton for CPU tensors. A forced ``TRITON`` on CPU tensors is
possible only under triton's interpreter (``TRITON_INTERPRET=1``, how the tests run the kernels);
anything else that makes triton impossible raises one :class:`KernelBackendError` that says why.

``AUTO`` never crashes where torch would not. Every triton call site goes through
:func:`run_triton`: under ``AUTO``, the first call of a kernel for a dtype on a device is its
compile probe, and a kernel that fails to compile or launch there is recorded, announced once with
a :class:`KernelFallbackWarning`, and replaced by the torch path from then on. ``AUTO`` also
leaves triton releases older than :data:`OLDEST_TESTED_TRITON` (whose GPU compilation this project
does not test) to torch. A forced ``TRITON`` gets neither safety net: its errors propagate.

Triton is optional: nothing here imports it until a triton path is actually considered.
"""

from __future__ import annotations

import contextvars
import importlib
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from typing import TypeVar

import torch
from torch import Tensor

from circuits.errors import CircuitError

ENV_VAR = "CIRCUITS_KERNELS"
#: dtypes the triton kernels compute in (exactly, with no down-cast).
TRITON_DTYPES = (torch.float32, torch.float64)
#: The oldest triton release whose GPU compilation of every kernel is tested
#: (``tests/test_kernels_cubin.py``, run against 3.6, 3.7 and the newest by
#: ``scripts/triton_compat.sh``). ``AUTO`` leaves older releases to torch.
OLDEST_TESTED_TRITON = (3, 6)
Result = TypeVar("Result")


class KernelBackendError(CircuitError, RuntimeError):
    """The requested kernel backend cannot run on these tensors (the message says why)."""


class KernelFallbackWarning(RuntimeWarning):
    """``AUTO`` chose torch instead of a triton kernel that cannot run here (the message says why)."""


class TritonKernel(Enum):
    """The triton kernels, as named in fallback records and warnings."""

    LSE_MATMUL = "log-space sum layer (shared weights)"
    LSE_MATVEC_ROWS = "log-space sum layer (per-row weights)"
    LSE_MATMUL_BACKWARD = "log-space sum layer backward"
    GUMBEL_SUM_CHOICE = "Gumbel-max sum child choice"
    SOFTMAX_STATS = "softmax statistics"
    SOFTMAX_MIXTURE = "softmax mixture"


class KernelBackend(Enum):
    AUTO = "auto"  # triton on CUDA when installed, torch otherwise
    TORCH = "torch"  # the reference torch implementation
    TRITON = "triton"  # the fused triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)


BackendLike = KernelBackend | str

_GLOBAL: KernelBackend | None = None
_CONTEXT: contextvars.ContextVar[KernelBackend | None] = contextvars.ContextVar(
    "circuits_kernel_backend", default=None)
_TRITON_IMPORT: dict[str, object] = {}  # cache: {"ok": bool, "error": str, "version": tuple}
#: (kernel, dtype, device) -> why its triton call failed under AUTO: torch runs it from then on
_FAILED: dict[tuple[TritonKernel, torch.dtype, str], str] = {}
_WARNED_OLD_TRITON: list[bool] = []


def parse_backend(value: BackendLike) -> KernelBackend:
    """A :class:`KernelBackend` from itself or its name (``"auto"``, ``"torch"``, ``"triton"``)."""
    if isinstance(value, KernelBackend):
        return value
    if isinstance(value, str):
        try:
            return KernelBackend(value.strip().lower())
        except ValueError:
            pass
    names = ", ".join(repr(b.value) for b in KernelBackend)
    raise KernelBackendError(f"unknown kernel backend {value!r}; use one of {names}")


def set_backend(backend: BackendLike | None) -> None:
    """Force a backend globally (``None`` returns to the environment variable / AUTO)."""
    global _GLOBAL
    _GLOBAL = None if backend is None else parse_backend(backend)


@contextmanager
def use_backend(backend: BackendLike) -> Iterator[KernelBackend]:
    """Force a backend inside a ``with`` block (thread- and task-local, nestable)."""
    token = _CONTEXT.set(parse_backend(backend))
    try:
        yield _CONTEXT.get() or KernelBackend.AUTO
    finally:
        _CONTEXT.reset(token)


def requested_backend(backend: BackendLike | None = None) -> KernelBackend:
    """The backend asked for, before looking at any tensor (see the module docstring)."""
    if backend is not None:
        return parse_backend(backend)
    context = _CONTEXT.get()
    if context is not None:
        return context
    if _GLOBAL is not None:
        return _GLOBAL
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        try:
            return parse_backend(env)
        except KernelBackendError as error:
            raise KernelBackendError(f"environment variable {ENV_VAR}: {error}") from None
    return KernelBackend.AUTO


def triton_import_error() -> str | None:
    """Why ``import triton`` fails (``None`` when it works). The outcome is cached."""
    if "ok" not in _TRITON_IMPORT:
        try:
            importlib.import_module("triton")
            importlib.import_module("triton.language")
            _TRITON_IMPORT.update(ok=True, error=None)
        except Exception as error:  # ImportError, or a broken install failing at import time
            _TRITON_IMPORT.update(ok=False, error=f"{type(error).__name__}: {error}")
    return None if _TRITON_IMPORT["ok"] else str(_TRITON_IMPORT["error"])


def reset_triton_import_cache() -> None:
    """Forget the cached outcome of ``import triton`` and every recorded kernel failure (for
    tests that simulate its absence or a failing kernel)."""
    _TRITON_IMPORT.clear()
    _FAILED.clear()
    _WARNED_OLD_TRITON.clear()


def triton_version() -> tuple[int, ...] | None:
    """The installed triton's ``(major, minor)``, or ``None`` when it is not importable."""
    if triton_import_error() is not None:
        return None
    if "version" not in _TRITON_IMPORT:  # read once: AUTO asks on every CUDA call
        import triton  # optional dependency: imported lazily

        parts = []
        for piece in triton.__version__.split(".")[:2]:
            digits = "".join(ch for ch in piece if ch.isdigit())
            parts.append(int(digits or 0))
        _TRITON_IMPORT["version"] = tuple(parts)
    return _TRITON_IMPORT["version"]  # type: ignore[return-value]


def failed_kernels() -> dict[tuple[TritonKernel, torch.dtype, str], str]:
    """The triton kernels ``AUTO`` has replaced by torch in this process, and why."""
    return dict(_FAILED)


def triton_available() -> bool:
    """Whether ``import triton`` works in this process."""
    return triton_import_error() is None


def interpreter_enabled() -> bool:
    """Whether triton kernels built now run in triton's CPU interpreter (``TRITON_INTERPRET``)."""
    if not triton_available():
        return False
    from triton import knobs  # optional dependency: imported lazily

    return bool(knobs.runtime.interpret)


def interpreter_usable() -> bool:
    """Whether interpreted kernels can run: ``TRITON_INTERPRET`` was already set when triton was
    imported (triton's own library functions, e.g. ``tl.max``, are built at import time)."""
    if not interpreter_enabled():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.max, InterpretedFunction)


def _triton_obstacle(tensors: tuple[Tensor, ...]) -> str | None:
    """Why the triton kernels cannot run on these tensors, or ``None`` when they can."""
    error = triton_import_error()
    if error is not None:
        return f"triton is not importable ({error}); install it with `pip install triton`"
    devices = {t.device.type for t in tensors}
    if len(devices) > 1:
        return f"the tensors are on several device types {sorted(devices)}"
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    unsupported = sorted(str(d) for d in dtypes if d not in TRITON_DTYPES)
    if unsupported:
        return f"the triton kernels support float32 and float64, got {', '.join(unsupported)}"
    device = devices.pop() if devices else "cpu"
    if device == "cuda":
        return None
    if device == "cpu":
        if interpreter_usable():
            return None
        if interpreter_enabled():
            return ("TRITON_INTERPRET=1 was set after this process imported triton, so its "
                    "interpreter cannot run: set it in the command's environment (before anything "
                    "imports triton), or use KernelBackend.TORCH")
        return ("the tensors are on the CPU, where triton kernels only run under its interpreter: "
                "start the process with TRITON_INTERPRET=1 (slow, for testing), move the tensors "
                "to CUDA, or use KernelBackend.TORCH")
    return f"triton kernels do not run on {device!r} tensors"


def _all_on_cuda(tensors: tuple[Tensor, ...]) -> bool:
    """Whether ``AUTO`` may consider triton at all: every operand is a CUDA tensor."""
    return bool(tensors) and all(t.device.type == "cuda" for t in tensors)


def _auto_obstacle(kernel: TritonKernel | None, tensors: tuple[Tensor, ...]) -> str | None:
    """Why ``AUTO`` leaves these tensors to torch although triton could be tried, or ``None``."""
    version = triton_version()
    if version is not None and version < OLDEST_TESTED_TRITON:
        if not _WARNED_OLD_TRITON:
            _WARNED_OLD_TRITON.append(True)
            oldest = ".".join(map(str, OLDEST_TESTED_TRITON))
            warnings.warn(f"triton {'.'.join(map(str, version))} is older than {oldest}, the oldest "
                          f"release whose GPU compilation of these kernels is tested: the torch "
                          f"path runs instead (upgrade triton, or force "
                          f"{ENV_VAR}=triton to try it anyway)", KernelFallbackWarning,
                          stacklevel=4)
        return "untested triton release"
    if kernel is not None and tensors and _FAILED:
        return _FAILED.get(_failure_key(kernel, tensors))
    return None


def _failure_key(kernel: TritonKernel, tensors: tuple[Tensor, ...]) -> tuple[TritonKernel, torch.dtype, str]:
    floats = [t for t in tensors if t.is_floating_point()]
    return kernel, (floats or list(tensors))[0].dtype, str(tensors[0].device)


def resolve_backend(*tensors: Tensor, backend: BackendLike | None = None,
                    kernel: TritonKernel | None = None) -> KernelBackend:
    """The backend that will run on ``tensors``: :attr:`~KernelBackend.TORCH` or ``TRITON``.

    Args:
        tensors: the operands (their devices and dtypes decide).
        backend: force a backend for this call.
        kernel: the triton kernel in question: ``AUTO`` skips one that already failed here.

    Raises:
        KernelBackendError: triton was forced but cannot run on these tensors.
    """
    requested = requested_backend(backend)
    if requested is KernelBackend.TORCH:
        return KernelBackend.TORCH
    if requested is KernelBackend.AUTO:
        if _all_on_cuda(tensors) and _triton_obstacle(tensors) is None \
                and _auto_obstacle(kernel, tensors) is None:
            return KernelBackend.TRITON
        return KernelBackend.TORCH
    obstacle = _triton_obstacle(tensors)
    if obstacle is not None:
        raise KernelBackendError(f"the triton kernel backend was forced but {obstacle}")
    return KernelBackend.TRITON


def use_triton(*tensors: Tensor, backend: BackendLike | None = None,
               kernel: TritonKernel | None = None) -> bool:
    """``resolve_backend(...) is KernelBackend.TRITON``: the one dispatch test of the library.

    Code being traced by ``torch.compile`` always takes the torch path: inductor generates its
    own fused kernels from it, and the hand-written launchers (with their compile probes and
    fallbacks) are host code a graph cannot hold.
    """
    if torch.compiler.is_compiling():
        return False
    return resolve_backend(*tensors, backend=backend, kernel=kernel) is KernelBackend.TRITON


def run_triton(kernel: TritonKernel, tensors: tuple[Tensor, ...], call: Callable[[], Result],
               backend: BackendLike | None = None) -> Result | None:
    """Run ``call`` (the triton path of ``kernel`` on ``tensors``) when triton is selected.

    Returns ``None`` when the caller should run its torch path instead: torch was selected, or
    ``AUTO`` selected triton and ``call`` failed (a kernel that does not compile with this triton
    release or GPU). That failure is recorded, so later ``AUTO`` calls of the kernel for this
    dtype and device go straight to torch, and announced once with a
    :class:`KernelFallbackWarning`. A forced triton backend propagates every error.
    """
    if not use_triton(*tensors, backend=backend, kernel=kernel):
        return None
    if requested_backend(backend) is not KernelBackend.AUTO:
        return call()
    try:
        return call()
    except Exception as error:  # compile errors differ by triton release: any failure falls back
        record_failure(kernel, tensors, error)
        return None


def record_failure(kernel: TritonKernel, tensors: tuple[Tensor, ...], error: Exception) -> None:
    """Remember that ``kernel`` failed on tensors like these under ``AUTO``, and warn once."""
    key = _failure_key(kernel, tensors)
    last_line = (str(error).strip().splitlines() or [""])[-1][:300]
    reason = f"{type(error).__name__}: {last_line}"
    if key not in _FAILED:
        version = ".".join(map(str, triton_version() or ()))
        warnings.warn(f"the triton kernel for the {kernel.value} failed for {key[1]} tensors on "
                      f"{key[2]} with triton {version} ({reason}); the torch path runs it from "
                      f"now on (set {ENV_VAR}=torch to skip triton altogether)",
                      KernelFallbackWarning, stacklevel=3)
    _FAILED[key] = reason
