"""The training loop: :func:`fit` a compiled circuit to data with EM or any torch optimiser.

One loop serves every optimiser. Each epoch shuffles the rows (a generator seeded by ``seed``)
and walks them in batches; with :class:`~circuits.learn.EM` a batch is one statistics pass
(:meth:`EM.accumulate <circuits.learn.EM.accumulate>`) and one step, with any other optimiser
(Adam, SGD, ...) it is ``zero_grad``, the mean negative log-likelihood of the batch, ``backward``
and ``step``. The objective is always the normalised log-likelihood ``log c(x) - log Z``, the
exact marginal one where entries are missing (``observed``).

After every epoch: the training log-likelihood (mean over rows, per row, in nats, of the batches
as they were seen: before each batch's update), the validation one (mean per row, after the
epoch), the seconds the epoch's training took (validation and checkpointing excluded), early
stopping on the validation log-likelihood (``patience``), and a checkpoint (``checkpoint=path``).
A run given a path that holds a checkpoint of the same configuration resumes from it: the model,
the optimiser, the shuffling generator, the history and the early-stopping state are restored, so
an interrupted and resumed run computes exactly what an uninterrupted one does.

Under ``torchrun`` every process reads its share of each batch and the statistics (EM) or the
gradients (other optimisers) are summed over processes before each step
(:mod:`circuits.learn.distributed`); rank 0 writes the checkpoint and shows the progress bar.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from circuits.compiled import CircuitCore, queries
from circuits.errors import InvalidInputError
from circuits.learn.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from circuits.learn.data import Dataset, prepare_data
from circuits.learn.distributed import LearningContext, learning_context
from circuits.learn.em import EM


@dataclass
class FitHistory:
    """Per-epoch record of a :func:`fit` run (lists indexed by epoch, 0-based).

    Attributes:
        train_ll: mean log-likelihood per row of the training batches, in nats, each computed
            before its batch's update.
        valid_ll: mean log-likelihood per validation row after each epoch (empty without
            validation data).
        epoch_seconds: wall-clock seconds of each epoch's training (not validation).
        best_epoch: the epoch with the highest ``valid_ll`` (None without validation data).
        stopped_early: whether ``patience`` ended the run before ``epochs``.
    """

    train_ll: list[float] = field(default_factory=list)
    valid_ll: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    best_epoch: int | None = None
    stopped_early: bool = False

    @property
    def epochs(self) -> int:
        return len(self.train_ll)


@dataclass
class _Progress:
    """What a checkpoint must restore besides the model and the optimiser."""

    history: FitHistory
    best_ll: float = -math.inf
    bad_epochs: int = 0
    best_state: dict[str, Tensor] | None = None


def fit(model: CircuitCore, data: object, *, optimizer: torch.optim.Optimizer, epochs: int,
        batch_size: int, valid: object = None, seed: int = 0, observed: object = None,
        valid_observed: object = None, patience: int | None = None, restore_best: bool = True,
        checkpoint: str | os.PathLike[str] | None = None, progress: bool = True) -> FitHistory:
    """Fit ``model`` to ``data`` for ``epochs`` epochs; returns the :class:`FitHistory`.

    Args:
        model: a compiled circuit (:func:`circuits.compile`); trained in place.
        data: (N, V) training rows (tensor or numpy array), see :mod:`circuits.learn.data`.
        optimizer: :class:`~circuits.learn.EM` over ``model``, or any torch optimiser over
            ``model.parameters()``.
        epochs: total number of epochs (a resumed run continues up to it).
        batch_size: rows per step (the global batch under ``torchrun``); ``N`` gives full-batch
            EM with one step per epoch.
        valid: optional (M, V) validation rows.
        seed: seeds the shuffling.
        observed, valid_observed: optional bool masks of observed entries ((N, V) or (V,));
            missing entries are summed out (exact marginal likelihood).
        patience: stop after this many epochs without a better validation log-likelihood
            (needs ``valid``); None never stops early.
        restore_best: with ``valid``, end with the parameters of the best validation epoch.
        checkpoint: a file to write after every epoch and to resume from when it exists.
        progress: show a tqdm progress bar (rank 0 only).

    Device: learning runs on the model's device (that of its parameters: move the model first,
    ``model.to("cuda")``), and every tensor it makes lives there. ``data`` and ``valid`` given on
    another device (a CPU tensor or a numpy array for a CUDA model) are copied to the model's
    device once, whole, when the call starts: one transfer per call and device memory for the
    whole set (``N x V`` int64 entries for discrete circuits, floats of the model's dtype for
    real-valued ones, plus an ``N x V`` bool mask), and no host-to-device copy per batch. The
    shuffled order is drawn on the CPU (the same order for a ``seed`` on every device) and moved
    once per epoch. A data set too large for the device memory: call :meth:`EM.accumulate
    <circuits.learn.EM.accumulate>` (which moves each batch it is given) and ``step`` on batches
    of your own.

    Raises:
        InvalidInputError: bad arguments or data (one message naming the variable and value),
            before any parameter changes.
        CheckpointError: the checkpoint is corrupt or belongs to a different configuration.
    """
    _check_arguments(model, optimizer, epochs, batch_size, patience, valid)
    train = prepare_data(model, data, observed, "data")
    if len(train) == 0:
        raise InvalidInputError("data has no rows: give at least one row to fit")
    held_out = prepare_data(model, valid, valid_observed, "valid") if valid is not None else None
    context = learning_context(model.device)
    try:
        return _run(model, train, held_out, optimizer, epochs, batch_size, seed, patience,
                    restore_best, None if checkpoint is None else Path(checkpoint), progress,
                    context)
    finally:
        context.close()


def _check_arguments(model: CircuitCore, optimizer: object, epochs: object, batch_size: object,
                     patience: object, valid: object) -> None:
    if not isinstance(model, CircuitCore):
        raise InvalidInputError(
            f"fit needs a compiled circuit (circuits.compile(...)), got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            f"optimizer must be a torch.optim.Optimizer (circuits.learn.EM(model) or e.g. "
            f"torch.optim.Adam(model.parameters())), got {type(optimizer).__name__}")
    if isinstance(optimizer, EM) and optimizer.model is not model:
        raise InvalidInputError("the EM optimizer was made for another model: use EM(model)")
    for name, value, low in (("epochs", epochs, 0), ("batch_size", batch_size, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InvalidInputError(f"{name} must be an int >= {low}, got {value!r}")
    if patience is not None:
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise InvalidInputError(f"patience must be an int >= 1 or None, got {patience!r}")
        if valid is None:
            raise InvalidInputError("patience (early stopping) needs validation data: pass valid=")


def _run(model: CircuitCore, train: Dataset, valid: Dataset | None, optimizer: torch.optim.Optimizer,
         epochs: int, batch_size: int, seed: int, patience: int | None, restore_best: bool,
         checkpoint: Path | None, progress: bool, context: LearningContext) -> FitHistory:
    generator = torch.Generator().manual_seed(seed)
    state = _Progress(FitHistory())
    fingerprint: dict[str, Any] = {}
    if checkpoint is not None:
        fingerprint = _fingerprint(model, optimizer, train, valid, batch_size, seed)
    if checkpoint is not None and checkpoint.exists():
        _resume(checkpoint, fingerprint, model, optimizer, generator, state)
    bar = tqdm(total=epochs, initial=min(state.history.epochs, epochs), unit="epoch", desc="fit",
               disable=not (progress and context.is_writer), leave=False)
    try:
        while state.history.epochs < epochs and not state.history.stopped_early:
            started = time.perf_counter()
            train_ll = _train_epoch(model, train, optimizer, batch_size, generator, context)
            seconds = time.perf_counter() - started
            history = state.history
            history.train_ll.append(train_ll)
            history.epoch_seconds.append(seconds)
            if valid is not None:
                _after_validation(model, valid, batch_size, context, state, patience)
            if checkpoint is not None:
                if context.is_writer:
                    save_checkpoint(checkpoint, _payload(fingerprint, model, optimizer, generator, state),
                                    history.epochs)
                context.barrier()
            postfix = {"train_ll": f"{train_ll:.4f}"}
            if history.valid_ll:
                postfix["valid_ll"] = f"{history.valid_ll[-1]:.4f}"
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
    finally:
        bar.close()
    if restore_best and state.best_state is not None:
        model.load_state_dict(state.best_state)
    return state.history


def _train_epoch(model: CircuitCore, train: Dataset, optimizer: torch.optim.Optimizer,
                 batch_size: int, generator: torch.Generator, context: LearningContext) -> float:
    """One pass over the shuffled rows; returns the mean log-likelihood per row (before updates)."""
    device = train.x.device  # the model's (prepare_data)
    # drawn on the CPU generator's device (the same order on every device), moved once per epoch
    order = torch.randperm(len(train), generator=generator, device=generator.device).to(device)
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of log-likelihoods, rows)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    for start in range(0, len(train), batch_size):
        batch = order[start:start + batch_size]
        mine = context.shard(batch)
        x, observed = train.rows(mine)
        if isinstance(optimizer, EM):
            log_likelihood = optimizer.accumulate_checked(x, observed)
            if context.enabled:
                optimizer.all_reduce(context)
            optimizer.step()
        else:
            optimizer.zero_grad()
            if x.shape[0] > 0:
                log_likelihood = normalised_log_likelihood(model, x, observed)
                (-log_likelihood.sum() / batch.shape[0]).backward()
            else:
                log_likelihood = torch.zeros(0, dtype=torch.float64, device=device)
            if context.enabled:
                grads = []
                for p in parameters:
                    if p.requires_grad:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        grads.append(p.grad)
                context.all_sum_(grads)
            optimizer.step()
        total[0] += log_likelihood.detach().double().sum()
        total[1] += x.shape[0]
    context.all_sum_([total])
    return float(total[0] / total[1])


def normalised_log_likelihood(model: CircuitCore, x: Tensor, observed: Tensor | None = None) -> Tensor:
    """``log c(x) - log Z`` per row (B,), the log-marginal where ``observed`` is False; differentiable."""
    values = queries.log_marginal(model, x, observed)
    if not model.normalized:
        values = values - queries.log_partition(model)
    return values


@torch.no_grad()
def _evaluate(model: CircuitCore, data: Dataset, batch_size: int, context: LearningContext) -> float:
    """Mean log-likelihood per row of ``data`` (every process reads its share)."""
    total = torch.zeros(2, dtype=torch.float64, device=data.x.device)
    rows = torch.arange(len(data), device=data.x.device)
    for start in range(0, len(data), batch_size):
        mine = context.shard(rows[start:start + batch_size])
        if mine.shape[0] == 0:
            continue
        x, observed = data.rows(mine)
        total[0] += normalised_log_likelihood(model, x, observed).double().sum()
        total[1] += mine.shape[0]
    context.all_sum_([total])
    return float(total[0] / total[1]) if total[1] > 0 else math.nan


def _after_validation(model: CircuitCore, valid: Dataset, batch_size: int, context: LearningContext,
                      state: _Progress, patience: int | None) -> None:
    history = state.history
    value = _evaluate(model, valid, batch_size, context)
    history.valid_ll.append(value)
    if value > state.best_ll:  # NaN never improves
        state.best_ll, state.bad_epochs = value, 0
        history.best_epoch = history.epochs - 1
        state.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        state.bad_epochs += 1
        if patience is not None and state.bad_epochs >= patience:
            history.stopped_early = True


def _digest(*tensors: Tensor | None) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        if tensor is None:
            digest.update(b"none")
            continue
        digest.update(f"{tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _fingerprint(model: CircuitCore, optimizer: torch.optim.Optimizer, train: Dataset,
                 valid: Dataset | None, batch_size: int, seed: int) -> dict[str, Any]:
    """What must be equal for a checkpoint to continue this run."""
    return {
        "parameters": {name: list(shape) for name, shape in model.parameter_shapes().items()},
        "dtype": str(model.dtype),
        "optimizer": type(optimizer).__name__,
        "batch_size": batch_size,
        "seed": seed,
        "data": _digest(train.x, train.observed),
        "valid": None if valid is None else _digest(valid.x, valid.observed),
    }


def _payload(fingerprint: dict[str, Any], model: CircuitCore, optimizer: torch.optim.Optimizer,
             generator: torch.Generator, state: _Progress) -> dict[str, Any]:
    return {
        "fingerprint": fingerprint,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "generator": generator.get_state(),
        "history": asdict(state.history),
        "best_ll": state.best_ll,
        "bad_epochs": state.bad_epochs,
        "best_state": state.best_state,
    }


def _resume(path: Path, fingerprint: dict[str, Any], model: CircuitCore,
            optimizer: torch.optim.Optimizer, generator: torch.Generator, state: _Progress) -> None:
    payload = load_checkpoint(path)
    saved = payload.get("fingerprint")
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path} has no run fingerprint; delete it to start over")
    differing = sorted(key for key in fingerprint.keys() | saved.keys()
                       if fingerprint.get(key) != saved.get(key))
    if differing:
        raise CheckpointError(
            f"checkpoint {path} belongs to a different run: its {', '.join(differing)} differ from "
            "this call's; pass the same model, optimizer, data, batch_size and seed to resume, or "
            "another checkpoint path (or delete the file) to start over")
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    generator.set_state(payload["generator"])
    history = payload["history"]
    state.history = FitHistory(**history)
    state.best_ll = float(payload["best_ll"])
    state.bad_epochs = int(payload["bad_epochs"])
    state.best_state = payload["best_state"]


__all__ = ["FitHistory", "fit", "normalised_log_likelihood"]
