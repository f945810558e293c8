"""Training circuit MTP heads (and LoRA draft layers) on a frozen causal LM.

* :class:`HeadTrainingConfig`: the run's hyper-parameters (JSON round-trippable);
  :class:`DataSource` picks the stdlib corpus or self-distilled data (FastMTP Sec. 2.4);
  :class:`FeatureCaching` and :class:`FeatureDtype` say whether and how the backbone's features
  are computed once and cached on disk (:mod:`circuits_llm.training.features`);
  :class:`TargetLaw` trains towards the data's tokens or the model's own law
  (:mod:`circuits_llm.training.teacher`).
* :func:`train_head`: resumable training with validation per window position, verified and
  rotated checkpoints, a locked run directory, graceful signals and an exported result; runs
  data-parallel under ``torchrun``.
* :func:`load_trained_head`: the exported head and its backbone, ready for
  :class:`~circuits_llm.decoding.decoder.SpeculativeDecoder`.
* ``HeadTrainingConfig(draft_block=True)`` (``train-head --draft-block``) trains a
  :class:`~circuits_llm.draft_block.DraftBlock` in the same loop
  (:mod:`circuits_llm.training.block_trainer`); :func:`load_trained_block` reads it back.
"""

from circuits_llm.runtime.checkpoint import CheckpointError, CheckpointWriteError
from circuits_llm.training.block_trainer import load_trained_block
from circuits_llm.training.config import (
    DataSource,
    FeatureCaching,
    FeatureDtype,
    HeadTrainingConfig,
    TargetLaw,
    TrainingConfigError,
)
from circuits_llm.training.lock import RunDirectoryBusy
from circuits_llm.training.loop import CHECKPOINT_FILE, NonFiniteTrainingError, train_head
from circuits_llm.training.results import (
    HeadTrainingResult,
    PositionValidation,
    load_trained_head,
    read_record,
)
from circuits_llm.training.resume import PREVIOUS_CHECKPOINT_FILE
from circuits_llm.training.signals import TrainingInterrupted

__all__ = [
    "CHECKPOINT_FILE", "PREVIOUS_CHECKPOINT_FILE", "CheckpointError", "CheckpointWriteError",
    "DataSource", "FeatureCaching", "FeatureDtype", "HeadTrainingConfig", "HeadTrainingResult",
    "NonFiniteTrainingError",
    "PositionValidation", "RunDirectoryBusy", "TargetLaw", "TrainingConfigError",
    "TrainingInterrupted",
    "load_trained_block", "load_trained_head", "read_record", "train_head",
]
