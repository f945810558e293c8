"""Loading the causal LM a command names with ``--model``: the one loader of the project.

``"embedded"`` is the packaged byte-level Llama (:mod:`circuits_llm.embedded`); anything else is a
local Hugging Face model directory. Nothing is downloaded (``local_files_only``). Every way this
can fail (the embedded weights missing, no such directory, no ``config.json``, corrupt or
truncated ``*.safetensors``, a config transformers cannot build) is one :class:`ModelLoadError`
whose message says what was wrong and what to do, and Hugging Face's weight-loading progress bar
is switched off meanwhile, so a failed command's stderr is its one error line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: The ``--model`` value naming the packaged byte-level model.
EMBEDDED = "embedded"


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
