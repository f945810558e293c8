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

Triton is optional: nothing here imports it until a triton path is actually considered.
"""

from __future__ import annotations

import contextvars
import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

import torch
from torch import Tensor

from circuits.errors import CircuitError

ENV_VAR = "CIRCUITS_KERNELS"
#: dtypes the triton kernels compute in (exactly, with no down-cast).
TRITON_DTYPES = (torch.float32, torch.float64)


class KernelBackendError(CircuitError, RuntimeError):
    """The requested kernel backend cannot run on these tensors (the message says why)."""


class KernelBackend(Enum):
    AUTO = "auto"  # triton on CUDA when installed, torch otherwise
    TORCH = "torch"  # the reference torch implementation
    TRITON = "triton"  # the fused triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)


BackendLike = KernelBackend | str

_GLOBAL: KernelBackend | None = None
_CONTEXT: contextvars.ContextVar[KernelBackend | None] = contextvars.ContextVar(
    "circuits_kernel_backend", default=None)
_TRITON_IMPORT: dict[str, object] = {}  # cache: {"ok": bool, "error": str}


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
    """Forget the cached outcome of ``import triton`` (for tests that simulate its absence)."""
    _TRITON_IMPORT.clear()


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


def resolve_backend(*tensors: Tensor, backend: BackendLike | None = None) -> KernelBackend:
    """The backend that will run on ``tensors``: :attr:`~KernelBackend.TORCH` or ``TRITON``.

    Raises:
        KernelBackendError: triton was forced but cannot run on these tensors.
    """
    requested = requested_backend(backend)
    if requested is KernelBackend.TORCH:
        return KernelBackend.TORCH
    if requested is KernelBackend.AUTO:
        on_cuda = bool(tensors) and all(t.device.type == "cuda" for t in tensors)
        if on_cuda and _triton_obstacle(tensors) is None:
            return KernelBackend.TRITON
        return KernelBackend.TORCH
    obstacle = _triton_obstacle(tensors)
    if obstacle is not None:
        raise KernelBackendError(f"the triton kernel backend was forced but {obstacle}")
    return KernelBackend.TRITON


def use_triton(*tensors: Tensor, backend: BackendLike | None = None) -> bool:
    """``resolve_backend(...) is KernelBackend.TRITON``: the one dispatch test of the library."""
    return resolve_backend(*tensors, backend=backend) is KernelBackend.TRITON
