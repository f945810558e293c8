"""Building the draft model of a run: the backbone (frozen + optional LoRA) and the circuit head.

Every way a head or config can fail to fit the model (vocabulary or hidden size, a circuit file
with the wrong categories or window, a window below 2) is reported as one
:class:`~circuits_llm.training.config.TrainingConfigError` before anything is trained or written.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel

from circuits.errors import CircuitError
from circuits.serialization import load_circuit
from circuits_llm.backbone import HFBackbone
from circuits_llm.data import SpecialToken
from circuits_llm.heads import HeadConfigError, MTPHead, check_head_circuit
from circuits_llm.heads.io import head_config
from circuits_llm.models import config_fingerprint
from circuits_llm.training.config import HeadTrainingConfig, TrainingConfigError

#: The largest token id the byte-level training data contain (EOS; PAD is never used as input).
MAX_DATA_TOKEN = int(SpecialToken.EOS)


def lm_head_weight(model: PreTrainedModel) -> Tensor:
    """The model's (V, d) output embedding (``model.get_output_embeddings().weight``)."""
    embeddings = model.get_output_embeddings()
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise TrainingConfigError(
            f"{type(model).__name__} has no (V, d) output embedding matrix to initialise the head")
    return weight


def build_backbone(model: PreTrainedModel, config: HeadTrainingConfig) -> HFBackbone:
    """``HFBackbone(model, lora_layers, lora_rank)``; the LoRA init draws from the global RNG.

    Raises:
        TrainingConfigError: ``lora_layers`` exceeds the model's layers, or the model's
            vocabulary cannot hold the byte-level training ids.
    """
    if not isinstance(model, PreTrainedModel):
        raise TrainingConfigError(f"model must be a Hugging Face PreTrainedModel, got "
                                  f"{type(model).__name__}")
    try:
        backbone = HFBackbone(model, lora_layers=config.lora_layers, lora_rank=config.lora_rank)
    except (TypeError, ValueError) as error:
        raise TrainingConfigError(f"cannot build the backbone: {error}") from None
    if backbone.vocab_size <= MAX_DATA_TOKEN:
        raise TrainingConfigError(
            f"the training data are byte-level ids 0..{MAX_DATA_TOKEN} (bytes, BOS, EOS) but the "
            f"model's vocabulary has only {backbone.vocab_size} ids")
    return backbone


def _circuit_head(config: HeadTrainingConfig, backbone: HFBackbone, weight: Tensor) -> MTPHead:
    assert config.circuit_file is not None
    path = Path(config.circuit_file)
    if not path.is_file():
        raise TrainingConfigError(f"circuit file {path} does not exist")
    try:
        circuit = load_circuit(path)
        window = check_head_circuit(circuit, backbone.vocab_size)
    except CircuitError as error:
        raise TrainingConfigError(f"circuit file {path} cannot be a head for this model: "
                                  f"{error}") from None
    if window != config.window:
        raise TrainingConfigError(
            f"circuit file {path} has {window} variables but the config's window is "
            f"{config.window}; set window={window}")
    return MTPHead(circuit, backbone.hidden_size, backbone.vocab_size, config.variant, weight,
                   lean_rank=config.lean_rank, seed=config.seed)


def build_head(config: HeadTrainingConfig, backbone: HFBackbone) -> MTPHead:
    """The head of ``config`` on ``backbone``'s sizes, initialised from its LM head.

    Shapes: the head maps draft hidden states (B, d) to the parameters of a circuit over
    ``window`` variables with ``V`` categories, ``d``/``V`` being the backbone's.
    """
    weight = lm_head_weight(backbone.model).detach().float().cpu()
    if tuple(weight.shape) != (backbone.vocab_size, backbone.hidden_size):
        raise TrainingConfigError(
            f"the output embedding has shape {tuple(weight.shape)}, expected (vocab, hidden) = "
            f"({backbone.vocab_size}, {backbone.hidden_size})")
    try:
        if config.circuit_file is not None:
            head = _circuit_head(config, backbone, weight)
        else:
            head = MTPHead.from_name(config.architecture, config.window, config.rank,
                                     backbone.hidden_size, backbone.vocab_size, config.variant,
                                     weight, lean_rank=config.lean_rank, seed=config.seed)
    except (CircuitError, HeadConfigError) as error:
        raise TrainingConfigError(f"cannot build the head: {error}") from None
    return head.to(backbone.device)


def model_fingerprint(model: PreTrainedModel) -> dict[str, str]:
    """What identifies the backbone a run trained against: its config and its LM head values."""
    weight = lm_head_weight(model).detach().to("cpu", torch.float32).contiguous()
    return {"config": config_fingerprint(model),
            "lm_head_sha256": hashlib.sha256(weight.numpy().tobytes()).hexdigest()}


def head_fingerprint(head: MTPHead) -> str:
    """SHA-256 of the head's structure record (template or full circuit, sizes, variant)."""
    return hashlib.sha256(head_config(head).to_json().encode()).hexdigest()
