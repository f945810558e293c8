"""``HFBackbone``: any ``transformers`` causal LM as a :class:`~circuits_llm.protocols.Backbone`.

Self-drafting (MTPC paper, Sec. 3.3-3.4 and App. D): the verifier is the frozen LM; the draft head
reads either the verifier's final hidden state (``lora_layers=0``) or the output of a *draft
branch* made of the last ``k`` decoder layers with LoRA adapters. The first ``N-k`` layers are
shared and run once per call: forward pre-hooks on the last ``k`` verifier layers record the
hidden state entering layer ``N-k`` and the exact arguments each of those layers receives
(attention mask, position embeddings, position ids, ...). The draft copies of those layers are
then called with the same arguments, their own KV cache substituted for the verifier's, and the
result goes through the model's final norm.

The draft copies share the frozen base weights with the verifier (no extra weight memory); only
the LoRA matrices (peft, ``lora_B`` initialised to zero) are new and trainable.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from circuits.errors import InvalidInputError
from circuits_llm.backbone._adapter_io import load_adapter_into, save_adapter_from
from circuits_llm.backbone._arch import (
    FINAL_NORM_NAMES,
    UnsupportedModelError,
    check_cache_support,
    find_parts,
    is_conv1d_target,
    lora_target_names,
)
from circuits_llm.backbone._validate import check_attention_mask, check_int, check_tokens
from circuits_llm.models import config_fingerprint
from circuits_llm.protocols import BackboneStep


@dataclass
class _Capture:
    """What the hooks record during one verifier forward call.

    Attributes:
        layer_calls: ``(args, kwargs)`` received by each of the last ``k`` verifier layers, in order.
        head_input: (B, m, d) tensor the LM head read (the final hidden state), once it ran.
    """

    layer_calls: list[tuple[tuple, dict]] = field(default_factory=list)
    head_input: Tensor | None = None


def _share_params_deepcopy(module: nn.Module) -> nn.Module:
    """Deep-copy ``module`` but keep the very same parameter and buffer tensors (shared, not cloned)."""
    memo: dict[int, object] = {id(t): t for t in module.parameters()}
    memo.update({id(t): t for t in module.buffers()})
    return copy.deepcopy(module, memo)


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

    Attributes:
        vocab_size: V, logits per position.
        hidden_size: d, width of ``draft_hidden``.
        num_layers: N, decoder layers of the model.
        lora_layers: k.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        lora_layers: int = 0,
        lora_rank: int = 8,
        lora_alpha: float | None = None,
        lora_dropout: float = 0.0,
        lora_target_modules: list[str] | None = None,
    ) -> None:
        super().__init__()
        parts = find_parts(model)
        check_cache_support(model)
        self.num_layers = parts.num_layers
        self.lora_layers = check_int(lora_layers, "lora_layers", 0, parts.num_layers)
        self.lora_rank = check_int(lora_rank, "lora_rank", 1)
        alpha = float(lora_rank if lora_alpha is None else lora_alpha)
        if isinstance(lora_alpha, bool) or not alpha > 0:
            raise ValueError(f"lora_alpha must be a positive number, got {lora_alpha!r}")
        self.lora_alpha = alpha
        if (
            isinstance(lora_dropout, bool)
            or not isinstance(lora_dropout, int | float)
            or not 0 <= lora_dropout < 1
        ):
            raise ValueError(f"lora_dropout must be a float in [0, 1), got {lora_dropout!r}")
        self.lora_dropout = float(lora_dropout)
        self.vocab_size = parts.vocab_size
        self.hidden_size = parts.hidden_size
        self.model = model
        self._parts = parts
        if self.lora_layers > 0 and parts.final_norm is None:
            raise UnsupportedModelError(
                f"no final norm found on {type(parts.base).__name__} (looked for an attribute among "
                f"{', '.join(FINAL_NORM_NAMES)}); it is needed for lora_layers > 0"
            )
        self.draft_layers = nn.ModuleList(
            _share_params_deepcopy(layer) for layer in parts.layers[parts.num_layers - self.lora_layers :]
        )
        self.lora_target_modules: list[str] = []
        if self.lora_layers > 0:
            self._inject_lora(lora_target_modules)
        model.requires_grad_(False)  # the draft copies share these weights: frozen too
        model.eval()
        self._fingerprint = config_fingerprint(model)
        self._cache = DynamicCache()
        self._draft_cache = DynamicCache()
        self._length = 0
        self._batch = 0

    def _inject_lora(self, target_modules: list[str] | None) -> None:
        """Wrap the draft layers' linear sub-modules with peft LoRA adapters (``lora_B`` = 0)."""
        first = self.draft_layers[0]
        if target_modules is None:
            names, conv = lora_target_names(first)
        else:
            if (
                not isinstance(target_modules, list | tuple)
                or not target_modules
                or not all(isinstance(n, str) and n for n in target_modules)
            ):
                raise ValueError(
                    "lora_target_modules must be None or a non-empty list of module names, "
                    f"got {target_modules!r}"
                )
            names = sorted(set(target_modules))
            conv = is_conv1d_target(first, names)
        config = LoraConfig(
            r=self.lora_rank,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=names,
            fan_in_fan_out=conv,
            bias="none",
            init_lora_weights=True,
        )
        inject_adapter_in_model(config, self.draft_layers)
        self.lora_target_modules = names
        if not self.draft_parameters():
            raise UnsupportedModelError(f"peft created no LoRA parameters for target modules {names}")

    # ------------------------------------------------------------------ Backbone protocol

    @property
    def device(self) -> torch.device:
        """Device of the model's LM head (where inputs are moved)."""
        return next(self._parts.lm_head.parameters()).device

    @property
    def verifier_cache(self) -> DynamicCache:
        """KV cache of the verifier (all N layers; read-only use: mutate only via extend/crop/reset)."""
        return self._cache

    @property
    def draft_cache(self) -> DynamicCache:
        """KV cache of the draft branch (entries only at the last k layer indices; empty when k = 0)."""
        return self._draft_cache

    @property
    def length(self) -> int:
        """Number of tokens currently held in the caches."""
        return self._length

    def reset(self) -> None:
        """Empty every cache (start a new sequence)."""
        self._cache = DynamicCache()
        self._draft_cache = DynamicCache()
        self._length = 0
        self._batch = 0

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached positions in every cache (rollback).

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
        # transformers 5.x: Cache.crop takes minus the number of tokens to drop (a positive value raises).
        removed = self._length - length
        self._cache.crop(-removed)
        self._draft_cache.crop(-removed)
        self._length = length

    def extend(self, tokens: Tensor) -> BackboneStep:
        """Run ``tokens`` after the cached ones in one forward call and append them to the caches.

        Args:
            tokens: (B, m) token ids, m >= 1; B must match the cached batch once caches are non-empty.

        Returns:
            ``BackboneStep(verifier_logits (B, m, V), draft_hidden (B, m, d))``. The draft branch runs in
            the backbone's current mode (call :meth:`eval` to disable LoRA dropout when decoding).

        Raises:
            TypeError, InvalidInputError: bad ``tokens`` (the caches are left unchanged).
            Exception: if the forward call itself fails, the caches are emptied (:meth:`reset`) and the
                error is re-raised, since a partial update cannot be undone exactly.
        """
        tokens = check_tokens(tokens, self.vocab_size)
        if self._length > 0 and tokens.shape[0] != self._batch:
            raise InvalidInputError(
                f"tokens has batch size {tokens.shape[0]} but the caches hold batch size {self._batch}; "
                "call reset() to start a new batch"
            )
        start, m = self._length, tokens.shape[1]
        positions = torch.arange(start, start + m, device=self.device).unsqueeze(0)
        try:
            with torch.no_grad():
                with self._capturing() as cap:
                    out = self.model(
                        input_ids=tokens.to(self.device),
                        past_key_values=self._cache,
                        position_ids=positions,
                        use_cache=True,
                    )
                if out.past_key_values is not self._cache:
                    raise UnsupportedModelError(
                        f"{type(self.model).__name__} did not update the DynamicCache it was given in place"
                    )
                draft = self._draft_output(cap, self._cache, self._draft_cache)
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
        with torch.no_grad(), self._capturing() as cap:
            out = self.model(input_ids=input_ids.to(self.device), use_cache=False, **kwargs)
        draft = self._draft_output(cap, None, None)
        return out.logits, draft

    def draft_parameters(self) -> list[nn.Parameter]:
        """The trainable LoRA parameters of the draft branch (empty when ``lora_layers == 0``)."""
        return [p for name, p in self.draft_layers.named_parameters() if "lora_" in name]

    def lora_state_dict(self) -> dict[str, Tensor]:
        """Name -> tensor of every LoRA parameter of the draft branch (detached, on CPU)."""
        return {
            name: p.detach().cpu().contiguous()
            for name, p in self.draft_layers.named_parameters()
            if "lora_" in name
        }

    def adapter_metadata(self) -> dict[str, object]:
        """What a saved adapter must agree on with the backbone it is loaded into."""
        return {
            "lora_layers": self.lora_layers,
            "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "lora_target_modules": list(self.lora_target_modules),
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
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

    @contextmanager
    def _capturing(self) -> Iterator[_Capture]:
        """Record the last ``k`` layers' call arguments and the LM head input during one forward."""
        cap = _Capture()

        def layer_hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            cap.layer_calls.append((args, dict(kwargs)))

        def head_hook(_module: nn.Module, args: tuple) -> None:
            cap.head_input = args[0]

        first_draft = self.num_layers - self.lora_layers
        handles = [
            layer.register_forward_pre_hook(layer_hook, with_kwargs=True)
            for layer in self._parts.layers[first_draft:]
        ]
        handles.append(self._parts.lm_head.register_forward_pre_hook(head_hook))
        try:
            yield cap
        finally:
            for handle in handles:
                handle.remove()

    def _draft_output(
        self, cap: _Capture, verifier_cache: DynamicCache | None, draft_cache: DynamicCache | None
    ) -> Tensor:
        """(B, m, d) draft hidden state from a capture: the LM head input, or the LoRA branch output."""
        if self.lora_layers == 0:
            if cap.head_input is None:
                raise UnsupportedModelError(
                    f"the LM head {type(self._parts.lm_head).__name__} was not called by the model's forward"
                )
            return cap.head_input
        if len(cap.layer_calls) != self.lora_layers:
            raise UnsupportedModelError(
                f"expected each of the last {self.lora_layers} decoder layers to be called once per forward, "
                f"saw {len(cap.layer_calls)} calls"
            )
        first_args, first_kwargs = cap.layer_calls[0]
        hidden = first_args[0] if first_args else first_kwargs["hidden_states"]
        for layer, (args, kwargs) in zip(self.draft_layers, cap.layer_calls, strict=True):
            args, kwargs = self._swap_cache(args, kwargs, verifier_cache, draft_cache)
            if args:
                args = (hidden, *args[1:])
            else:
                kwargs["hidden_states"] = hidden
            out = layer(*args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        assert self._parts.final_norm is not None  # checked in __init__
        return self._parts.final_norm(hidden)

    @staticmethod
    def _swap_cache(
        args: tuple, kwargs: dict, verifier_cache: DynamicCache | None, draft_cache: DynamicCache | None
    ) -> tuple[tuple, dict]:
        """Replace the verifier cache object by the draft cache in a layer's call arguments."""
        if verifier_cache is None:
            return args, dict(kwargs)
        found = False

        def swap(value: object) -> object:
            nonlocal found
            if value is verifier_cache:
                found = True
                return draft_cache
            return value

        new_args = tuple(swap(a) for a in args)
        new_kwargs = {key: swap(value) for key, value in kwargs.items()}
        if not found:
            raise UnsupportedModelError(
                "the decoder layers did not receive the verifier DynamicCache as an argument, so the draft "
                "branch cannot be given its own cache"
            )
        return new_args, new_kwargs
