"""Locating the parts of a Hugging Face causal LM that :class:`HFBackbone` needs.

A causal LM is seen as ``embeddings -> decoder layers (a ModuleList) -> final norm -> LM head``.
The helpers here find the decoder layer list, the final norm and the LM head generically, and decide
which linear sub-modules of a decoder layer get LoRA adapters. (The config fingerprint that keeps
adapters saved for one base model out of another is :func:`circuits_llm.text.models.config_fingerprint`.)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.pytorch_utils import Conv1D


class UnsupportedModelError(ValueError):
    """The model does not have the structure :class:`HFBackbone` needs (the message says what is missing)."""


#: Attribute paths (relative to the base model) tried, in order, for the decoder layer list.
LAYER_LIST_PATHS: tuple[str, ...] = ("layers", "h", "blocks", "decoder.layers", "transformer.h", "block")
#: Attribute paths (relative to the base model) tried, in order, for the final norm (OPT keeps it
#: on its decoder: ``decoder.final_layer_norm``).
FINAL_NORM_NAMES: tuple[str, ...] = (
    "norm",
    "ln_f",
    "final_layer_norm",
    "final_layernorm",
    "norm_f",
    "final_norm",
    "decoder.final_layer_norm",
    "decoder.norm",
)
#: Attribute paths of a projection applied after the final norm, before the LM head (OPT models whose
#: ``word_embed_proj_dim`` differs from ``hidden_size``: ``decoder.project_out``).
OUTPUT_PROJECTION_PATHS: tuple[str, ...] = ("decoder.project_out",)
#: Cache layer classes whose ``crop`` is an exact rollback (others, e.g. linear attention, are refused).
_CROPPABLE_CACHE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


@dataclass
class ModelParts:
    """The pieces of a causal LM used by the backbone.

    Attributes:
        base: the base (decoder-only) model, e.g. ``LlamaModel`` or ``GPT2Model``.
        layers: the decoder layers, in order (``num_layers`` entries).
        final_norm: what the base model applies to the last layer's output before the LM head (its
            final norm, followed by an output projection where it has one, as OPT's
            ``project_out``), or ``None`` if none was found.
        lm_head: the output embedding mapping (…, d) hidden states to (…, V) logits.
        num_layers: number of decoder layers.
        vocab_size: number of logits per position (V).
        hidden_size: width of the hidden state read by the LM head (d).
    """

    base: nn.Module
    layers: nn.ModuleList
    final_norm: nn.Module | None
    lm_head: nn.Module
    num_layers: int
    vocab_size: int
    hidden_size: int


def _resolve(root: nn.Module, path: str) -> object | None:
    """Follow a dotted attribute ``path`` from ``root``; ``None`` if any step is missing."""
    obj: object = root
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _declared_none(root: nn.Module, path: str) -> bool:
    """Whether the attribute at ``path`` exists and is ``None`` (a part the model declares absent)."""
    parent_path, _, name = path.rpartition(".")
    parent = _resolve(root, parent_path) if parent_path else root
    return parent is not None and name in vars(parent) and getattr(parent, name) is None


def find_parts(model: nn.Module) -> ModelParts:
    """Find the decoder layers, final norm and LM head of ``model``.

    Raises:
        UnsupportedModelError: naming the part that could not be found.
    """
    if not isinstance(model, PreTrainedModel):
        raise UnsupportedModelError(
            "HFBackbone needs a transformers PreTrainedModel (an AutoModelForCausalLM), "
            f"got {type(model).__name__}"
        )
    config = model.config.get_text_config(decoder=True)
    num_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise UnsupportedModelError(f"{type(model).__name__}.config has no positive `num_hidden_layers`")
    lm_head = model.get_output_embeddings()
    if not isinstance(lm_head, nn.Module):
        raise UnsupportedModelError(
            f"{type(model).__name__}.get_output_embeddings() returned {lm_head!r}: no LM head module found"
        )
    base = model.base_model
    if base is model:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no base model under `{model.base_model_prefix}`: is it a causal LM "
            "with a head (AutoModelForCausalLM)?"
        )
    layers: nn.ModuleList | None = None
    for path in LAYER_LIST_PATHS:
        found = _resolve(base, path)
        if isinstance(found, nn.ModuleList) and len(found) == num_layers:
            layers = found
            break
    if layers is None:
        candidates = [m for m in base.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers]
        if len(candidates) != 1:
            raise UnsupportedModelError(
                f"could not find the decoder layer list of {type(model).__name__}: tried "
                f"{', '.join(LAYER_LIST_PATHS)} on {type(base).__name__} and found {len(candidates)} "
                f"ModuleLists of length num_hidden_layers={num_layers}"
            )
        layers = candidates[0]
    final_norm = next((found for path in FINAL_NORM_NAMES
                       if isinstance(found := _resolve(base, path), nn.Module)), None)
    if final_norm is None and any(_declared_none(base, path) for path in FINAL_NORM_NAMES):
        final_norm = nn.Identity()  # the model says it has none (OPT-350m: do_layer_norm_before=False)
    projection = next((found for path in OUTPUT_PROJECTION_PATHS
                       if isinstance(found := _resolve(base, path), nn.Module)), None)
    if projection is not None:  # what the base model applies after its last layer, in its order
        final_norm = nn.Sequential(*(m for m in (final_norm, projection) if m is not None))
    vocab_size = int(getattr(lm_head, "out_features", None) or config.vocab_size)
    hidden_size = int(getattr(lm_head, "in_features", None) or config.hidden_size)
    return ModelParts(base, layers, final_norm, lm_head, num_layers, vocab_size, hidden_size)


def check_cache_support(model: PreTrainedModel) -> None:
    """Refuse models whose KV cache cannot be rolled back exactly by cropping.

    The backbone keeps full-length ``DynamicLayer`` caches for every layer (sliding-window layers are
    handled by the attention mask), so only attention layers whose default cache is a
    ``DynamicLayer`` or ``DynamicSlidingWindowLayer`` are supported.

    Raises:
        UnsupportedModelError: naming the first cache layer type that is not supported.
    """
    probe = DynamicCache(config=model.config)
    for idx, layer in enumerate(probe.layers):
        if type(layer) not in _CROPPABLE_CACHE_LAYERS:
            raise UnsupportedModelError(
                f"layer {idx} of {type(model).__name__} uses cache layer {type(layer).__name__}, "
                "which cannot be rolled back by cropping; only full or sliding-window attention layers "
                "are supported"
            )


def lora_target_names(layer: nn.Module) -> tuple[list[str], bool]:
    """Names (last path component) of the linear sub-modules of a decoder layer, for LoRA.

    Returns:
        (names, fan_in_fan_out): the sorted unique names of ``nn.Linear`` / GPT-2 ``Conv1D`` leaves, and
        whether they are all ``Conv1D`` (weights stored transposed, peft's ``fan_in_fan_out``).

    Raises:
        UnsupportedModelError: if the layer has no linear sub-module or mixes Linear and Conv1D.
    """
    linear, conv = set(), set()
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            linear.add(name.rsplit(".", 1)[-1])
        elif isinstance(module, Conv1D):
            conv.add(name.rsplit(".", 1)[-1])
    if linear and conv:
        raise UnsupportedModelError(
            f"decoder layer {type(layer).__name__} mixes nn.Linear {sorted(linear)} and "
            f"Conv1D {sorted(conv)}: pass lora_target_modules naming modules of one kind"
        )
    if not linear and not conv:
        raise UnsupportedModelError(
            f"decoder layer {type(layer).__name__} has no nn.Linear or Conv1D to adapt"
        )
    return sorted(linear or conv), bool(conv)


def is_conv1d_target(layer: nn.Module, names: list[str]) -> bool:
    """Whether every sub-module of ``layer`` whose last name component is in ``names`` is a ``Conv1D``.

    Raises:
        UnsupportedModelError: if no sub-module matches, or the matches mix Linear and Conv1D.
    """
    kinds = {
        isinstance(module, Conv1D)
        for name, module in layer.named_modules()
        if name and name.rsplit(".", 1)[-1] in names
    }
    if not kinds:
        raise UnsupportedModelError(
            f"lora_target_modules {names} match no sub-module of decoder layer {type(layer).__name__}"
        )
    if len(kinds) > 1:
        raise UnsupportedModelError(f"lora_target_modules {names} mix nn.Linear and Conv1D modules")
    return kinds.pop()
