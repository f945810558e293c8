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

The walk (:func:`top_down`) and a sum fold's step (:func:`sum_scale`,
:func:`sum_input_gradient`) are also those of the flows that learning reads
(:mod:`circuits.learn.flows`), which adds the weights' expected counts ``W * (S^T @ P)`` from the
same ``S`` and ``P``.
"""

from __future__ import annotations

from collections.abc import Callable

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
    def through_sum(fold_id: int, grad: Tensor) -> Tensor:
        weights = params.exp_weights(fold_id)
        probs, scale = sum_scale(trace.sum_inputs[fold_id], trace.outputs[fold_id], grad, weights,
                                 trace.sum_parts.get(fold_id))
        return sum_input_gradient(probs, scale, weights)

    return top_down(circuit, trace.outputs, torch.ones_like(trace.outputs[-1]), through_sum)


@torch.no_grad()
def top_down(circuit: CircuitCore, outputs: list[Tensor], seed: Tensor,
             through_sum: Callable[[int, Tensor], Tensor]) -> dict[int, Tensor]:
    """The walk from the root down, shared by the derivative pass and the flows of learning.

    Args:
        circuit: the circuit whose bottom-up pass gave ``outputs``.
        outputs: every fold's output ``(F, B, K)`` (the gradients take their shapes).
        seed: the root's gradient, shaped like ``outputs[-1]`` (ones: ``d log c / d log c``;
            row weights scale it).
        through_sum: ``(fold id, G (F, B, K)) -> G_in (F, B, D)``: a sum fold's step (the caller
            may record more, e.g. the weights' counts, from the same products).

    Returns ``{input fold id: G (F, B, K)}``; input folds the root does not depend on are absent.
    A fold's gradient is released once passed on.
    """
    grads: list[Tensor | None] = [None] * len(outputs)
    grads[-1] = seed
    result: dict[int, Tensor] = {}
    for plan, module in zip(reversed(circuit.plans), reversed(circuit.folds), strict=True):
        grad = grads[plan.fold_id]
        grads[plan.fold_id] = None
        if grad is None:
            continue
        if isinstance(module, FoldedInput):
            result[plan.fold_id] = grad
            continue
        assert isinstance(module, RoutedFold)
        if isinstance(module, FoldedSum):
            parts = list(through_sum(plan.fold_id, grad).split(list(plan.input_widths), dim=-1))
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


def sum_scale(joined: Tensor, out: Tensor, grad: Tensor, weights: ExpWeights,
              parts: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``(P (F, B, D), S = G / T (F, B, K))`` of a sum fold ``out = log_matmul(joined, log w)``.

    ``parts`` is the forward's ``(P, T)`` (:attr:`Trace.sum_parts`); without it (a fused kernel
    ran) ``P`` and ``T = exp(out - shift)`` are recomputed from the fold's input and output.
    ``S`` is 0 where a unit's value is 0 (such units pass on nothing). ``weights`` may be grouped
    (one set per ``B / S`` rows).
    """
    if parts is not None:
        probs, total = parts
        scale = grad / total  # G / T; 0 / 0 and x / 0 (units of value 0) pass on nothing
    else:
        fold, batch, _ = joined.shape
        in_max = joined.amax(-1, keepdim=True).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        probs = (joined - in_max).exp_()
        if weights.shift.dim() == 4:  # grouped: (F, S, 1, K)
            sets = weights.shift.shape[1]
            groups = rows_per_set(batch, sets)
            shift = (in_max.view(fold, sets, groups, 1) + weights.shift).view(fold, batch, -1)
        else:
            shift = in_max + weights.shift
        scale = (shift - out).exp_().mul_(grad)  # G / T; out = -inf gives inf or NaN
    return probs, scale.nan_to_num_(nan=0.0, posinf=0.0)


def sum_input_gradient(probs: Tensor, scale: Tensor, weights: ExpWeights) -> Tensor:
    """``G_in = P * (S @ W)`` (F, B, D) from :func:`sum_scale`'s ``(P, S)``, grouped or not."""
    if weights.shift.dim() == 4:
        fold, batch, width = probs.shape
        sets = weights.shift.shape[1]
        mixed = torch.bmm(scale.reshape(fold * sets, rows_per_set(batch, sets), scale.shape[-1]),
                          weights.weights)
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


__all__ = ["input_gradients", "sum_input_gradient", "sum_scale", "top_down"]
