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

**Other input families** (:mod:`~circuits.compiled.input_families`, :class:`ValueRule`): a
Bernoulli or Binomial success logit may be any number, ``-inf`` and ``+inf`` included (the exact
probabilities 0 and 1), but not NaN; a Gaussian's mean and log-standard-deviation must be finite.
Their errors name the entry the same way (tensor, layer, unit, index).

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

import math
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from circuits.compiled.folding import FoldPlan
from circuits.compiled.input_families import ValueRule
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

#: the advice of the other value rules (see the module docstring)
_RULE_ADVICE = {
    ValueRule.NOT_NAN: ("A success logit must be a number (-inf and +inf are the exact probabilities 0 "
                        "and 1); NaN usually comes from a diverged training step, a corrupt "
                        "checkpoint or non-finite inputs to the network that produced it."),
    ValueRule.FINITE: ("A Gaussian's mean and log-standard-deviation must be finite; NaN and inf "
                       "usually come from a diverged training step, a corrupt checkpoint or "
                       "non-finite inputs to the network that produced them."),
}


@dataclass(frozen=True)
class ParameterTable:
    """One raw parameter tensor to check, and what to call it in an error.

    Attributes:
        where: the tensor's name in messages, e.g. ``"params['sum_3']"``.
        values: ``(F, K, D)`` (a module's own) or ``(B, F, K, D)`` (external) raw parameters.
        layers: the symbolic layer behind each of the ``F`` slots.
        rule: which values are valid (sum weights and categorical logits: ROWS).
    """

    where: str
    values: Tensor
    layers: tuple[Layer, ...]
    rule: ValueRule = ValueRule.ROWS


def parameter_tables(plans: Sequence[FoldPlan], folds: Iterable[nn.Module],
                     external: Mapping[str, Tensor],
                     verified: Container[int] = ()) -> list[ParameterTable]:
    """Every parameterised fold's raw table a query will use: ``external[name]`` where given,
    else the fold's own ``raw``, unless its fold id is ``verified`` (own parameters unchanged,
    bit for bit, since they were last checked)."""
    tables = []
    for plan, module in zip(plans, folds, strict=True):
        if isinstance(module, (FoldedInput, FoldedSum)):
            rule = module.family.value_rule if isinstance(module, FoldedInput) else ValueRule.ROWS
            given = external.get(plan.name)
            if given is not None:
                tables.append(ParameterTable(f"params[{plan.name!r}]", given, plan.layers, rule))
            elif plan.fold_id not in verified:
                tables.append(ParameterTable(f"{plan.name!r} (the circuit's own parameters, raw)",
                                             module.raw, plan.layers, rule))
    return tables


def first_problem(values: Tensor, rule: ValueRule = ValueRule.ROWS
                  ) -> tuple[tuple[int, ...], ParameterProblem | None] | None:
    """The first invalid entry or row of ``values`` (row-major order) under ``rule`` and what is
    wrong with it, or None.

    The index has every dimension for a bad entry and drops the last one for a row without mass
    (ROWS). The problem is None for a ``-inf`` entry where FINITE forbids it (the
    :class:`ParameterProblem` values name NaN, +inf and rows without mass).
    """
    if not values.numel():
        return None
    values = values.detach()
    if rule is not ValueRule.ROWS:
        wrong = torch.isnan(values) if rule is ValueRule.NOT_NAN else ~torch.isfinite(values)
        if not bool(wrong.any()):
            return None
        index = tuple(int(i) for i in wrong.nonzero()[0])
        entry = float(values[index])
        if math.isnan(entry):
            return index, ParameterProblem.NAN
        return index, ParameterProblem.POSITIVE_INFINITY if entry > 0 else None
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


def problem_text(problem: ParameterProblem | None) -> str:
    """How a problem reads in a message: ``"NaN"``, ``"+inf"``, ``"no mass"``; ``"-inf"`` for None."""
    return "-inf" if problem is None else problem.value


def _error(table: ParameterTable, index: tuple[int, ...],
           problem: ParameterProblem | None) -> InvalidParameterError:
    slot_axis = -2 if problem is ParameterProblem.NO_MASS else -3
    slot, unit = index[slot_axis], index[slot_axis + 1]
    layer = table.layers[slot].describe()
    text = ", ".join(map(str, index))
    if problem is ParameterProblem.NO_MASS:
        what = (f"{table.where}[{text}, :] is -inf everywhere: unit {unit} of {layer} has no mass "
                "(every probability or weight is zero)")
    else:
        what = f"{table.where}[{text}] is {problem_text(problem)} (unit {unit} of {layer})"
    advice = _RULE_ADVICE.get(table.rule, ADVICE)
    return InvalidParameterError(f"invalid parameter: {what}. {advice}", where=table.where,
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
        rows = [t for t in tables if t.values.numel() and t.rule is ValueRule.ROWS]
        own = [t for t in rows if t.values.dim() == 3]
        external = [t for t in rows if t.values.dim() != 3]
        extremes = [torch.aminmax(t.values) for t in external]
        finite = [t.values.amax(-1).reshape(-1) for t in own] + [hi.reshape(1) for _, hi in extremes]
        for table in tables:  # other families: whole-tensor extremes (NaN propagates into both)
            if table.values.numel() and table.rule is not ValueRule.ROWS:
                lo, hi = torch.aminmax(table.values)
                if table.rule is ValueRule.FINITE:
                    finite.append(torch.stack([lo, hi]))
                else:  # NOT_NAN: +-inf are valid, so map them to finite numbers first
                    finite.append(torch.stack([lo, hi]).nan_to_num(nan=math.nan, posinf=0.0, neginf=0.0))
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
        found = first_problem(table.values, table.rule)
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


__all__ = ["ADVICE", "ParameterTable", "ValueRule", "check_evidence", "check_parameters",
           "first_problem", "parameter_tables", "problem_text"]
