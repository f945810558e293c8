"""Backbones: causal LMs with KV caches that feed the verifier logits and the draft head's hidden state.

:class:`HFBackbone` wraps any ``transformers`` causal LM (Llama-style, GPT-2-style, ...) as a
:class:`~circuits_llm.protocols.Backbone`, with an optional LoRA draft branch on the last ``k``
decoder layers, and an optional static KV cache with a compiled forward (``compile=True``).
:func:`pack_linear_layers` packs a model's float32 linear weights with MKL or oneDNN (on a CPU;
:func:`tune_linear_packing` measures which is faster on the machine) so that a verify block of a
few tokens costs little more than one token; call it before wrapping the model.
:func:`tune_weight_layout` stores those weights row- or column-major, whichever makes a one-token
step faster on the machine (:mod:`~circuits_llm.backbone.weight_layout`); call it before packing.
"""

from circuits_llm.backbone._adapter_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterMismatchError
from circuits_llm.backbone._arch import UnsupportedModelError
from circuits_llm.backbone._static import DEFAULT_MAX_CACHE_LEN, CacheCapacityError, CacheKind
from circuits_llm.backbone.hf import HFBackbone
from circuits_llm.backbone.packed_linear import (
    PackedLinear,
    PackingBackend,
    pack_linear_layers,
    repack_linear_layers,
    tune_linear_packing,
)
from circuits_llm.backbone.weight_layout import WeightLayout, set_weight_layout, tune_weight_layout

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "DEFAULT_MAX_CACHE_LEN",
    "AdapterMismatchError",
    "CacheCapacityError",
    "CacheKind",
    "HFBackbone",
    "PackedLinear",
    "PackingBackend",
    "UnsupportedModelError",
    "WeightLayout",
    "pack_linear_layers",
    "repack_linear_layers",
    "set_weight_layout",
    "tune_linear_packing",
    "tune_weight_layout",
]
