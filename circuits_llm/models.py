"""Loading the causal LM a command names with ``--model``: the one loader of the project.

``"embedded"`` is the packaged byte-level Llama (:mod:`circuits_llm.embedded`); anything else is a
local Hugging Face model directory. Nothing is downloaded (``local_files_only``). Every way this
can fail (the embedded weights missing, no such directory, no ``config.json``, corrupt or
truncated ``*.safetensors``, a config transformers cannot build) is one :class:`ModelLoadError`
whose message says what was wrong and what to do, and Hugging Face's weight-loading progress bar
is switched off meanwhile, so a failed command's stderr is its one error line.

:func:`load_byte_model` is the loader of the commands that decode bytes (``demo``, ``bench``,
``generate``, the study): it also checks that the vocabulary is byte-level and returns a
:class:`LoadedModel` (the model, where it came from, its fingerprint). A loaded model is
identified by two fingerprints: :func:`config_fingerprint` (its
computation-relevant config: what adapters and checkpoints are checked against) and
:func:`model_fingerprint` (config and every weight: what the head cache is keyed by).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: The ``--model`` value naming the packaged byte-level model.
EMBEDDED = "embedded"


#: Config keys that do not change the computation and are left out of the fingerprint.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "architectures",
        "use_cache",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_commit_hash",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)


def config_fingerprint(model: Any) -> str:
    """SHA-256 of the model config's computation-relevant fields (hex string)."""
    items = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps(items, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def model_fingerprint(model: Any) -> str:
    """SHA-256 (hex) of a model's computation-relevant config and of every weight tensor.

    It does not depend on the device the weights are on, so heads cached for a model on one
    device are found on another.
    """
    digest = hashlib.sha256(config_fingerprint(model).encode())
    for name, tensor in sorted(model.state_dict().items()):
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


class ModelLoadError(ValueError):
    """The model named by ``--model`` cannot be loaded (the message says why and what to do)."""


def load_causal_lm(spec: str | Path, device: torch.device | None = None) -> Any:
    """The causal LM named by ``spec``, in eval mode, on ``device`` (None: the CPU it loads on).

    Raises:
        ModelLoadError: see the module docstring.
    """
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = _load(str(spec))
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return (model if device is None else model.to(device)).eval()


def _weights_error(directory: Path, error: Exception, advice: str) -> ModelLoadError:
    files = sorted(path.name for path in directory.glob("*.safetensors"))
    which = files[0] if len(files) == 1 else "a *.safetensors file"
    return ModelLoadError(f"{which} in {directory} is corrupt or truncated ({error}); {advice}")


def _load(spec: str) -> Any:
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from circuits_llm.embedded import (
        EMBEDDED_MODEL_DIR,
        EmbeddedModelMissingError,
        load_embedded_model,
    )

    if spec == EMBEDDED:
        try:
            return load_embedded_model()
        except EmbeddedModelMissingError as error:
            raise ModelLoadError(str(error)) from None
        except SafetensorError as error:
            raise _weights_error(EMBEDDED_MODEL_DIR, error, "reinstall circuits-llm, or re-export "
                                 "the model with `circuits-llm export-model`") from None
    path = Path(spec)
    if not path.is_dir():
        raise ModelLoadError(f"--model {spec}: no such directory (give '{EMBEDDED}' or a Hugging "
                             "Face model directory)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"--model {spec}: the directory has no config.json, so it is not a "
                             "Hugging Face model directory")
    try:
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except SafetensorError as error:
        raise _weights_error(path, error, f"copy or export the model to --model {spec} "
                             "again") from None
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"--model {spec}: cannot load a causal LM ({error})") from None


@dataclass
class LoadedModel:
    """A causal LM ready for decoding, with where it came from and its :func:`model_fingerprint`."""

    model: Any
    source: str
    fingerprint: str

    def describe(self) -> dict[str, Any]:
        """JSON-ready facts about the model for a report."""
        config = self.model.config
        info: dict[str, Any] = {
            "source": self.source, "fingerprint": self.fingerprint,
            "model_type": str(getattr(config, "model_type", "")),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "layers": getattr(config, "num_hidden_layers", None),
            "hidden_size": getattr(config, "hidden_size", None),
            "vocab_size": getattr(config, "vocab_size", None),
        }
        if self.source == EMBEDDED:
            from circuits_llm.embedded import embedded_model_card
            card = embedded_model_card()
            info["card"] = {k: v for k, v in card.items() if k != "history"}
        return info


def load_byte_model(spec: str | Path, device: torch.device | None = None) -> LoadedModel:
    """:func:`load_causal_lm`, checked to be byte-level, with its source and fingerprint.

    The model is moved to ``device`` (None: left where it was loaded, the CPU). Its fingerprint
    does not depend on the device, so heads cached on one device are found on another.

    Raises:
        ModelLoadError: the model cannot be loaded, or its vocabulary is not byte-level.
    """
    from circuits_llm.data import SpecialToken
    model = load_causal_lm(spec, device)
    vocab = int(getattr(model.config, "vocab_size", 0))
    if vocab <= max(SpecialToken):
        raise ModelLoadError(f"--model {spec}: vocabulary of {vocab} ids is not byte-level (need "
                             f"bytes 0..255 plus special ids up to {int(max(SpecialToken))})")
    source = EMBEDDED if str(spec) == EMBEDDED else str(Path(spec).resolve())
    return LoadedModel(model, source, model_fingerprint(model))
