"""What a decoder decodes with: a :class:`~circuits_llm.protocols.Backbone` from what the user
passes (a Hugging Face causal LM is wrapped in :class:`~circuits_llm.backbone.HFBackbone`, with a
static cache and compiled forwards under ``compile=True``), and the Hugging Face model under a
backbone (for its ``generation_config``: the decoders' default EOS ids)."""

from __future__ import annotations

from collections.abc import Sequence

from circuits_llm.decoding.warping import DecoderError
from circuits_llm.protocols import Backbone, backbone_problem


def is_hf_model(model: object) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(model, PreTrainedModel)


def as_backbone(model: object, lora_layers: int, compile: bool,
                blocks: Sequence[int] = (1,), feature_layers: Sequence[int] = ()) -> Backbone:
    """An HF causal LM -> HFBackbone (static cache and compiled forwards for blocks of 1 and
    every length in ``blocks`` when ``compile``; the outputs of ``feature_layers`` in its draft
    hidden state, for a draft block that fuses them); a Backbone is used as it is (a compiled
    HFBackbone learns the block lengths ``blocks``); anything else is an error."""
    lengths = sorted({1, *blocks})
    problem = backbone_problem(model)
    if problem is None:
        if getattr(model, "compiled", False) and hasattr(model, "add_compiled_length"):
            for length in lengths[1:]:
                model.add_compiled_length(length)  # type: ignore[attr-defined]
        return model  # type: ignore[return-value]
    if is_hf_model(model):
        from circuits_llm.backbone import HFBackbone
        if not compile:
            return HFBackbone(model, lora_layers=lora_layers,  # type: ignore[arg-type]
                              feature_layers=feature_layers)
        return HFBackbone(model, lora_layers=lora_layers, compile=True,  # type: ignore[arg-type]
                          compiled_lengths=lengths, feature_layers=feature_layers)
    raise DecoderError(f"backbone must implement circuits_llm.protocols.Backbone or be a Hugging "
                       f"Face PreTrainedModel: {problem}")


def drafter_backbone(model: object, drafter: object, **options: object) -> Backbone:
    """``HFBackbone(model, **options)`` that hands ``drafter`` what it reads: the outputs of its
    ``feature_layers`` before the LM head's input (a draft block with EAGLE-3's fused layers),
    else the LM head's input alone. What every place that builds a backbone for a drafter it
    was handed calls, so a block with fused layers decodes wherever one without them does."""
    from circuits_llm.backbone import HFBackbone
    layers = tuple(getattr(drafter, "feature_layers", ()))
    return HFBackbone(model, feature_layers=layers, **options)  # type: ignore[arg-type]


#: how many wrappers :func:`hf_model_under` looks through (``inner``: a backbone that wraps another)
_WRAPPER_DEPTH = 8


def hf_model_under(backbone: object) -> object | None:
    """The Hugging Face model under ``backbone``: itself, an ``HFBackbone``'s ``model``, or either
    under wrappers that keep the backbone they wrap as ``inner`` (``ProcessedBackbone``); None
    when there is none (a toy or custom backbone)."""
    for _ in range(_WRAPPER_DEPTH):
        if backbone is None:
            return None
        if is_hf_model(backbone):
            return backbone
        model = getattr(backbone, "model", None)
        if is_hf_model(model):
            return model
        backbone = getattr(backbone, "inner", None)
    return None
