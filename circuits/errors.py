"""Exceptions raised by the circuits package.

Every error carries a message that says what was wrong and what to do about it, so that a
researcher never has to read library internals to fix their input.
"""

from __future__ import annotations


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


class SerializationError(CircuitError, ValueError):
    """A circuit file or dictionary is malformed, of an unsupported version, or not serialisable."""


class UnknownArchitectureError(CircuitError, KeyError):
    """A template name that is not registered was requested."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""
