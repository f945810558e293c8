"""Numerics under which a position's logits do not depend on how many positions one call runs.

Why this exists: a speculative round verifies a block of positions in one forward; plain decoding
runs one position a forward. The decoder's output law is the law the verify forward computes, so
it equals plain decoding's only as far as the two calls give a position the same logits. In
float32 they agree to the last bits (a difference of about 1e-5 in a logit). In bfloat16 on a CPU
they do not: the attention kernel (SDPA's CPU flash kernel) rounds a block's rows differently from
a lone row's, and SmolLM2's logits then differ by up to 0.4 (a total variation of up to 0.03
between the two laws), enough to change a greedy decode. Yet bfloat16 is where a CPU with
AVX512-BF16 / AMX verifies cheaply: a forward of 6-16 positions costs about 1.1x one position,
against 1.5-2x in float32 (journal §16).

:func:`make_row_invariant` makes every position's computation the same function of its own tokens,
whatever else the call runs (the other positions of a block, the other rows of a batch):

* **attention** in float64 (:func:`row_invariant_attention`, registered with transformers as
  :data:`ROW_INVARIANT_ATTENTION`): the products of bfloat16 queries and keys are exact in float64,
  the softmax and the value product run in float64, and the result is rounded once to the model's
  dtype, so two calls can differ only where float64 rounding straddles a bfloat16 rounding
  boundary (about 2^-45 of the outputs);
* **linear layers** applied in chunks of at most ``rows`` rows (:class:`RowInvariantLinear`),
  ``rows`` probed on this machine's own kernels (:func:`invariant_rows`): oneDNN's bfloat16 kernel
  gives each row the same bits for 1 to 32 rows on the Intel Xeon here, and switches kernels past
  32.

Elementwise layers (norms, rotary embeddings, activations) compute each row alone already. The
result: a verify block's logits equal the logits of the same positions decoded one by one, bit
for bit on every measured prompt, so greedy speculative decoding reproduces plain decoding of the
same model exactly, and the sampled law is the law of plain decoding, not of a block kernel.
The probe runs at the current thread count; changing ``torch.set_num_threads`` afterwards can
change the kernels, so set threads first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

__all__ = [
    "ROW_INVARIANT_ATTENTION",
    "RowInvariance",
    "RowInvarianceError",
    "RowInvariantConv1D",
    "RowInvariantLinear",
    "chunk_rows",
    "invariant_rows",
    "make_row_invariant",
    "row_invariant_attention",
]

#: the name under which transformers' attention and mask interfaces know the float64 attention
ROW_INVARIANT_ATTENTION = "row_invariant"
#: the most rows :func:`invariant_rows` probes (a probe costs one call per row count)
MOST_PROBED_ROWS = 64


class RowInvarianceError(ValueError):
    """The model cannot run row-invariant (an attention feature the float64 path does not have)."""


def row_invariant_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """Attention computed in float64 and rounded once: the same bits for a query row whatever
    else the call holds.

    Args:
        module: the attention layer (read for ``training``).
        query: (B, H, q, D).
        key, value: (B, H_kv, n, D), ``H`` a multiple of ``H_kv`` (grouped-query attention).
        attention_mask: (B or 1, 1, q, n) boolean (True: may attend) or additive float, or None
            (every query sees every key: a single query, or no padding).
        scaling: the score scale (None: ``D ** -0.5``).
        dropout: must be 0 (this is an inference path).
        kwargs: ``softcap`` (tanh soft-capping of the scores) is applied; ``sliding_window``
            arrives through the mask; attention sinks (``s_aux``) are refused.

    Returns:
        ((B, q, H, D) in ``query``'s dtype, None): transformers' attention-function contract.
    """
    if dropout and module.training:
        raise RowInvarianceError("row-invariant attention is an inference path: dropout "
                                 f"{dropout} in training mode; call model.eval()")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise RowInvarianceError("row-invariant attention has no attention sinks; load this "
                                 "model without --precision bfloat16")
    batch, heads, length, width = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise RowInvarianceError(f"{heads} query heads are not a multiple of {kv_heads} "
                                 "key/value heads")
    groups = heads // kv_heads
    scale = scaling if scaling is not None else width ** -0.5
    queries = query.to(torch.float64).reshape(batch, kv_heads, groups * length, width)
    scores = torch.matmul(queries, key.to(torch.float64).transpose(-1, -2)) * scale
    scores = scores.reshape(batch, kv_heads, groups, length, -1)
    softcap = kwargs.get("softcap")
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        # the lowest finite score, not -inf: a query that may see nothing (a padding position)
        # gets a finite, never-read output instead of NaN, which would reach real rows through
        # its keys and values; a masked score's weight is still exactly 0 beside a visible one
        scores = scores.masked_fill(~mask[:, :, None, :, -scores.shape[-1]:],
                                    torch.finfo(torch.float64).min)
    probs = torch.softmax(scores, dim=-1).reshape(batch, kv_heads, groups * length, -1)
    out = torch.matmul(probs, value.to(torch.float64)).reshape(batch, heads, length, -1)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _boolean_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' SDPA mask, never skipped for a causal block: the float64 attention reads an
    explicit mask whenever one is needed."""
    from transformers.masking_utils import sdpa_mask
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register_attention() -> None:
    """Make :data:`ROW_INVARIANT_ATTENTION` a name transformers accepts (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(ROW_INVARIANT_ATTENTION, row_invariant_attention)
    AttentionMaskInterface.register(ROW_INVARIANT_ATTENTION, _boolean_mask)


def _chunked(layer: Callable[[Tensor], Tensor], x: Tensor, rows: int, width: int) -> Tensor:
    """``layer`` on the rows of ``x`` (..., in), at most ``rows`` a call -> (..., ``width``)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= rows:
        return layer(x)
    out = torch.cat([layer(chunk) for chunk in flat.split(rows)])
    return out.reshape(*x.shape[:-1], width)


class RowInvariantLinear(nn.Linear):
    """An ``nn.Linear`` that sends its rows to the kernel at most ``rows`` at a time, sharing the
    source layer's parameters (so the kernel that handles a row never depends on how many rows
    came with it, within the probed range)."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.rows = rows

    def forward(self, x: Tensor) -> Tensor:
        """(..., in) -> (..., out): ``F.linear`` on chunks of at most ``rows`` rows."""
        return _chunked(lambda rows: F.linear(rows, self.weight, self.bias), x, self.rows,
                        self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows={self.rows}"


class RowInvariantConv1D(Conv1D):
    """transformers' ``Conv1D`` (GPT-2's linear layers: ``x @ W + b``, ``W`` (in, out)) applied
    at most ``rows`` rows at a time, sharing the source layer's parameters."""

    def __init__(self, layer: Conv1D, rows: int) -> None:
        nn.Module.__init__(self)
        self.nf, self.nx = layer.nf, layer.nx
        self.weight, self.bias = layer.weight, layer.bias
        self.rows = rows

    def forward(self, x: Tensor) -> Tensor:
        """(..., in) -> (..., out): ``Conv1D`` on chunks of at most ``rows`` rows."""
        return _chunked(super().forward, x, self.rows, self.nf)

    def __repr__(self) -> str:
        return f"RowInvariantConv1D(nf={self.nf}, nx={self.nx}, rows={self.rows})"


def _input_width(layer: nn.Module) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else int(layer.weight.shape[0])


def invariant_rows(layers: Sequence[nn.Module], most: int = MOST_PROBED_ROWS,
                   generator: torch.Generator | None = None) -> int:
    """The largest ``r <= most`` such that, for every ``m <= r`` and every layer, the layer on
    ``m`` rows gives each row the bits it gets alone: the chunk size the row-invariant layers may
    use on this machine. 1 where even two rows change a row's bits.

    Args:
        layers: row-wise layers (``nn.Linear``, transformers' ``Conv1D``) in the dtype and on the
            device they run in; one per weight shape is enough.
        most: the largest row count probed.
        generator: seeds the random probe rows.
    """
    best = most
    with torch.no_grad():
        for layer in layers:
            weight = layer.weight
            rows = torch.randn(most, _input_width(layer), generator=generator).to(weight)
            alone = torch.cat([layer(rows[i:i + 1]) for i in range(most)])
            for m in range(2, best + 1):
                if not torch.equal(layer(rows[:m]), alone[:m]):
                    best = m - 1
                    break
    return best


@dataclass(frozen=True)
class RowInvariance:
    """What :func:`make_row_invariant` did: the dtype, the probed chunk size and the layers."""

    dtype: torch.dtype
    rows: int
    linear_layers: int

    def describe(self) -> str:
        return (f"row-invariant {str(self.dtype).removeprefix('torch.')}: float64 attention, "
                f"{self.linear_layers} linear layers applied {self.rows} rows at a time (the most "
                "rows this machine's kernel computes as it computes one)")


def _row_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, layer) for every plain ``nn.Linear`` and ``Conv1D`` of ``model``."""
    kinds = (nn.Linear, Conv1D)
    return [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if type(child) in kinds]


def make_row_invariant(model: nn.Module, dtype: torch.dtype | None = None,
                       generator: torch.Generator | None = None) -> RowInvariance:
    """Cast ``model`` (a transformers causal LM, in place) to ``dtype`` (None: keep its dtype),
    switch its attention to :func:`row_invariant_attention` and its plain linear layers
    (``nn.Linear``, ``Conv1D``) to chunks of the probed size (:func:`invariant_rows`). Call it
    before wrapping the model in a backbone and after ``torch.set_num_threads``.

    Raises:
        RowInvarianceError: the model has no linear layers or does not take a custom attention
            implementation.
    """
    targets = _row_layers(model)
    if not targets:
        raise RowInvarianceError("the model has no nn.Linear or Conv1D layers to make "
                                 "row-invariant")
    if not callable(getattr(model, "set_attn_implementation", None)):
        raise RowInvarianceError(f"{type(model).__name__} is not a transformers model that takes "
                                 "a custom attention; run it in float32")
    if dtype is not None:
        model.to(dtype)
    register_attention()
    try:
        model.set_attn_implementation(ROW_INVARIANT_ATTENTION)  # type: ignore[operator]
    except (AttributeError, ValueError) as error:
        raise RowInvarianceError(f"the model does not take a custom attention ({error}); run it "
                                 "in float32") from None
    shapes: dict[tuple[str, tuple[int, ...]], nn.Module] = {}
    for _, _, layer in targets:
        shapes.setdefault((type(layer).__name__, tuple(layer.weight.shape)), layer)
    rows = invariant_rows(list(shapes.values()), generator=generator)
    for parent, name, layer in targets:
        chunked = RowInvariantLinear(layer, rows) if isinstance(layer, nn.Linear) else \
            RowInvariantConv1D(layer, rows)
        setattr(parent, name, chunked)
    return RowInvariance(next(model.parameters()).dtype, rows, len(targets))


def chunk_rows(model: nn.Module) -> int | None:
    """The rows a call of ``model``'s row-invariant layers takes (:func:`make_row_invariant`'s
    probe), ``None`` for a model that was not made row-invariant."""
    for module in model.modules():
        if isinstance(module, RowInvariantLinear | RowInvariantConv1D):
            return module.rows
    return None
