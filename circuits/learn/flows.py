"""Circuit flows: the expected counts of every sum weight and the responsibilities of every input
unit, from one bottom-up and one top-down pass per batch, without autograd.

For rows ``x_b`` (with evidence masks) and the circuit's log-value ``log c(x_b)``, the *flow* of
an edge from sum unit ``k`` to its input unit ``d`` is

    n_kd = sum_b  w_kd c_d(x_b) (d c(x_b) / d c_k(x_b)) / c(x_b)  =  d (sum_b log c(x_b)) / d log w_kd,

the expected number of times the edge is used by the latent choices of the circuit given the data
(its posterior count): the gradient of the log-likelihood with respect to the *normalised*
log-weights taken as leaves. The flow of an input unit ``u`` in row ``b`` is
``g_ub = d log c(x_b) / d log l_u(x_b)`` (``l_u`` its output), the posterior probability that the
unit is used. Both are what expectation-maximisation needs (:class:`~circuits.learn.EM`).

The pass here computes them fold by fold. The bottom-up pass is the one of
:meth:`CircuitCore.evaluate <circuits.compiled.core.CircuitCore.evaluate>` (the same fold modules
for sums and products), except that categorical input folds are read from a ``(F * C, K)`` table
of their log-probabilities made once per parameter version (:class:`InputTables`) with one
``index_select`` per batch, whose row index the EM counts then reuse; walking from the root down,
a sum fold
``out = log(P W^T) + shift`` (``P = exp(in - max in)`` (F, B, D), ``W = exp(log w - max)``
(F, K, D), both kept by the forward) with incoming flows ``G`` (F, B, K) gives

    S = G / (P W^T)            (F, B, K), 0 where the unit's value is 0
    G_in = P * (S @ W)         (F, B, D): the flows of its inputs
    n = W * (S^T @ P)          (F, K, D): its weights' counts, summed over the batch

(two batched matrix products, the cost of the forward's one each), products pass ``G`` to every
input (Hadamard) or sum it over the other inputs' digits (Kronecker), and reads route it back to
the folds they came from. No autograd graph is built and no normalisation is recomputed: the
pass reads the cached ``exp`` of the weights that the forward used.
The top-down walk and the sum step ``(S, G_in)`` are those of the derivative pass behind the
conditional queries (:func:`circuits.compiled.derivatives.top_down`); the flows only add ``n``.

Flows are invariant under the rescalings that turn an unnormalised circuit into its normalised
equivalent (see :mod:`circuits.learn.normal_form`), so they are computed on the parameters as
they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor

from circuits.compiled import CircuitCore, LogParameters
from circuits.compiled.derivatives import sum_input_gradient, sum_scale, top_down
from circuits.compiled.layers import FoldedInput, FoldedProduct, FoldedSum, Semiring, gather_inputs


@dataclass
class InputRows:
    """One input fold's view of a batch of ``B`` rows.

    Attributes:
        values: (B, F) the value of each slot's variable.
        seen: (B, F) bool: observed, and not an integrated slot.
        all_seen: whether ``seen`` is all True.
        index: categorical folds: (F * B,) rows of the fold's ``(F * C, K)`` table, slot-major
            (the layout of the fold's flows ``(F, B, K)``); None for other families.
    """

    values: Tensor
    seen: Tensor
    all_seen: bool
    index: Tensor | None = None


@dataclass
class Flows:
    """What one flow pass over a batch of ``B`` rows computed.

    Attributes:
        log_values: (B,) ``log c(x_b)`` (unnormalised when the circuit is).
        sum_counts: ``{sum fold id: (F, K, D)}`` edge flows summed over the batch.
        input_flows: ``{input fold id: (F, B, K)}`` per-row flows of the input units.
        inputs: ``{input fold id: InputRows}``.
    """

    log_values: Tensor
    sum_counts: dict[int, Tensor]
    input_flows: dict[int, Tensor]
    inputs: dict[int, InputRows]


def is_categorical(module: FoldedInput) -> bool:
    """Whether the input fold is categorical (other families compute their own densities)."""
    return bool(module.categorical)


@dataclass
class InputTables:
    """Per categorical input fold, its log-probabilities ``(F, K, C)`` as a ``(F * C, K)`` table
    (row ``f * C + c``), and its units' log-masses ``(F, K)``: made once per parameter version
    (the ``LogParameters`` entry they came from is kept to tell)."""

    entries: dict[int, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict)

    def get(self, fold_id: int, log_probs: Tensor) -> tuple[Tensor, Tensor]:
        entry = self.entries.get(fold_id)
        if entry is None or entry[0] is not log_probs:
            fold, units, size = log_probs.shape
            table = log_probs.detach().transpose(1, 2).reshape(fold * size, units)
            entry = (log_probs, table, torch.logsumexp(log_probs.detach(), -1))
            self.entries[fold_id] = entry
        return entry[1], entry[2]


def input_rows(module: FoldedInput, x: Tensor, observed: Tensor) -> InputRows:
    """The fold's :class:`InputRows` of validated ``x``, ``observed`` (B, V)."""
    values = x.index_select(1, module.variables)
    seen = observed.index_select(1, module.variables)
    if module.any_integrated:
        seen = seen & module.live[None, :]
    all_seen = bool(seen.all())
    index = None
    if is_categorical(module):
        size = module.num_categories
        columns = values.nan_to_num(0.0, 0.0, 0.0).long() if values.is_floating_point() else values
        offsets = torch.arange(values.shape[1], device=x.device)[None, :] * size
        index = (columns.clamp(0, size - 1) + offsets).T.reshape(-1)
    return InputRows(values, seen, all_seen, index)


@torch.no_grad()
def circuit_flows(circuit: CircuitCore, prepared: LogParameters, x: Tensor, observed: Tensor,
                  row_weights: Tensor | None = None, tables: InputTables | None = None) -> Flows:
    """One bottom-up and one top-down pass: the :class:`Flows` of rows ``x`` under ``observed``.

    Args:
        circuit: the compiled circuit.
        prepared: its own normalised parameters (``circuit.resolve_params(None, None)``): every
            entry an ``(F, K, D)`` tensor, shared by the batch.
        x, observed: validated data (``circuit.validate_data``), ``(B, V)``.
        row_weights: optional (B,) weight of each row's flows (0 drops a row); default 1.
        tables: the input tables kept between calls (a fresh one when None).

    Rows of probability zero contribute no flow (their log-value is ``-inf``).
    """
    tables = tables if tables is not None else InputTables()
    outputs: list[Tensor] = []
    inputs: dict[int, InputRows] = {}
    sum_parts: dict[int, tuple[Tensor, tuple[Tensor, Tensor] | None]] = {}  # joined, (P, P W^T)
    for plan, module in zip(circuit.plans, circuit.folds, strict=True):
        if isinstance(module, FoldedInput):
            log_probs = prepared.values[plan.fold_id]
            rows = inputs[plan.fold_id] = input_rows(module, x, observed)
            if rows.index is not None and isinstance(log_probs, Tensor) and log_probs.dim() == 3:
                out = _categorical_values(module, rows, *tables.get(plan.fold_id, log_probs))
            else:
                out = module(x, observed, log_probs)
        elif isinstance(module, FoldedSum):
            parts = gather_inputs(outputs, plan, module.index_buffers(), module.input_slices,
                                  module.routes)
            joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
            log_weights = prepared.values[plan.fold_id]
            keep: dict[str, Tensor] = {}
            out = module(joined, log_weights, Semiring.SUM,
                         partial(prepared.exp_weights, plan.fold_id), keep)
            # without keep a fused kernel ran: the top-down step recomputes P and P W^T
            sum_parts[plan.fold_id] = (joined, (keep["probs"], keep["total"]) if keep else None)
        else:
            assert isinstance(module, FoldedProduct)
            out = module(gather_inputs(outputs, plan, module.index_buffers(), module.input_slices,
                                       module.routes))
        outputs.append(out)
    root = outputs[-1][0, :, 0]
    seed = torch.ones_like(outputs[-1])
    if row_weights is not None:
        seed = seed * row_weights.to(seed.dtype)[None, :, None]
    sum_counts: dict[int, Tensor] = {}

    def through_sum(fold_id: int, grad: Tensor) -> Tensor:
        """The derivative pass's sum step, and the weights' counts ``n = W * (S^T @ P)``."""
        joined, kept = sum_parts[fold_id]
        weights = prepared.exp_weights(fold_id)
        probs, scale = sum_scale(joined, outputs[fold_id], grad, weights, kept)
        sum_counts[fold_id] = weights.weights * torch.bmm(scale.transpose(1, 2), probs)
        return sum_input_gradient(probs, scale, weights)

    input_flows = top_down(circuit, outputs, seed, through_sum)
    return Flows(root, sum_counts, input_flows, inputs)


def _categorical_values(module: FoldedInput, rows: InputRows, table: Tensor,
                        log_mass: Tensor) -> Tensor:
    """``(F, B, K)`` log-values of a categorical fold: one gather from its ``(F * C, K)`` table;
    unobserved (and integrated) slots output their mass (0 in log space when normalised)."""
    assert rows.index is not None
    fold, batch = rows.values.shape[1], rows.values.shape[0]
    out = table.index_select(0, rows.index).view(fold, batch, table.shape[1])
    if rows.all_seen:
        return out
    free = log_mass[:, None, :] if not module.parameterization.normalized else out.new_zeros(())
    return torch.where(rows.seen.T[:, :, None], out, free)


__all__ = ["Flows", "InputRows", "InputTables", "circuit_flows", "input_rows", "is_categorical"]
