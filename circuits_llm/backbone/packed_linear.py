"""Linear layers with packed weights, so a verify block costs little more than one token on a CPU.

A speculative round runs the backbone on a block of ``L + 1 <= n`` tokens. On a CPU a float32
``nn.Linear`` over a few rows is a small-``M`` matrix product, and ``torch``'s default path packs
the weight matrix again on every call and, for 2-3 rows, runs kernels that cost nearly a full
product per row: measured on SmolLM2-135M (Intel Xeon, 1 thread), a forward of 8 tokens costs 2.1
single-token forwards; over SmolLM2's linear weights on an AMD EPYC (1 thread), 2 rows cost 1.9x
one row, although they read the same weights once. Two libraries can pack a weight once
(:class:`PackingBackend`): MKL for a fixed row count (``cblas_sgemm_pack``, exposed by torch as
``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, the ops inductor's CPU freezing
emits; a smaller block is padded to it) and oneDNN, whose blocked layout serves every block up to
the row count it was chosen for (``torch.ops.mkldnn._reorder_linear_weight`` /
``_linear_pointwise``; a row's output does not depend on the block it came in).

:func:`pack_linear_layers` swaps every plain ``nn.Linear`` of a model for a :class:`PackedLinear`
packed for ``rows`` rows. A call with ``min_rows <= M <= rows`` rows runs the packed product (the
real rows' values do not depend on MKL's zero padding: each output row is its own input row times
the weight); any other ``M`` (one token, a prompt) runs ``F.linear`` as before. Which backend and
``min_rows`` are fastest depends on the CPU: :func:`tune_linear_packing` measures them on the
model's own weights (what ``circuits-llm demo`` does). The autoregressive baseline sharing the
model then runs whatever is fastest for one row, and every decoder on the model gets the best
kernel for its block size.

Nothing else changes: the module is an ``nn.Linear`` with the same parameters and state dict
(the packed copy is not saved); a call that needs gradients, runs under ``torch.compile``, or
finds that the weight changed since it was packed (its version counter or storage moved, e.g. an
optimiser step or ``load_state_dict``) runs ``F.linear`` on the live weight and repacks lazily,
so a stale packed copy is never used. One kind of edit escapes both checks: an in-place change
through ``weight.data`` (``.data`` has a version counter of its own); after such edits call
:func:`repack_linear_layers`. The outputs equal ``F.linear``'s up to float32 rounding
(the kernels sum in different orders), as the outputs of blocks of different lengths already do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from circuits_llm.runtime.timing import interleaved

__all__ = ["PackedLinear", "PackingBackend", "PackingChoice", "available_backends",
           "choose_packing", "linear_packing_available", "pack_linear_layers",
           "repack_linear_layers", "tune_linear_packing"]

#: Smallest row count worth MKL's padded packed product on the Intel Xeon it was measured on
#: (below it ``F.linear`` is as fast: a 2-token SmolLM2 forward costs 72 ms plain and 77 ms
#: packed, a 4-token one 106 and 96 ms); :func:`tune_linear_packing` measures it instead.
DEFAULT_MIN_ROWS = 4


class PackingBackend(Enum):
    """The library that holds a :class:`PackedLinear`'s packed weight."""

    #: MKL's packed GEMM, packed for exactly ``rows`` rows: smaller blocks are padded to it
    MKL = "mkl"
    #: oneDNN's blocked weight layout chosen for ``rows`` rows: any block up to it runs unpadded
    ONEDNN = "onednn"

    def available(self) -> bool:
        """Whether this torch build has the backend's ops (x86 CPU builds)."""
        if self is PackingBackend.MKL:
            return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_linear")
        return torch.backends.mkldnn.is_available() and \
            hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and \
            hasattr(torch.ops.mkldnn, "_linear_pointwise")

    def pack(self, weight: Tensor, rows: int) -> Tensor:
        """``weight`` (out, in) float32 packed for blocks of ``rows`` rows (an opaque tensor)."""
        if self is PackingBackend.MKL:
            return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)

    def linear(self, x: Tensor, packed: Tensor, weight: Tensor, bias: Tensor | None,
               rows: int) -> Tensor:
        """``x`` (M, in) contiguous, ``M <= rows`` -> ``F.linear(x, weight, bias)`` (M, out) through
        the packed weight."""
        if self is PackingBackend.ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        count = x.shape[0]
        if count < rows:  # MKL's packing is for exactly `rows` rows: pad with zero rows
            x = torch.cat([x, x.new_zeros(rows - count, x.shape[1])])
        return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)[:count]


def available_backends() -> tuple[PackingBackend, ...]:
    """The packing backends this torch build has, in :class:`PackingBackend` order."""
    return tuple(backend for backend in PackingBackend if backend.available())


def linear_packing_available() -> bool:
    """Whether this torch has any packed-GEMM backend (x86 CPU builds with MKL or oneDNN)."""
    return bool(available_backends())


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose float32 CPU weight is also held packed for blocks of ``rows`` rows.

    Attributes:
        rows: the row count the weight is packed for (the largest block the packed path runs).
        min_rows: the smallest block that runs the packed path (smaller ones run ``F.linear``).
        backend: the library holding the packed weight (:class:`PackingBackend`).
    """

    def __init__(self, linear: nn.Linear, rows: int, min_rows: int = DEFAULT_MIN_ROWS,
                 backend: PackingBackend = PackingBackend.MKL) -> None:
        nn.Module.__init__(self)
        if not 1 <= min_rows <= rows:
            raise ValueError(f"PackedLinear needs 1 <= min_rows <= rows, got min_rows={min_rows}, "
                             f"rows={rows}")
        if not isinstance(backend, PackingBackend):
            raise ValueError(f"backend must be a PackingBackend, got {backend!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_parameter("weight", linear.weight)  # the same Parameters, shared (ties too)
        self.register_parameter("bias", linear.bias)
        self.rows, self.min_rows, self.backend = rows, min_rows, backend
        self._packed: Tensor | None = None
        self._packed_from: tuple[int, int] | None = None

    def __getstate__(self) -> dict[str, object]:
        """The module's state without the packed copy (an opaque tensor that cannot be copied
        or pickled): a deep copy or an unpickled module packs again on its first packed call."""
        state = self.__dict__.copy()
        state["_packed"], state["_packed_from"] = None, None
        return state

    def repack(self) -> None:
        """Forget the packed copy: the next packed call packs the current weight."""
        self._packed, self._packed_from = None, None

    def _weight_key(self) -> tuple[int, int]:
        """Identifies the weight's current values: its storage and its in-place version counter."""
        return self.weight.data_ptr(), self.weight._version

    def _packed_weight(self) -> Tensor:
        """The packed weight, packed again if the weight changed since the last packing."""
        key = self._weight_key()
        if self._packed is None or self._packed_from != key:
            self._packed = self.backend.pack(self.weight.detach(), self.rows)
            self._packed_from = key
        return self._packed

    def forward(self, x: Tensor) -> Tensor:
        """``F.linear(x, weight, bias)``; (..., in) -> (..., out)."""
        count = x.numel() // self.in_features if self.in_features else 0
        if not self.min_rows <= count <= self.rows or not self._packable(x):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(count, self.in_features).contiguous()
        out = self.backend.linear(flat, self._packed_weight(), self.weight, self.bias, self.rows)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _packable(self, x: Tensor) -> bool:
        """Whether this call may take the packed path (inference, float32 CPU, not traced)."""
        if torch.compiler.is_compiling():
            return False
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return False
        return x.device.type == "cpu" and x.dtype == torch.float32 \
            and self.weight.dtype == torch.float32 and self.weight.device.type == "cpu"

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, packed with {self.backend.value} for "
                f"{self.min_rows}..{self.rows} rows")


def _linear_targets(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, name, layer)`` of every plain float32 CPU ``nn.Linear`` of ``model``."""
    return [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children()
            if type(child) is nn.Linear and child.weight.dtype == torch.float32
            and child.weight.device.type == "cpu"]


@dataclass(frozen=True)
class PackingChoice:
    """What :func:`tune_linear_packing` measured and chose.

    Attributes:
        backend: the fastest backend over the measured blocks.
        min_rows: the smallest block it serves (``F.linear`` below it).
        rows: the largest block it is packed for.
        milliseconds: ``{kernel: {rows: ms}}``: one pass over every layer, per kernel (``plain``
            is ``F.linear``) and measured block size.
    """

    backend: PackingBackend
    min_rows: int
    rows: int
    milliseconds: dict[str, dict[int, float]] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for logs: the choice and the measured pass times."""
        cells = ", ".join(f"{kernel} " + "/".join(f"{ms:.0f}" for ms in by_rows.values())
                          for kernel, by_rows in self.milliseconds.items())
        sizes = "/".join(str(m) for m in next(iter(self.milliseconds.values()), {}))
        return (f"{self.backend.value} for blocks of {self.min_rows}..{self.rows} rows (ms per "
                f"pass over the linear weights at {sizes} rows: {cells})")


def _pass(layers: Sequence[nn.Linear], inputs: dict[int, Tensor],
          kernel: Callable[[Tensor, nn.Linear], Tensor]) -> Callable[[], None]:
    """One pass of ``kernel`` over every layer (each reading its own weight, as a forward does)."""
    def run() -> None:
        for layer in layers:
            kernel(inputs[layer.in_features], layer)
    return run


def tune_linear_packing(model: nn.Module, rows: int, repeats: int = 4) -> PackingChoice | None:
    """Measure, on ``model``'s own float32 linear weights, which packing serves blocks of up to
    ``rows`` rows fastest; ``None`` when no backend beats ``F.linear`` (or none is available).

    For blocks of 1, 2, 4 and ``rows`` rows (those up to ``rows``), one pass over every layer is
    timed with each available backend and, in the same interleaved rounds, with ``F.linear`` (best
    of ``repeats``); a pass streams all the weights, as a forward does, so the times include the
    memory traffic that dominates small blocks. One backend's packed copies exist at a time (for
    memory), so ``F.linear`` is timed beside each backend, and each backend's times are scaled by
    the ratio of the first backend's ``F.linear`` time to the one beside it: a machine whose memory
    bandwidth drifts between two backends' turns then compares each backend with ``F.linear`` as
    it ran at the same moment. :func:`choose_packing` then picks the backend and ``min_rows`` with
    the least total time. About 10-15 s for SmolLM2-135M on a 2-core machine; the packed copies are
    dropped afterwards (:func:`pack_linear_layers` packs the winner).
    """
    layers = [layer for _, _, layer in _linear_targets(model)]
    backends = available_backends()
    if not layers or not backends:
        return None
    sizes = sorted({m for m in (1, 2, 4, rows) if 1 <= m <= rows})
    widths = {layer.in_features for layer in layers}
    times: dict[str, dict[int, float]] = {"plain": {}}
    with torch.no_grad():
        for backend in backends:
            packed = [PackedLinear(layer, rows, 1, backend) for layer in layers]
            times[backend.value] = {}
            for m in sizes:
                inputs = {width: torch.randn(m, width) for width in widths}
                candidates = {backend.value: _pass(packed, inputs, lambda x, la: la(x)),
                              "plain": _pass(layers, inputs,
                                             lambda x, la: F.linear(x, la.weight, la.bias))}
                timed = {name: 1e3 * timing.best for name, timing in
                         interleaved(candidates, rounds=repeats, max_calls=1).items()}
                reference = times["plain"].setdefault(m, timed["plain"])
                times[backend.value][m] = timed[backend.value] * reference / timed["plain"]
            del packed
    return choose_packing(times, rows)


def choose_packing(milliseconds: dict[str, dict[int, float]], rows: int) -> PackingChoice | None:
    """The choice :func:`tune_linear_packing` makes from its measurements: ``{kernel: {block
    rows: ms}}`` with ``plain`` (``F.linear``) and backends by :class:`PackingBackend` value.

    Every (backend, ``min_rows``) with ``min_rows`` a measured size is scored by the total time
    over the measured sizes (``plain``'s below ``min_rows``, the backend's from it); the least
    total wins if it beats ``plain`` alone, else ``None``. A total rather than a win at every size:
    on a noisy machine one size's timing may flip, the sum over sizes rarely does.
    """
    plain = milliseconds["plain"]
    sizes = sorted(plain)
    best: tuple[float, PackingBackend, int] | None = None
    for backend in PackingBackend:
        measured = milliseconds.get(backend.value)
        if measured is None:
            continue
        for start in sizes:
            total = sum(measured[m] if m >= start else plain[m] for m in sizes)
            if best is None or total < best[0]:
                best = (total, backend, start)
    if best is None or best[0] >= sum(plain.values()):
        return None
    return PackingChoice(best[1], best[2], rows, milliseconds)


def pack_linear_layers(model: nn.Module, rows: int, min_rows: int | None = None,
                       backend: PackingBackend | None = None) -> int:
    """Swap every plain float32 CPU ``nn.Linear`` of ``model`` for a :class:`PackedLinear`.

    Args:
        model: the model, changed in place (its parameters and state dict are unchanged).
        rows: the largest block to pack for: a speculative decoder's window ``n`` (its verify
            block has at most ``n`` tokens).
        min_rows: the smallest block that takes the packed path (default
            :data:`DEFAULT_MIN_ROWS` when a ``backend`` is given).
        backend: the packing library. ``None`` (with ``min_rows`` None): measured on this
            machine by :func:`tune_linear_packing` (about 10 s for SmolLM2), which also picks
            ``min_rows``, and nothing is packed when no backend beats ``F.linear``.

    Raises:
        ValueError: a layer to swap carries hooks (the model was already wrapped, e.g. in an
            ``HFBackbone``): pack first.

    Returns:
        how many layers were swapped: 0 when the backend's ops are missing, the model is not a
        float32 CPU model, ``rows < min_rows`` (no block would take the packed path), or the
        measurement found no backend faster than ``F.linear``.
    """
    if backend is not None or min_rows is not None:
        backend = PackingBackend.MKL if backend is None else backend
        min_rows = DEFAULT_MIN_ROWS if min_rows is None else min_rows
        if not backend.available() or rows < min_rows:
            return 0
    targets = _linear_targets(model)
    hooked = [name for _, name, child in targets
              if child._forward_hooks or child._forward_pre_hooks or child._backward_hooks]
    if hooked:
        raise ValueError(f"cannot pack the linear layers of {type(model).__name__}: {hooked[:3]} "
                         "carry hooks that a swapped module would lose (an HFBackbone hooks the LM "
                         "head); call pack_linear_layers on the model before wrapping it")
    if backend is None or min_rows is None:  # neither given: measured here
        choice = tune_linear_packing(model, rows) if targets else None
        if choice is None:
            return 0
        backend, min_rows = choice.backend, choice.min_rows
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, rows, min_rows, backend))
    return len(targets)


def repack_linear_layers(model: nn.Module) -> int:
    """Make every :class:`PackedLinear` of ``model`` pack its weight again on its next packed call.

    Needed only after in-place edits through ``weight.data``, which the version counter does not
    see; returns how many layers were reset.
    """
    layers = [module for module in model.modules() if isinstance(module, PackedLinear)]
    for layer in layers:
        layer.repack()
    return len(layers)
