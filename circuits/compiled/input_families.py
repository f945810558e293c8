"""The math of each input family, for the compiled input folds: log-densities, modes, sampling
draws, initial values, value rules and EM estimates.

A :class:`~circuits.compiled.layers.FoldedInput` holds one family object (:func:`family_of`) for
its ``F`` stacked layers of ``K`` units and ``D`` raw parameters each:

* :class:`CategoricalFamily`: ``D = C`` logits mapped to log-probabilities by the layer's
  parameterisation (Softmax or Exp). Its bottom-up pass and the samplers keep their own fast
  table paths in :mod:`~circuits.compiled.layers` and :mod:`~circuits.compiled.sampling`; here it
  contributes its initial values and :meth:`~InputFamily.em_estimate`.
* :class:`BinomialFamily` (:class:`~circuits.symbolic.Bernoulli` is ``total_count = 1``): one
  success logit ``l`` per unit, ``log p(x) = log C(n, x) + x log sigmoid(l) + (n - x) log
  sigmoid(-l)``; ``l = -inf`` and ``+inf`` are the exact probabilities 0 and 1.
* :class:`GaussianFamily`: ``(mean, log_std)`` per unit, ``log p(x) = -((x - mean) / std)^2 / 2
  - log std - log(2 pi) / 2``.

For the last two, the prepared parameters a query runs on (the fold's entry of
:class:`~circuits.compiled.prepared.LogParameters`) are the raw parameters themselves, ``(F, K, D)``
for the module's own and ``(S, F, K, D)`` for ``S`` per-call sets, set ``s`` serving rows
``s * B/S .. (s+1) * B/S - 1`` (:func:`~circuits.kernels.rows_per_set`). Their densities are
normalised, so an unobserved variable contributes ``log 1 = 0`` under the SUM semiring and its
highest log-density under MAX (:meth:`~InputFamily.max_log_value`: at the mode, exactly the value
of the state :meth:`~InputFamily.mode` returns).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from enum import Enum

import torch
import torch.nn.functional as nnf
from torch import Tensor

from circuits.errors import InvalidInputError
from circuits.kernels import rows_per_set
from circuits.parameterizations import Parameterization
from circuits.symbolic import Bernoulli, Binomial, Categorical, Gaussian, InputDistribution

_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)


class ValueRule(Enum):
    """Which raw parameter values are valid (:mod:`circuits.compiled.validity` applies it)."""

    #: every row (last dimension) free of NaN and +inf with an entry above -inf: categorical
    #: logits and sum weights, where -inf is an exact zero
    ROWS = "rows"
    #: every entry a number; +-inf allowed: success logits, where they are probabilities 1 and 0
    NOT_NAN = "not NaN"
    #: every entry finite: a Gaussian's mean and log-standard-deviation
    FINITE = "finite"


def _per_row(values: Tensor, param: Tensor) -> tuple[Tensor, Tensor]:
    """``values`` (B, F) and a per-unit parameter (F, K) or (S, F, K), as broadcastable
    ``(F, S, B/S, 1)`` and ``(F, S, 1, K)`` (``S = 1`` for shared parameters); the result of an
    elementwise op on both reshapes to ``(F, B, K)``."""
    batch, fold = values.shape
    if param.dim() == 2:
        return values.T[:, None, :, None], param[:, None, None, :]
    sets = param.shape[0]
    group = rows_per_set(batch, sets)
    return values.T.reshape(fold, sets, group)[..., None], param.transpose(0, 1)[:, :, None, :]


def free_value_per_row(best: Tensor, batch: int) -> Tensor:
    """A per-unit value ``(F, K)`` or per-set ``(S, F, K)`` as ``(F, 1, K)`` or ``(F, B, K)``."""
    if best.dim() == 2:
        return best[:, None, :]
    sets, fold, units = best.shape
    group = rows_per_set(batch, sets)
    return best.transpose(0, 1)[:, :, None, :].expand(fold, sets, group, units).reshape(
        fold, batch, units)


class InputFamily(ABC):
    """What a compiled input fold needs from its distribution family (see the module docstring).

    Attributes:
        distribution: the symbolic family.
        support_size: number of values of a discrete family, 0 for a real-valued one.
        value_rule: which raw values are valid.
    """

    distribution: InputDistribution
    value_rule: ValueRule

    @property
    def discrete(self) -> bool:
        return self.distribution.discrete

    @property
    def support_size(self) -> int:
        size = self.distribution.support_size
        return 0 if size is None else size

    @abstractmethod
    def initial_raw(self, num_units: int, generator: torch.Generator) -> Tensor:
        """Random raw parameters ``(num_units, D)`` (float32) for a layer without ``initial``."""

    @abstractmethod
    def em_estimate(self, raw: Tensor, values: Tensor, observed: Tensor, flows: Tensor,
                    pseudocount: float) -> Tensor:
        """The weighted maximum-likelihood raw parameters ``(F, K, D)`` (see
        :meth:`FoldedInput.em_estimate <circuits.compiled.layers.FoldedInput.em_estimate>`).

        ``observed`` already excludes integrated slots; ``flows`` has the dtype of ``raw``.
        Units without any flow (and no pseudocount) keep their raw parameters.
        """


class NativeFamily(InputFamily):
    """A family with its own raw parameters (Bernoulli, Binomial, Gaussian): what the bottom-up
    pass and MAP read from it."""

    def prepare(self, raw: Tensor) -> Tensor:
        """What a query runs on for raw parameters ``(F, K, D)`` or ``(S, F, K, D)``: the raw
        values themselves (the module's own are copied, so the prepared parameters do not follow
        later in-place updates of the module)."""
        return raw.clone() if raw.dim() == 3 else raw

    @abstractmethod
    def log_density(self, values: Tensor, observed: Tensor, params: Tensor) -> Tensor:
        """Log-density (log-mass) of every unit at ``values`` (B, F): ``(F, B, K)``.

        Entries where ``observed`` (B, F) is False hold a finite placeholder (the caller replaces
        them), whatever ``values`` holds there (NaN included).
        """

    @abstractmethod
    def max_log_value(self, params: Tensor) -> Tensor:
        """The highest log-density of every unit, ``(F, K)`` or ``(S, F, K)``: its value at
        :meth:`mode` (the MAX semiring's value of an unobserved variable)."""

    @abstractmethod
    def mode(self, params: Tensor) -> Tensor:
        """The most probable value of the units whose parameters are ``params`` (..., D):
        ``(...)``, long for discrete families."""


class CategoricalFamily(InputFamily):
    """Categorical units: logits ``(K, C)`` through the layer's parameterisation."""

    value_rule = ValueRule.ROWS

    def __init__(self, distribution: Categorical, parameterization: Parameterization) -> None:
        self.distribution = distribution
        self.parameterization = parameterization

    def initial_raw(self, num_units: int, generator: torch.Generator) -> Tensor:
        return self.parameterization.initial_raw((num_units, self.distribution.num_categories),
                                                 generator)

    def em_estimate(self, raw: Tensor, values: Tensor, observed: Tensor, flows: Tensor,
                    pseudocount: float) -> Tensor:
        fold, units, size = raw.shape
        probs = torch.softmax(raw.detach(), -1)  # the units' current (normalised) distributions
        seen = torch.where(observed[..., None], flows, 0.0)  # (B, F, K)
        index = torch.where(observed, values, 0).long().clamp(0, size - 1).T  # (F, B)
        counts = raw.new_zeros(fold, size, units)
        counts.scatter_add_(1, index[:, :, None].expand(-1, -1, units), seen.transpose(0, 1))
        missing = torch.where(observed[..., None], 0.0, flows).sum(0)  # (F, K)
        counts = counts.transpose(1, 2) + missing[..., None] * probs + pseudocount
        total = counts.sum(-1, keepdim=True)
        estimate = torch.log(counts / total)
        return torch.where(total > 0, estimate, raw.detach())


class BinomialFamily(NativeFamily):
    """Binomial units over ``0 .. n`` (Bernoulli: ``n = 1``) with one success logit each."""

    value_rule = ValueRule.NOT_NAN

    def __init__(self, distribution: Bernoulli | Binomial) -> None:
        self.distribution = distribution
        self.total_count = distribution.total_count if isinstance(distribution, Binomial) else 1

    def initial_raw(self, num_units: int, generator: torch.Generator) -> Tensor:
        return torch.randn((num_units, 1), generator=generator)

    def _log_mass(self, counts: Tensor, logits: Tensor) -> Tensor:
        """``log p(counts)`` broadcast between integer-valued ``counts`` and ``logits`` (same dtype)."""
        n = self.total_count
        successes = torch.where(counts > 0, counts * nnf.logsigmoid(logits), 0.0)
        failures = torch.where(counts < n, (n - counts) * nnf.logsigmoid(-logits), 0.0)
        value = successes + failures
        if n > 1:  # log C(n, x), exactly 0 at x = 0 and x = n (the same lgamma on both sides)
            full = torch.lgamma(counts.new_tensor(n + 1.0))
            value = value + ((full - torch.lgamma(counts + 1)) - torch.lgamma(n - counts + 1))
        return value

    def log_density(self, values: Tensor, observed: Tensor, params: Tensor) -> Tensor:
        counts = torch.where(observed, values, 0).to(params.dtype).clamp(0, self.total_count)
        column, logits = _per_row(counts, params[..., 0])
        fold, batch = counts.shape[1], counts.shape[0]
        return self._log_mass(column, logits).reshape(fold, batch, params.shape[-2])

    def log_table(self, params: Tensor) -> Tensor:
        """Log-probabilities of every value, ``(..., K, n + 1)``, from logits ``(..., K, 1)``."""
        counts = torch.arange(self.total_count + 1, dtype=params.dtype, device=params.device)
        return self._log_mass(counts, params)

    def mode(self, params: Tensor) -> Tensor:
        """``#{m in 1..n : l > log(m / (n + 1 - m))}``: the mode, ``floor((n + 1) p)`` away
        from ties; at a tie (``(n + 1) p = m``, two modes) the smaller one, ``m - 1``."""
        n = self.total_count
        m = torch.arange(1, n + 1, dtype=torch.float64, device=params.device)
        thresholds = torch.log(m) - torch.log(n + 1 - m)  # increasing; exactly 0 at the middle
        logits = params[..., 0].detach().double().contiguous()
        return torch.searchsorted(thresholds, logits.reshape(-1)).view(logits.shape)

    def max_log_value(self, params: Tensor) -> Tensor:
        return self._log_mass(self.mode(params).to(params.dtype), params[..., 0])

    def em_estimate(self, raw: Tensor, values: Tensor, observed: Tensor, flows: Tensor,
                    pseudocount: float) -> Tensor:
        n = self.total_count
        logits = raw.detach()[..., 0]  # (F, K)
        counts = torch.where(observed, values, 0).to(raw.dtype)[..., None]  # (B, F, 1)
        # expected successes and failures; unobserved entries count the unit's own mean n p
        succ = torch.where(observed[..., None], counts, n * torch.sigmoid(logits))
        fail = torch.where(observed[..., None], n - counts, n * torch.sigmoid(-logits))
        successes = (flows * succ).sum(0) + pseudocount
        failures = (flows * fail).sum(0) + pseudocount
        estimate = torch.log(successes) - torch.log(failures)
        empty = (successes == 0) & (failures == 0)
        return torch.where(empty, logits, estimate)[..., None]


class GaussianFamily(NativeFamily):
    """Normal units with raw ``(mean, log_std)``."""

    value_rule = ValueRule.FINITE

    def __init__(self, distribution: Gaussian) -> None:
        self.distribution = distribution

    def initial_raw(self, num_units: int, generator: torch.Generator) -> Tensor:
        means = torch.randn((num_units, 1), generator=generator)
        return torch.cat([means, torch.zeros(num_units, 1)], dim=1)  # unit standard deviations

    def log_density(self, values: Tensor, observed: Tensor, params: Tensor) -> Tensor:
        points = torch.where(observed, values.to(params.dtype), 0.0)
        column, mean = _per_row(points, params[..., 0])
        _, log_std = _per_row(points, params[..., 1])
        z = (column - mean) * torch.exp(-log_std)
        value = -0.5 * z * z - log_std - _HALF_LOG_TWO_PI
        return value.reshape(points.shape[1], points.shape[0], params.shape[-2])

    def max_log_value(self, params: Tensor) -> Tensor:
        return -params[..., 1] - _HALF_LOG_TWO_PI

    def mode(self, params: Tensor) -> Tensor:
        return params[..., 0]

    def sample(self, params: Tensor, generator: torch.Generator | None) -> Tensor:
        """One draw ``mean + std * eps`` per row of ``params`` (..., 2), ``eps`` float64 standard
        normal from ``generator`` (``torch.distributions.Normal``'s formula, reproducible)."""
        noise = torch.randn(params.shape[:-1], generator=generator, dtype=torch.float64,
                            device=params.device)
        return (params[..., 0].double() + torch.exp(params[..., 1].double()) * noise).to(params.dtype)

    def em_estimate(self, raw: Tensor, values: Tensor, observed: Tensor, flows: Tensor,
                    pseudocount: float) -> Tensor:
        del pseudocount  # a Gaussian has no prior count; the variance floor keeps it proper
        mean, log_std = raw.detach()[..., 0], raw.detach()[..., 1]  # (F, K)
        points = torch.where(observed, values.to(raw.dtype), 0.0)[..., None]  # (B, F, 1)
        seen = observed[..., None]
        total = flows.sum(0)
        safe = torch.where(total > 0, total, 1.0)
        # E[x] per row: the point where observed, the unit's own mean where not
        new_mean = (flows * torch.where(seen, points, mean)).sum(0) / safe
        # E[(x - new_mean)^2]: the squared deviation, or var + (mean - new_mean)^2 where unobserved
        deviation = torch.where(seen, (points - new_mean) ** 2,
                                torch.exp(2 * log_std) + (mean - new_mean) ** 2)
        variance = ((flows * deviation).sum(0) / safe).clamp(min=self.distribution.min_variance)
        estimate = torch.stack([new_mean, 0.5 * torch.log(variance)], dim=-1)
        return torch.where((total > 0)[..., None], estimate, raw.detach())


def family_of(distribution: InputDistribution, parameterization: Parameterization) -> InputFamily:
    """The compiled family of a symbolic one (``parameterization`` matters for Categorical only)."""
    if isinstance(distribution, Categorical):
        return CategoricalFamily(distribution, parameterization)
    if isinstance(distribution, (Bernoulli, Binomial)):
        return BinomialFamily(distribution)
    if isinstance(distribution, Gaussian):
        return GaussianFamily(distribution)
    raise InvalidInputError(f"no compiled input family for {distribution!r}")


__all__ = ["BinomialFamily", "CategoricalFamily", "GaussianFamily", "InputFamily", "NativeFamily",
           "ValueRule", "family_of", "free_value_per_row"]
