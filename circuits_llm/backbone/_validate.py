"""Input checks shared by the backbone's public methods (one clear error per bad input)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from circuits.errors import InvalidInputError

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_token_layout(tokens: object, name: str = "tokens") -> Tensor:
    """Check that ``tokens`` is a non-empty (B, m) integer tensor, without reading its values.

    Reading no values means no host synchronisation: the compiled backbone checks the id range
    inside its graph instead.

    Returns:
        the tokens as an int64 tensor (B, m) on their original device.

    Raises:
        TypeError: if ``tokens`` is not a tensor.
        InvalidInputError: wrong dtype, wrong number of dimensions, or an empty dimension.
    """
    if not isinstance(tokens, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (B, m), got {type(tokens).__name__}")
    if tokens.dtype not in _INT_DTYPES:
        raise InvalidInputError(f"{name} must have an integer dtype (e.g. torch.long), got {tokens.dtype}")
    if tokens.ndim != 2:
        raise InvalidInputError(f"{name} must have shape (B, m), got shape {tuple(tokens.shape)}")
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise InvalidInputError(f"{name} must be non-empty, got shape {tuple(tokens.shape)}")
    return tokens.long()


def check_tokens(tokens: object, vocab_size: int, name: str = "tokens") -> Tensor:
    """Check a (B, m) integer token tensor with ids in ``[0, vocab_size)`` (reads the ids on the host).

    Returns:
        the tokens as an int64 tensor (B, m) on their original device.

    Raises:
        TypeError: if ``tokens`` is not a tensor.
        InvalidInputError: wrong dtype, wrong number of dimensions, an empty dimension, or an id out of range.
    """
    tokens = check_token_layout(tokens, name)
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InvalidInputError(f"{name} contains id {bad}, outside the vocabulary [0, {vocab_size})")
    return tokens


def check_attention_mask(mask: object, shape: tuple[int, int]) -> Tensor:
    """Check a (B, T) 0/1 attention mask matching ``input_ids`` of shape ``shape``.

    Raises:
        TypeError: if ``mask`` is not a tensor.
        InvalidInputError: wrong shape or values other than 0 and 1.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor of shape {shape}, got {type(mask).__name__}")
    if tuple(mask.shape) != shape:
        raise InvalidInputError(
            f"attention_mask must have the shape of input_ids {shape}, got {tuple(mask.shape)}"
        )
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise InvalidInputError(f"attention_mask must be integer or bool (0/1), got {mask.dtype}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise InvalidInputError("attention_mask must contain only 0 and 1")
    return mask.long()


def check_int(value: object, name: str, low: int, high: int | None = None) -> int:
    """Check that ``value`` is an ``int`` (not bool) in ``[low, high]`` (``high=None``: unbounded).

    Raises:
        TypeError: if ``value`` is not an int.
        ValueError: if it is out of range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        upper = "inf)" if high is None else f"{high}]"
        raise ValueError(f"{name} must be in [{low}, {upper}, got {value}")
    return value


def check_feature_layers(layers: object, count: int) -> tuple[int, ...]:
    """``layers`` as a tuple of distinct indices ``0 <= i < count - 1`` of a model's ``count``
    decoder layers, whose outputs a draft block fuses (EAGLE-3) with the LM head's input.

    The last layer is excluded: its output is what the final norm turns into the LM head's input,
    which is read anyway.

    Raises:
        ValueError: anything else, saying what was wrong.
    """
    if isinstance(layers, (str, bytes, Tensor)) or not isinstance(layers, Sequence):
        raise ValueError(f"feature layers must be a sequence of layer indices, got {layers!r}")
    result = tuple(layers)
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count - 1
           for i in result) or len(set(result)) != len(result):
        raise ValueError(f"feature layers must be distinct indices of the model's layers 0.."
                         f"{count - 2} (the last one, {count - 1}, feeds the LM head's input, "
                         f"which is read anyway), got {list(result)}")
    return result
