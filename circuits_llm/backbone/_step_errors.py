"""What a failed extend on the static caches says to its caller: one clear error per cause.

A compiled extend reads nothing back from the device, so a token id out of range is caught inside
the graph by an asynchronous assertion carrying :data:`TOKEN_RANGE_MESSAGE`, and surfaces as a
``RuntimeError`` after the call: :func:`static_step_error` turns it back into the
:class:`~circuits.errors.InvalidInputError` an eager call raises. A model that dynamo cannot trace
as one graph becomes :class:`~circuits_llm.backbone._arch.UnsupportedModelError` (naming the way
out: ``compile=False``), and a call past dynamo's recompile limit a ``RuntimeError`` saying which
graphs exist. Anything else is re-raised as it is.

Kept apart from :class:`~circuits_llm.backbone.hf.HFBackbone`'s extend, which empties its caches
after any failure and only asks here what to raise.
"""

from __future__ import annotations

import torch

from circuits.errors import InvalidInputError
from circuits_llm.backbone._arch import UnsupportedModelError

#: Message of the in-graph id check of the compiled backbone (found again in the error it raises).
TOKEN_RANGE_MESSAGE = "HFBackbone: a token id is outside the vocabulary"


def static_step_error(error: BaseException, model: str, lora_layers: int, vocab_size: int,
                      batch: int, length: int, used_graph: bool) -> Exception | None:
    """The error to raise from ``error`` (None: ``error`` itself) after an extend of ``length``
    tokens in a batch of ``batch`` failed on the static caches of a ``model`` backbone
    (``used_graph``: the compiled graph ran, else the eager step)."""
    if used_graph and isinstance(error, RuntimeError) and TOKEN_RANGE_MESSAGE in str(error):
        return InvalidInputError(
            f"tokens contains an id outside the vocabulary [0, {vocab_size}) (checked inside "
            "the compiled graph; the caches were emptied)"
        )
    if isinstance(error, torch._dynamo.exc.TorchDynamoException):
        first_line = (str(error).strip().splitlines() or [""])[0]
        return UnsupportedModelError(
            f"{model} with lora_layers={lora_layers} cannot be compiled "
            f"as one graph (torch.compile, fullgraph=True, static shapes): {type(error).__name__}: "
            f"{first_line}. Pass compile=False (cache=CacheKind.STATIC runs the same step eagerly)"
        )
    if isinstance(error, torch._dynamo.exc.FailOnRecompileLimitHit):
        return RuntimeError(
            f"the compiled backbone needs a new graph for batch size {batch} and length {length}, "
            f"but it already has torch._dynamo.config.recompile_limit="
            f"{torch._dynamo.config.recompile_limit} graphs (one per batch size, compiled length "
            "and training mode): use fewer of them, or raise that limit"
        )
    return None
