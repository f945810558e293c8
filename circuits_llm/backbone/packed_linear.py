"""Linear layers with MKL-packed weights, so a verify block costs little more than one token on a CPU.

A speculative round runs the backbone on a block of ``L + 1 <= n`` tokens. On a CPU a float32
``nn.Linear`` over a few rows is a small-``M`` matrix product, and ``torch``'s default path packs
the weight matrix again on every call: measured on SmolLM2-135M (Intel Xeon, 1 thread), a
forward of 8 tokens costs 2.1 single-token forwards, although it reads the same weights once.
MKL can pack a weight once for a fixed row count (``cblas_sgemm_pack``, exposed by torch as
``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, the ops inductor's CPU freezing
emits); with the packed weights the 8-token forward costs 1.5 single-token forwards.

:func:`pack_linear_layers` swaps every plain ``nn.Linear`` of a model for a :class:`PackedLinear`
packed for ``rows`` rows. A call with ``min_rows <= M <= rows`` rows pads its input to ``rows``
with zero rows, runs the packed product and drops the padding (the real rows' values do not depend
on the padding: each output row is its own input row times the weight); any other ``M`` (one
token, a prompt) runs ``F.linear`` as before, which is the faster kernel there. So the
autoregressive baseline sharing the model keeps its single-token kernel, and every decoder on the
model gets the best kernel for its block size.

Nothing else changes: the module is an ``nn.Linear`` with the same parameters and state dict
(the packed copy is not saved); a call that needs gradients, runs under ``torch.compile``, or
finds that the weight changed since it was packed (its version counter or storage moved, e.g. an
optimiser step or ``load_state_dict``) runs ``F.linear`` on the live weight and repacks lazily,
so a stale packed copy is never used. One kind of edit escapes both checks: an in-place change
through ``weight.data`` (``.data`` has a version counter of its own); after such edits call
:func:`repack_linear_layers`. The outputs equal ``F.linear``'s up to float32 rounding
(the two kernels sum in different orders), as the outputs of blocks of different lengths already
do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PackedLinear", "linear_packing_available", "pack_linear_layers", "repack_linear_layers"]

#: Smallest row count worth the padded packed product (below it ``F.linear`` is as fast:
#: a 2-token SmolLM2 forward costs 72 ms plain and 77 ms packed, a 4-token one 106 and 96 ms).
DEFAULT_MIN_ROWS = 4


def linear_packing_available() -> bool:
    """Whether this torch has the MKL packed-GEMM ops (x86 CPU builds with MKL)."""
    return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose float32 CPU weight is also held packed for blocks of ``rows`` rows.

    Attributes:
        rows: the row count the weight is packed for (the largest block the packed path runs).
        min_rows: the smallest block that runs the packed path (smaller ones run ``F.linear``).
    """

    def __init__(self, linear: nn.Linear, rows: int, min_rows: int = DEFAULT_MIN_ROWS) -> None:
        nn.Module.__init__(self)
        if not 2 <= min_rows <= rows:
            raise ValueError(f"PackedLinear needs 2 <= min_rows <= rows, got min_rows={min_rows}, "
                             f"rows={rows}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_parameter("weight", linear.weight)  # the same Parameters, shared (ties too)
        self.register_parameter("bias", linear.bias)
        self.rows, self.min_rows = rows, min_rows
        self._packed: Tensor | None = None
        self._packed_from: tuple[int, int] | None = None

    def __getstate__(self) -> dict[str, object]:
        """The module's state without the packed copy (an opaque MKL tensor that cannot be copied
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
            self._packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), self.rows)
            self._packed_from = key
        return self._packed

    def forward(self, x: Tensor) -> Tensor:
        """``F.linear(x, weight, bias)``; (..., in) -> (..., out)."""
        count = x.numel() // self.in_features if self.in_features else 0
        if not self.min_rows <= count <= self.rows or not self._packable(x):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(count, self.in_features)
        if count < self.rows:
            flat = torch.cat([flat, flat.new_zeros(self.rows - count, self.in_features)])
        out = torch.ops.mkl._mkl_linear(flat.contiguous(), self._packed_weight(), self.weight,
                                        self.bias, self.rows)
        return out[:count].reshape(*x.shape[:-1], self.out_features)

    def _packable(self, x: Tensor) -> bool:
        """Whether this call may take the packed path (inference, float32 CPU, not traced)."""
        if torch.compiler.is_compiling():
            return False
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return False
        return x.device.type == "cpu" and x.dtype == torch.float32 \
            and self.weight.dtype == torch.float32 and self.weight.device.type == "cpu"

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, packed for {self.min_rows}..{self.rows} rows"


def pack_linear_layers(model: nn.Module, rows: int, min_rows: int = DEFAULT_MIN_ROWS) -> int:
    """Swap every plain float32 CPU ``nn.Linear`` of ``model`` for a :class:`PackedLinear`.

    Args:
        model: the model, changed in place (its parameters and state dict are unchanged).
        rows: the largest block to pack for: a speculative decoder's window ``n`` (its verify
            block has at most ``n`` tokens).
        min_rows: the smallest block that takes the packed path.

    Raises:
        ValueError: a layer to swap carries hooks (the model was already wrapped, e.g. in an
            ``HFBackbone``): pack first.

    Returns:
        how many layers were swapped: 0 when the ops are missing (no MKL), the model is not a
        float32 CPU model, or ``rows < min_rows`` (blocks that small gain nothing).
    """
    if not linear_packing_available() or rows < min_rows:
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype == torch.float32
               and child.weight.device.type == "cpu"]
    hooked = [name for _, name, child in targets
              if child._forward_hooks or child._forward_pre_hooks or child._backward_hooks]
    if hooked:
        raise ValueError(f"cannot pack the linear layers of {type(model).__name__}: {hooked[:3]} "
                         "carry hooks that a swapped module would lose (an HFBackbone hooks the LM "
                         "head); call pack_linear_layers on the model before wrapping it")
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, rows, min_rows))
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
