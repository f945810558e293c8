"""Static KV caches for the compiled backbone: preallocated, rolled back by a length reset.

A ``transformers`` ``StaticLayer`` holds keys and values of shape ``(B, H, max_cache_len, D)`` and
its valid length as a 0-d device tensor (``cumulative_length``). A forward of ``m`` tokens writes
them at positions ``length .. length+m-1`` (``index_copy_``), advances the length in place, and
attends over all ``max_cache_len`` slots through a causal mask whose query positions start at the
length tensor. So every shape is fixed by ``(B, m, max_cache_len)``, and no step reads the length
on the host: what ``torch.compile`` (and a CUDA graph) needs.

Rollback is a length reset: :meth:`StaticCaches.set_length` writes the new length into every
layer's length tensor. The slots beyond it keep stale keys and values, which are never read: the
next forward overwrites the slots it writes before attending, and the causal mask excludes every
slot after the last query position. Every layer is a full-attention ``StaticLayer`` (sliding-window
models are handled by the attention mask, as in the dynamic path), since a ring-buffer sliding
layer overwrites what a rollback would need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import Enum

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, StaticLayer

from circuits.errors import InvalidInputError
from circuits_llm.backbone._validate import check_int
from circuits_llm.runtime.compiling import CompiledProgram, private_copy


class CacheKind(Enum):
    """The KV cache an :class:`~circuits_llm.backbone.HFBackbone` keeps.

    ``DYNAMIC``: ``transformers`` ``DynamicCache`` (grows by concatenation, cropped on rollback; no
    length limit). ``STATIC``: preallocated ``StaticLayer`` caches of ``max_cache_len`` positions,
    rolled back by a length reset; needed by ``compile=True``.
    """

    DYNAMIC = "dynamic"
    STATIC = "static"


class CacheCapacityError(InvalidInputError):
    """An extend would run past the end of a static cache (the message says what to pass)."""


#: Default capacity of a static cache when ``max_cache_len`` is not given: the model's
#: ``max_position_embeddings`` capped at this (a cache is allocated whole, per layer and batch row).
DEFAULT_MAX_CACHE_LEN = 2048


def default_max_cache_len(model: PreTrainedModel) -> int:
    """``min(max_position_embeddings, DEFAULT_MAX_CACHE_LEN)`` (the cap alone if the config has none)."""
    config = model.config.get_text_config(decoder=True)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return min(limit, DEFAULT_MAX_CACHE_LEN)
    return DEFAULT_MAX_CACHE_LEN


def resolve_cache_options(model: PreTrainedModel, cache: CacheKind | None, compile: bool,
                          max_cache_len: int | None, compiled_lengths: Iterable[int] | None
                          ) -> tuple[CacheKind, int]:
    """The cache kind and static capacity that :class:`HFBackbone`'s options ask for.

    Raises:
        TypeError, ValueError: one clear error when an option has the wrong type or options clash.
    """
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool, got {type(compile).__name__}")
    if cache is None:
        cache = CacheKind.STATIC if compile else CacheKind.DYNAMIC
    if not isinstance(cache, CacheKind):
        raise TypeError(f"cache must be a CacheKind or None, got {cache!r}")
    if compile and cache is not CacheKind.STATIC:
        raise ValueError("compile=True needs the static cache: pass cache=CacheKind.STATIC or leave "
                         "cache unset")
    if cache is CacheKind.DYNAMIC and max_cache_len is not None:
        raise ValueError("max_cache_len sizes the static cache: pass cache=CacheKind.STATIC (or "
                         "compile=True) with it, or leave it unset")
    if not compile and compiled_lengths is not None:
        raise ValueError("compiled_lengths needs compile=True")
    if max_cache_len is None:
        return cache, default_max_cache_len(model)
    return cache, check_int(max_cache_len, "max_cache_len", 1)


def _new_cache(num_layers: int, max_cache_len: int) -> Cache:
    # Made outside inference mode whatever the caller's: a layer's length tensor is updated in place.
    with torch.inference_mode(False):
        return Cache(layers=[StaticLayer(max_cache_len=max_cache_len) for _ in range(num_layers)])


class StaticCaches:
    """The verifier's and the draft branch's static caches for one batch size.

    The tensors are allocated lazily by the first forward after :meth:`discard` (an eager call: the
    allocation marks them as static addresses for ``torch.compile``, which must happen outside a
    compiled region); later forwards of the same batch size reuse them.

    Attributes:
        max_cache_len: capacity in tokens, per batch row.
        verifier: the verifier's cache (``num_layers`` layers).
        draft: the draft branch's cache (only its last ``k`` layers are ever written).
        batch: the batch size the tensors were allocated for (0: not allocated).
    """

    def __init__(self, num_layers: int, max_cache_len: int) -> None:
        self.num_layers = num_layers
        self.max_cache_len = max_cache_len
        self.discard()

    def discard(self) -> None:
        """Drop the tensors; the next forward allocates new ones (for any batch size)."""
        self.verifier = _new_cache(self.num_layers, self.max_cache_len)
        self.draft = _new_cache(self.num_layers, self.max_cache_len)
        self.batch = 0

    def prepare(self, batch: int) -> None:
        """Make the caches ready for a batch of ``batch`` rows (reallocated if it changed)."""
        if batch != self.batch:
            self.discard()
            self.batch = batch

    @property
    def allocated(self) -> bool:
        """Whether the tensors exist (a forward ran since the last :meth:`discard`)."""
        return self.verifier.is_initialized

    def set_length(self, length: int) -> None:
        """Make ``length`` the valid length of every allocated layer (rollback; two dispatches)."""
        lengths = [layer.cumulative_length for cache in (self.verifier, self.draft)
                   for layer in cache.layers if layer.is_initialized]
        if lengths:
            torch._foreach_zero_(lengths)
            if length:
                torch._foreach_add_(lengths, length)

    def check_capacity(self, start: int, m: int) -> None:
        """Refuse an extend of ``m`` tokens after ``start`` that does not fit.

        Raises:
            CacheCapacityError: saying which ``max_cache_len`` would have fitted.
        """
        if start + m > self.max_cache_len:
            raise CacheCapacityError(
                f"the static KV cache holds at most max_cache_len={self.max_cache_len} tokens, but "
                f"this extend needs {start + m} ({start} cached + {m} new): pass "
                f"HFBackbone(..., max_cache_len=N) with N >= {start + m} (for decoding, at least "
                "prompt length + max_new_tokens + the draft window)"
            )

    def positions(self, m: int, device: torch.device) -> Tensor:
        """(1, m) positions of ``m`` new tokens, read from the length tensor (no host read)."""
        offset = self.verifier.layers[0].cumulative_length
        return (torch.arange(m, device=device) + offset).unsqueeze(0)


def _block_variant(tokens: Tensor) -> str:
    """The compiled specialisation a step call selects: its batch size and block length."""
    batch, m = tokens.shape
    return f"batch {batch}, {m} token{'s' if m != 1 else ''}"


def compile_step(step: Callable[..., tuple[Tensor, Tensor]], device: torch.device
                 ) -> Callable[..., tuple[Tensor, Tensor]]:
    """A backbone's step method, compiled whole with static shapes (one graph per batch size and
    block length), as a :class:`~circuits_llm.runtime.compiling.CompiledProgram`.

    The compiler is the current one (:func:`~circuits_llm.runtime.compiling.use_compiler`; by
    default ``torch.compile``, ``mode="reduce-overhead"`` (CUDA graphs: the static caches are
    static addresses) on CUDA, inductor's default elsewhere). It compiles a private copy of the
    function's code object: Dynamo keeps compiled graphs (and counts recompilations against
    ``recompile_limit``) per code object, so without the copy every backbone of the process would
    share one budget of graphs.

    Under CUDA graphs the returned logits and draft hidden states are copies: they are read after
    later compiled calls (the accept program reads the logits, the next round's draft program the
    hidden state), which may overwrite the graph's static outputs. A block length whose graph the
    compiler refuses (``BackendCompilerFailed``, at its first call) runs ``step`` eagerly from then
    on, after one :class:`~circuits_llm.runtime.compiling.CompileFallbackWarning`; the other block
    lengths stay compiled.
    """
    owner = step.__self__  # type: ignore[attr-defined]
    model = type(getattr(owner, "model", owner)).__name__
    return CompiledProgram(step, name=f"backbone step ({model})", device=device,
                           target=private_copy(step), variant=_block_variant)
