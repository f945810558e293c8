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
* **linear layers** applied in chunks of ``least`` to ``rows`` rows (:class:`RowInvariantLinear`;
  fewer rows are padded with copies of the last), both probed on this machine's own kernels
  (:func:`invariant_chunk`): oneDNN's bfloat16 kernel gives each row the same bits for 1 to 32
  rows on the Intel Xeon (AMX) here and switches kernels past 32; on an AMD EPYC (AVX512-BF16) a
  lone row takes another kernel, whose bits differ in a down projection's sums, while 2 to 64
  rows agree, so every call there takes at least 2 rows.

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
    "invariant_chunk",
    "invariant_rows",
    "make_row_invariant",
    "priced_rows",
    "row_invariant_attention",
]

#: the name under which transformers' attention and mask interfaces know the float64 attention
ROW_INVARIANT_ATTENTION = "row_invariant"
#: the most rows :func:`invariant_rows` probes
MOST_PROBED_ROWS = 64
#: the fewest rows a call may be padded to, tried in turn by :func:`invariant_chunk`
LEAST_ROWS_TRIED = (1, 2)
#: the rows a batch's verify call is sized by on a CPU without AMX tiles, where the bfloat16
#: kernel's cost grows with its rows (an AMD EPYC with AVX512-BF16: 32 rows of SmolLM2's MLP cost
#: 2.7x one row's, its LM head 2.1x); measured there, 3 drafts at batch 4 (16 rows) beat 5 and 1
#: (journal section 18)
ROWS_PRICED_WITHOUT_AMX = 16
#: a chunk of this many rows is wide enough: :func:`invariant_chunk` tries no further ``least``
USEFUL_ROWS = 8


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


def _chunked(layer: Callable[[Tensor], Tensor], x: Tensor, rows: int, width: int,
             least: int = 1) -> Tensor:
    """``layer`` on the rows of ``x`` (..., in), ``least`` to ``rows`` a call (a call of fewer is
    padded with copies of its last row, whose outputs are dropped) -> (..., ``width``)."""
    flat = x.reshape(-1, x.shape[-1])
    count = flat.shape[0]
    if least <= count <= rows:
        return layer(x)
    outputs = []
    for chunk in flat.split(rows):
        short = least - chunk.shape[0]
        padded = chunk if short <= 0 else torch.cat([chunk, chunk[-1:].expand(short, -1)])
        outputs.append(layer(padded)[:chunk.shape[0]])
    return torch.cat(outputs).reshape(*x.shape[:-1], width)


class RowInvariantLinear(nn.Linear):
    """An ``nn.Linear`` that sends its rows to the kernel ``least`` to ``rows`` at a time
    (padding a shorter call), sharing the source layer's parameters (so the kernel that handles a
    row never depends on how many rows came with it, within the probed range)."""

    def __init__(self, linear: nn.Linear, rows: int, least: int = 1) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.rows, self.least = rows, least

    def forward(self, x: Tensor) -> Tensor:
        """(..., in) -> (..., out): ``F.linear`` on chunks of ``least`` to ``rows`` rows."""
        return _chunked(lambda rows: F.linear(rows, self.weight, self.bias), x, self.rows,
                        self.out_features, self.least)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows={self.rows}, least={self.least}"


class RowInvariantConv1D(Conv1D):
    """transformers' ``Conv1D`` (GPT-2's linear layers: ``x @ W + b``, ``W`` (in, out)) applied
    ``least`` to ``rows`` rows at a time (padding a shorter call), sharing the source layer's
    parameters."""

    def __init__(self, layer: Conv1D, rows: int, least: int = 1) -> None:
        nn.Module.__init__(self)
        self.nf, self.nx = layer.nf, layer.nx
        self.weight, self.bias = layer.weight, layer.bias
        self.rows, self.least = rows, least

    def forward(self, x: Tensor) -> Tensor:
        """(..., in) -> (..., out): ``Conv1D`` on chunks of ``least`` to ``rows`` rows."""
        return _chunked(super().forward, x, self.rows, self.nf, self.least)

    def __repr__(self) -> str:
        return (f"RowInvariantConv1D(nf={self.nf}, nx={self.nx}, rows={self.rows}, "
                f"least={self.least})")


def _input_width(layer: nn.Module) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else int(layer.weight.shape[0])


def invariant_rows(layers: Sequence[nn.Module], most: int = MOST_PROBED_ROWS,
                   generator: torch.Generator | None = None, least: int = 1) -> int:
    """The largest ``r <= most`` such that, for every ``m`` from ``least`` to ``r`` and every
    layer, the layer on ``m`` rows gives each row the bits it gets alone (in a call padded to
    ``least`` rows with copies of it): the chunk size the row-invariant layers may use on this
    machine: ``least`` where ``least + 1`` rows already change a row's bits, ``least - 1`` where
    ``least`` rows do.

    A kernel may change a row's bits only for some values (a sum rounded differently now and
    then), so every row count is checked on every disjoint chunk of ``most`` random rows: each
    count compares as many rows as the probe holds. The layers are probed smallest first, so the
    largest (an LM head) is called only up to the rows the others allow.

    Args:
        layers: row-wise layers (``nn.Linear``, transformers' ``Conv1D``) in the dtype and on the
            device they run in; one per weight shape is enough.
        most: the largest row count probed.
        generator: seeds the random probe rows.
        least: the fewest rows a call takes.
    """
    best = most
    with torch.no_grad():
        for layer in sorted(layers, key=lambda layer: layer.weight.numel()):
            weight = layer.weight
            rows = torch.randn(most, _input_width(layer), generator=generator).to(weight)
            alone = torch.cat([layer(rows[i:i + 1].expand(least, -1))[:1]
                               for i in range(rows.shape[0])])
            for m in range(max(least, 2), best + 1):
                if any(not torch.equal(layer(rows[start:start + m]), alone[start:start + m])
                       for start in range(0, rows.shape[0] - m + 1, m)):
                    best = m - 1
                    break
    return best


def invariant_chunk(layers: Sequence[nn.Module], most: int = MOST_PROBED_ROWS,
                    generator: torch.Generator | None = None) -> tuple[int, int]:
    """``(least, rows)``: the fewest rows a call is padded to and the most it takes, as
    :func:`invariant_rows` probes them for ``layers``: the first ``least`` of
    :data:`LEAST_ROWS_TRIED` whose calls take :data:`USEFUL_ROWS` rows or more, else the most
    rows found. A padded call costs about what a lone row's does where this matters (bfloat16
    kernels that take many rows at the price of one)."""
    found = []
    for least in LEAST_ROWS_TRIED:
        rows = invariant_rows(layers, most, generator, least)
        if rows >= min(USEFUL_ROWS, most):
            return least, rows
        found.append((least, rows))
    # the most rows, the smaller least on a tie (least 1 always takes at least 1 row, so a
    # larger least wins only with more rows than it pads to)
    return max(found, key=lambda pair: (pair[1], -pair[0]))


@dataclass(frozen=True)
class RowInvariance:
    """What :func:`make_row_invariant` did: the dtype, the probed chunk size and the layers."""

    dtype: torch.dtype
    rows: int
    linear_layers: int
    least: int = 1

    def describe(self) -> str:
        at_least = "" if self.least == 1 else \
            f", at least {self.least} (a lone row takes another kernel here)"
        return (f"row-invariant {str(self.dtype).removeprefix('torch.')}: float64 attention, "
                f"{self.linear_layers} linear layers applied {self.rows} rows at a time (the most "
                f"rows this machine's kernel computes as it computes one){at_least}")


def _row_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, layer) for every plain ``nn.Linear`` and ``Conv1D`` of ``model``."""
    kinds = (nn.Linear, Conv1D)
    return [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if type(child) in kinds]


def make_row_invariant(model: nn.Module, dtype: torch.dtype | None = None,
                       generator: torch.Generator | None = None) -> RowInvariance:
    """Cast ``model`` (a transformers causal LM, in place) to ``dtype`` (None: keep its dtype),
    switch its attention to :func:`row_invariant_attention` and its plain linear layers
    (``nn.Linear``, ``Conv1D``) to chunks of the probed sizes (:func:`invariant_chunk`). Call it
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
    least, rows = invariant_chunk(list(shapes.values()), generator=generator)
    for parent, name, layer in targets:
        chunked = RowInvariantLinear(layer, rows, least) if isinstance(layer, nn.Linear) else \
            RowInvariantConv1D(layer, rows, least)
        setattr(parent, name, chunked)
    return RowInvariance(next(model.parameters()).dtype, rows, len(targets), least)


def chunk_rows(model: nn.Module) -> int | None:
    """The rows a call of ``model``'s row-invariant layers takes (:func:`make_row_invariant`'s
    probe), ``None`` for a model that was not made row-invariant."""
    for module in model.modules():
        if isinstance(module, RowInvariantLinear | RowInvariantConv1D):
            return module.rows
    return None


def priced_rows(model: nn.Module) -> int | None:
    """The rows a verify call of ``model`` (made row-invariant) should hold, for sizing a batch's
    rounds (:meth:`~circuits_llm.draft_block.batch_depth.BatchDepth.within`): its chunk on a CPU
    with AMX tiles, where oneDNN's bfloat16 kernel takes up to the chunk's rows at about the
    price of one (the Intel Xeon of journal section 16: 32); elsewhere at most
    :data:`ROWS_PRICED_WITHOUT_AMX`. ``None`` for a model that was not made row-invariant."""
    rows = chunk_rows(model)
    if rows is None:
        return None
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return rows if amx is not None and amx() else min(rows, ROWS_PRICED_WITHOUT_AMX)
