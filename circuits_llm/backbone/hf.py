"""``HFBackbone``: any ``transformers`` causal LM as a :class:`~circuits_llm.protocols.Backbone`.

Self-drafting (MTPC paper, Sec. 3.3-3.4 and App. D): the verifier is the frozen LM; the draft head
reads either the verifier's final hidden state (``lora_layers=0``) or the output of a *draft
branch* made of the last ``k`` decoder layers with LoRA adapters. The first ``N-k`` layers are
shared and run once per call: forward pre-hooks on the verifier's layers (``_capture.py``) record
the hidden state entering layer ``N-k`` and the exact arguments each of the last ``k`` layers
receives (attention mask, position embeddings, position ids, ...). The draft copies of those layers
are then called with the same arguments, their own KV cache substituted for the verifier's, and
the result goes through the model's final norm.

The draft copies share the frozen base weights with the verifier (no extra weight memory); only
the LoRA matrices (peft, ``lora_B`` initialised to zero) are new and trainable. How the branch is
built (which layers, which sub-modules get adapters) is ``_lora.py``'s; what a failed static or
compiled call raises is ``_step_errors.py``'s; this module holds the backbone itself: its caches,
the forward that fills them and runs the branch, and the training and adapter API.

Two caches (:class:`CacheKind`): ``transformers``' ``DynamicCache`` (cropped on rollback), or
preallocated static caches rolled back by a length reset (``_static.py``), on which ``compile=True``
runs the whole step (verifier forward and draft branch) as one compiled graph per block length.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache

from circuits.errors import InvalidInputError
from circuits_llm.backbone._adapter_io import load_adapter_into, save_adapter_from
from circuits_llm.backbone._arch import UnsupportedModelError, check_cache_support, find_parts
from circuits_llm.backbone._capture import Capture, capture_hooks, draft_output, with_layer_outputs
from circuits_llm.backbone._lora import draft_branch, lora_options, lora_parameters, lora_state
from circuits_llm.backbone._static import CacheKind, StaticCaches, compile_step, resolve_cache_options
from circuits_llm.backbone._step_errors import TOKEN_RANGE_MESSAGE, static_step_error
from circuits_llm.backbone._validate import (
    check_attention_mask,
    check_feature_layers,
    check_int,
    check_token_layout,
    check_tokens,
)
from circuits_llm.backbone.cache_slots import drop_last_positions, gather_slots
from circuits_llm.protocols import BackboneStep
from circuits_llm.text.models import config_fingerprint


class HFBackbone(nn.Module):
    """A frozen Hugging Face causal LM with KV caches and an optional LoRA draft branch.

    Args:
        model: a ``transformers`` causal LM (Llama-style, GPT-2-style, ...). It is frozen
            (``requires_grad=False``) and put in eval mode.
        lora_layers: number ``k`` of final decoder layers duplicated into the draft branch (0: the
            draft head reads the verifier's final hidden state).
        lora_rank: LoRA rank ``r``.
        lora_alpha: LoRA scaling numerator (``None``: equal to ``lora_rank``, i.e. scale 1).
        lora_dropout: dropout on the LoRA input, active only in training mode.
        lora_target_modules: names of the linear sub-modules of a decoder layer to adapt (``None``:
            every ``nn.Linear`` / GPT-2 ``Conv1D`` in the layer).
        cache: the KV cache kept (:class:`CacheKind`; ``None``: ``STATIC`` when ``compile`` else
            ``DYNAMIC``).
        compile: run :meth:`extend` calls of the lengths in ``compiled_lengths`` as one compiled
            graph (``torch.compile``, full graph, static shapes; CUDA graphs on CUDA), on the static
            cache. Other lengths (a prompt's prefill), and the first call after the caches are
            (re)allocated, run eagerly on the same cache: compiling every prompt length would cost
            a compilation per length for a call made once per sequence.
        max_cache_len: capacity of the static cache in tokens (``None``:
            :func:`~circuits_llm.backbone._static.default_max_cache_len`); an extend past it raises
            :class:`CacheCapacityError`.
        compiled_lengths: the block lengths ``m`` that run compiled (``None``: ``(1,)``, the
            autoregressive step; a speculative decoder adds its window with
            :meth:`add_compiled_length`).
        feature_layers: decoder layers whose outputs ``draft_hidden`` carries before the draft
            hidden state, ``[l_a; l_b; ...; h]`` ((n + 1) d wide): what a draft block with
            EAGLE-3's fused layers reads (its ``fused_layers``); ``()``: ``h`` alone.

    Attributes:
        vocab_size: V, logits per position.
        hidden_size: F, width of ``draft_hidden``: d, or (n + 1) d with ``n`` feature layers.
        feature_layers: as given (a tuple).
        num_layers: N, decoder layers of the model.
        lora_layers: k.
        cache_kind: the :class:`CacheKind` in use.
        compiled: whether ``compile=True``.
        max_length: capacity of the caches in tokens (``None``: unbounded, the dynamic cache).

    A compiled :meth:`extend` reads nothing back from the device (no ``.item()``, no branch on tensor
    values): positions and the attention mask come from the caches' length tensors, and token ids
    are range-checked inside the graph, so a bad id surfaces as :class:`InvalidInputError` after the
    call ran (the caches are then emptied, as for any failed call). Each batch size and length is
    one graph (and each training mode, where LoRA dropout is active); dynamo keeps
    ``torch._dynamo.config.recompile_limit`` of them per backbone, and a call that would need more
    raises (the graph is compiled whole, so dynamo never falls back to running it eagerly).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        lora_layers: int = 0,
        lora_rank: int = 8,
        lora_alpha: float | None = None,
        lora_dropout: float = 0.0,
        lora_target_modules: list[str] | None = None,
        *,
        cache: CacheKind | None = None,
        compile: bool = False,
        max_cache_len: int | None = None,
        compiled_lengths: Iterable[int] | None = None,
        feature_layers: Sequence[int] = (),
    ) -> None:
        super().__init__()
        parts = find_parts(model)
        check_cache_support(model)
        self.num_layers = parts.num_layers
        lora = lora_options(lora_layers, lora_rank, lora_alpha, lora_dropout, parts.num_layers)
        self.lora_layers, self.lora_rank = lora.layers, lora.rank
        self.lora_alpha, self.lora_dropout = lora.alpha, lora.dropout
        self.cache_kind, capacity = resolve_cache_options(model, cache, compile, max_cache_len,
                                                          compiled_lengths)
        self.feature_layers = check_feature_layers(feature_layers, parts.num_layers)
        self.vocab_size = parts.vocab_size
        self.hidden_size = parts.hidden_size * (len(self.feature_layers) + 1)
        self.model = model
        self._parts = parts
        self.draft_layers, self.lora_target_modules = draft_branch(parts, lora, lora_target_modules)
        model.requires_grad_(False)  # the draft copies share these weights: frozen too
        model.eval()
        self._fingerprint = config_fingerprint(model)
        self._cache = DynamicCache()
        self._draft_cache = DynamicCache()
        self._length = 0
        self._batch = 0
        self._static: StaticCaches | None = None
        self._hooks = capture_hooks(parts.layers, parts.lm_head)
        self._compiled_step: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None
        self._compiled_lengths: tuple[int, ...] = ()
        if self.cache_kind is CacheKind.STATIC:
            self._static = StaticCaches(parts.num_layers, capacity)
        if compile:
            self._compiled_step = compile_step(self._checked_static_step, self.device)
            for length in (1,) if compiled_lengths is None else compiled_lengths:
                self.add_compiled_length(length)

    # ------------------------------------------------------------------ Backbone protocol

    @property
    def device(self) -> torch.device:
        """Device of the model's LM head (where inputs are moved)."""
        return next(self._parts.lm_head.parameters()).device

    @property
    def verifier_cache(self) -> Cache:
        """KV cache of the verifier (all N layers; read-only use: mutate only via extend/crop/reset).

        A static cache holds ``max_cache_len`` slots per layer; only the first :attr:`length` are valid.
        """
        return self._static.verifier if self._static is not None else self._cache

    @property
    def draft_cache(self) -> Cache:
        """KV cache of the draft branch (entries only at the last k layer indices; empty when k = 0)."""
        return self._static.draft if self._static is not None else self._draft_cache

    @property
    def length(self) -> int:
        """Number of tokens currently held in the caches."""
        return self._length

    @property
    def compiled(self) -> bool:
        """Whether extends of :attr:`compiled_lengths` run as compiled graphs (``compile=True``)."""
        return self._compiled_step is not None

    @property
    def compiled_lengths(self) -> tuple[int, ...]:
        """The block lengths that run compiled, in increasing order (empty unless :attr:`compiled`)."""
        return self._compiled_lengths

    @property
    def max_length(self) -> int | None:
        """How many tokens the caches can hold (``None``: unbounded, the dynamic cache)."""
        return self._static.max_cache_len if self._static is not None else None

    def add_compiled_length(self, length: int) -> None:
        """Run extends of ``length`` tokens compiled too (e.g. a speculative decoder's window).

        The graph is built on the first such call (seconds to a minute on a CPU), not here.

        Raises:
            ValueError: if the backbone is not compiled, or ``length`` is not in ``[1, max_cache_len]``.
            TypeError: if ``length`` is not an int.
        """
        if self._static is None or self._compiled_step is None:
            raise ValueError("add_compiled_length needs a compiled backbone: HFBackbone(..., compile=True)")
        check_int(length, "compiled length", 1, self._static.max_cache_len)
        self._compiled_lengths = tuple(sorted({*self._compiled_lengths, length}))

    def reset(self) -> None:
        """Empty every cache (start a new sequence).

        A static cache keeps its tensors (a length reset), so the next sequence of the same batch
        size reuses the compiled graphs.
        """
        if self._static is not None:
            self._static.set_length(0)
        else:
            self._cache = DynamicCache()
            self._draft_cache = DynamicCache()
        self._length = 0
        self._batch = 0

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached positions in every cache (rollback).

        On a static cache this sets the valid length (two small device ops, no host read); the
        slots beyond it are masked out and overwritten by later extends.

        Raises:
            TypeError: if ``length`` is not an int.
            ValueError: if ``length`` is negative or larger than :attr:`length`.
        """
        check_int(length, "length", 0, self._length)
        if length == self._length:
            return
        if length == 0:
            self.reset()
            return
        if self._static is not None:
            self._static.set_length(length)
        else:
            removed = self._length - length
            drop_last_positions(self._cache, removed)
            drop_last_positions(self._draft_cache, removed)
        self._length = length

    def extend(self, tokens: Tensor) -> BackboneStep:
        """Run ``tokens`` after the cached ones in one forward call and append them to the caches.

        Args:
            tokens: (B, m) token ids, m >= 1; B must match the cached batch once caches are non-empty.

        Returns:
            ``BackboneStep(verifier_logits (B, m, V), draft_hidden (B, m, d))``. The draft branch runs in
            the backbone's current mode (call :meth:`eval` to disable LoRA dropout when decoding).

        Raises:
            TypeError, InvalidInputError: bad ``tokens`` (the caches are left unchanged, except for an
                id out of range in a compiled call: see the class docstring).
            CacheCapacityError: a static cache cannot hold ``length + m`` tokens (caches unchanged).
            Exception: if the forward call itself fails, the caches are emptied (:meth:`reset`) and the
                error is re-raised, since a partial update cannot be undone exactly.
        """
        use_graph = False
        if self._compiled_step is not None:
            tokens = check_token_layout(tokens)
            use_graph = tokens.shape[1] in self._compiled_lengths
        if not use_graph:
            tokens = check_tokens(tokens, self.vocab_size)
        if self._length > 0 and tokens.shape[0] != self._batch:
            raise InvalidInputError(
                f"tokens has batch size {tokens.shape[0]} but the caches hold batch size {self._batch}; "
                "call reset() to start a new batch"
            )
        if self._static is None:
            return self._extend_dynamic(tokens)
        return self._extend_static(tokens, use_graph)

    def extend_rows(self, tokens: Tensor, attention_mask: Tensor, position_ids: Tensor) -> BackboneStep:
        """:meth:`extend` for a batch whose rows hold different numbers of tokens (the dynamic cache).

        The caches' slots are physical: slot ``j`` of every row sits at the same index, and a row's
        tokens need not fill them (left padding, or holes left by a rollback of that row alone).
        What each row attends to is given by ``attention_mask``, and where its new tokens sit in its
        own sequence by ``position_ids`` (:mod:`~circuits_llm.backbone.ragged_cache` keeps both).

        Args:
            tokens: (B, m) token ids appended to every row (slots ``length .. length + m - 1``).
            attention_mask: (B, length + m) 0/1: the slots each row's new tokens may attend to
                (its own tokens), the ``m`` new slots included.
            position_ids: (B, m) long: each new token's position in its row's own sequence.

        Raises:
            UnsupportedModelError: the backbone keeps a static cache (per-row layouts need the
                dynamic one).
            InvalidInputError: bad tokens, or a batch size other than the cached one.
        """
        if self._static is not None:
            raise UnsupportedModelError(
                "rows of different lengths need the dynamic KV cache: build the HFBackbone without "
                "compile=True and with cache=CacheKind.DYNAMIC to decode a batch of prompts")
        tokens = check_tokens(tokens, self.vocab_size)
        if self._length > 0 and tokens.shape[0] != self._batch:
            raise InvalidInputError(
                f"tokens has batch size {tokens.shape[0]} but the caches hold batch size {self._batch}")
        return self._extend_dynamic(tokens, attention_mask.to(self.device), position_ids.to(self.device))

    def gather_slots(self, rows: Tensor, slots: Tensor) -> None:
        """Rebuild both dynamic caches from some of their slots: new row ``b`` holds, in its slot
        ``j``, what old row ``rows[b]`` held in slot ``slots[b, j]`` (every layer, keys and values).

        How a batch drops finished rows and closes the holes rollbacks left
        (:class:`~circuits_llm.backbone.ragged_cache.RaggedCache`); one copy of what is kept.

        Args:
            rows: (B',) long, old row indices.
            slots: (B', P') long, old slot indices (``0 <= slots < length``).
        """
        if self._static is not None:
            raise UnsupportedModelError("gather_slots needs the dynamic KV cache")
        rows, slots = rows.to(self.device), slots.to(self.device)
        for cache in (self._cache, self._draft_cache):
            gather_slots(cache, rows, slots)
        self._batch = int(rows.shape[0])
        self._length = int(slots.shape[1])

    def _extend_dynamic(self, tokens: Tensor, attention_mask: Tensor | None = None,
                        position_ids: Tensor | None = None) -> BackboneStep:
        start, m = self._length, tokens.shape[1]
        positions = position_ids if position_ids is not None else \
            torch.arange(start, start + m, device=self.device).unsqueeze(0)
        masks = {} if attention_mask is None else {"attention_mask": attention_mask}
        try:
            with torch.no_grad():
                out, cap = self._recorded(
                    input_ids=tokens.to(self.device),
                    past_key_values=self._cache,
                    position_ids=positions,
                    use_cache=True,
                    **masks,
                )
                if out.past_key_values is not self._cache:
                    raise UnsupportedModelError(
                        f"{type(self.model).__name__} did not update the DynamicCache it was given in place"
                    )
                draft = self._draft(cap, self._cache, self._draft_cache)
            if self._cache.get_seq_length() != start + m:
                raise UnsupportedModelError(
                    f"the verifier cache holds {self._cache.get_seq_length()} tokens after extend, "
                    f"expected {start + m}"
                )
        except BaseException:
            # Some layers may have appended to their cache and others not: the caches are no longer
            # consistent, so start over rather than leave a silently corrupted state behind.
            self.reset()
            raise
        self._batch = tokens.shape[0]
        self._length = start + m
        return BackboneStep(verifier_logits=out.logits, draft_hidden=draft)

    def _extend_static(self, tokens: Tensor, use_graph: bool) -> BackboneStep:
        """Extend on the static caches: the compiled graph when ``use_graph`` and the caches exist,
        else an eager call of the same step (which allocates the caches on a first call)."""
        static = self._static
        assert static is not None
        batch, m = tokens.shape
        start = self._length
        static.check_capacity(start, m)
        if start == 0:
            static.prepare(batch)
        use_graph = use_graph and static.allocated
        tokens = tokens.to(self.device)
        try:
            # The caches are updated in place, so they must not become inference tensors when a
            # caller runs under torch.inference_mode; one grad mode also means one set of graphs.
            with torch.inference_mode(False), torch.no_grad():
                if use_graph:
                    assert self._compiled_step is not None
                    if tokens.is_inference():  # made under inference_mode: would need graphs of its own
                        tokens = tokens.clone()
                    # copied out by the compiled step itself when they live in CUDA-graph memory
                    logits, draft = self._compiled_step(tokens.contiguous())
                else:
                    logits, draft = self._static_step(tokens)
        except BaseException as error:
            # Some layers may have written their slots and advanced their length and others not.
            static.discard()
            self._length, self._batch = 0, 0
            clearer = static_step_error(error, type(self.model).__name__, self.lora_layers,
                                        self.vocab_size, batch, m, use_graph)
            if clearer is None:
                raise
            raise clearer from error
        self._batch = batch
        self._length = start + m
        return BackboneStep(verifier_logits=logits, draft_hidden=draft)

    # ------------------------------------------------------------------ training API

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Full-sequence forward without caches (for training draft heads and LoRA).

        The caches are left untouched. Only ``draft_hidden`` carries gradients, and only with respect
        to :meth:`draft_parameters` (and only when ``lora_layers > 0``).

        Args:
            input_ids: (B, T) token ids.
            attention_mask: optional (B, T) 0/1 padding mask (use right padding).

        Returns:
            ``(verifier_logits (B, T, V), draft_hidden (B, T, d))``.
        """
        input_ids = check_tokens(input_ids, self.vocab_size, "input_ids")
        kwargs: dict[str, Tensor] = {}
        if attention_mask is not None:
            mask = check_attention_mask(attention_mask, tuple(input_ids.shape))
            kwargs["attention_mask"] = mask.to(self.device)
        with torch.no_grad():
            out, cap = self._recorded(input_ids=input_ids.to(self.device), use_cache=False, **kwargs)
        draft = self._draft(cap, None, None)
        return out.logits, draft

    def draft_parameters(self) -> list[nn.Parameter]:
        """The trainable LoRA parameters of the draft branch (empty when ``lora_layers == 0``)."""
        return lora_parameters(self.draft_layers)

    def lora_state_dict(self) -> dict[str, Tensor]:
        """Name -> tensor of every LoRA parameter of the draft branch (detached, on CPU)."""
        return lora_state(self.draft_layers)

    def adapter_metadata(self) -> dict[str, object]:
        """What a saved adapter must agree on with the backbone it is loaded into."""
        return {
            "lora_layers": self.lora_layers,
            "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "lora_target_modules": list(self.lora_target_modules),
            "num_layers": self.num_layers,
            "hidden_size": self._parts.hidden_size,
            "vocab_size": self.vocab_size,
            "model_type": str(getattr(self.model.config, "model_type", "")),
            "config_fingerprint": self._fingerprint,
        }

    def save_adapter(self, directory: str | Path) -> Path:
        """Write the LoRA weights (``adapter.safetensors``) and metadata (``adapter.json``) atomically.

        Returns:
            the directory written to.
        """
        return save_adapter_from(self, Path(directory))

    def load_adapter(self, directory: str | Path) -> None:
        """Load LoRA weights saved by :meth:`save_adapter` (clear error on any mismatch)."""
        load_adapter_into(self, Path(directory))

    def train(self, mode: bool = True) -> HFBackbone:
        """Set the draft branch's training mode (LoRA dropout); the frozen model always stays in eval."""
        if not isinstance(mode, bool):
            raise TypeError(f"mode must be a bool, got {type(mode).__name__}")
        self.training = mode
        self.draft_layers.train(mode)
        self.model.eval()
        return self

    # ------------------------------------------------------------------ internals

    def _recorded(self, **model_kwargs: object) -> tuple[Any, Capture]:
        """``self.model(**model_kwargs)`` with its layer calls and LM head input recorded."""
        cap = self._hooks.start()
        try:
            out = self.model(**model_kwargs)
        finally:
            self._hooks.stop()
        return out, cap

    def _draft(self, cap: Capture, verifier_cache: Cache | None, draft_cache: Cache | None) -> Tensor:
        """(B, m, F) draft hidden state of a recorded forward (see :func:`draft_output`), after
        the outputs of the :attr:`feature_layers` when there are some."""
        draft = draft_output(cap, self.num_layers, self.draft_layers, self._parts.final_norm,
                             self._parts.lm_head, verifier_cache, draft_cache)
        return with_layer_outputs(cap, self.feature_layers, draft)

    def _static_step(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """One forward of ``tokens`` (B, m) on the static caches -> (logits (B, m, V), draft (B, m, d)).

        Reads no tensor value on the host: traced whole by ``torch.compile``.
        """
        static = self._static
        assert static is not None
        positions = static.positions(tokens.shape[1], tokens.device)
        out, cap = self._recorded(input_ids=tokens, past_key_values=static.verifier, position_ids=positions,
                                  use_cache=True)
        return out.logits, self._draft(cap, static.verifier, static.draft)

    def _checked_static_step(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`_static_step` after an id range check that stays on the device (the compiled step)."""
        torch._assert_async(((tokens >= 0) & (tokens < self.vocab_size)).all(), TOKEN_RANGE_MESSAGE)
        return self._static_step(tokens)
