"""The compiled circuit: a :class:`~circuits.compiled.core.CircuitCore` with the queries as methods.

The queries are functions over a core and its parameters (:mod:`circuits.compiled.queries`,
:mod:`circuits.compiled.sampling`), which import neither this module nor each other's callers;
:class:`CompiledCircuit` only forwards to them. Parameters supplied per call are a mapping from a
fold's name to a raw tensor with a leading batch dimension (see :mod:`circuits.compiled.core`).
Several queries on the same parameters can share one normalisation:
``prepared = compiled.log_parameters(params)`` (:class:`LogParameters`) is accepted wherever
``params`` is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

import circuits.compiled.queries as queries
import circuits.compiled.sampling as sampling
from circuits.compiled.core import CircuitCore, ParameterSpec
from circuits.compiled.prepared import LogParameters, ParamsLike, Trace
from circuits.errors import InvalidInputError
from circuits.symbolic import Circuit


class CompiledCircuit(CircuitCore):
    """A folded, log-space torch implementation of a smooth and decomposable circuit.

    Build it with :func:`circuits.compile`. Data ``x`` is a ``(B, V)`` integer tensor with
    ``V = circuit.num_variables`` columns; ``observed`` is a ``(B, V)`` or ``(V,)`` bool mask.
    """

    def forward(self, x: Tensor, observed: Tensor | None = None,
                params: ParamsLike | None = None) -> Tensor:
        """Log-likelihood (all observed) or log-marginal (``observed`` mask) per row: ``(B,)``."""
        return queries.log_marginal(self, x, observed, params)

    def log_likelihood(self, x: Tensor, params: ParamsLike | None = None) -> Tensor:
        """``log c(x)`` for complete data ``x`` (B, V): ``(B,)``."""
        return queries.log_marginal(self, x, None, params)

    def log_marginal(self, x: Tensor, observed: Tensor, params: ParamsLike | None = None) -> Tensor:
        """``log sum_{unobserved} c(x)``: the marginal of the observed variables, ``(B,)``."""
        return queries.log_marginal(self, x, observed, params)

    def log_partition(self, params: ParamsLike | None = None) -> Tensor:
        """``log Z``: a scalar, or ``(B,)`` when external parameters with batch B are given."""
        return queries.log_partition(self, params)

    def log_conditional(self, x: Tensor, observed: Tensor, variables: Sequence[int] | None = None,
                        params: ParamsLike | None = None) -> Tensor:
        """See :func:`circuits.compiled.queries.log_conditional`."""
        return queries.log_conditional(self, x, observed, variables, params)

    def log_prefix_marginals(self, x: Tensor, order: Sequence[int] | None = None,
                             params: ParamsLike | None = None) -> Tensor:
        """See :func:`circuits.compiled.queries.log_prefix_marginals`."""
        return queries.log_prefix_marginals(self, x, order, params)

    def log_prefix_conditionals(self, x: Tensor, order: Sequence[int] | None = None,
                                params: ParamsLike | None = None) -> Tensor:
        """See :func:`circuits.compiled.queries.log_prefix_conditionals`."""
        return queries.log_prefix_conditionals(self, x, order, params)

    def sample(self, num_samples: int | None = None, generator: torch.Generator | None = None,
               params: ParamsLike | None = None) -> Tensor:
        """See :func:`circuits.compiled.sampling.sample`."""
        return sampling.sample(self, num_samples, generator, params)

    def conditional_sample(self, x: Tensor, observed: Tensor,
                           generator: torch.Generator | None = None,
                           params: ParamsLike | None = None) -> Tensor:
        """See :func:`circuits.compiled.sampling.conditional_sample`."""
        return sampling.conditional_sample(self, x, observed, generator, params)

    def map_state(self, x: Tensor | None = None, observed: Tensor | None = None,
                  params: ParamsLike | None = None) -> tuple[Tensor, Tensor]:
        """See :func:`circuits.compiled.sampling.map_state`."""
        return sampling.map_state(self, x, observed, params)


def compile(circuit: Circuit, *, fold: bool = True, dtype: torch.dtype = torch.float32,
            device: torch.device | str | None = None, seed: int = 0,
            validate: bool = True) -> CompiledCircuit:
    """Compile a smooth and decomposable symbolic circuit into a folded torch module.

    Args:
        circuit: the symbolic circuit; its output layer must have one unit.
        fold: stack same-signature layers of equal depth (``False``: one fold per layer, the
            naive reference evaluation).
        dtype: float32 or float64 parameters and computation.
        device: where the module lives (``"cpu"``, ``"cuda"``...).
        seed: seeds the random initialisation of layers without ``initial`` parameters.
        validate: run :func:`circuits.structure.check` first (raises StructureError).

    Raises:
        InvalidParameterError: a parameter (after the cast to ``dtype``) is NaN or +inf, or a
            row of them is all -inf; the message names the fold, layer and first bad index.
    """
    if dtype not in (torch.float32, torch.float64):
        raise InvalidInputError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    module = CompiledCircuit(circuit, fold=fold, seed=seed, validate=validate)
    module = module.to(dtype=dtype, device=device)
    module.resolve_params(None, None)  # NaN, +inf or no-mass parameters (e.g. from `initial`)
    return module


__all__ = ["CompiledCircuit", "LogParameters", "ParameterSpec", "Trace", "compile"]
