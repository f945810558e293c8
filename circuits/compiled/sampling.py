"""Ancestral sampling, conditional (posterior) sampling and MAP on a compiled circuit.

All three are one bottom-up pass (skipped for unconditional sampling of normalised circuits)
followed by one top-down pass over the folds. Top-down, each layer has at most one *chosen* unit
per sample (all units of a layer share a scope, and a smooth, decomposable circuit visits each
scope once per induced tree), so the state is a ``(F, B)`` index tensor per fold, ``-1`` where the
layer is not visited.

* a chosen sum unit picks one input unit ``j`` with probability proportional to
  ``w_j * c_j(evidence)``: the exact posterior of the sum's latent variable given the evidence
  (``c_j = 1`` without evidence in a normalised circuit, so the weights alone are used);
* a chosen product unit chooses the matching unit of every input (Kronecker: mixed-radix digits);
* a chosen input unit over an unobserved variable samples a value from its distribution, or
  copies the evidence when the variable is observed.

Sampling draws float64 uniforms from the caller's ``torch.Generator``: Gumbel-max for sum units,
inverse-CDF for categorical input units with shared parameters and for Bernoulli and Binomial
units (over their table of ``n + 1`` log-probabilities), and ``mean + std * eps`` with float64
standard normal ``eps`` for Gaussian units. MAP replaces the random choice by an argmax on the
max-product values (exact for deterministic circuits, max-product/Viterbi otherwise); an input
unit's MAP value is its mode (:meth:`~circuits.compiled.input_families.NativeFamily.mode`: a
Gaussian's mean, a Binomial's ``floor((n + 1) p)`` with ties to the smaller value).

Results are ``(B, V)`` long with ``-1`` outside the circuit's scope; for a real-valued circuit (a
Gaussian variable) they are floating-point, discrete columns holding integral values, with NaN
outside the scope.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from circuits.compiled.core import CircuitCore
from circuits.compiled.folding import FoldKind
from circuits.compiled.input_families import BinomialFamily, GaussianFamily, NativeFamily
from circuits.compiled.layers import FoldedInput, FoldedProduct, FoldedSum, Semiring, SoftmaxParts
from circuits.compiled.prepared import ParamsLike, Trace
from circuits.compiled.validity import check_evidence
from circuits.errors import InvalidInputError
from circuits.kernels import GumbelChooser, choose_sum_children, rows_of
from circuits.symbolic import ProductKind

Chooser = Callable[[Tensor], Tensor]


def gumbel_chooser(generator: torch.Generator | None) -> Chooser:
    """Sample ``argmax(logits + Gumbel)``: an exact draw from ``softmax(logits)`` per row.

    Float64 uniforms of the logits' shape from ``generator``; the top-down pass uses the fused
    triton step for sum folds when :mod:`circuits.kernels` selects it (same uniforms, same draw).
    """
    return GumbelChooser(generator)


def argmax_chooser(logits: Tensor) -> Tensor:
    return logits.argmax(-1)


def _choose_categories(choose: Chooser, table: Tensor | SoftmaxParts, unit: Tensor) -> Tensor:
    """Input units' choices ``(F, B)``, each from row ``unit[f, b]`` of their log-probabilities.

    For a table shared by the batch, ``(F, K, C)``, the ``(F, B, C)`` rows are never built: MAP
    takes the table's row-wise argmax once, and sampling inverts each row's CDF with one float64
    uniform per draw instead of ``C`` Gumbel variables (the same exact distribution). For
    :class:`~circuits.compiled.layers.SoftmaxParts`, Gumbel-max and argmax read the logits
    (both are blind to the per-row shift ``lse``), through the fused step on the triton backend.
    """
    if isinstance(table, SoftmaxParts):
        batch = unit.shape[1]
        sets = table.logits.shape[0]
        shift_free = isinstance(choose, GumbelChooser) or choose is argmax_chooser
        if shift_free and sets in (1, batch):
            logits = table.logits.expand(batch, *table.logits.shape[1:])
            return choose_sum_children(choose, logits, unit, None)
        table = table.log_probs()
    if table.dim() == 3:
        if choose is argmax_chooser:
            folds = torch.arange(unit.shape[0], device=unit.device)[:, None]
            return table.argmax(-1)[folds, unit]
        if isinstance(choose, GumbelChooser):
            return _inverse_cdf(table, unit, choose.uniforms(tuple(unit.shape), unit.device))
    return choose(rows_of(table, unit))


def _choose_inputs(choose: Chooser, module: FoldedInput, table: Tensor | SoftmaxParts,
                   unit: Tensor) -> Tensor:
    """The values ``(F, B)`` that the input units ``unit`` (F, B) emit, for any family: a
    Categorical fold's categories (:func:`_choose_categories`); a Bernoulli or Binomial fold's
    mode under MAP, else a choice over its log-probability table; a Gaussian fold's mean under
    MAP, a normal draw when sampling."""
    family = module.family
    if module.categorical:
        return _choose_categories(choose, table, unit)
    assert isinstance(table, Tensor) and isinstance(family, NativeFamily)
    if choose is argmax_chooser:
        return family.mode(rows_of(table, unit))
    if isinstance(family, BinomialFamily):
        return _choose_categories(choose, family.log_table(table), unit)
    assert isinstance(family, GaussianFamily)
    if isinstance(choose, GumbelChooser):
        return family.sample(rows_of(table, unit), choose.generator)
    raise InvalidInputError(
        f"a Gaussian input fold can be sampled (GumbelChooser) or maximised (argmax_chooser), "
        f"not chosen by {choose!r}")


def _inverse_cdf(table: Tensor, unit: Tensor, uniforms: Tensor) -> Tensor:
    """Category ``c`` of row ``unit[f, b]`` of ``softmax(table)`` with ``cdf[c-1] <= u < cdf[c]``.

    Row ``k`` of each fold's CDF is shifted to ``[k, k + 1]`` so one batched ``searchsorted`` over
    the fold's ``K * C`` sorted values serves every row (float64: ~1e-13 resolution for K < 1e3).
    """
    fold, units, size = table.shape
    cdf = torch.softmax(table.double(), -1).cumsum_(-1)
    cdf = cdf / cdf[..., -1:]  # the last entry is exactly 1, so the shifted rows stay sorted
    cdf = cdf + torch.arange(units, dtype=cdf.dtype, device=cdf.device)[:, None]
    position = torch.searchsorted(cdf.view(fold, units * size), unit + uniforms, right=True)
    return (position - unit * size).clamp_(0, size - 1)


def _send(chosen: list[Tensor], module: FoldedSum | FoldedProduct, h: int, unit: Tensor) -> None:
    """Mark the units read by input ``h`` as chosen: ``unit`` (F, B) holds the child unit or -1.

    At most one parent chooses a unit of a given layer per sample, so ``amax`` against the
    initial -1 combines the writes of several parents.
    """
    window = module.input_slices[h]
    if window is not None:  # one source read at evenly spaced slots, in this fold's order
        target = chosen[module.plan.inputs[h].sources[0]][window]
        target.copy_(torch.maximum(target, unit))  # in place through the view (traceable)
        return
    for source, fold_index, slot_index in module.routes(h):
        values = unit.index_select(0, fold_index)
        target = chosen[source]
        target.scatter_reduce_(0, slot_index[:, None].expand_as(values), values, "amax")


def descend(circuit: CircuitCore, trace: Trace, x: Tensor, observed: Tensor,
            choose: Chooser) -> Tensor:
    """The top-down pass: returns the completed assignment ``(B, V)``: long with -1 outside the
    scope, or (``x`` floating-point: a real-valued circuit) of ``x``'s dtype with NaN there."""
    batch = x.shape[0]
    device = x.device
    sizes = [plan.num_folded for plan in circuit.plans]
    # every fold's chosen units (F, B), -1 where not visited: views of one tensor
    chosen = list(torch.full((sum(sizes), batch), -1, dtype=torch.long,
                             device=device).split(sizes))
    chosen[-1][0] = 0
    real = x.is_floating_point()
    # each visited variable is written by exactly one unit per row: amax against the initial
    # -1 (categories are >= 0) or -inf (real values are finite) keeps that one write
    result = torch.full((batch, circuit.num_variables), -torch.inf if real else -1,
                        dtype=x.dtype if real else torch.long, device=device)
    for plan, module in zip(reversed(circuit.plans), reversed(circuit.folds), strict=True):
        selected = chosen[plan.fold_id]
        if isinstance(module, FoldedInput):
            values = _choose_inputs(choose, module, trace.log_params[plan.fold_id],
                                    selected.clamp(min=0))  # (F, B)
            variables = module.variables
            if real:
                values = values.to(x.dtype)
            values = torch.where(observed[:, variables].T, x[:, variables].T, values)
            keep = selected >= 0
            if module.any_integrated:
                keep = keep & module.live[:, None]
            values = torch.where(keep, values, -torch.inf if real else -1)
            result.scatter_reduce_(1, variables[None, :].expand(batch, -1), values.T, "amax")
        elif isinstance(module, FoldedSum):
            table, inputs = trace.log_params[plan.fold_id], trace.sum_inputs.get(plan.fold_id)
            if inputs is None and table.dim() == 3 and isinstance(choose, GumbelChooser):
                # no evidence, shared weights: inverse-CDF draws, the same on every backend
                unit = selected.clamp(min=0)
                draws = _inverse_cdf(table, unit, choose.uniforms(tuple(unit.shape), device))
                child = torch.where(selected >= 0, draws, -1)
            else:
                child = choose_sum_children(choose, table, selected, inputs)  # (F, B) or -1
            if len(plan.input_widths) == 1:
                _send(chosen, module, 0, child)
                continue
            start = 0
            for h, width in enumerate(plan.input_widths):  # child is -1 where not visited
                inside = (child >= start) & (child < start + width)
                _send(chosen, module, h, torch.where(inside, child - start, -1))
                start += width
        else:
            assert isinstance(module, FoldedProduct)
            if plan.product_kind is ProductKind.HADAMARD:
                for h in range(len(plan.input_widths)):
                    _send(chosen, module, h, selected)  # the same unit of every input
            else:
                active = selected >= 0
                rest = selected.clamp(min=0)
                for h in reversed(range(len(plan.input_widths))):
                    width = plan.input_widths[h]
                    _send(chosen, module, h, torch.where(active, rest % width, -1))
                    rest = torch.div(rest, width, rounding_mode="floor")
    if real:
        result = torch.where(torch.isneginf(result), torch.nan, result)
    return result


@torch.no_grad()
def conditional_sample(circuit: CircuitCore, x: Tensor, observed: Tensor,
                       generator: torch.Generator | None = None,
                       params: ParamsLike | None = None) -> Tensor:
    """One exact sample of the unobserved variables from ``p(. | evidence)`` per row.

    Args:
        x: (B, V) evidence (read where ``observed``); observed entries are copied to the output.
        observed: (B, V) or (V,) bool mask.
        generator: source of randomness (on the circuit's device).
        params: optional external parameters with batch B.

    Returns:
        (B, V) long; variables outside the circuit's scope are -1 (float with NaN there for a
        real-valued circuit, see the module docstring).

    Raises:
        ZeroProbabilityEvidenceError: some row's evidence has probability zero (there is no
            posterior to sample from); the error names the rows and the log-probability.
    """
    x, observed = circuit.validate_data(x, observed)
    prepared = circuit.resolve_params(params, x.shape[0])
    trace = Trace()
    check_evidence(circuit.evaluate(x, observed, prepared, trace=trace), "conditional_sample")
    return descend(circuit, trace, x, observed, gumbel_chooser(generator))


@torch.no_grad()
def sample(circuit: CircuitCore, num_samples: int | None = None,
           generator: torch.Generator | None = None, params: ParamsLike | None = None) -> Tensor:
    """Exact samples from the circuit's distribution: ``(num_samples, V)`` long (floating-point
    for a real-valued circuit, see the module docstring).

    With external parameters of batch B, draws one sample per parameter set (``num_samples``
    may be omitted or must equal B). A normalised circuit needs no bottom-up pass at all.
    """
    prepared = circuit.resolve_params(params, None)
    batch = prepared.batch
    if batch is None:
        if num_samples is None or not isinstance(num_samples, int) or num_samples < 1:
            raise InvalidInputError(f"num_samples must be a positive int, got {num_samples!r}")
        batch = num_samples
    elif num_samples is not None and num_samples != batch:
        raise InvalidInputError(
            f"external parameters hold {batch} parameter sets: draw one sample per set "
            f"(num_samples={batch} or None), got num_samples={num_samples}")
    x = circuit.blank_data(batch)
    observed = torch.zeros_like(x, dtype=torch.bool)
    if circuit.normalized:  # the weights alone: no bottom-up pass
        trace = Trace(log_params=dict(prepared.values))
    else:
        trace = Trace()
        circuit.evaluate(x, observed, prepared, trace=trace)
    return descend(circuit, trace, x, observed, gumbel_chooser(generator))


@torch.no_grad()
def map_state(circuit: CircuitCore, x: Tensor | None = None, observed: Tensor | None = None,
              params: ParamsLike | None = None) -> tuple[Tensor, Tensor]:
    """Most probable completion of the evidence by max-product, and its max-product log-value.

    Exact MAP for deterministic circuits (at most one non-zero input per sum unit for any
    complete assignment). For other circuits this is the max-product (Viterbi) state: the best
    single induced tree, whose value lower-bounds ``log c(state)``.

    Args:
        x: (B, V) evidence, or None for no evidence (then ``params`` fixes the batch, default 1).
        observed: (B, V) or (V,) mask; default: nothing observed.

    Returns:
        ``(state (B, V) long, log_value (B,))``; the state is floating-point for a real-valued
        circuit (a Gaussian unit's value is its mean) and the log-value is then a log-density.

    Raises:
        ZeroProbabilityEvidenceError: some row's evidence has probability zero (every
            completion is impossible, so none is most probable).
    """
    if x is None:  # the parameters fix the batch
        prepared = circuit.resolve_params(params, None)
        batch = prepared.batch
        x = circuit.blank_data(1 if batch is None else batch)
        if observed is None:
            observed = torch.zeros_like(x, dtype=torch.bool)
        x, observed = circuit.validate_data(x, observed)
    else:
        if observed is None:
            observed = torch.zeros(circuit.num_variables, dtype=torch.bool,
                                   device=circuit.categories.device)
        x, observed = circuit.validate_data(x, observed)
        prepared = circuit.resolve_params(params, x.shape[0])
    trace = Trace()
    value = circuit.evaluate(x, observed, prepared, semiring=Semiring.MAX, trace=trace)
    check_evidence(value, "map_state")
    return descend(circuit, trace, x, observed, argmax_chooser), value


__all__ = ["FoldKind", "conditional_sample", "descend", "map_state", "sample"]
