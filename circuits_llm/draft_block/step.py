"""The draft block's decode step for one sequence: a preallocated KV cache and a lean step, eager or
compiled.

Drafting calls the block on a few positions at a time (the round's first step: the pending pairs
and the round's pair; then one position per recursive draft). Through Hugging Face's decoder layer
and a ``DynamicCache`` each such call pays per-call work beside its matrix products: a float mask,
rotary angles, the cache's concatenation, the key/value repeat of grouped-query attention. On the
2-core CPU it was measured on, that was about half of a one-position step's 1.2 ms; on a GPU it is
host work that made the block's drafts cost 5-6x a compiled verify (docs/journal.md, section 12).

So drafting runs the same layers here over a cache of its own:

* :class:`BlockKVCache`: each layer's keys and values in one preallocated ``(1, H_kv, C, D)``
  buffer, the first :attr:`~BlockKVCache.length` slots held, the rest stale and never attended; a
  rollback is a length reset; the rotary angles of every slot are computed once per capacity
  ``C`` (by the block's own rotary module, so they are the very values its forward uses); the
  capacity doubles when a call needs more.
* :class:`BlockStep`: the block's layers called through their own submodules (norms, projections,
  MLP: biases and activations as configured) with the attention written out: new keys and values
  written into their slots, grouped-query heads attended as groups of query rows (no repeated
  keys), one scaled-dot-product call. Eager, a call attends to the held slots only. Compiled
  (:meth:`BlockStep.compile`), every shape is fixed: a one-position step, and a first step of a
  fixed number of rows (longer runs go in chunks of it, the last one padded), each attending to
  all ``C`` slots under the mask ``slot <= position``. Padding rows write stale slots past the
  real ones, which the next call overwrites before any real query can attend to them (the
  argument of the backbone's static cache, :mod:`circuits_llm.backbone._static`). A program the
  compiler refuses runs eager (:class:`~circuits_llm.runtime.compiling.CompiledProgram`).

The step computes exactly what :meth:`~circuits_llm.draft_block.block.DraftBlock.forward` computes
on the same positions, up to float rounding (``tests/test_block_step.py`` checks it in float64
against the Hugging Face layers, eager and compiled, with biases, grouped heads, an explicit head
size and scaled rotary angles). Training keeps the Hugging Face path. A batch of sequences runs
through :meth:`BlockStep.batch`: the rows' new positions through the row-wise layers together,
each row's attention over its own cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor
from torch.nn import functional
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from circuits_llm.draft_block.block import DraftBlock, DraftBlockError
from circuits_llm.runtime.compiling import CompiledProgram, Compiler, private_copy

__all__ = ["BlockKVCache", "BlockStep", "BlockStepMode", "CachedLayer"]

#: The first capacity of a :class:`BlockKVCache` (slots; it doubles when a call needs more).
INITIAL_CAPACITY = 256


class BlockStepMode(Enum):
    """When a drafter runs the block's calls compiled (:meth:`BlockStep.compile`).

    ``AUTO`` (default): when its round programs are compiled and the block is on a GPU, where
    graphs remove the host work that dominates a one-position call; eager elsewhere (on the CPU it
    was measured on, the compiled step was no faster than the eager one: attending to every slot
    and the compiled call's guards cost what fusion saves; ``benchmarks/block_step_bench.py``).
    ``COMPILED``: whenever its round programs are compiled. ``EAGER``: never.
    """

    AUTO = "auto"
    COMPILED = "compiled"
    EAGER = "eager"

    def compiles(self, device: torch.device) -> bool:
        """Whether a drafter whose round programs compile runs compiled block calls on
        ``device``."""
        return self is BlockStepMode.COMPILED or (self is BlockStepMode.AUTO
                                                  and device.type == "cuda")


@dataclass(frozen=True)
class CachedLayer:
    """One layer's held entries (views of the cache's buffers).

    Attributes:
        keys: (1, H_kv, P, D) the keys of the ``P`` held positions.
        values: (1, H_kv, P, D) their values.
    """

    keys: Tensor
    values: Tensor


class BlockKVCache:
    """One sequence's KV cache for a draft block's layers, preallocated (see the module doc).

    Args:
        block: the draft block whose layers it serves (shapes, dtype, device, rotary angles).
        capacity: slots to allocate now (it grows by doubling when a call needs more).

    Attributes:
        length: the held positions (slots ``0 .. length - 1``).
        keys, values: per layer, (1, H_kv, C, D) buffers.
        cos, sin: (C, D) the rotary angles of every slot.
    """

    def __init__(self, block: DraftBlock, capacity: int = INITIAL_CAPACITY) -> None:
        config = block.config
        self.kv_heads: int = config.num_key_value_heads
        self.head_size: int = block.layers[0].self_attn.head_dim
        self.dtype, self.device = block.dtype, block.device
        self._block_rotary = block.rotary
        self._layers = len(block.layers)
        self.length = 0
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self._allocate(max(1, int(capacity)))

    @property
    def capacity(self) -> int:
        """``C``: the allocated slots."""
        return self.keys[0].shape[2]

    def _allocate(self, capacity: int) -> None:
        """Buffers of ``capacity`` slots holding the current entries, and their rotary angles."""
        shape = (1, self.kv_heads, capacity, self.head_size)
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                for _ in range(self._layers)]
        values = [torch.zeros_like(keys[0]) for _ in range(self._layers)]
        for new, old in zip(keys + values, self.keys + self.values, strict=False):
            new[:, :, :self.length] = old[:, :, :self.length]
        for buffer in keys + values:  # fixed addresses: a CUDA graph writes them in place
            torch._dynamo.mark_static_address(buffer)
        self.keys, self.values = keys, values
        slots = torch.arange(capacity, device=self.device)
        with torch.no_grad():
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self._block_rotary(probe, slots[None])
        self.cos, self.sin = cos[0], sin[0]
        self.slots = slots

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` slots (doubling the capacity until it fits)."""
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        if capacity != self.capacity:
            self._allocate(capacity)

    def get_seq_length(self) -> int:
        """The held positions (the name ``transformers`` caches use)."""
        return self.length

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (a rollback: the slots after them turn stale)."""
        if not 0 <= length <= self.length:
            raise DraftBlockError(f"cannot keep {length} of {self.length} cached positions")
        self.length = length

    @property
    def layers(self) -> tuple[CachedLayer, ...]:
        """Each layer's held keys and values, (1, H_kv, length, D) views."""
        return tuple(CachedLayer(k[:, :, :self.length], v[:, :, :self.length])
                     for k, v in zip(self.keys, self.values, strict=True))


def _fresh(tensor: Tensor) -> Tensor:
    """A copy of ``tensor`` with the canonical strides of its shape: a compiled program guards on
    its inputs' strides, and the slices drafting passes (a chunk of a longer run, the last row of
    an earlier output) have others, which would compile the program again for each."""
    return tensor.new_empty(tensor.shape).copy_(tensor)


class BlockStep:
    """The block's layers over a :class:`BlockKVCache`, eager or compiled (see the module doc).

    Args:
        block: the draft block (its weights are read at every call, never copied).
    """

    def __init__(self, block: DraftBlock) -> None:
        if not isinstance(block, DraftBlock):
            raise DraftBlockError(f"a BlockStep runs a DraftBlock, got {type(block).__name__}")
        self.block = block
        self.heads: int = block.config.num_attention_heads
        self._compiled: CompiledProgram[Tensor] | None = None
        self.rows: int = 1

    def new_cache(self, capacity: int = INITIAL_CAPACITY) -> BlockKVCache:
        """An empty cache for one sequence."""
        return BlockKVCache(self.block, capacity)

    @property
    def compiled(self) -> bool:
        """Whether calls run the compiled program."""
        return self._compiled is not None

    def compile(self, rows: int, compiler: Compiler | None = None) -> None:
        """Run calls compiled from now on: one-position steps and chunks of ``rows`` positions
        (the round's first step: its pending pairs and its own; ``rows >= 1``), through
        ``compiler`` (``None``: the current one, CUDA graphs on CUDA)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise DraftBlockError(f"rows must be an int >= 1, got {rows!r}")
        self.rows = rows
        if self._compiled is None:
            self._compiled = CompiledProgram(
                self._fixed_call, name="draft block step",
                device=self.block.device, compiler=compiler,
                target=private_copy(self._fixed_call),
                variant=lambda hidden, *rest: f"{hidden.shape[1]} rows, capacity "
                                              f"{rest[2][0].shape[2]}")

    def __call__(self, cache: BlockKVCache, hidden: Tensor, tokens: Tensor) -> Tensor:
        """Append ``m`` positions to ``cache``, causally: ``hidden`` (1, m, d) their features,
        ``tokens`` (1, m) long the token each reads -> (1, m, d) the block's outputs (before the
        final norm); the cache then holds ``length + m`` positions."""
        m = hidden.shape[1]
        if hidden.dim() != 3 or hidden.shape[0] != 1 or tokens.shape != (1, m) or m < 1:
            raise DraftBlockError(f"a block step takes hidden (1, m, d) and tokens (1, m) with "
                                  f"m >= 1, got {tuple(hidden.shape)} and {tuple(tokens.shape)}")
        with torch.no_grad():
            if self._compiled is None:
                cache.reserve(cache.length + m)
                output = self._call(cache.keys, cache.values, cache.cos, cache.sin, cache.slots,
                                    hidden, tokens, cache.length, cache.length + m)
            else:
                output = self._chunked(cache, hidden, tokens)
        cache.length += m
        return output

    def _chunked(self, cache: BlockKVCache, hidden: Tensor, tokens: Tensor) -> Tensor:
        """The compiled program on fixed shapes: one row, or chunks of :attr:`rows` (padded)."""
        assert self._compiled is not None
        m = hidden.shape[1]
        size = 1 if m == 1 else self.rows
        padded = -(-m // size) * size
        cache.reserve(cache.length + padded)
        if padded != m:  # padding rows: copies of the last row, written to stale slots
            hidden = torch.cat([hidden, hidden[:, -1:].expand(-1, padded - m, -1)], 1)
            tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, padded - m)], 1)
        outputs = []
        for start in range(0, padded, size):
            positions = torch.arange(cache.length + start, cache.length + start + size,
                                     device=cache.device)
            outputs.append(self._compiled(_fresh(hidden[:, start:start + size]),
                                          _fresh(tokens[:, start:start + size]), positions,
                                          cache.keys, cache.values, cache.cos, cache.sin,
                                          cache.slots))
        return torch.cat(outputs, 1)[:, :m]

    def _fixed_call(self, hidden: Tensor, tokens: Tensor, positions: Tensor, keys: list[Tensor],
                    values: list[Tensor], cos: Tensor, sin: Tensor, slots: Tensor) -> Tensor:
        """The compiled program: ``hidden`` (1, r, d), ``tokens`` (1, r) at ``positions`` (r,),
        attending to all ``C`` slots under ``slot <= position`` -> (1, r, d)."""
        angles = cos.index_select(0, positions)[None], sin.index_select(0, positions)[None]
        allowed = slots[None, :] <= positions[:, None]  # (r, C)
        return self._layers(hidden, tokens, positions, angles, keys, values, allowed, None)

    def _call(self, keys: list[Tensor], values: list[Tensor], cos: Tensor, sin: Tensor,
              slots: Tensor, hidden: Tensor, tokens: Tensor, start: int, end: int) -> Tensor:
        """The eager call: positions ``start .. end - 1`` attending to the held slots only."""
        positions = slots[start:end]
        angles = cos[start:end][None], sin[start:end][None]
        allowed = None if end - start == 1 else slots[None, :end] <= positions[:, None]
        return self._layers(hidden, tokens, positions, angles, keys, values, allowed, end)

    def _layers(self, hidden: Tensor, tokens: Tensor, positions: Tensor,
                angles: tuple[Tensor, Tensor], keys: list[Tensor], values: list[Tensor],
                allowed: Tensor | None, held: int | None) -> Tensor:
        """The fused input through every layer (:meth:`_layer`), attending to the first ``held``
        slots (``None``: all ``C``)."""
        x = self.block.fused_input(hidden, tokens)
        for layer, k, v in zip(self.block.layers, keys, values, strict=True):
            x = self._layer(layer, x, angles, k, v, positions, allowed, held)
        return x

    def _layer(self, layer: torch.nn.Module, x: Tensor, angles: tuple[Tensor, Tensor],
               keys: Tensor, values: Tensor, positions: Tensor, allowed: Tensor | None,
               held: int | None) -> Tensor:
        """One decoder layer on ``x`` (1, r, d) at ``positions`` (r,): its new keys and values
        written to their slots of ``keys``/``values`` (1, H_kv, C, D), then attention over the
        first ``S = held`` slots (``None``: all ``C``) under ``allowed`` (r, S) bool (``None``:
        everything)."""
        query, key, value = self._project(layer, x, angles)
        attended = self._attend(layer.self_attn, query, key, value, keys, values, positions,
                                allowed, held)
        return self._finish(layer, x, attended)

    def _project(self, layer: torch.nn.Module, x: Tensor, angles: tuple[Tensor, Tensor]
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """``x`` (1, r, d) -> its rotated queries (1, H, r, D), rotated keys and values
        (1, H_kv, r, D)."""
        attention = layer.self_attn
        rows, size = x.shape[1], attention.head_dim
        normed = layer.input_layernorm(x)
        query = attention.q_proj(normed).view(1, rows, self.heads, size).transpose(1, 2)
        key = attention.k_proj(normed).view(1, rows, -1, size).transpose(1, 2)
        value = attention.v_proj(normed).view(1, rows, -1, size).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *angles)
        return query, key, value

    def _attend(self, attention: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                keys: Tensor, values: Tensor, positions: Tensor, allowed: Tensor | None,
                held: int | None) -> Tensor:
        """One sequence's attention: ``key``/``value`` (1, H_kv, r, D) written to the slots
        ``positions`` (r,) of ``keys``/``values`` (1, H_kv, C, D), then ``query`` (1, H, r, D)
        over the first ``held`` slots (``None``: all) under ``allowed`` -> (1, r, H * D)."""
        rows, size = query.shape[2], query.shape[3]
        groups = self.heads // keys.shape[1]
        keys.index_copy_(2, positions, key)
        values.index_copy_(2, positions, value)
        # the query heads of one key head as one group of rows: (1, H_kv, groups * r, D)
        grouped = query.reshape(1, keys.shape[1], groups * rows, size)
        mask = None if allowed is None else allowed.repeat(groups, 1)
        attended_keys = keys if held is None else keys[:, :, :held]
        attended_values = values if held is None else values[:, :, :held]
        attended = functional.scaled_dot_product_attention(
            grouped, attended_keys, attended_values, attn_mask=mask, scale=attention.scaling)
        return attended.reshape(1, self.heads, rows, size).transpose(1, 2).reshape(
            1, rows, self.heads * size)

    @staticmethod
    def _finish(layer: torch.nn.Module, x: Tensor, attended: Tensor) -> Tensor:
        """The layer's output projection and MLP, both residual: (1, r, d) -> (1, r, d)."""
        x = x + layer.self_attn.o_proj(attended)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    # ------------------------------------------------------------------ many sequences at once
    def batch(self, caches: Sequence[BlockKVCache], hidden: Sequence[Tensor],
             tokens: Sequence[Tensor]) -> Tensor:
        """Append row ``b``'s ``m_b`` positions to its own ``caches[b]``, every row in one call
        (eager): ``hidden[b]`` (m_b, d) their features, ``tokens[b]`` (m_b,) long -> (B, d) each
        row's output at its last new position.

        A batch of sequences with caches of different lengths (a batch's rows,
        :mod:`~circuits_llm.draft_block.batch`): the rows' new positions are concatenated, not
        padded, so the fusion, projections, norms and MLP run once on ``sum m_b`` rows; each
        row's attention runs on its own cache exactly as :meth:`__call__` runs it for that row
        alone (its own positions, rotary angles and causal mask). So a row's outputs differ from
        its own call's only by the rounding of a linear kernel given more rows."""
        counts = [int(t.numel()) for t in tokens]
        if not caches or len(hidden) != len(caches) or len(tokens) != len(caches) \
                or min(counts) < 1:
            raise DraftBlockError(f"a batch call takes one cache, (m, d) features and (m,) tokens "
                                  f"per row, m >= 1; got {len(caches)} caches, {len(hidden)} "
                                  f"features and token counts {counts}")
        starts = [cache.length for cache in caches]
        for cache, start, m in zip(caches, starts, counts, strict=True):
            cache.reserve(start + m)
        spans = [(cache.slots[start:start + m], None if m == 1 else
                  cache.slots[None, :start + m] <= cache.slots[start:start + m, None])
                 for cache, start, m in zip(caches, starts, counts, strict=True)]
        with torch.no_grad():
            angles = (torch.cat([c.cos[s:s + m] for c, s, m in zip(caches, starts, counts,
                                                                     strict=True)])[None],
                      torch.cat([c.sin[s:s + m] for c, s, m in zip(caches, starts, counts,
                                                                     strict=True)])[None])
            x = self.block.fused_input(torch.cat(list(hidden))[None].to(self.block.dtype),
                                       torch.cat(list(tokens))[None])
            offsets = [0, *itertools.accumulate(counts)]
            for index, layer in enumerate(self.block.layers):
                query, key, value = self._project(layer, x, angles)
                attended = torch.cat([
                    self._attend(layer.self_attn, query[:, :, lo:hi], key[:, :, lo:hi],
                                 value[:, :, lo:hi], cache.keys[index], cache.values[index],
                                 positions, allowed, start + hi - lo)
                    for cache, (positions, allowed), start, lo, hi
                    in zip(caches, spans, starts, offsets[:-1], offsets[1:], strict=True)], 1)
                x = self._finish(layer, x, attended)
        for cache, m in zip(caches, counts, strict=True):
            cache.length += m
        return x[0, torch.tensor(offsets[1:], device=x.device) - 1]
