"""The one parameter type of the queries (:class:`LogParameters`), the pass trace, and the cache
that normalises a module's own parameters once per change of their values.

Every query turns whatever parameters it is given (none: the module's own; a mapping of raw
external tensors; an already made :class:`LogParameters`) into one :class:`LogParameters` on
entry (:meth:`CircuitCore.resolve_params <circuits.compiled.core.CircuitCore.resolve_params>`);
the bottom-up, derivative and top-down passes only ever see that type. This module sits below
the circuit class and the query modules, which all import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from circuits.compiled.layers import SoftmaxParts
from circuits.errors import InvalidInputError
from circuits.kernels import ExpWeights, exp_weights

Params = Mapping[str, Tensor]


@dataclass(frozen=True, eq=False)  # identity equality: tensors have no truth value
class LogParameters:
    """Every parameterised fold's normalised log-parameters, computed once for several passes.

    Made by :meth:`CompiledCircuit.log_parameters` (and, inside every query, from the raw
    parameters it was given); every query accepts it in place of a raw ``params`` mapping and then
    skips the parameterisation (e.g. a log-softmax over a vocabulary) that it would otherwise
    recompute, and the value check that ``log_parameters`` already did. ``values[fold_id]`` is
    ``(F, K, D)`` for the module's own parameters or ``(S, F, K, D)`` for external ones; ``batch``
    is ``S`` (None when every fold uses the module's own). Differentiable when the raw parameters
    were. Where the triton kernels run on gradient-free softmax logits, an input fold's entry is a
    :class:`~circuits.compiled.layers.SoftmaxParts` instead of the log-softmax table.
    """

    values: dict[int, Tensor | SoftmaxParts]
    batch: int | None
    #: tensors derived from ``values`` (gradient-free), filled on demand by the methods below:
    #: ``("probs", fold_id)`` and ``("exp_weights", fold_id)``.
    derived: dict[tuple[str, int], object] = field(default_factory=dict, repr=False)

    def probs(self, fold_id: int) -> Tensor:
        """``exp(values[fold_id])`` of an input fold, computed once (no gradient)."""
        key = ("probs", fold_id)
        if key not in self.derived:
            table = self.values[fold_id]
            if isinstance(table, SoftmaxParts):
                table = table.log_probs()
            self.derived[key] = table.detach().exp()
        return self.derived[key]  # type: ignore[return-value]

    def exp_weights(self, fold_id: int) -> ExpWeights:
        """:func:`~circuits.kernels.exp_weights` of a sum fold, computed once."""
        key = ("exp_weights", fold_id)
        if key not in self.derived:
            table = self.values[fold_id]
            assert isinstance(table, Tensor), "sum folds always hold tensors"
            self.derived[key] = exp_weights(table.detach())
        return self.derived[key]  # type: ignore[return-value]

    def expand(self, sets: int) -> LogParameters:
        """These single-set parameters seen as ``sets`` sets (stride-0 views, no copy)."""
        if self.batch in (None, sets):
            return self
        if self.batch != 1:
            raise InvalidInputError(f"only one parameter set can be expanded, not {self.batch}")
        values: dict[int, Tensor | SoftmaxParts] = {}
        for key, value in self.values.items():
            if isinstance(value, SoftmaxParts):
                values[key] = value.expand(sets)
            else:
                values[key] = value.expand(sets, *value.shape[1:]) if value.dim() == 4 else value
        return LogParameters(values, sets)


#: what every query accepts as parameters: raw external tensors or prepared log-parameters.
ParamsLike = Params | LogParameters


@dataclass
class Trace:
    """Everything a bottom-up pass computed, for the top-down passes that follow it.

    ``outputs[i]`` is fold ``i``'s output ``(F, B, K)``; ``sum_inputs[i]`` the concatenated input
    of sum fold ``i`` ``(F, B, D)``; ``log_params[i]`` its log-weights or log-probabilities
    (an input fold's may be :class:`~circuits.compiled.layers.SoftmaxParts`; read-only: they may
    be the module's cached own parameters); ``sum_parts[i]`` (gradient-free SUM passes on the
    torch path) the ``(probs, total)`` that :func:`~circuits.kernels.torch_log_matmul` computed
    for sum fold ``i``.
    """

    outputs: list[Tensor] = field(default_factory=list)
    sum_inputs: dict[int, Tensor] = field(default_factory=dict)
    log_params: dict[int, Tensor | SoftmaxParts] = field(default_factory=dict)
    sum_parts: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)


#: same-width integer views: cached values are compared bit for bit (NaN, -0.0 and -inf included)
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


@dataclass(frozen=True)
class OwnEntry:
    """A fold's own raw parameters as they were when checked and normalised, and the results."""

    bits: Tensor
    inference: bool
    value: Tensor
    #: a sum fold's :func:`~circuits.kernels.exp_weights` (None for input folds)
    weights: ExpWeights | None


class OwnParameterCache:
    """A module's own parameters, checked and normalised once per change of their values.

    Queries that use a fold's own parameters used to check and normalise them on every call (a
    row-wise check, a log-softmax over every input unit's categories and the sum weights'
    ``exp``: about a fifth of a BTree log-likelihood on two CPU threads). This cache keeps, per
    fold, a bit-for-bit copy of the raw tensor it last checked and normalised. A call reuses the
    result only when the raw tensor still holds exactly those bits: one comparison instead of a
    check and a normalisation, and nothing can go stale, whatever changed the parameters (an
    optimiser step, ``load_state_dict``, an edit through ``.data``, which version counters miss).
    Only CPU tensors are cached (elsewhere the comparison would cost a host synchronisation per
    fold), and never where a gradient must reach the parameters. Entries made in inference mode
    serve only inference mode (inference tensors cannot enter autograd graphs later). The cached
    tensors are shared by the calls that hit them: passes read them and never write them.
    ``.to()`` and the like clear the cache.
    """

    def __init__(self) -> None:
        self.entries: dict[int, OwnEntry] = {}

    @staticmethod
    def usable(raw: Tensor) -> bool:
        """Whether ``raw`` may be served from (and stored in) the cache in this call."""
        return (raw.device.type == "cpu" and raw.dtype in _BITS
                and not (raw.requires_grad and torch.is_grad_enabled()))

    def lookup(self, fold_id: int, raw: Tensor) -> OwnEntry | None:
        """The entry of fold ``fold_id`` when ``raw`` holds exactly the bits it was made from."""
        entry = self.entries.get(fold_id)
        if entry is None or not self.usable(raw) or raw.shape != entry.bits.shape \
                or raw.dtype != entry.value.dtype \
                or (entry.inference and not torch.is_inference_mode_enabled()):
            return None
        with torch.no_grad():
            same = torch.equal(raw.view(_BITS[raw.dtype]), entry.bits)
        return entry if same else None

    def store(self, fold_id: int, raw: Tensor, value: Tensor, sum_fold: bool) -> None:
        """Remember ``value``, the normalisation of ``raw`` (already checked), for fold ``fold_id``."""
        if not self.usable(raw):
            return
        with torch.no_grad():
            bits = raw.detach().view(_BITS[raw.dtype]).clone()
            value = value.detach()
            weights = exp_weights(value) if sum_fold else None
        self.entries[fold_id] = OwnEntry(bits, torch.is_inference_mode_enabled(), value, weights)

    def clear(self) -> None:
        self.entries.clear()


__all__ = ["LogParameters", "OwnEntry", "OwnParameterCache", "Params", "ParamsLike", "Trace"]
