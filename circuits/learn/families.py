"""How EM re-estimates an input fold: from categorical counts, or through the fold's own
``em_estimate``.

Two strategies, chosen per input fold by :func:`input_update_for`:

* :class:`CategoricalCounts` (categorical inputs): the fold's sufficient statistics are the
  expected counts ``n[f, k, c] = sum_b g[f, b, k] [x_b = c]`` for observed entries, and
  ``g[f, b, k] phi'[f, k, c]`` (the unit's own normalised distribution: its expected statistics)
  for unobserved ones. Counts add up over batches and over processes, so full-batch EM over many
  :meth:`~circuits.learn.EM.accumulate` calls and data-parallel EM are exact, and the update is
  :func:`~circuits.learn.update.em_log_update` in probability space, which also keeps exact
  zeros (a categorical fold's own ``em_estimate`` is a per-batch estimate that adds the
  pseudocount everywhere; the tests check that both agree where they should).
* :class:`FamilyEstimate` (Bernoulli, Binomial, Gaussian): the fold's
  ``em_estimate(values (B, F), observed (B, F), flows (B, F, K), pseudocount) -> raw (F, K, D)``
  (the flow-weighted maximum-likelihood estimate, unobserved entries contributing the leaf's own
  expected statistics). Its statistics are the rows themselves, kept until the step (and
  gathered from every process). With a step size ``s < 1`` the batch is combined with the old
  parameters by one more, unobserved, row whose flow is ``(1 - s) / s`` times the batch's flow
  of each unit, so the estimate mixes the old expected statistics and the batch's with weights
  ``1 - s`` and ``s`` (in the space of the family's sufficient statistics: a Bernoulli's mean, a
  Gaussian's mean and second moment): exactly the mixture of the module docs of
  :mod:`circuits.learn.em` when the pseudocount is 0 (or ``s = 1``); with a pseudocount, the
  prior enters with weight ``s`` relative to the batch.

Statistics live in the optimiser's per-parameter ``state`` dictionary, so that
:meth:`torch.optim.Optimizer.state_dict` carries them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from circuits.compiled.layers import FoldedInput
from circuits.learn.flows import InputRows, is_categorical
from circuits.learn.update import em_log_update

State = dict[str, Any]


class InputUpdate(ABC):
    """The EM statistics and update of one input fold (stateless: state is passed in)."""

    def __init__(self, module: FoldedInput) -> None:
        self.module = module

    @abstractmethod
    def reset(self, state: State) -> None:
        """Empty statistics in ``state``."""

    @abstractmethod
    def accumulate(self, state: State, rows: InputRows, flows: Tensor, log_probs: Tensor) -> None:
        """Add a batch: the fold's :class:`~circuits.learn.flows.InputRows`, its flows
        (F, B, K), and ``log_probs`` (F, K, D) its log-parameters as the pass used them."""

    @abstractmethod
    def new_raw(self, state: State, normal_log: Tensor, step_size: float,
                pseudocount: float) -> Tensor:
        """The fold's new raw parameters (F, K, D); ``normal_log`` is its normal form."""


class CategoricalCounts(InputUpdate):
    """Expected category counts, float64, in ``state["counts"]`` laid out (F, C, K): the layout
    the batch's flows scatter into; :meth:`new_raw` reads it as (F, K, C)."""

    def reset(self, state: State) -> None:
        fold, units, size = self.module.raw.shape
        state["counts"] = torch.zeros((fold, size, units), dtype=torch.float64,
                                      device=self.module.raw.device)

    def accumulate(self, state: State, rows: InputRows, flows: Tensor, log_probs: Tensor) -> None:
        assert rows.index is not None, "categorical folds have a row index"
        fold, batch, units = flows.shape
        size = self.module.num_categories
        picked = flows if rows.all_seen else flows * rows.seen.T[:, :, None].to(flows.dtype)
        table = flows.new_zeros(fold * size, units)
        table.index_add_(0, rows.index, picked.reshape(fold * batch, units))
        counts: Tensor = state["counts"]
        counts += table.view(fold, size, units)
        if not rows.all_seen:  # unobserved entries: the unit's own normalised distribution
            free = (flows * (~rows.seen).T[:, :, None].to(flows.dtype)).sum(1)  # (F, K)
            probs = torch.softmax(log_probs.detach().to(torch.float64), -1)  # (F, K, C)
            counts += (free.to(torch.float64)[:, :, None] * probs).transpose(1, 2)

    def new_raw(self, state: State, normal_log: Tensor, step_size: float,
                pseudocount: float) -> Tensor:
        return em_log_update(normal_log, state["counts"].transpose(1, 2), step_size, pseudocount)


class FamilyEstimate(InputUpdate):
    """Rows kept for the fold's ``em_estimate``: ``state["values"|"observed"|"flows"]``."""

    def reset(self, state: State) -> None:
        state["values"], state["observed"], state["flows"] = [], [], []

    def accumulate(self, state: State, rows: InputRows, flows: Tensor, log_probs: Tensor) -> None:
        state["values"].append(rows.values)
        state["observed"].append(rows.seen)
        state["flows"].append(flows.transpose(0, 1).contiguous())

    def new_raw(self, state: State, normal_log: Tensor, step_size: float,
                pseudocount: float) -> Tensor:
        module = self.module
        values = torch.cat(state["values"])
        seen = torch.cat(state["observed"]).to(torch.bool)
        flows = torch.cat(state["flows"])  # (B, F, K)
        total = flows.sum(0)  # (F, K)
        if step_size < 1.0:  # the old parameters' expected statistics, weight (1 - s) / s
            values = torch.cat([values, values.new_zeros((1, values.shape[1]))])
            seen = torch.cat([seen, seen.new_zeros((1, seen.shape[1]))])
            old = total * ((1.0 - step_size) / step_size)
            flows = torch.cat([flows, old[None]])
        raw = module.em_estimate(values, seen, flows, pseudocount)  # type: ignore[operator]
        if pseudocount <= 0:  # units without flow: nothing to estimate from, keep them
            stale = (total <= 0)[:, :, None]
            raw = torch.where(stale, module.raw.detach(), raw.to(module.raw.dtype))
        return raw


def input_update_for(module: FoldedInput) -> InputUpdate | None:
    """The strategy of an input fold, or None when EM cannot update it (no ``em_estimate``)."""
    if is_categorical(module):
        return CategoricalCounts(module)
    if callable(getattr(module, "em_estimate", None)):
        return FamilyEstimate(module)
    return None


def statistics_tensors(update: InputUpdate, state: State) -> list[Tensor]:
    """The summable statistics of ``update`` (empty for row-kept families)."""
    return [state["counts"]] if isinstance(update, CategoricalCounts) else []


__all__ = ["CategoricalCounts", "FamilyEstimate", "InputUpdate", "input_update_for",
           "statistics_tensors"]
