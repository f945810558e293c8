"""``train_head``: fit a circuit MTP head (and optional LoRA draft layers) to a frozen LM.

The steps themselves are :class:`~circuits_llm.training.trainer.Trainer`'s. Resumability:
``run_dir/checkpoint.pt`` (atomic, SHA-256 verified, the previous one kept as
``checkpoint.prev.pt``; :mod:`.resume`) holds the head, the LoRA weights, the optimiser, the data
generator and RNG states, the step and the history. It is written every ``checkpoint_every_s``
seconds, at every validation and when the call returns. Calling ``train_head`` again on the same
directory continues exactly where the checkpoint left off: a run to N steps in one call and a run
to k steps then resumed to N give identical parameters, also after a SIGKILL.

Safety: the run directory is locked for the whole call (:mod:`.lock`); a non-finite loss, gradient
norm or parameter stops training before anything poisoned is saved
(:class:`~circuits_llm.training.trainer.NonFiniteTrainingError`); with ``handle_signals`` a first
SIGINT / SIGTERM finishes the step and writes a checkpoint, a second stops at once
(:mod:`.signals`). Under ``torchrun`` the same call trains data-parallel (:mod:`.distributed`);
only rank 0 locks and writes, and every stop decision is agreed on by all ranks.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import PreTrainedModel

from circuits_llm.runtime.checkpoint import CheckpointWriteError
from circuits_llm.training.block_head_trainer import BlockHeadTrainer
from circuits_llm.training.block_trainer import BlockTrainer
from circuits_llm.training.config import HeadTrainingConfig, TrainingConfigError
from circuits_llm.training.datasets import training_sets
from circuits_llm.training.distributed import DistributedContext, distributed_context
from circuits_llm.training.lock import RunDirectoryBusy, RunLock
from circuits_llm.training.results import HeadTrainingResult
from circuits_llm.training.resume import CHECKPOINT_FILE, CHECKPOINT_KIND
from circuits_llm.training.signals import StopSignals, TrainingInterrupted
from circuits_llm.training.trainer import NonFiniteTrainingError, Trainer

__all__ = ["CHECKPOINT_FILE", "CHECKPOINT_KIND", "NonFiniteTrainingError", "train_head"]

_COMMAND = "circuits-llm train-head"


def _notify(message: str) -> None:
    print(f"{_COMMAND}: {message}", file=sys.stderr, flush=True)


@contextmanager
def _locked(run_dir: Path, context: DistributedContext) -> Iterator[None]:
    """Hold ``run_dir``'s :class:`RunLock` on rank 0; every rank fails if rank 0 cannot get it."""
    lock = RunLock(run_dir, "train-head", _notify) if context.is_writer else None
    failure: Exception | None = None
    if lock is not None:
        try:
            lock.acquire()
        except RunDirectoryBusy as error:
            failure = error
        except OSError as error:
            failure = CheckpointWriteError(
                f"cannot create the lock file in {run_dir} ({error.strerror or error}); check that "
                "the run directory is writable and the disk is not full")
    if bool(context.all_sum(torch.tensor([0.0 if failure is None else 1.0])) > 0):
        raise failure or RunDirectoryBusy(f"rank 0 could not lock {run_dir} (see its message)")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def train_head(model: PreTrainedModel, config: HeadTrainingConfig, run_dir: str | Path, *,
               max_seconds: float | None = None, max_steps: int | None = None,
               progress: bool = True, corpus_root: Path | None = None,
               resume_from: str | Path | None = None,
               handle_signals: bool = False) -> HeadTrainingResult:
    """Train (or resume) a circuit MTP head on ``model`` in ``run_dir``.

    Args:
        model: the target causal LM (Hugging Face); it is frozen and put in eval mode.
        config: the run's :class:`HeadTrainingConfig`.
        run_dir: where ``checkpoint.pt`` (and ``checkpoint.prev.pt``) and the export
            (``head/``, ``adapter/``, ``training.json``) go; a directory with a checkpoint is
            resumed. It is locked for the whole call.
        max_seconds: return after about this many seconds of this call (the checkpoint and the
            export hold the state reached; call again to continue).
        max_steps: stop once this many steps are done in total (at most ``config.steps``).
        progress: show a progress bar (loss, tokens/s, peak step memory, ETA) on rank 0.
        corpus_root: the corpus directory (default: this interpreter's standard library).
        resume_from: resume from this checkpoint file instead of ``run_dir/checkpoint.pt``
            (e.g. ``checkpoint.prev.pt`` when the latest fails its checksum); it must belong to
            the same run (config, model, head). Later checkpoints go to ``run_dir`` as usual.
        handle_signals: handle SIGINT / SIGTERM (main thread only): the first finishes the step,
            writes a checkpoint and returns with ``interrupted_by`` set (no export); a second
            raises :class:`TrainingInterrupted` at once. Off by default: a library call leaves
            the process's signal handling alone unless asked.

    With ``config.draft_block`` the run trains a :class:`~circuits_llm.draft_block.DraftBlock`
    instead of a head, in this same loop (:class:`~circuits_llm.training.block_trainer.
    BlockTrainer`: recursive depths, the model's own law, ``run_dir/block/`` exported); with
    ``config.on_block`` a circuit head on a frozen block's outputs (:class:`~circuits_llm.
    training.block_head_trainer.BlockHeadTrainer`).

    The head's size (rank, draft vocabulary ``K``) is chosen within ``config.head_budget`` of the
    model's parameters unless the config fixes it (:func:`~circuits_llm.training.build.plan_head`);
    ``training.json`` records the choice (``head_size``), the share of training tokens the draft
    vocabulary covers (``draft_vocab_coverage``) and the largest peak memory of a step
    (``peak_step_memory``; per validation period in ``history``).

    Returns:
        :class:`HeadTrainingResult`; ``finished`` tells whether ``config.steps`` were reached.
        The export is written whenever the call returns, finished or not, except after a
        signal (``interrupted_by``), when only the checkpoint is.

    Cached features (``config.cache_features``; :mod:`circuits_llm.training.features`): the
    backbone's features of every training and validation row are computed once into the feature
    cache (``$CIRCUITS_LLM_FEATURE_CACHE``, else ``features/`` beside the corpus cache; resumed if
    interrupted, shared by every run on the same model and data), and the steps run only the head
    and the LoRA layers; ``training.json`` names the files read (``feature_cache``).

    Side effects: seeds torch's global RNG with ``config.seed`` (the LoRA initialisation draws
    from it); freezes ``model`` and puts it in eval mode.

    Raises:
        TrainingConfigError: the config, the head or the corpus does not fit; features cannot be
            cached (:class:`~circuits_llm.training.feature_store.FeatureCacheError`).
        RunDirectoryBusy: another live process holds ``run_dir`` (the message names it).
        CheckpointError: the run directory holds a corrupt checkpoint, or one written with
            another config or model; nothing in ``run_dir`` is changed.
            :class:`~circuits_llm.runtime.checkpoint.CheckpointWriteError`: a write failed (e.g. a full
            disk); the files written before are intact.
        NonFiniteTrainingError: the loss, a gradient or a parameter became NaN or infinite; the
            step is not taken or saved, the last good checkpoint is kept.
        TrainingInterrupted: a second signal (``handle_signals``), or one during setup.
    """
    started = time.perf_counter()
    if not isinstance(config, HeadTrainingConfig):
        raise TrainingConfigError(f"config must be a HeadTrainingConfig, got "
                                  f"{type(config).__name__}")
    for name, value in (("max_seconds", max_seconds), ("max_steps", max_steps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value < 0):
            raise TrainingConfigError(f"{name} must be None or a number >= 0, got {value!r}")
    if not isinstance(model, PreTrainedModel):
        raise TrainingConfigError(f"model must be a Hugging Face PreTrainedModel, got "
                                  f"{type(model).__name__}")
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainingConfigError(f"run_dir {run_dir} exists and is not a directory")
    context = distributed_context(model.device, config.batch_size)
    try:
        kind = BlockTrainer if config.draft_block else \
            BlockHeadTrainer if config.on_block is not None else Trainer
        trainer = kind(model, config, run_dir, context, progress, _notify)
        with StopSignals(handle_signals, _COMMAND) as signals:
            try:
                with _locked(run_dir, context):
                    found = trainer.read_checkpoint(resume_from)  # refused before data are made
                    train, validation = training_sets(model, config, run_dir,
                                                      writer=context.is_writer, root=corpus_root,
                                                      progress=trainer.progress)
                    train, validation = trainer.cached_features(train, validation)
                    trainer.build_head(train)  # its draft vocabulary: the data's frequent tokens
                    trainer.restore(found)
                    with signals.deferred():
                        result = trainer.run(train, validation, started, max_seconds, max_steps,
                                             signals)
                    if trainer.progress:
                        _notify(trainer.summary())
                    return result
            except TrainingInterrupted as stop:
                raise TrainingInterrupted(stop.signal, trainer.interrupted(stop),
                                          second=stop.second) from None
    finally:
        context.close()
