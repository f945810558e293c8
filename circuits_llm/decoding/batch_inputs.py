"""What a batch ``generate`` is given, checked row by row: prompts, per-row limits, stop
conditions and generators.

A batch is a list of prompts (each a list of ids or a 1-D tensor, of any lengths), or a
``(B, L)`` tensor with an ``attention_mask`` marking each row's ids (left or right padding; all
ones when no row is padded). A flat list of ids and an ``(L,)`` or ``(1, L)`` tensor are one
prompt: the single-prompt path, unchanged (a ``(B, L)`` tensor without a mask is refused there,
as before: say which ids are padding).
Every bad row raises one :class:`~circuits_llm.decoding.warping.DecoderError` that names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import Tensor

from circuits_llm.decoding.inputs import check_prompt
from circuits_llm.decoding.warping import DecoderError

__all__ = ["batch_prompts", "check_context", "is_batch", "per_row", "row_generators"]

T = TypeVar("T")


def is_batch(input_ids: object, attention_mask: object = None) -> bool:
    """Whether ``generate``'s input is a batch of prompts (see the module docstring)."""
    if attention_mask is not None:
        return True
    if isinstance(input_ids, Tensor):
        return False
    if isinstance(input_ids, Sequence) and not isinstance(input_ids, str | bytes) and input_ids:
        first = input_ids[0]
        return isinstance(first, Tensor | Sequence) and not isinstance(first, str | bytes)
    return False


def batch_prompts(input_ids: object, attention_mask: Tensor | None, vocab: int) -> list[list[int]]:
    """The batch's prompts as lists of ids, each checked (non-empty, ids in ``0 .. vocab - 1``).

    Raises:
        DecoderError: naming the first bad row: an empty prompt, an id outside the vocabulary,
            rows of mixed kinds (lists and tensors), a mask whose ones are not one run (neither
            left nor right padding).
    """
    if attention_mask is not None:
        return _masked_rows(input_ids, attention_mask, vocab)
    if isinstance(input_ids, Sequence) and not isinstance(input_ids, str | bytes):
        rows: list[object] = list(input_ids)
    else:
        raise DecoderError(f"input_ids must be token ids or a batch of prompts, got "
                           f"{type(input_ids).__name__}")
    if not rows:
        raise DecoderError("the batch is empty: give at least one prompt")
    kind = _kind(rows[0])
    prompts = []
    for b, row in enumerate(rows):
        if _kind(row) != kind:
            raise DecoderError(
                f"row {b} is of type {type(row).__name__} but row 0 is of type "
                f"{type(rows[0]).__name__}: give "
                "every prompt of a batch the same way (lists of ids, or 1-D tensors)")
        if isinstance(row, Tensor) and row.dim() != 1:
            raise DecoderError(f"row {b}: a prompt tensor in a batch has shape (L,), got "
                               f"{tuple(row.shape)}")
        prompts.append(_row(b, row, vocab))
    return prompts


def _kind(row: object) -> str:
    if isinstance(row, Tensor):
        return "tensor"
    if isinstance(row, Sequence) and not isinstance(row, str | bytes):
        return "sequence"
    return type(row).__name__


def _row(b: int, row: object, vocab: int) -> list[int]:
    """One row checked by the single-prompt check, its errors prefixed with the row."""
    if not isinstance(row, Tensor | Sequence) or isinstance(row, str | bytes):
        raise DecoderError(f"row {b}: a prompt is a list of token ids or a 1-D tensor, got "
                           f"{type(row).__name__}")
    if (row.numel() if isinstance(row, Tensor) else len(row)) == 0:
        raise DecoderError(f"row {b}: the prompt is empty: give at least one token id")
    try:
        return check_prompt(row, vocab)  # type: ignore[arg-type]
    except DecoderError as error:
        raise DecoderError(f"row {b}: {error}") from None


def _masked_rows(input_ids: object, attention_mask: object, vocab: int) -> list[list[int]]:
    """The rows of a padded ``(B, L)`` tensor: the ids where ``attention_mask`` is 1, which must
    be one run per row (left or right padding)."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise DecoderError("with an attention_mask, input_ids must be a (B, L) tensor of ids")
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != \
            tuple(input_ids.shape):
        shape = getattr(attention_mask, "shape", None)
        raise DecoderError(f"attention_mask must be a tensor of input_ids' shape "
                           f"{tuple(input_ids.shape)}, got {shape if shape is None else tuple(shape)}")
    if attention_mask.is_floating_point() or bool(((attention_mask != 0) &
                                                   (attention_mask != 1)).any()):
        raise DecoderError("attention_mask must hold only 0 and 1 (integers or bools)")
    mask = attention_mask.bool().cpu()
    prompts = []
    for b in range(mask.shape[0]):
        where = mask[b].nonzero()[:, 0]
        if where.numel() == 0:
            raise DecoderError(f"row {b}: the prompt is empty (its attention_mask is all 0)")
        if int(where[-1] - where[0]) + 1 != where.numel():
            raise DecoderError(f"row {b}: its attention_mask has holes; pad on the left or on "
                               f"the right only")
        prompts.append(_row(b, input_ids[b, int(where[0]):int(where[-1]) + 1], vocab))
    return prompts


def per_row(value: T | Sequence[T] | None, batch: int, name: str, single: type | tuple[type, ...]
            ) -> list[T | None]:
    """``value`` given once for every row, or one per row (a list or tuple of ``batch``)."""
    if isinstance(value, list | tuple) and not isinstance(value, single):
        if len(value) != batch:
            raise DecoderError(f"{name}: {len(value)} values for a batch of {batch} prompts")
        return list(value)
    return [value] * batch  # type: ignore[list-item]


def row_generators(generator: object, batch: int) -> list[torch.Generator | None]:
    """One generator for every row (rows draw from it in turn) or one per row."""
    generators = per_row(generator, batch, "generator", torch.Generator)
    for b, each in enumerate(generators):
        if each is not None and not isinstance(each, torch.Generator):
            raise DecoderError(f"generator of row {b} must be a torch.Generator or None, got "
                               f"{type(each).__name__}")
    return generators  # type: ignore[return-value]


def check_context(prompts: list[list[int]], limits: list[int], lookahead: int,
                  context: int | None) -> None:
    """Every row fits the model's context: prompt + max_new_tokens + the drafts read ahead.

    Raises:
        DecoderError: naming the first row that does not.
    """
    if context is None:
        return
    for b, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        needed = len(prompt) + limit + lookahead
        if needed > context:
            raise DecoderError(
                f"row {b}: prompt {len(prompt)} + max_new_tokens {limit} + {lookahead} drafted "
                f"ahead = {needed} positions, past the model's context length {context}: shorten "
                "that prompt or generate less")
