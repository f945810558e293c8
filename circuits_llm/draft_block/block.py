"""The draft block: a decoder layer of the target's own shape that reads the context (FastMTP's MTP
module; DeepSeek-V3's ``M[rms(h); rms(E(x))]``, a transformer block, the shared LM head).

At position ``j`` the block reads a feature ``h_j`` (the backbone's draft hidden state after
``x_j``, or the block's own earlier output when it drafts recursively) and the token after it,
``x_{j+1}``, fuses them as ``W [rms(h_j); rms(E[x_{j+1}])]`` (2d -> d, ``E`` the target's frozen,
shared token embedding), runs ``L`` decoder layers with causal attention over its own KV cache of
earlier positions, and gives the law of ``x_{j+2}`` through the target's final norm and LM head,
restricted to a compressed draft vocabulary when it has one (:mod:`circuits_llm.heads.vocab`).

EAGLE-3's fused features (``fused_layers``): the block may read, besides ``h_j``, the outputs of
some of the target's own layers at ``j`` (a low, a middle and a high one), which the verify
forward computes anyway (:class:`~circuits_llm.backbone.HFBackbone`'s ``feature_layers``). The
backbone then hands it features ``[l_a; l_b; ...; h_j]`` ((n + 1) d wide, :attr:`feature_size`),
and :meth:`DraftBlock.read_features` turns them into the ``h_j`` the block reads as
``h_j + G [rms(l_a); rms(l_b); ...]`` with ``G`` (n d -> d) zero at the start, so a block with
fused layers starts exactly where the same block without them stands (a trained block can be
continued with them). Only verified positions have layer outputs; the recursion's later steps read
the block's own outputs, as in EAGLE-3.

Initialisation (:class:`BlockInit`) starts where a token map starts: the fusion's feature half is
the identity and its token half zero, and every layer's output projections (``o_proj``,
``down_proj``) are zero, so a fresh block is the identity on ``rms(h_j)`` and its law is the
target's own law at ``j`` (through the final norm, which ignores scale). Training moves it from
there. The layers are Hugging Face ``LlamaDecoderLayer``: the target's own config for Llama models,
else a Llama-shaped (pre-norm, RoPE, gated MLP) layer of the target's width and head count.

The target's parts are held by reference, not registered: the block's ``parameters()`` and
``state_dict()`` are its own (fusion, norms, layers), and the target stays frozen.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor, nn
from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from circuits_llm.backbone._arch import find_parts
from circuits_llm.backbone._validate import check_feature_layers
from circuits_llm.heads.config import HeadConfigError
from circuits_llm.heads.vocab import check_draft_tokens

__all__ = ["BlockInit", "DraftBlock", "DraftBlockError", "LayerFusion", "check_pairs"]


class DraftBlockError(ValueError):
    """A draft block cannot be built or run as asked (the message says what was wrong)."""


class BlockInit(Enum):
    """What the block's layers start from (either way the output projections are zero, so the
    block starts as the identity on its fused input).

    ``IDENTITY``: a fresh layer (Hugging Face's initialisation). ``LAST_LAYER``: a copy of the
    target's last decoder layer (Llama-family targets only).
    """

    IDENTITY = "identity"
    LAST_LAYER = "last_layer"


@dataclass(frozen=True)
class TargetParts:
    """The target's frozen parts the block shares (held by reference, never trained).

    Attributes:
        embedding: the token embedding ``E`` (V -> d).
        final_norm: what the target applies before its LM head (``None``: nothing).
        lm_head: the LM head, a module with ``weight`` (V, d) and maybe ``bias`` (V,).
    """

    embedding: nn.Module
    final_norm: nn.Module | None
    lm_head: nn.Module


def check_pairs(hidden: Tensor, tokens: Tensor, size: int, device: torch.device
                ) -> tuple[Tensor, Tensor]:
    """One sequence's new pairs for a block's cache, checked: ``hidden`` (1, m, ``size``) the
    features and ``tokens`` (m,) integer ids, the token after each -> both on ``device`` (the
    tokens long): what a block's cache takes (``BlockCacheFollower``, a batch's block rows).
    Raises :class:`DraftBlockError` naming the wrong shape."""
    if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[2] != size:
        raise DraftBlockError(f"features must be (1, m, {size}), got {tuple(hidden.shape)}")
    if tokens.dim() != 1 or tokens.shape[0] != hidden.shape[1] or tokens.is_floating_point():
        raise DraftBlockError(f"tokens must be ({hidden.shape[1]},) integer ids (one per "
                              f"feature), got {tuple(tokens.shape)} {tokens.dtype}")
    return hidden.to(device), tokens.to(device, torch.long)


class LayerFusion(nn.Module):
    """EAGLE-3's fusion, as a residual that starts as nothing: ``[l_1; ...; l_n; h]`` (..., (n + 1)
    d) -> ``h + G [rms(l_1); ...; rms(l_n)]`` (..., d), ``G`` zero at the start.

    Args:
        width: d.
        count: n, the fused layers.
        eps: the norms' epsilon.
    """

    def __init__(self, width: int, count: int, eps: float) -> None:
        super().__init__()
        self.width, self.count = width, count
        self.norms = nn.ModuleList(LlamaRMSNorm(width, eps=eps) for _ in range(count))
        self.project = nn.Linear(count * width, width, bias=False)
        with torch.no_grad():
            self.project.weight.zero_()

    def forward(self, features: Tensor) -> Tensor:
        d = self.width
        layers = features[..., :-d]
        normed = [norm(layers[..., i * d:(i + 1) * d]) for i, norm in enumerate(self.norms)]
        return features[..., -d:] + self.project(torch.cat(normed, -1))


def _layer_config(config: PretrainedConfig, layers: int) -> LlamaConfig:
    """The block's Llama config: the target's own for a Llama model, else a Llama-shaped one of
    its width, head count and MLP width; ``layers`` layers, SDPA attention with the block's own
    mask (eager attention's float32 softmax would make a cached step and a prefill differ by
    ~1e-8 even in float64)."""
    if isinstance(config, LlamaConfig):
        result = copy.deepcopy(config)
    else:
        hidden = config.hidden_size
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
        if not isinstance(heads, int) or heads < 1 or hidden % heads:
            raise DraftBlockError(f"cannot read a head count dividing hidden_size {hidden} from "
                                  f"the {type(config).__name__}")
        inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
        result = LlamaConfig(hidden_size=hidden, num_attention_heads=heads,
                             num_key_value_heads=getattr(config, "num_key_value_heads", heads),
                             intermediate_size=inner or 4 * hidden,
                             max_position_embeddings=getattr(config, "max_position_embeddings",
                                                             None) or 4096,
                             rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6))
    result.num_hidden_layers = layers
    result._attn_implementation = "sdpa"
    return result


class DraftBlock(nn.Module):
    """``L`` decoder layers over ``W [rms(h); rms(E[x])]``, read out by the target's final norm and
    (compressed) LM head.

    Args:
        model: the target, a Hugging Face causal LM (its embedding, final norm and LM head are
            shared, frozen; its config gives the layers' shape).
        steps: ``k``, drafts per round (the block is applied ``k`` times with shared weights);
            the decoder's window is ``k + 1``.
        layers: ``L`` decoder layers.
        init: :class:`BlockInit`.
        draft_vocab: (K,) distinct model ids the block drafts over (FastMTP's compressed
            vocabulary, :func:`circuits_llm.heads.vocab.frequent_tokens`), or ``None``: all ``V``.
        fused_layers: indices of the target's layers whose outputs the block reads besides
            ``h`` (EAGLE-3; see the module docstring), ``()``: none.

    Raises:
        DraftBlockError: bad arguments, or a target whose parts cannot be found.
    """

    def __init__(self, model: PreTrainedModel, *, steps: int = 3, layers: int = 1,
                 init: BlockInit = BlockInit.IDENTITY,
                 draft_vocab: Tensor | Sequence[int] | None = None,
                 fused_layers: Sequence[int] = ()) -> None:
        super().__init__()
        for name, value in (("steps", steps), ("layers", layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DraftBlockError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(init, BlockInit):
            raise DraftBlockError(f"init must be a BlockInit, got {init!r}")
        try:
            parts = find_parts(model)
        except ValueError as error:
            raise DraftBlockError(f"cannot build a draft block on this model: {error}") from error
        weight = getattr(parts.lm_head, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise DraftBlockError("the target's LM head has no (V, d) weight to share")
        self.vocab_size: int = parts.vocab_size
        self.hidden_size: int = parts.hidden_size
        try:
            self.fused_layers = check_feature_layers(fused_layers, parts.num_layers)
        except ValueError as error:
            raise DraftBlockError(f"fused_layers: {error}") from None
        self.steps = steps
        self.window = steps + 1
        self.init = init
        self.config = _layer_config(model.config, layers)
        if self.config.hidden_size != self.hidden_size:
            raise DraftBlockError(f"the target's layers are {self.config.hidden_size} wide but its "
                                  f"LM head reads {self.hidden_size}")
        # plain attribute (not a submodule): shared, frozen, outside parameters() and state_dict()
        self.target = TargetParts(model.get_input_embeddings(), parts.final_norm, parts.lm_head)
        if draft_vocab is None:
            self.draft_tokens: Tensor | None = None
        else:
            try:
                self.draft_tokens = check_draft_tokens(draft_vocab, self.vocab_size)
            except HeadConfigError as error:
                raise DraftBlockError(str(error)) from error
        d, eps = self.hidden_size, self.config.rms_norm_eps
        self.norm_hidden = LlamaRMSNorm(d, eps=eps)
        self.norm_token = LlamaRMSNorm(d, eps=eps)
        self.fuse = nn.Linear(2 * d, d, bias=False)
        if self.fused_layers:
            self.layer_fusion = LayerFusion(d, len(self.fused_layers), eps)
        self.layers = nn.ModuleList(LlamaDecoderLayer(self.config, i) for i in range(layers))
        self.rotary = LlamaRotaryEmbedding(self.config)
        self._initialise(parts.layers[-1])
        self.to(device=weight.device, dtype=weight.dtype)

    def _initialise(self, last: nn.Module) -> None:
        """The identity start: fusion ``[I, 0]``, zero output projections; the layers' other
        weights copied from ``last`` under :attr:`BlockInit.LAST_LAYER`."""
        with torch.no_grad():
            d = self.hidden_size
            self.fuse.weight.zero_()
            self.fuse.weight[:, :d].copy_(torch.eye(d))
            for layer in self.layers:
                if self.init is BlockInit.LAST_LAYER:
                    if not isinstance(last, LlamaDecoderLayer):
                        raise DraftBlockError(f"BlockInit.LAST_LAYER copies a Llama decoder layer; "
                                              f"the target's last layer is a {type(last).__name__}")
                    layer.load_state_dict(last.state_dict())
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
                for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    if projection.bias is not None:
                        projection.bias.zero_()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the block's float weights and outputs (read from a norm, which stays float
        when the projections are held in int8: :mod:`~circuits_llm.draft_block.weights`)."""
        return self.norm_hidden.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the block's weights live."""
        return self.norm_hidden.weight.device

    @property
    def draft_size(self) -> int:
        """``K``: the size of the draft vocabulary (``V`` without compression)."""
        return self.vocab_size if self.draft_tokens is None else int(self.draft_tokens.numel())

    @property
    def feature_size(self) -> int:
        """The width of the features the block reads from the backbone: ``(n + 1) d`` with ``n``
        fused layers (``d`` without)."""
        return (len(self.fused_layers) + 1) * self.hidden_size

    def read_features(self, features: Tensor) -> Tensor:
        """(..., :attr:`feature_size`) features from the backbone -> (..., d) the ``h`` the block
        reads: the features themselves without fused layers, else
        :class:`LayerFusion`'s ``h + G [rms(l_1); ...]``.

        Raises:
            DraftBlockError: features of another width.
        """
        if features.shape[-1] != self.feature_size:
            hint = f" (fused layers {list(self.fused_layers)}: build the backbone with " \
                f"HFBackbone(model, feature_layers={list(self.fused_layers)}))" \
                if self.fused_layers else ""
            raise DraftBlockError(f"the block reads features {self.feature_size} wide, got "
                                  f"{tuple(features.shape)}{hint}")
        if not self.fused_layers:
            return features
        return self.layer_fusion(features.to(self.dtype))

    def last_hidden(self, features: Tensor) -> Tensor:
        """(..., :attr:`feature_size`) features -> (..., d) the LM head's input among them (the
        last ``d``: the fused layers' outputs come first), whose readout is the target's law."""
        return features[..., -self.hidden_size:]

    def new_cache(self) -> Cache:
        """An empty KV cache for the block's layers (one per sequence)."""
        from transformers.cache_utils import DynamicCache
        return DynamicCache()

    def forward(self, hidden: Tensor, tokens: Tensor, positions: Tensor, allowed: Tensor,
                cache: Cache | None = None) -> Tensor:
        """Run the block on ``m`` new positions of each of ``B`` sequences at the same positions
        (:meth:`extend`, training; drafting runs the same layers through
        :class:`~circuits_llm.draft_block.step.BlockStep`).

        Args:
            hidden: (B, m, d) the features ``h`` of the new positions.
            tokens: (B, m) long, the token each position reads (``x_{j+1}`` for ``h_j``).
            positions: (m,) long, each position's index (its rotary angle).
            allowed: (m, P + m) bool, which keys each new position attends to: the ``P`` cached
                ones, then the new ones (every position must attend to some key).
            cache: the block's KV cache (``P`` positions, batch ``B``; the new ones are
                appended), or ``None`` (``P = 0``, nothing kept: training).

        Returns:
            (B, m, d) the block's outputs ``o`` (before the final norm).
        """
        if hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size:
            raise DraftBlockError(f"hidden must be (B, m, {self.hidden_size}), got "
                                  f"{tuple(hidden.shape)}")
        if tokens.shape != hidden.shape[:2] or tokens.is_floating_point():
            raise DraftBlockError(f"tokens must be (B, m) = {tuple(hidden.shape[:2])} integer ids, "
                                  f"got {tuple(tokens.shape)} {tokens.dtype}")
        rows = hidden.shape[1]
        past = 0 if cache is None else cache.get_seq_length()
        if positions.shape != (rows,) or allowed.shape != (rows, past + rows):
            raise DraftBlockError(f"positions must be ({rows},) and allowed ({rows}, "
                                  f"{past + rows}), got {tuple(positions.shape)} and "
                                  f"{tuple(allowed.shape)}")
        x = self.fused_input(hidden, tokens)
        position_ids = positions[None].to(x.device)  # (1, m)
        angles = self.rotary(x, position_ids)
        allowed = allowed[None].to(x.device)  # (1, m, P + m)
        mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device)
        mask = mask.masked_fill(~allowed, torch.finfo(x.dtype).min)[:, None]
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                      use_cache=cache is not None, position_embeddings=angles)
        return x

    def fused_input(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """What the first layer reads: ``W [rms(h); rms(E[x])]`` for ``hidden`` (..., d) and
        ``tokens`` (...) long -> (..., d)."""
        with torch.no_grad():  # the target's embedding is shared and frozen
            embedded = self.target.embedding(tokens).to(hidden.dtype)
        return self.fuse(torch.cat([self.norm_hidden(hidden), self.norm_token(embedded)], -1))

    def extend(self, hidden: Tensor, tokens: Tensor, cache: Cache) -> Tensor:
        """Append ``m`` rows after the ``P`` cached positions, causally: ``hidden`` (B, m, d),
        ``tokens`` (B, m) -> (B, m, d) outputs; the cache then holds ``P + m`` positions."""
        past, rows = cache.get_seq_length(), hidden.shape[1]
        device = hidden.device
        positions = torch.arange(past, past + rows, device=device)
        keys = torch.arange(past + rows, device=device)
        return self(hidden, tokens, positions, keys[None, :] <= positions[:, None], cache)

    def logits(self, output: Tensor) -> Tensor:
        """(..., d) block outputs -> (..., K) logits over the draft vocabulary: the target's final
        norm, then the rows of its LM head for the draft tokens (or, in a drafter's int8 copy,
        its :attr:`readout_override`)."""
        normed = output if self.target.final_norm is None else self.target.final_norm(output)
        override = self.__dict__.get("readout_override")
        if override is not None:
            return override(normed)
        weight, bias = self.readout()
        return nn.functional.linear(normed.to(weight.dtype), weight, bias)

    def readout(self) -> tuple[Tensor, Tensor | None]:
        """The LM head's rows for the draft vocabulary: weight (K, d) contiguous and bias (K,) or
        ``None``, detached (the target is frozen).

        With a compressed vocabulary the rows are gathered once and kept, and gathered again only
        when the LM head's weight changed (its storage, in-place version, device or dtype): a
        gather per call costs more than the product itself, and on a column-major weight
        (:mod:`~circuits_llm.backbone.weight_layout`) 40 ms for SmolLM2's 8,192 rows, more than a
        whole backbone step on the CPU it was measured on."""
        head = self.target.lm_head
        weight, bias = head.weight.detach(), getattr(head, "bias", None)
        bias = None if bias is None else bias.detach()
        if self.draft_tokens is None:
            return weight, bias
        key = (weight.data_ptr(), weight._version, weight.device, weight.dtype,
               None if bias is None else (bias.data_ptr(), bias._version))
        kept = self.__dict__.get("_readout")
        if kept is None or kept[0] != key:
            rows = self.draft_tokens.to(weight.device)
            kept = (key, weight.index_select(0, rows).contiguous(),
                    None if bias is None else bias.index_select(0, rows))
            self.__dict__["_readout"] = kept  # a plain attribute: not a buffer, never saved
        return kept[1], kept[2]
