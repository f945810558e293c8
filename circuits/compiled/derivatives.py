"""The derivative (top-down) pass of a circuit, written out instead of run through autograd.

After a SUM-semiring bottom-up pass (:meth:`CompiledCircuit.evaluate` with a
:class:`~circuits.compiled.prepared.Trace`), :func:`input_gradients` returns
``g_u = d log c / d log l_u`` for every input unit ``u`` (``l_u`` its output), the quantity of the
derivative identity behind the conditional queries (:mod:`circuits.compiled.queries`). Walking
the folds from the root down, each fold's gradient ``G`` (F, B, K) goes to the units it read:

* sum fold ``out_k = log sum_d exp(in_d + log w_kd)``: ``G_in = P * ((G / T) @ W)`` with
  ``P = exp(in - max in)``, ``W = exp(log w - max log w)`` and ``T = P W^T`` (so
  ``G / T = G exp(shift - out)``), zero where ``out = -inf``, as autograd of the torch
  log-matmul gives;
* Hadamard product (sum of log-values): ``G`` to every input;
* Kronecker product (outer sum): ``G`` summed over the other inputs' digits;

then back through the reads: slices of a source fold get ``+= G`` in place, other reads an
``index_add_``. A handful of tensor ops per fold and no autograd graph: the conditional queries'
backward costs about what their forward does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits.compiled.core import CircuitCore
from circuits.compiled.layers import FoldedInput, FoldedSum, RoutedFold
from circuits.compiled.prepared import LogParameters, Trace
from circuits.kernels import ExpWeights, rows_per_set
from circuits.symbolic import ProductKind


@torch.no_grad()
def input_gradients(circuit: CircuitCore, trace: Trace,
                    params: LogParameters) -> dict[int, Tensor]:
    """``{input fold id: d log c / d log l (F, B, K)}`` of the traced pass (the root's rows summed).

    Args:
        circuit: the circuit the trace comes from.
        trace: a SUM-semiring :meth:`CompiledCircuit.evaluate` trace (outputs and sum inputs).
        params: the log-parameters that pass used.

    Input folds the root does not depend on are absent.
    """
    outputs = trace.outputs
    grads: list[Tensor | None] = [None] * len(outputs)
    grads[-1] = torch.ones_like(outputs[-1])
    result: dict[int, Tensor] = {}
    for plan, module in zip(reversed(circuit.plans), reversed(circuit.folds), strict=True):
        grad = grads[plan.fold_id]
        if grad is None:
            continue
        if isinstance(module, FoldedInput):
            result[plan.fold_id] = grad
            continue
        assert isinstance(module, RoutedFold)
        if isinstance(module, FoldedSum):
            log_weights = params.values[plan.fold_id]
            assert isinstance(log_weights, Tensor), "sum folds always hold tensors"
            grad_in = _sum_input_gradient(trace, plan.fold_id, grad, log_weights,
                                          params.exp_weights(plan.fold_id))
            parts = list(grad_in.split(list(plan.input_widths), dim=-1))
        elif plan.product_kind is ProductKind.HADAMARD:
            parts = [grad] * len(plan.input_widths)
        else:
            fold, batch = grad.shape[:2]
            digits = grad.reshape(fold, batch, *plan.input_widths)
            others = range(2, 2 + len(plan.input_widths))
            parts = [digits.sum(dim=tuple(d for d in others if d != 2 + h))
                     if len(plan.input_widths) > 1 else digits
                     for h in range(len(plan.input_widths))]
        for h, part in enumerate(parts):
            _send_back(grads, outputs, module, h, part)
    return result


def _sum_input_gradient(trace: Trace, fold_id: int, grad: Tensor, log_weights: Tensor,
                        weights: ExpWeights) -> Tensor:
    """``d(sum_k grad_k out_k) / d in`` for sum fold ``fold_id``: ``out = log_matmul(in, log w)``.

    ``grad`` (F, B, K) -> (F, B, D). Reads the forward's ``(P, T)`` from ``trace.sum_parts``, or
    recomputes them from the fold's input and output (``T = exp(out - shift)``).
    """
    joined, out = trace.sum_inputs[fold_id], trace.outputs[fold_id]
    fold, batch, width = joined.shape
    units = out.shape[2]
    grouped = log_weights.dim() == 4
    sets = log_weights.shape[0] if grouped else 1
    groups = rows_per_set(batch, sets)
    parts = trace.sum_parts.get(fold_id)
    if parts is not None:
        probs, total = parts
        scale = grad / total  # G / T; 0 / 0 and x / 0 (units of value 0) pass on nothing
    else:
        in_max = joined.amax(-1, keepdim=True).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        probs = (joined - in_max).exp_()
        if grouped:
            shift = (in_max.view(fold, sets, groups, 1) + weights.shift).view(fold, batch, units)
        else:
            shift = in_max + weights.shift
        scale = (shift - out).exp_().mul_(grad)  # G / T; out = -inf gives inf or NaN
    scale = scale.nan_to_num_(nan=0.0, posinf=0.0)
    if grouped:
        mixed = torch.bmm(scale.reshape(fold * sets, groups, units), weights.weights)
        return probs * mixed.view(fold, batch, width)
    return probs * torch.bmm(scale, weights.weights)


def _send_back(grads: list[Tensor | None], outputs: list[Tensor], module: RoutedFold, h: int,
               part: Tensor) -> None:
    """Add input ``h``'s gradient ``part`` (F, B, K_h) to the gradients of the units it read."""
    address = module.plan.inputs[h]
    window = module.input_slices[h]
    if len(address.sources) == 1:
        target = _buffer(grads, outputs, address.sources[0])
        if window is not None:
            target[window].add_(part)  # a view: accumulates in place
        else:
            target.index_add_(0, module.index_buffers()[h], part)
        return
    for source, folds, slots in module.routes(h):
        _buffer(grads, outputs, source).index_add_(0, slots, part.index_select(0, folds))


def _buffer(grads: list[Tensor | None], outputs: list[Tensor], fold_id: int) -> Tensor:
    grad = grads[fold_id]
    if grad is None:
        grad = grads[fold_id] = torch.zeros_like(outputs[fold_id])
    return grad
