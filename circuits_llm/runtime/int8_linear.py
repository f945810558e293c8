"""A linear layer whose weight is stored in int8 with one scale per output row (weight-only
quantisation): four times fewer bytes to read than float32 at each call.

Why: a draft's matrix-vector products are bound by the bytes they read. On the 2-core CPU this
project measures on, a draft block's step reads 36 MB of float32 weights, and the draft side of a
round costs 17-18% of a verify forward (docs/results.md). Drafts may come from any law as long as
the verifier is told which (the accept test reads the ``q`` each draft was drawn from), so a
drafter can read quantised weights without changing what the decoder generates; only how often
its drafts are accepted moves.

Two ways to compute the same product, chosen per call:

* on a CPU, torch's packed kernel ``torch._weight_int8pack_mm`` (bfloat16 activations, int8
  weights, bfloat16 scales), when the input width is a multiple of 16: measured on this project's
  CPU, that kernel reads out of bounds (a segmentation fault or infinities) for other widths;
* anywhere else, the weight dequantised in the input's dtype and a plain ``linear``.

A call of :data:`WIDE_ROWS` rows or more on a CPU whose oneDNN computes bfloat16 natively
(AVX512-BF16 or AMX: :func:`native_bfloat16`) multiplies by the codes held in bfloat16 instead
(exact: the codes are integers of at most 7 bits), then scales: on the Intel Xeon (AMX) of
journal section 17 the bfloat16 kernel takes up to 32 rows at the price of one, while the packed
int8 kernel's cost grows with the rows (8 rows of SmolLM2's 8,192-token readout: 0.70 against
1.05 ms); the crossover was not measured on an AVX512-BF16 CPU without AMX. A batch of 8 rows
drafting through a draft block makes such calls.

Outputs come back in the input's dtype.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

__all__ = ["PACKED_WIDTH_MULTIPLE", "WIDE_ROWS", "Int8Linear", "int8_rows", "native_bfloat16",
           "packed_kernel_runs"]

#: the packed CPU kernel is used only for input widths that are multiples of this
PACKED_WIDTH_MULTIPLE = 16
#: from this many rows a call multiplies by the bfloat16 codes where bfloat16 is native
#: (measured crossover on SmolLM2's draft-block shapes: 6 rows)
WIDE_ROWS = 6


def native_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` is a CPU whose oneDNN kernels compute bfloat16 natively (AVX512-BF16 or
    AMX), where a bfloat16 product of up to 32 rows costs about one row's."""
    return device.type == "cpu" and _cpu_bfloat16_native()


@torch.compiler.assume_constant_result  # a compiled block step reads it as a constant
def _cpu_bfloat16_native() -> bool:
    """The CPU's answer (every wide int8 call reads it)."""
    return _ask_cpu_bfloat16()


@functools.cache
def _ask_cpu_bfloat16() -> bool:
    """Asked once: oneDNN's own probe of the CPU."""
    return torch.backends.mkldnn.is_available() and \
        bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packed_kernel_runs(width: int, device: torch.device) -> bool:
    """Whether an :class:`Int8Linear` of input width ``width`` on ``device`` runs torch's packed
    kernel (a CPU, a width that is a multiple of 16, a torch that has the kernel), rather than the
    dequantised product."""
    return (device.type == "cpu" and width % PACKED_WIDTH_MULTIPLE == 0
            and hasattr(torch, "_weight_int8pack_mm"))


def int8_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row quantisation: ``weight`` (N, K) float -> ``(codes, scales)``, codes
    (N, K) int8 in [-127, 127] and scales (N,) float32 with ``codes * scales[:, None]`` the nearest
    such approximation of ``weight`` row by row (a zero row gets scale 1 and zero codes)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"int8_rows quantises a (N, K) float weight, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    detached = weight.detach().float()
    largest = detached.abs().amax(1)
    scales = torch.where(largest > 0, largest / 127, torch.ones_like(largest))
    codes = torch.round(detached / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scales


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` held as int8 codes times a float scale per output row.

    Built from a float layer by :meth:`from_linear` or from a weight by :meth:`from_weight`; the
    codes, scales and bias are buffers (they follow ``.to(device)``), and nothing is trainable.

    Attributes:
        in_features, out_features: ``K`` and ``N``.
        codes: (N, K) int8.
        scales: (N,) float32, and ``packed_scales`` the same in bfloat16 (the packed kernel's).
        bias: (N,) in the source layer's dtype, or ``None``.
    """

    def __init__(self, codes: Tensor, scales: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        if codes.dtype != torch.int8 or codes.dim() != 2:
            raise ValueError(f"codes must be (N, K) int8, got {tuple(codes.shape)} {codes.dtype}")
        if scales.shape != codes.shape[:1]:
            raise ValueError(f"scales must be ({codes.shape[0]},), got {tuple(scales.shape)}")
        if bias is not None and bias.shape != codes.shape[:1]:
            raise ValueError(f"bias must be ({codes.shape[0]},), got {tuple(bias.shape)}")
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.float())
        self.register_buffer("packed_scales", scales.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None = None) -> Int8Linear:
        """The int8 form of ``weight`` (N, K) and ``bias`` (N,) or ``None`` (:func:`int8_rows`),
        on their device."""
        codes, scales = int8_rows(weight)
        return cls(codes, scales, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 form of an ``nn.Linear`` (its weight and bias)."""
        return cls.from_weight(linear.weight, linear.bias)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """(N, K) the weight this layer applies, in ``dtype``."""
        return self.codes.to(dtype) * self.scales.to(dtype)[:, None]

    def uses_packed_kernel(self, x: Tensor) -> bool:
        """Whether a call on ``x`` runs torch's packed CPU kernel (else the dequantised
        product)."""
        return self.codes.device == x.device and packed_kernel_runs(self.in_features, x.device)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` (..., K) float -> (..., N) in ``x``'s dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Int8Linear expects inputs (..., {self.in_features}), got "
                             f"{tuple(x.shape)}")
        if self.uses_packed_kernel(x):
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
            if flat.shape[0] >= WIDE_ROWS and native_bfloat16(x.device):
                out = nn.functional.linear(flat, self._bfloat16_codes()).float() * self.scales
            else:
                out = torch._weight_int8pack_mm(flat, self.codes, self.packed_scales)
            out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        else:
            out = nn.functional.linear(x, self.codes.to(x.dtype)) * self.scales.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def _bfloat16_codes(self) -> Tensor:
        """(N, K) the codes in bfloat16 (exact), made once per device and kept out of the state
        dict."""
        held = self.__dict__.get("_codes_bf16")
        if held is None or held.device != self.codes.device:
            held = self.__dict__["_codes_bf16"] = self.codes.to(torch.bfloat16)
        return held

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
