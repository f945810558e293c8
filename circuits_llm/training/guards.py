"""What stops head training before anything poisoned is kept: :class:`NonFiniteTrainingError`.

Head outputs that the circuit refuses (NaN, +inf, a distribution or sum unit with no mass:
:class:`~circuits.errors.InvalidParameterError`, described by :func:`refused_output`) and a NaN or
infinite global loss or gradient norm (:func:`gradient_norm`) stop a step before the optimiser
step; a non-finite parameter (:func:`first_non_finite`) stops before a checkpoint is written. The
error names the step and the last good checkpoint (:func:`non_finite_error`). The checks only read
tensors, so a run stays bit-identical to one without them.

Under DDP the loss and gradient checks see all-reduced values, so every rank stops at the same
step; an invalid output is seen by the rank that computed it, whose exit makes torchrun stop the
others (rank 0 cannot have saved the step: it waits for that rank's gradients).

Kept apart from the trainer (:mod:`circuits_llm.training.trainer`) and the checkpoint
(:mod:`circuits_llm.training.checkpointing`), which both stop through it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from circuits.errors import InvalidParameterError, ParameterProblem


class NonFiniteTrainingError(RuntimeError):
    """The loss, the gradients or the parameters became NaN or infinite (the message names the
    step and the last good checkpoint, which is kept)."""


def non_finite_error(step: int, what: str, kept: str) -> NonFiniteTrainingError:
    """The error that stops training at ``step`` because ``what`` is not finite; ``kept`` says what
    is on disk to resume from."""
    return NonFiniteTrainingError(
        f"step {step}: {what}; training stopped and nothing of this step was saved; "
        f"{kept}; start a new run directory with a lower --lr or with --grad-clip (the "
        "same settings diverge again at this step)")


def refused_output(error: InvalidParameterError) -> str:
    """The head output the circuit refused, for :func:`non_finite_error`'s ``what``."""
    place = f"{error.where}[{', '.join(map(str, error.index))}"
    if error.problem is ParameterProblem.NO_MASS:  # index: (batch, fold, unit)
        what, unit = f"{place}, :] has no mass", error.index[-1]
    else:  # index: (batch, fold, unit, category or input)
        problem = error.problem.value if error.problem else "invalid"
        what, unit = f"{place}] is {problem}", error.index[-2]
    return f"the head's output {what} (unit {unit} of {error.layer})"


def first_non_finite(tensors: Mapping[str, Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity (None: none)."""
    return next((name for name, value in tensors.items()
                 if value.is_floating_point() and not bool(torch.isfinite(value).all())), None)


def gradient_norm(parameters: Iterable[nn.Parameter]) -> float:
    """The global L2 norm of the parameters' gradients (0.0 when there are none)."""
    norms = [torch.linalg.vector_norm(p.grad.detach().float()) for p in parameters
             if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
