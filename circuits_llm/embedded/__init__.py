"""The embedded byte-level model shipped inside the package (``byte-llama/``).

It is a small ``LlamaForCausalLM`` (bytes 0..255 + BOS/EOS/PAD, vocabulary 260) pretrained by
``circuits-llm pretrain`` on the CPython standard library and exported with
``circuits-llm export-model``; ``byte-llama/training.json`` records how it was trained and its
held-out bits per byte (see ``docs/model-card.md``).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoModelForCausalLM, PreTrainedModel

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "byte-llama"


class EmbeddedModelMissingError(FileNotFoundError):
    """The package was installed without the embedded model files."""


def embedded_model_card() -> dict[str, object]:
    """The training record of the embedded model (``training.json``)."""
    path = EMBEDDED_MODEL_DIR / "training.json"
    if not path.is_file():
        raise EmbeddedModelMissingError(
            f"no embedded model at {EMBEDDED_MODEL_DIR}; run `circuits-llm pretrain` then "
            "`circuits-llm export-model`")
    return json.loads(path.read_text())


def load_embedded_model() -> PreTrainedModel:
    """The embedded model in eval mode, loaded offline with ``AutoModelForCausalLM``."""
    embedded_model_card()  # raises a clear error when missing
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, local_files_only=True)
    return model.eval()
