"""Folded torch layers: each evaluates a stack of ``F`` same-shaped symbolic layers at once.

All values are log-values of shape ``(F, B, K)`` (``F`` folded layers, batch ``B``, ``K`` units).
Parameters are either the layer's own (``raw`` of shape ``(F, K, D)``) or supplied per call with a
leading batch dimension (``(B, F, K, D)``): one parameter set per data row. ``D`` is the number of
raw parameters per input unit (the categories of a Categorical one, see
:mod:`~circuits.compiled.input_families` for the others) or of concatenated input units (sum layers).

Two semirings are supported: :attr:`Semiring.SUM` (log-sum-exp: probabilities) and
:attr:`Semiring.MAX` (max-product: MAP/Viterbi values).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

import torch
from torch import Tensor, nn

from circuits.compiled.folding import FoldPlan, InputAddress
from circuits.compiled.input_families import (
    CategoricalFamily,
    InputFamily,
    NativeFamily,
    family_of,
    free_value_per_row,
)
from circuits.errors import InvalidInputError
from circuits.kernels import TritonKernel, log_matmul, rows_per_set, use_triton
from circuits.kernels.ops import WeightsLike
from circuits.kernels.softmax import softmax_stats
from circuits.parameterizations import Parameterization, Softmax
from circuits.symbolic import InputLayer, ProductKind, SumLayer


class Semiring(Enum):
    SUM = "sum"  # log-sum-exp: likelihoods and marginals
    MAX = "max"  # max-product: MAP values


def _initial_raw(plan: FoldPlan, random_raw: Callable[[], Tensor]) -> Tensor:
    """Stack the symbolic layers' initial parameters, drawing random ones (``random_raw()``) where
    none are given."""
    rows = []
    for layer in plan.layers:
        assert isinstance(layer, (InputLayer, SumLayer))
        if layer.initial is not None:
            rows.append(layer.initial.detach().cpu())
        else:
            rows.append(random_raw())
    # float64 initial values keep their precision until compile() casts to the requested dtype
    dtype = torch.float64 if any(row.dtype == torch.float64 for row in rows) else torch.float32
    return torch.stack([row.to(dtype) for row in rows])


class SoftmaxParts(NamedTuple):
    """Per-row categorical log-probabilities kept as ``logits - lse``, without the table.

    :meth:`FoldedInput.softmax_parts` makes them where the triton kernels run
    (:meth:`~circuits.compiled.CompiledCircuit.log_parameters`): the bottom-up pass gathers
    ``logits[c] - lse``, the sampler draws by Gumbel-max on the logits and the conditionals mix
    them with :func:`~circuits.kernels.softmax.softmax_mixture`, so the ``(S, F, K, C)``
    log-softmax is never written. :meth:`log_probs` builds it for the queries that need it.

    Attributes:
        logits: (S, F, K, C) raw parameters of S sets.
        lse: (S, F, K) their log-normalisers.
    """

    logits: Tensor
    lse: Tensor

    def log_probs(self) -> Tensor:
        """The ``(S, F, K, C)`` log-softmax (``-inf`` rows where a row has no mass)."""
        finite = torch.isfinite(self.lse)[..., None]
        return torch.where(finite, self.logits - self.lse[..., None], -torch.inf)

    def expand(self, sets: int) -> SoftmaxParts:
        """The same single parameter set seen as ``sets`` sets (stride-0 views, no copy)."""
        return SoftmaxParts(self.logits.expand(sets, *self.logits.shape[1:]),
                            self.lse.expand(sets, *self.lse.shape[1:]))


class FoldedInput(nn.Module):
    """A fold of input layers of one family (:mod:`~circuits.compiled.input_families`).

    Buffers: ``variables`` (F,) the variable of each stacked layer; ``integrated`` (F,) bool.
    Parameter: ``raw`` (F, K, D): categorical logits (D = C), a success logit (Bernoulli,
    Binomial: D = 1) or a mean and log-standard-deviation (Gaussian: D = 2).
    """

    def __init__(self, plan: FoldPlan, generator: torch.Generator) -> None:
        super().__init__()
        assert plan.parameterization is not None and plan.distribution is not None
        self.plan = plan
        self.parameterization: Parameterization = plan.parameterization
        #: the family's math; ``categorical`` selects the table fast paths below
        self.family: InputFamily = family_of(plan.distribution, plan.parameterization)
        self.categorical = isinstance(self.family, CategoricalFamily)
        #: number of values of a discrete family (0 for a Gaussian one)
        self.num_categories = plan.num_categories
        layers = [layer for layer in plan.layers if isinstance(layer, InputLayer)]
        self.register_buffer("variables", torch.tensor([la.variable for la in layers]))
        self.register_buffer("integrated", torch.tensor([la.integrated for la in layers]))
        #: (F,) bool, ``~integrated``: slots whose variable can be observed
        self.register_buffer("live", ~self.integrated, persistent=False)
        self.any_integrated = any(la.integrated for la in layers)
        #: whether some variable has several slots in this fold (static, for fixed-shape queries)
        self.repeats_variables = len({la.variable for la in layers}) < len(layers)
        self.raw = nn.Parameter(_initial_raw(
            plan, lambda: self.family.initial_raw(plan.num_units, generator)))

    def log_probs(self, raw: Tensor | None) -> Tensor:
        """What the passes read: a Categorical fold's log-probabilities ``(F, K, C)`` or, for
        per-row parameters, ``(B, F, K, C)``; another family's raw parameters (a copy of the
        module's own, :meth:`NativeFamily.prepare
        <circuits.compiled.input_families.NativeFamily.prepare>`)."""
        raw = self.raw if raw is None else raw
        if self.categorical:
            return self.parameterization.log_weights(raw)
        assert isinstance(self.family, NativeFamily)
        return self.family.prepare(raw)

    def em_estimate(self, values: Tensor, observed: Tensor, flows: Tensor,
                    pseudocount: float) -> Tensor:
        """The EM update of this fold's own parameters: new raw values of shape ``raw.shape``.

        The weighted maximum-likelihood estimate of every unit, each row ``b`` weighted by the
        unit's flow. Unobserved entries (and integrated slots) count the unit's own expected
        sufficient statistics (Categorical: its probabilities; Bernoulli, Binomial: its mean;
        Gaussian: its mean and second moment), which makes EM with missing values exact.
        ``pseudocount`` is added to every category's count (Categorical) or to the successes and
        to the failures (Bernoulli, Binomial); a Gaussian's variance is floored at its
        ``min_variance`` instead. Units with no flow (and no pseudocount) keep their parameters.
        Categorical units get ``log`` of the estimated probabilities, which Softmax (and Exp,
        then normalised) maps back exactly.

        Args:
            values: (B, F) the data of the fold's slot variables (long or float; read where
                observed).
            observed: (B, F) bool.
            flows: (B, F, K) nonnegative: ``d log p(x_b) / d log l_u`` per row, the unit's
                posterior responsibility (expected count).
            pseudocount: >= 0.

        Returns:
            (F, K, D) raw parameters, the dtype and device of ``raw``, without gradient.
        """
        fold, units = self.raw.shape[:2]
        if not isinstance(values, Tensor) or not isinstance(observed, Tensor) or \
                not isinstance(flows, Tensor):
            raise InvalidInputError("em_estimate needs tensors values, observed and flows")
        if values.dim() != 2 or values.shape[1] != fold or tuple(observed.shape) != tuple(values.shape) \
                or tuple(flows.shape) != (values.shape[0], fold, units):
            raise InvalidInputError(
                f"em_estimate needs values and observed of shape (batch, {fold}) and flows of shape "
                f"(batch, {fold}, {units}); got {tuple(values.shape)}, {tuple(observed.shape)} and "
                f"{tuple(flows.shape)}")
        if observed.dtype != torch.bool:
            raise InvalidInputError(f"em_estimate: observed must be a bool tensor, got {observed.dtype}")
        if isinstance(pseudocount, bool) or not isinstance(pseudocount, (int, float)) or \
                not pseudocount >= 0 or pseudocount == float("inf"):
            raise InvalidInputError(f"em_estimate: pseudocount must be a finite number >= 0, got "
                                    f"{pseudocount!r}")
        device = self.raw.device
        with torch.no_grad():
            observed = observed.to(device)
            if self.any_integrated:
                observed = observed & self.live
            return self.family.em_estimate(self.raw.detach(), values.to(device), observed,
                                           flows.to(device=device, dtype=self.raw.dtype),
                                           float(pseudocount))

    def lazy_softmax(self, raw: Tensor | None) -> bool:
        """Whether :meth:`softmax_parts` should stand in for :meth:`log_probs` on ``raw``: external
        softmax logits, no integrated slot, no gradient wanted, and the triton backend selected."""
        return (raw is not None and self.categorical and isinstance(self.parameterization, Softmax)
                and not self.any_integrated
                and not (torch.is_grad_enabled() and raw.requires_grad)
                and use_triton(raw, kernel=TritonKernel.SOFTMAX_STATS))

    def softmax_parts(self, raw: Tensor) -> SoftmaxParts:
        """``raw`` (S, F, K, C) logits and their log-normalisers, in one pass over ``C``."""
        stats = softmax_stats(raw.reshape(-1, raw.shape[-1]))
        return SoftmaxParts(raw, stats.log_normalizer.view(raw.shape[:-1]))

    def forward(self, x: Tensor, observed: Tensor, log_probs: Tensor | SoftmaxParts,
                semiring: Semiring = Semiring.SUM) -> Tensor:
        """Log-values ``(F, B, K)`` of the units given data.

        Args:
            x: (B, V) long, category of every variable (ignored where not observed); float when
                the circuit has a Gaussian variable (discrete columns then hold integral values).
            observed: (B, V) bool; unobserved variables are summed out (max-ed out under MAX).
            log_probs: from :meth:`log_probs`, or :meth:`softmax_parts` (read without building
                the log-softmax table under the SUM semiring).
        """
        if not self.categorical:
            assert isinstance(log_probs, Tensor)
            return self._native_forward(x, observed, log_probs, semiring)
        parts = log_probs if isinstance(log_probs, SoftmaxParts) else None
        if parts is not None and semiring is not Semiring.SUM:
            parts, log_probs = None, log_probs.log_probs()
        # unobserved entries are never read, whatever they hold: keep them in range for indexing
        columns = x[:, self.variables]
        if columns.is_floating_point():  # real-valued data: this fold's columns are integral
            columns = columns.nan_to_num(0.0, 0.0, 0.0).long()
        values = columns.clamp(0, self.num_categories - 1)  # (B, F)
        if parts is not None:
            sets, fold, units = parts.lse.shape
            group = rows_per_set(values.shape[0], sets)
            index = values.view(sets, group, fold).permute(0, 2, 1)[:, :, None, :]
            picked = parts.logits.gather(3, index.expand(sets, fold, units, group))
            lse = parts.lse[..., None]
            picked = torch.where(torch.isfinite(lse), picked - lse, -torch.inf)
            picked = picked.permute(1, 0, 3, 2).reshape(fold, values.shape[0], units)
            return torch.where(observed[:, self.variables].T[:, :, None], picked, 0.0)
        assert isinstance(log_probs, Tensor)
        if log_probs.dim() == 3:
            fold, units, size = log_probs.shape
            batch = values.shape[0]
            if 4 * size <= batch:  # few categories: copy whole rows of a (F * C, K) table
                rows = log_probs.transpose(1, 2).reshape(fold * size, units)
                offsets = torch.arange(fold, device=x.device)[:, None] * size
                picked = rows.index_select(0, (values.T + offsets).reshape(-1))
                picked = picked.view(fold, batch, units)
            else:  # gather (F, K, C) at c = value[b, f] -> (F, K, B), read as a (F, B, K) view
                index = values.T[:, None, :].expand(fold, units, batch)
                picked = log_probs.gather(2, index).transpose(1, 2)
        else:
            # one parameter set per group of consecutive rows (see evaluate)
            sets, fold, units = log_probs.shape[:3]
            group = rows_per_set(values.shape[0], sets)
            index = values.view(sets, group, fold).permute(0, 2, 1)[:, :, None, :]
            picked = log_probs.gather(3, index.expand(sets, fold, units, group))
            picked = picked.permute(1, 0, 3, 2).reshape(fold, values.shape[0], units)
        is_observed = observed[:, self.variables].T  # (F, B)
        if self.any_integrated:
            is_observed = is_observed & self.live[:, None]
        if self.parameterization.normalized and semiring is Semiring.SUM:
            return torch.where(is_observed[:, :, None], picked, 0.0)  # free variables sum to 1
        if self.parameterization.normalized:
            mass = log_probs.new_zeros(log_probs.shape[:-1])
        else:
            mass = torch.logsumexp(log_probs, -1)
        if semiring is Semiring.MAX:  # max out free variables, but integrated ones stay summed
            best = log_probs.amax(-1)
            free = best if mass.dim() == 2 else best.transpose(0, 1)
            mass = mass if mass.dim() == 2 else mass.transpose(0, 1)
            integrated = self.integrated.view(-1, *([1] * (mass.dim() - 1)))  # (F, 1[, 1])
            summed_out = torch.where(integrated, mass, free)
        else:
            summed_out = mass if mass.dim() == 2 else mass.transpose(0, 1)
        if summed_out.dim() == 2:
            summed_out = summed_out[:, None, :]
        elif summed_out.shape[1] != values.shape[0]:  # per-set masses -> per-row
            summed_out = summed_out.repeat_interleave(
                rows_per_set(values.shape[0], summed_out.shape[1]), 1)
        return torch.where(is_observed[:, :, None], picked, summed_out)

    def _native_forward(self, x: Tensor, observed: Tensor, params: Tensor,
                        semiring: Semiring) -> Tensor:
        """:meth:`forward` of a Bernoulli, Binomial or Gaussian fold: normalised densities, so an
        unobserved variable gives ``log 1 = 0`` (SUM) or the unit's highest log-density (MAX;
        integrated slots stay summed)."""
        family = self.family
        assert isinstance(family, NativeFamily)
        is_observed = observed[:, self.variables]  # (B, F)
        if self.any_integrated:
            is_observed = is_observed & self.live
        picked = family.log_density(x[:, self.variables], is_observed, params)  # (F, B, K)
        if semiring is Semiring.SUM:
            free: Tensor | float = 0.0
        else:
            free = free_value_per_row(family.max_log_value(params), x.shape[0])
            if self.any_integrated:
                free = torch.where(self.integrated[:, None, None], 0.0, free)
        return torch.where(is_observed.T[:, :, None], picked, free)


def input_slice(address: InputAddress) -> slice | None:
    """``address.index`` as a slice of its single source fold when the slots are evenly spaced
    (``start, start + step, ...``), so the input can be read as a view instead of a copy."""
    index = address.index
    if len(address.sources) != 1 or not index:
        return None
    step = index[1] - index[0] if len(index) > 1 else 1
    stop = index[0] + step * len(index)
    if step < 1 or index != tuple(range(index[0], stop, step)):
        return None
    return slice(index[0], stop, step)


Routes = list[tuple[int, Tensor, Tensor]]


def gather_inputs(outputs: list[Tensor], plan: FoldPlan, buffers: list[Tensor],
                  slices: list[slice | None] | None = None,
                  routes: Callable[[int], Routes] | None = None) -> list[Tensor]:
    """The fold's ``H`` inputs, each ``(F, B, K_h)``, read from earlier folds' outputs.

    ``slices`` (see :func:`input_slice`, one per input) lets evenly spaced reads be views;
    ``routes`` (:meth:`RoutedFold.routes`) lets an input read from several folds copy only the
    rows it uses instead of concatenating those folds whole.
    """
    gathered = []
    for h, (address, index) in enumerate(zip(plan.inputs, buffers, strict=True)):
        if len(address.sources) == 1:
            source = outputs[address.sources[0]]
            window = slices[h] if slices is not None else None
            if window is not None:
                gathered.append(source[window])  # a strided view: no copy
                continue
            if index.shape[0] == source.shape[0] and address.index == tuple(range(index.shape[0])):
                gathered.append(source)
                continue
        elif routes is not None:
            gathered.append(_gather_routed(outputs, routes(h), index.shape[0]))
            continue
        else:
            source = torch.cat([outputs[s] for s in address.sources], dim=0)
        gathered.append(source.index_select(0, index))
    return gathered


def _gather_routed(outputs: list[Tensor], routes: Routes, size: int) -> Tensor:
    """Rows ``slots`` of each source fold copied to rows ``folds`` of a new ``(size, B, K)``."""
    first = outputs[routes[0][0]]
    result = first.new_empty((size, *first.shape[1:]))
    for source, folds, slots in routes:
        result.index_copy_(0, folds, outputs[source].index_select(0, slots))
    return result


class RoutedFold(nn.Module):
    """Shared by sum and product folds: index buffers to read inputs and route choices back.

    ``index_{h}`` gathers input ``h`` bottom-up; ``routes(h)`` lists, per source fold, which of
    this fold's slots read from which of the source's slots (used by top-down passes).
    """

    def __init__(self, plan: FoldPlan) -> None:
        super().__init__()
        self.plan = plan
        self._routes: list[list[tuple[int, str, str]]] = []
        for h, address in enumerate(plan.inputs):
            self.register_buffer(f"index_{h}", torch.tensor(address.index), persistent=False)
            routes = []
            for source in address.sources:
                folds = [f for f, (src, _) in enumerate(address.slots) if src == source]
                slots = [address.slots[f][1] for f in folds]
                self.register_buffer(f"route_{h}_{source}_f", torch.tensor(folds), persistent=False)
                self.register_buffer(f"route_{h}_{source}_s", torch.tensor(slots), persistent=False)
                routes.append((source, f"route_{h}_{source}_f", f"route_{h}_{source}_s"))
            self._routes.append(routes)
        #: per input, a slice of its source fold when it can be read as a view (else None)
        self.input_slices: list[slice | None] = [input_slice(a) for a in plan.inputs]

    def index_buffers(self) -> list[Tensor]:
        return [getattr(self, f"index_{h}") for h in range(len(self.plan.inputs))]

    def routes(self, h: int) -> list[tuple[int, Tensor, Tensor]]:
        """``(source fold id, this fold's slots, source slots)`` for input ``h``."""
        return [(source, getattr(self, f), getattr(self, s)) for source, f, s in self._routes[h]]


class FoldedSum(RoutedFold):
    """A fold of sum layers. Parameter ``raw`` (F, K, D) with D = total input units."""

    def __init__(self, plan: FoldPlan, generator: torch.Generator) -> None:
        super().__init__(plan)
        assert plan.parameterization is not None
        self.parameterization: Parameterization = plan.parameterization
        self.input_width = sum(plan.input_widths)
        parameterization = plan.parameterization
        self.raw = nn.Parameter(_initial_raw(
            plan, lambda: parameterization.initial_raw((plan.num_units, self.input_width), generator)))

    def log_weights(self, raw: Tensor | None) -> Tensor:
        """Log-weights ``(F, K, D)`` or, for per-row parameters, ``(B, F, K, D)``."""
        return self.parameterization.log_weights(self.raw if raw is None else raw)

    def forward(self, inputs: Tensor, log_weights: Tensor, semiring: Semiring = Semiring.SUM,
                weights: WeightsLike | None = None, keep: dict[str, Tensor] | None = None) -> Tensor:
        """``inputs`` (F, B, D) log-values -> (F, B, K) log-values of the sum units.

        ``weights`` and ``keep`` (SUM only): see :func:`circuits.kernels.log_matmul`.
        """
        if semiring is Semiring.MAX:
            if log_weights.dim() == 3:
                return (inputs[:, :, None, :] + log_weights[:, None, :, :]).amax(-1)
            per_row = log_weights.transpose(0, 1)  # (F, S, K, D)
            if per_row.shape[1] != inputs.shape[1]:
                per_row = per_row.repeat_interleave(rows_per_set(inputs.shape[1], per_row.shape[1]), dim=1)
            return (inputs[:, :, None, :] + per_row).amax(-1)
        return log_matmul(inputs, log_weights, weights=weights, keep=keep)


class FoldedProduct(RoutedFold):
    """A fold of product layers (Hadamard: sum of log-values; Kronecker: outer sum)."""

    def __init__(self, plan: FoldPlan) -> None:
        super().__init__(plan)
        self.kind = plan.product_kind

    def forward(self, inputs: list[Tensor]) -> Tensor:
        """``H`` inputs ``(F, B, K_h)`` -> ``(F, B, K)``."""
        if self.kind is ProductKind.HADAMARD and len(inputs) > 2:
            result = inputs[0] + inputs[1]
            for other in inputs[2:]:
                result.add_(other)  # a fresh tensor: accumulate in place, same order of sums
            return result
        result = inputs[0]
        for other in inputs[1:]:
            if self.kind is ProductKind.HADAMARD:
                result = result + other
            else:
                fold, batch = result.shape[:2]
                width = result.shape[2] * other.shape[2]  # explicit: a batch of 0 rows is fine
                result = (result[:, :, :, None] + other[:, :, None, :]).reshape(fold, batch, width)
        return result
