"""Parameterisations: how raw, unconstrained tensors become (log-)weights of a circuit.

A parameterisation is an explicit object attached to every input and sum layer. It maps a raw
tensor whose last dimension indexes the alternatives (the categories of a categorical input unit,
or the inputs of a sum unit) to log-weights along that dimension.

* :class:`Softmax` gives normalised weights (each row sums to one); circuits whose layers all use
  it are normalised by construction, so their partition function is 1.
* :class:`Exp` gives unnormalised positive weights ``exp(raw)``; the partition function is then
  whatever the circuit computes, and :meth:`CompiledCircuit.log_partition` is the query for it.
* :class:`Native` marks the input families that hold their own raw parameters (a Bernoulli or
  Binomial success logit, a Gaussian mean and log-standard-deviation): their densities are
  normalised and computed by the family (:mod:`circuits.compiled.input_families`), so there is no
  table of log-weights to map to.

Both are differentiable and work on any leading batch dimensions, which is what lets the same
compiled circuit run with parameters supplied per call (one parameter set per batch row).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits.errors import StructureError


class Parameterization(ABC):
    """Maps raw parameters (last dimension = alternatives) to log-weights."""

    #: True when every row of the resulting weights sums to one.
    normalized: bool

    @abstractmethod
    def log_weights(self, raw: Tensor) -> Tensor:
        """Log-weights of the same shape as ``raw``, normalised along the last dimension or not."""

    def initial_raw(self, shape: tuple[int, ...], generator: torch.Generator | None = None,
                    dtype: torch.dtype = torch.float32) -> Tensor:
        """A random raw tensor of ``shape`` to initialise a layer (standard normal)."""
        return torch.randn(shape, generator=generator, dtype=dtype)


@dataclass(frozen=True)
class Softmax(Parameterization):
    """Normalised weights ``softmax(raw)`` along the last dimension (sum weights, categorical logits)."""

    normalized: bool = True

    def log_weights(self, raw: Tensor) -> Tensor:
        return torch.log_softmax(raw, dim=-1)


@dataclass(frozen=True)
class Exp(Parameterization):
    """Unnormalised positive weights ``exp(raw)``: raw values are log-weights as they are.

    ``-inf`` raw entries are exact zeros, which is how structured (sparse) weights are written.
    """

    normalized: bool = False

    def log_weights(self, raw: Tensor) -> Tensor:
        return raw


@dataclass(frozen=True)
class Native(Parameterization):
    """The raw parameters of a Bernoulli, Binomial or Gaussian input layer, read by its family.

    Those families are normalised densities over their domain whatever their (finite) raw values,
    so :attr:`normalized` is True; their log-densities come from
    :mod:`circuits.compiled.input_families`, not from a table of log-weights. Set automatically on
    such layers (``InputLayer(..., Gaussian())``); a Categorical layer cannot use it.
    """

    normalized: bool = True

    def log_weights(self, raw: Tensor) -> Tensor:
        raise StructureError(
            "Native parameters (Bernoulli, Binomial, Gaussian input layers) have no table of "
            "log-weights; operations that need one (such as circuits.operations.multiply) support "
            "Categorical input layers only")
