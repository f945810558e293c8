"""The distribution families an input unit can carry: a variable's domain and its raw parameters.

:class:`Categorical` (categories ``0 .. C-1``, logits through a
:class:`~circuits.parameterizations.Parameterization`), :class:`Bernoulli` (``{0, 1}``, one success
logit per unit), :class:`Binomial` (``0 .. n``, one success logit per unit) and :class:`Gaussian`
(real values, a mean and a log-standard-deviation per unit). They are frozen values of the IR
(:mod:`circuits.symbolic` re-exports them); their math (densities, modes, draws, EM estimates)
lives in :mod:`circuits.compiled.input_families`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from circuits.errors import StructureError


class InputDistribution:
    """Base class of the distribution families an input unit can carry.

    A family fixes the variable's *domain* (:attr:`support_size` values ``0 .. support_size - 1``,
    or the real line when it is None) and how many raw parameters each unit holds
    (:attr:`num_parameters`, the last dimension of the layer's raw tensor). Families are frozen
    dataclasses: equal families compare equal, which is what lets layers fold together.
    """

    @property
    def num_parameters(self) -> int:
        """Raw parameters per unit (``D`` of the ``(num_units, D)`` raw tensor)."""
        raise NotImplementedError

    @property
    def support_size(self) -> int | None:
        """Number of values of a discrete family (``0 .. support_size - 1``); None for real values."""
        raise NotImplementedError

    @property
    def discrete(self) -> bool:
        return self.support_size is not None

    def describe(self) -> str:
        """A short name of the family for messages, e.g. ``"Binomial(4)"``."""
        return type(self).__name__


@dataclass(frozen=True)
class Categorical(InputDistribution):
    """A categorical distribution over ``num_categories`` values ``0 .. num_categories - 1``.

    Raw parameters: ``num_categories`` logits per unit, mapped to log-probabilities by the
    layer's :class:`~circuits.parameterizations.Parameterization` (Softmax or Exp).
    """

    num_categories: int

    def __post_init__(self) -> None:
        if not isinstance(self.num_categories, int) or isinstance(self.num_categories, bool) \
                or self.num_categories < 1:
            raise StructureError(
                f"Categorical needs num_categories >= 1, got {self.num_categories!r}")

    @property
    def num_parameters(self) -> int:
        return self.num_categories

    @property
    def support_size(self) -> int:
        return self.num_categories

    def describe(self) -> str:
        return f"Categorical({self.num_categories})"


@dataclass(frozen=True)
class Bernoulli(InputDistribution):
    """A Bernoulli distribution over ``{0, 1}``: ``p(1) = sigmoid(logit)``.

    Raw parameters: one success logit per unit. ``-inf`` and ``+inf`` are the exact probabilities
    ``p(1) = 0`` and ``p(1) = 1`` (as ``-inf`` is an exact zero of a categorical logit).
    """

    @property
    def num_parameters(self) -> int:
        return 1

    @property
    def support_size(self) -> int:
        return 2

    def describe(self) -> str:
        return "Bernoulli"


@dataclass(frozen=True)
class Binomial(InputDistribution):
    """A binomial distribution over ``0 .. total_count``: ``total_count`` trials of success
    probability ``sigmoid(logit)``.

    Raw parameters: one success logit per unit (``+-inf``: exact probabilities 1 and 0).
    """

    total_count: int

    def __post_init__(self) -> None:
        if not isinstance(self.total_count, int) or isinstance(self.total_count, bool) \
                or self.total_count < 1:
            raise StructureError(f"Binomial needs total_count >= 1, got {self.total_count!r}")

    @property
    def num_parameters(self) -> int:
        return 1

    @property
    def support_size(self) -> int:
        return self.total_count + 1

    def describe(self) -> str:
        return f"Binomial({self.total_count})"


@dataclass(frozen=True)
class Gaussian(InputDistribution):
    """A normal distribution over the real line, ``N(mean, exp(log_std) ** 2)``.

    Raw parameters: ``(mean, log_std)`` per unit, both finite. ``min_variance`` is the variance
    floor of the EM estimate (:meth:`FoldedInput.em_estimate
    <circuits.compiled.layers.FoldedInput.em_estimate>`): a unit whose data collapse on one value
    would otherwise get an infinite density. It does not constrain the raw parameters.
    """

    min_variance: float = 1e-6

    def __post_init__(self) -> None:
        value = self.min_variance
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or value <= 0:
            raise StructureError(f"Gaussian needs a finite min_variance > 0, got {value!r}")

    @property
    def num_parameters(self) -> int:
        return 2

    @property
    def support_size(self) -> None:
        return None

    def describe(self) -> str:
        return "Gaussian"


#: the families the compiled layer knows, in the order the serialisation names them
FAMILIES: tuple[type[InputDistribution], ...] = (Categorical, Bernoulli, Binomial, Gaussian)


__all__ = ["FAMILIES", "Bernoulli", "Binomial", "Categorical", "Gaussian", "InputDistribution"]
