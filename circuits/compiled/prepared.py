"""Normalised log-parameters computed once and shared by several queries (:class:`LogParameters`).

:meth:`CompiledCircuit.log_parameters <circuits.compiled.circuit.CompiledCircuit.log_parameters>`
checks the raw parameters (names, shapes, values: :mod:`circuits.compiled.validity`) and then
calls :func:`prepare`; queries that already validated their parameters call :func:`prepare`
directly, so nothing is checked twice in one call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from circuits.compiled.folding import FoldPlan
from circuits.compiled.layers import ExpWeights, FoldedInput, FoldedSum, SoftmaxParts, exp_weights
from circuits.errors import InvalidInputError

Params = Mapping[str, Tensor]


@dataclass(frozen=True, eq=False)  # identity equality: tensors have no truth value
class LogParameters:
    """Every parameterised fold's normalised log-parameters, computed once for several queries.

    Made by :meth:`CompiledCircuit.log_parameters`; every query accepts it in place of a raw
    ``params`` mapping and then skips the parameterisation (e.g. a log-softmax over a
    vocabulary) that it would otherwise recompute, and the value check that
    ``log_parameters`` already did. ``values[fold_id]`` is ``(F, K, D)`` for the
    module's own parameters or ``(S, F, K, D)`` for external ones; ``batch`` is ``S`` (None when
    every fold uses the module's own). Differentiable when the raw parameters were. Where the
    triton kernels run on gradient-free softmax logits, an input fold's entry is a
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
        """:func:`~circuits.compiled.layers.exp_weights` of a sum fold, computed once."""
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


def prepare(plans: Sequence[FoldPlan], folds: Iterable[nn.Module], checked: Params,
            batch: int | None) -> LogParameters:
    """The :class:`LogParameters` of *validated* raw parameters ``checked`` (batch ``batch``;
    folds missing from ``checked`` use their own parameters)."""
    values: dict[int, Tensor | SoftmaxParts] = {}
    for plan, module in zip(plans, folds, strict=True):
        if isinstance(module, FoldedInput):
            raw = checked.get(plan.name)
            if module.lazy_softmax(raw):
                assert raw is not None
                values[plan.fold_id] = module.softmax_parts(raw)
            else:
                values[plan.fold_id] = module.log_probs(raw)
        elif isinstance(module, FoldedSum):
            values[plan.fold_id] = module.log_weights(checked.get(plan.name))
    return LogParameters(values, batch)


__all__ = ["LogParameters", "Params", "ParamsLike", "prepare"]
