"""Operations on the slots of a transformers ``DynamicCache``, written once for every cache the
project keeps (the backbone's verifier and draft caches, a batch's ragged caches, a draft block's
own cache).

transformers 5.x keeps one layer object per decoder layer with ``keys`` / ``values`` tensors of
shape ``(B, H, P, D)`` (batch, KV heads, positions, head size); layers never written (the draft
cache's layers below the draft branch) are skipped by both operations.
"""

from __future__ import annotations

from torch import Tensor
from transformers.cache_utils import Cache

__all__ = ["drop_last_positions", "gather_slots"]


def _written_layers(cache: Cache) -> list[object]:
    return [layer for layer in cache.layers
            if getattr(layer, "is_initialized", True) and getattr(layer, "keys", None) is not None]


def drop_last_positions(cache: Cache, removed: int) -> None:
    """Drop the last ``removed`` positions of every written layer of ``cache`` (no-op when
    ``removed <= 0``).

    transformers 5.x: ``crop`` takes minus the number of positions to drop (a positive value
    raises); up to transformers 5.17, cropping a never-written layer raised ``'NoneType' object is
    not subscriptable``, hence the skip.
    """
    if removed <= 0:
        return
    for layer in _written_layers(cache):
        layer.crop(-removed)  # type: ignore[attr-defined]


def gather_slots(cache: Cache, rows: Tensor, slots: Tensor) -> None:
    """Rebuild ``cache`` from some of its slots: new row ``b`` holds, in its slot ``j``, what old
    row ``rows[b]`` held in slot ``slots[b, j]`` (every written layer, keys and values).

    Args:
        rows: (B',) long, old row indices, on the cache's device.
        slots: (B', P') long, old slot indices, on the cache's device.
    """
    for layer in _written_layers(cache):
        for name in ("keys", "values"):
            tensor = getattr(layer, name).index_select(0, rows)  # (B', H, P, D)
            index = slots[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
            setattr(layer, name, tensor.gather(2, index))
