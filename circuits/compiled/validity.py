"""Validity of parameter values and of evidence: one cheap check per call, a precise report on failure.

**Parameters.** A *row* is the last dimension of a raw parameter tensor: one input unit's
categorical logits or one sum unit's weights. Both parameterisations
(:class:`~circuits.parameterizations.Softmax` and :class:`~circuits.parameterizations.Exp`) map a
raw ``-inf`` to an exact zero, so one rule serves both: a row is valid when it holds no NaN and no
``+inf`` and at least one entry above ``-inf``. Equivalently, the row's maximum is finite. A single
``-inf`` is a zero probability and stays valid (determinism, constraints and zero-probability
evidence are built from exact zeros). Invalid rows used to be hidden: the layers turn NaN into
``-inf`` (``nan_to_num``), so a NaN parameter gave ``-inf`` likelihoods and a plausible
``log_partition``.

**Cost.** :func:`check_parameters` reads every table once (a row-wise ``amax`` for a module's own
small tables, a whole-tensor ``aminmax`` for external ones), reduces the results with one
``isfinite().all()`` and synchronises with the host **once** per call; only external tables that
hold exact zeros get a second, row-wise pass. Only when a problem is found does the slow path
locate the first offending index.

**Evidence.** :func:`check_evidence` reads the root value of the bottom-up pass that conditional
sampling and MAP run anyway: evidence of probability zero has root value ``-inf`` (max-product is
``-inf`` exactly when sum-product is 0: all terms are non-negative). One reduction and one
synchronisation per call.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from circuits.compiled.folding import FoldPlan
from circuits.compiled.layers import FoldedInput, FoldedSum
from circuits.errors import (
    InvalidInputError,
    InvalidParameterError,
    ParameterProblem,
    ZeroProbabilityEvidenceError,
)
from circuits.symbolic import Layer

#: what to do about an invalid parameter, appended to every :class:`InvalidParameterError`
ADVICE = ("Parameters must be finite numbers or -inf (an exact zero), with at least one entry above "
          "-inf in every row; NaN and inf usually come from a diverged training step, a corrupt "
          "checkpoint or non-finite inputs to the network that produced them.")


@dataclass(frozen=True)
class ParameterTable:
    """One raw parameter tensor to check, and what to call it in an error.

    Attributes:
        where: the tensor's name in messages, e.g. ``"params['sum_3']"``.
        values: ``(F, K, D)`` (a module's own) or ``(B, F, K, D)`` (external) raw parameters.
        layers: the symbolic layer behind each of the ``F`` slots.
    """

    where: str
    values: Tensor
    layers: tuple[Layer, ...]


def parameter_tables(plans: Sequence[FoldPlan], folds: Iterable[nn.Module],
                     external: Mapping[str, Tensor],
                     verified: Container[int] = ()) -> list[ParameterTable]:
    """Every parameterised fold's raw table a query will use: ``external[name]`` where given,
    else the fold's own ``raw``, unless its fold id is ``verified`` (own parameters unchanged,
    bit for bit, since they were last checked)."""
    tables = []
    for plan, module in zip(plans, folds, strict=True):
        if isinstance(module, (FoldedInput, FoldedSum)):
            given = external.get(plan.name)
            if given is not None:
                tables.append(ParameterTable(f"params[{plan.name!r}]", given, plan.layers))
            elif plan.fold_id not in verified:
                tables.append(ParameterTable(f"{plan.name!r} (the circuit's own parameters, raw)",
                                             module.raw, plan.layers))
    return tables


def first_problem(values: Tensor) -> tuple[tuple[int, ...], ParameterProblem] | None:
    """The first invalid row of ``values`` (row-major order) and what is wrong with it, or None.

    The index has every dimension for NaN and ``+inf`` (the first such entry of the row) and
    drops the last one for a row without mass.
    """
    if not values.numel():
        return None
    values = values.detach()
    invalid = ~torch.isfinite(values.amax(-1))
    if not bool(invalid.any()):
        return None
    row = tuple(int(i) for i in invalid.nonzero()[0])
    entries = values[row]
    wrong = torch.isnan(entries) | torch.isposinf(entries)
    if bool(wrong.any()):
        column = int(wrong.nonzero()[0, 0])
        nan = bool(torch.isnan(entries[column]))
        return (*row, column), ParameterProblem.NAN if nan else ParameterProblem.POSITIVE_INFINITY
    return row, ParameterProblem.NO_MASS


def _error(table: ParameterTable, index: tuple[int, ...],
           problem: ParameterProblem) -> InvalidParameterError:
    slot_axis = -2 if problem is ParameterProblem.NO_MASS else -3
    slot, unit = index[slot_axis], index[slot_axis + 1]
    layer = table.layers[slot].describe()
    text = ", ".join(map(str, index))
    if problem is ParameterProblem.NO_MASS:
        what = (f"{table.where}[{text}, :] is -inf everywhere: unit {unit} of {layer} has no mass "
                "(every probability or weight is zero)")
    else:
        what = f"{table.where}[{text}] is {problem.value} (unit {unit} of {layer})"
    return InvalidParameterError(f"invalid parameter: {what}. {ADVICE}", where=table.where,
                                 layer=layer, index=index, problem=problem)


def check_parameters(tables: Sequence[ParameterTable]) -> None:
    """Raise :class:`InvalidParameterError` naming the first invalid entry of the first table
    that has one (see the module docstring); otherwise return.

    A module's own tables ``(F, K, D)`` are small: their row maxima are checked directly. An
    external table ``(B, F, K, D)`` is first reduced whole by ``aminmax`` (one pass, several
    times faster than a row-wise reduction when rows are short): a finite maximum rules out NaN
    and ``+inf``, and a minimum above ``-inf`` rules out rows without mass. Only a table that holds
    a ``-inf`` (an exact zero) gets the row-wise check as well. One host synchronisation per call
    (two when external parameters hold exact zeros): the price of an error instead of silently
    wrong answers.
    """
    with torch.no_grad():
        own = [t for t in tables if t.values.dim() == 3 and t.values.numel()]
        external = [t for t in tables if t.values.dim() != 3 and t.values.numel()]
        extremes = [torch.aminmax(t.values) for t in external]
        finite = [t.values.amax(-1).reshape(-1) for t in own] + [hi.reshape(1) for _, hi in extremes]
        if not finite:
            return
        verdict = torch.isfinite(torch.cat(finite)).all().reshape(1)
        zeros = [torch.isneginf(lo).reshape(1) for lo, _ in extremes]
        summary = torch.cat([verdict, *zeros]).tolist()  # the one host synchronisation
        if summary[0]:  # no NaN, no +inf; rows without mass can only be where -inf entries are
            with_zeros = [t for t, zero in zip(external, summary[1:], strict=True) if zero]
            if not with_zeros:
                return
            maxima = torch.cat([t.values.amax(-1).reshape(-1) for t in with_zeros])
            if bool(torch.isfinite(maxima).all()):
                return
    for table in tables:
        found = first_problem(table.values)
        if found is not None:
            raise _error(table, *found)
    raise AssertionError("check_parameters found a problem that first_problem cannot locate")


def check_evidence(root: Tensor, query: str) -> None:
    """Raise unless every row's bottom-up value ``root`` (B,) is finite.

    ``-inf``: the evidence has probability zero, :class:`ZeroProbabilityEvidenceError` naming the
    rows and the log-probability. NaN or ``+inf`` (valid parameters whose values overflow the
    dtype): :class:`InvalidInputError`. One reduction and one host synchronisation per call,
    which ``query`` (conditional sampling, MAP) needs anyway to return a meaningful answer.
    """
    if bool(torch.isfinite(root).all()):
        return
    impossible = torch.isneginf(root)
    if bool(impossible.any()):
        rows = tuple(int(i) for i in impossible.nonzero()[:, 0])
        shown = ", ".join(map(str, rows[:10])) + (", ..." if len(rows) > 10 else "")
        raise ZeroProbabilityEvidenceError(
            f"{query}: the evidence of row{'s' if len(rows) > 1 else ''} {shown} has probability "
            f"zero (log-probability {float(root[rows[0]])}): no completion of it is possible, so "
            "there is nothing to return. Check those rows of x and observed (log_marginal(x, "
            "observed) is -inf for them) or drop them.", rows=rows,
            log_probability=float(root[rows[0]]))
    row = int((~torch.isfinite(root)).nonzero()[0, 0])
    raise InvalidInputError(
        f"{query}: the circuit's log-value given the evidence of row {row} is "
        f"{float(root[row])}: the parameters overflow {root.dtype}; use float64 or smaller "
        "parameter values")


__all__ = ["ADVICE", "ParameterTable", "check_evidence", "check_parameters", "first_problem",
           "parameter_tables"]
