"""Saving and loading the draft branch's LoRA adapter (safetensors weights + JSON metadata).

Layout of an adapter directory::

    adapter.safetensors   # LoRA tensors, keyed by their name inside the draft branch
    adapter.json          # {"format", "version", "lora_layers", "lora_rank", ..., "config_fingerprint"}

Both files are written to a temporary file in the same directory and moved into place with
``os.replace``, so a crash never leaves a half-written adapter behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from circuits.files import atomic_write, atomic_write_json


class AdapterHolder(Protocol):
    """What saving and loading an adapter reads of a backbone (``HFBackbone`` is one); a static
    type only, so this module needs nothing from ``hf.py``, which imports it."""

    lora_layers: int
    draft_layers: nn.Module

    def lora_state_dict(self) -> dict[str, torch.Tensor]: ...

    def adapter_metadata(self) -> dict[str, Any]: ...


ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter.json"
_FORMAT = "circuits_llm.hf_backbone_lora"
_VERSION = 1


class AdapterMismatchError(ValueError):
    """A saved adapter does not fit the backbone it is being loaded into."""


def save_adapter_from(backbone: AdapterHolder, directory: Path) -> Path:
    """Write ``backbone``'s LoRA weights and metadata into ``directory`` (created if needed).

    Raises:
        ValueError: if the backbone has no LoRA layers (nothing to save).
    """
    if backbone.lora_layers == 0:
        raise ValueError("this backbone has lora_layers=0: there is no adapter to save")
    directory.mkdir(parents=True, exist_ok=True)
    tensors = backbone.lora_state_dict()
    meta = {"format": _FORMAT, "version": _VERSION, **backbone.adapter_metadata()}
    atomic_write(directory / ADAPTER_WEIGHTS, lambda tmp: save_file(tensors, str(tmp)))
    atomic_write_json(directory / ADAPTER_CONFIG, meta, sort_keys=True)
    return directory


def load_adapter_into(backbone: AdapterHolder, directory: Path) -> None:
    """Copy the LoRA weights saved in ``directory`` into ``backbone``'s draft branch.

    Raises:
        FileNotFoundError: if a file of the adapter is missing.
        AdapterMismatchError: if the metadata, tensor names or shapes do not match the backbone.
    """
    if backbone.lora_layers == 0:
        raise AdapterMismatchError("this backbone has lora_layers=0: it cannot hold an adapter")
    config_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"adapter file {path} does not exist (written by HFBackbone.save_adapter?)"
            )
    try:
        meta = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise AdapterMismatchError(f"{config_path} is not valid JSON: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise AdapterMismatchError(f"{config_path} is not an HFBackbone adapter (format != {_FORMAT!r})")
    if meta.get("version") != _VERSION:
        raise AdapterMismatchError(f"{config_path} has version {meta.get('version')!r}, expected {_VERSION}")
    expected = backbone.adapter_metadata()
    diffs = [
        f"{key}: saved {meta.get(key)!r}, backbone {value!r}"
        for key, value in expected.items()
        if meta.get(key) != value
    ]
    if diffs:
        raise AdapterMismatchError(
            f"adapter in {directory} does not match this backbone: " + "; ".join(diffs)
        )
    saved = load_file(str(weights_path))
    params = dict(backbone.draft_layers.named_parameters())
    own = {name for name in params if "lora_" in name}
    if set(saved) != own:
        missing, extra = sorted(own - set(saved)), sorted(set(saved) - own)
        raise AdapterMismatchError(
            f"adapter tensors in {weights_path} do not match: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for name, tensor in saved.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise AdapterMismatchError(
                f"adapter tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor.to(dtype=params[name].dtype, device=params[name].device))
