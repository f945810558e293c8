"""Which checkpoint a head-training run resumes from, and the checks it must pass first.

A run directory keeps two checkpoints: ``checkpoint.pt`` (the latest) and ``checkpoint.prev.pt``
(the one it replaced; :func:`~circuits_llm.runtime.checkpoint.save_checkpoint` with ``keep_previous``).
A run resumes from ``checkpoint.pt``, or from the file the user names (``resume_from``,
``--resume-from``). It never falls back to the older file by itself: when ``checkpoint.pt`` fails
its checksum the error says whether ``checkpoint.prev.pt`` is intact, at which step, and how to
resume from it. Every checkpoint is verified (SHA-256) before it is read, and its state is
checked against the run: keys, configuration, model and head fingerprints, finite tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_llm.runtime.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    UnverifiableCheckpointError,
    inspect_checkpoint,
    load_checkpoint,
    previous_path,
)
from circuits_llm.training.config import HeadTrainingConfig
from circuits_llm.training.results import RECORD_FILE, read_record, record_config

CHECKPOINT_KIND = "circuits_llm.train_head"
CHECKPOINT_FILE = "checkpoint.pt"
PREVIOUS_CHECKPOINT_FILE = previous_path(CHECKPOINT_FILE).name
STATE_KEYS = ("config", "model_fingerprint", "head_fingerprint", "head", "lora", "optimizer",
              "data_generator", "torch_rng", "step", "elapsed", "history", "recent_losses",
              "initial_validation")


def check_config(saved: HeadTrainingConfig, config: HeadTrainingConfig, source: Path) -> None:
    """Raise :class:`CheckpointError` unless ``saved`` and ``config`` describe the same run."""
    differences = saved.differences(config)
    if differences:
        raise CheckpointError(
            f"{source} was written with a different configuration ({'; '.join(differences)})"
            "; use the same settings or a new run directory")


def previous_advice(path: Path) -> str:
    """What to do about a bad ``path``: resume from the intact previous checkpoint, if any."""
    previous = previous_path(path)
    try:
        info = inspect_checkpoint(previous, CHECKPOINT_KIND)
    except CheckpointError:
        return f"there is no intact previous checkpoint ({previous.name}); use a new run directory"
    return (f"the previous checkpoint {previous} (step {info.summary.get('step', '?')}) is intact: "
            f"resume from it with --resume-from {previous}, or use a new run directory")


def checkpoint_source(run_dir: Path, config: HeadTrainingConfig,
                      resume_from: str | Path | None) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run.

    Raises:
        CheckpointError: the exported record belongs to another config; ``resume_from`` does not
            exist; ``checkpoint.pt`` is missing although the run has an export or an older
            ``checkpoint.prev.pt`` (a fresh start would silently discard them).
    """
    checkpoint = run_dir / CHECKPOINT_FILE
    record_path = run_dir / RECORD_FILE
    if record_path.exists():
        check_config(record_config(read_record(run_dir), record_path), config, record_path)
    if resume_from is not None:
        source = Path(resume_from)
        if not source.is_file():
            raise CheckpointError(f"--resume-from {source}: no such file; give a checkpoint file "
                                  f"such as {run_dir / PREVIOUS_CHECKPOINT_FILE}")
        return source
    if checkpoint.exists():
        return checkpoint
    previous = previous_path(checkpoint)
    if previous.exists():
        raise CheckpointError(f"{run_dir} has no {CHECKPOINT_FILE} but an older {previous.name}; "
                              f"resume from it with --resume-from {previous}, or use a new run "
                              "directory")
    if record_path.exists():
        raise CheckpointError(f"{run_dir} holds an exported run but no {CHECKPOINT_FILE} to resume "
                              "from; use a new run directory")
    return None


def _check_finite(path: Path, state: dict[str, Any]) -> None:
    for group in ("head", "lora"):
        for name, value in state[group].items():
            if isinstance(value, Tensor) and value.is_floating_point() and \
                    not bool(torch.isfinite(value).all()):
                raise CheckpointError(f"{path} holds non-finite values in {group} tensor {name}; "
                                      "resume from an earlier checkpoint (--resume-from) or use a "
                                      "new run directory")


def read_state(source: Path, explicit: bool) -> dict[str, Any]:
    """Verify and load the checkpoint ``source``; check its keys and tensors.

    Args:
        source: the file (:func:`checkpoint_source`).
        explicit: the user named it (``--resume-from``): a format 1 file without checksum is
            then accepted, and a failure gets no advice about the previous checkpoint.

    Raises:
        CheckpointError: the file fails its checksum (naming the file, and saying whether the
            previous checkpoint is intact), lacks state, or holds non-finite tensors.
    """
    try:
        state = load_checkpoint(source, CHECKPOINT_KIND, allow_unverified=explicit)
    except UnverifiableCheckpointError as error:
        raise CheckpointError(f"{error.problem}; pass it explicitly as --resume-from {source} to "
                              "load it unverified, or use a new run directory") from None
    except CheckpointCorruptError as error:
        if explicit:
            raise CheckpointError(f"{error.problem}; choose another --resume-from file or a new "
                                  "run directory") from None
        raise CheckpointError(f"{error.problem}; {previous_advice(source)}") from None
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"{source} lacks {missing}; the file is corrupt")
    _check_finite(source, state)
    return state
