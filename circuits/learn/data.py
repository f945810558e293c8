"""Training data for :func:`circuits.learn.fit`: checked once, whole, before anything is learned.

A data set is ``x`` (N, V), one column per variable of the circuit, and an optional mask
``observed`` (N, V) bool (or (V,) for every row): entries marked False are *missing*; the circuit
sums them out, so learning maximises the exact marginal likelihood of what was observed. Missing
entries may hold anything (NaN included). Columns of variables outside the circuit's scope are not
read by any unit and are treated as missing.

Every problem is one :class:`~circuits.errors.InvalidInputError` that names the data set, the row,
the variable and the value, raised before any parameter changes: a tensor of the wrong shape or
type, NaN or infinity in an observed entry, a value of a discrete variable (Categorical,
Bernoulli, Binomial) that is not an integer or lies outside ``0 .. size - 1``. Then the model's
own input check (``validate_data``) runs on the whole set. Data of circuits with Gaussian
(real-valued) variables is kept as floats, discrete columns holding integral values.

Device: the checked data set lives on the model's device (that of its parameters). Data given on
another device (a CPU tensor or a numpy array for a CUDA model) is copied there once, whole, before
the checks, which then run on that device with one host synchronisation each when all is well.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from circuits.compiled import CircuitCore
from circuits.errors import InvalidInputError


@dataclass(frozen=True)
class Dataset:
    """Checked data: ``x`` (N, V) in the dtype the model reads, ``observed`` (N, V) bool."""

    x: Tensor
    observed: Tensor

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def rows(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """Rows ``index`` of ``x`` and ``observed``."""
        return self.x.index_select(0, index), self.observed.index_select(0, index)


def _as_tensor(value: object, what: str) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    raise InvalidInputError(f"{what} must be a torch.Tensor or a numpy array, got {type(value).__name__}")


def discrete_sizes(model: CircuitCore) -> dict[int, int]:
    """``{variable: number of values}`` for the discrete scope variables (Categorical, Bernoulli,
    Binomial); Gaussian (real-valued) variables are absent."""
    continuous = set(getattr(model, "continuous_variables", ()))
    return {v: model.category_sizes[v] for v in model.scope if v not in continuous}


def prepare_data(model: CircuitCore, data: object, observed: object = None,
                 name: str = "data") -> Dataset:
    """Check ``data`` (and ``observed``) against ``model`` and return them as a :class:`Dataset`.

    Args:
        model: the compiled circuit the data is for.
        data: (N, V) tensor or numpy array; integer values of discrete variables (or floats
            holding integers), real values of Gaussian ones.
        observed: None (everything observed), or a bool (N, V) / (V,) tensor or array.
        name: how messages call the data set (``"data"``, ``"valid"``).

    Raises:
        InvalidInputError: naming the row, variable and value at fault (see the module docs).
    """
    x = _as_tensor(data, name)
    variables = model.num_variables
    if x.dim() != 2 or x.shape[1] != variables:
        raise InvalidInputError(
            f"{name} must have shape (rows, {variables}): one column per variable of the circuit, "
            f"got {tuple(x.shape)}")
    if x.dtype == torch.bool or x.is_complex():
        raise InvalidInputError(f"{name} must hold numbers (integer categories), got {x.dtype}")
    rows = x.shape[0]
    device = model.device
    x = x.to(device)  # the one copy of data held elsewhere; everything below runs on the model's
    mask = _observed_mask(observed, rows, variables, name, device)
    scope = torch.zeros(variables, dtype=torch.bool, device=device)
    scope[list(model.scope)] = True
    mask = mask & scope[None, :]
    if x.is_floating_point():
        _check_finite(x, mask, name)
    sizes = discrete_sizes(model)
    _check_values(x, mask, sizes, name)
    x = torch.where(mask, x, x.new_zeros(()))
    if getattr(model, "real_valued", False):  # Gaussian variables: every column as a float
        x = x.to(torch.promote_types(x.dtype if x.is_floating_point() else model.dtype, model.dtype))
    else:
        x = x.to(torch.long)
    x, mask = model.validate_data(x, mask)  # the model's own rules (other families)
    return Dataset(x, mask)


def _observed_mask(observed: object, rows: int, variables: int, name: str,
                  device: torch.device) -> Tensor:
    if observed is None:
        return torch.ones(rows, variables, dtype=torch.bool, device=device)
    mask = _as_tensor(observed, f"the observed mask of {name}")
    if mask.dtype != torch.bool:
        raise InvalidInputError(
            f"the observed mask of {name} must be bool (True = observed), got {mask.dtype}")
    if mask.dim() == 1 and mask.shape[0] == variables:
        mask = mask[None, :]
    if mask.dim() != 2 or mask.shape[1] != variables or mask.shape[0] not in (1, rows):
        raise InvalidInputError(
            f"the observed mask of {name} must have shape ({rows}, {variables}) or ({variables},), "
            f"got {tuple(mask.shape)}")
    return mask.to(device).expand(rows, variables)


def _first(bad: Tensor) -> tuple[int, int]:
    row, col = (int(i) for i in bad.nonzero()[0])
    return row, col


def _check_finite(values: Tensor, mask: Tensor, name: str) -> None:
    nan = mask & torch.isnan(values)
    if bool(nan.any()):
        row, col = _first(nan)
        raise InvalidInputError(
            f"{name}[{row}, {col}] is NaN (variable {col}): mark missing entries as unobserved "
            f"instead, e.g. observed=~torch.isnan({name})")
    infinite = mask & torch.isinf(values)
    if bool(infinite.any()):
        row, col = _first(infinite)
        raise InvalidInputError(
            f"{name}[{row}, {col}] = {float(values[row, col])} (variable {col}) is not finite")


def _check_values(values: Tensor, mask: Tensor, sizes: dict[int, int], name: str) -> None:
    if not sizes:
        return
    limits = torch.tensor([sizes.get(v, -1) for v in range(values.shape[1])], dtype=torch.long,
                          device=values.device)
    checked = mask & (limits >= 0)[None, :]
    if values.is_floating_point():
        fractional = checked & (values != torch.round(values))
        if bool(fractional.any()):
            row, col = _first(fractional)
            raise InvalidInputError(
                f"{name}[{row}, {col}] = {float(values[row, col])} is not a value of variable "
                f"{col}: it is discrete, with integer values 0..{sizes[col] - 1}")
    outside = checked & ((values < 0) | (values >= limits[None, :].to(values.dtype)))
    if bool(outside.any()):
        row, col = _first(outside)
        value = values[row, col]
        shown = int(value) if not values.is_floating_point() else float(value)
        raise InvalidInputError(
            f"{name}[{row}, {col}] = {shown} is outside the values of variable {col} "
            f"(valid: 0..{sizes[col] - 1})")


__all__ = ["Dataset", "discrete_sizes", "prepare_data"]
