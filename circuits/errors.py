"""Exceptions raised by the circuits package.

Every error carries a message that says what was wrong and what to do about it, so that a
researcher never has to read library internals to fix their input.
"""

from __future__ import annotations

from enum import Enum


class CircuitError(Exception):
    """Base class of every error raised on purpose by :mod:`circuits`."""


class StructureError(CircuitError, ValueError):
    """A circuit violates a structural property (smoothness, decomposability, ...).

    The message names the offending layer and the scopes involved.
    """


class RegionGraphError(CircuitError, ValueError):
    """A region graph is malformed (cyclic, inconsistent scopes, no single root, ...)."""


class InvalidInputError(CircuitError, ValueError):
    """A query received data of the wrong shape, dtype or range."""


class ParameterProblem(Enum):
    """Why a parameter row is invalid (see :class:`InvalidParameterError`)."""

    NAN = "NaN"
    POSITIVE_INFINITY = "+inf"
    #: every entry of the row is -inf: a distribution or sum unit with no mass at all
    NO_MASS = "no mass"


class InvalidParameterError(InvalidInputError):
    """A parameter value is NaN or +inf, or a row of parameters has no mass (every entry -inf).

    A row is one input unit's categorical distribution or one sum unit's weights (the last
    dimension of a raw parameter tensor). A single ``-inf`` raw entry is an exact zero and stays
    valid: determinism, constraints and zero-probability evidence are written that way.

    Attributes:
        where: how the tensor is named, e.g. ``"params['sum_3']"`` (external parameters) or
            ``"'sum_3' (the circuit's own parameters)"``.
        layer: the symbolic layer whose parameters these are (its ``describe()``).
        index: the first offending index into that tensor (for NO_MASS: the row, without the
            last dimension).
        problem: the :class:`ParameterProblem` found there.
    """

    def __init__(self, message: str, *, where: str = "", layer: str = "",
                 index: tuple[int, ...] = (), problem: ParameterProblem | None = None) -> None:
        super().__init__(message)
        self.where = where
        self.layer = layer
        self.index = index
        self.problem = problem


class ZeroProbabilityEvidenceError(InvalidInputError):
    """Conditional sampling or MAP was asked to complete evidence that has probability zero.

    Attributes:
        rows: the data rows whose evidence is impossible under the circuit.
        log_probability: the evidence's log-probability (``-inf``) of the first such row.
    """

    def __init__(self, message: str, *, rows: tuple[int, ...] = (),
                 log_probability: float = float("-inf")) -> None:
        super().__init__(message)
        self.rows = rows
        self.log_probability = log_probability


class SerializationError(CircuitError, ValueError):
    """A circuit file or dictionary is malformed, of an unsupported version, or not serialisable."""


class UnknownArchitectureError(CircuitError, KeyError):
    """A template name that is not registered was requested."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""
