"""Training circuit MTP heads (and LoRA draft layers) on a frozen causal LM.

* :class:`HeadTrainingConfig`: the run's hyper-parameters (JSON round-trippable);
  :class:`DataSource` picks the stdlib corpus or self-distilled data (FastMTP Sec. 2.4).
* :func:`train_head`: resumable training with validation per window position, atomic
  checkpoints and an exported result; runs data-parallel under ``torchrun``.
* :func:`load_trained_head`: the exported head and its backbone, ready for
  :class:`~circuits_llm.decoder.SpeculativeDecoder`.
"""

from circuits_llm.checkpoint import CheckpointError
from circuits_llm.training.config import DataSource, HeadTrainingConfig, TrainingConfigError
from circuits_llm.training.loop import CHECKPOINT_FILE, train_head
from circuits_llm.training.results import (
    HeadTrainingResult,
    PositionValidation,
    load_trained_head,
    read_record,
)

__all__ = [
    "CHECKPOINT_FILE", "CheckpointError", "DataSource", "HeadTrainingConfig", "HeadTrainingResult",
    "PositionValidation", "TrainingConfigError", "load_trained_head", "read_record", "train_head",
]
