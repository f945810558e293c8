"""Head kinds: the named circuits a head is built over, open to new ones without editing the head.

A *head kind* is a name and a builder of the head's circuit over the window. The built-in kinds
are the templates of :mod:`circuits.templates` (``ff``, ``cp``, ``hmm``, ``btree``). A researcher
adds one in their own module with :func:`register_head_kind`::

    from circuits_llm.heads import register_head_kind

    @register_head_kind("my-tree")
    def my_tree(num_variables: int, rank: int, num_categories: int) -> Circuit:
        ...  # any smooth, decomposable, Softmax-parameterised circuit over 0..num_variables-1

after which ``MTPHead.from_name("my-tree", window, rank, ...)`` builds a head over it,
``save_head`` records the name in ``head_config.json`` (``architecture``) and ``load_head``
rebuilds the circuit through the registry, as long as the module that registers the kind has
been imported. The head checks the circuit (:func:`~circuits_llm.heads.check_head_circuit`), so a
builder only has to build it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from circuits import templates
from circuits.errors import UnknownArchitectureError
from circuits.symbolic import Circuit
from circuits.templates import Architecture
from circuits_llm.heads.config import HeadConfigError


class CircuitBuilder(Protocol):
    """Builds a head's circuit: ``num_variables`` (the window) categorical variables
    ``0 .. num_variables-1`` with ``num_categories`` (the vocabulary) categories each, at
    ``rank`` (the kind decides what rank means: units per region, mixture components...)."""

    def __call__(self, num_variables: int, rank: int, num_categories: int) -> Circuit: ...


Builder = TypeVar("Builder", bound=CircuitBuilder)

#: Kind names: lower-case letters, digits, ``-`` and ``_`` (they name cache directories too).
_NAME = re.compile(r"[a-z][a-z0-9_-]*")


@dataclass(frozen=True)
class HeadKind:
    """A registered head kind.

    Attributes:
        name: the registered name (what ``head_config.json`` records as ``architecture``).
        build: the :class:`CircuitBuilder`.
        identity_init: the default of ``MTPHead.from_name(..., identity_init=)`` for this kind
            (True for chains of square sum layers, e.g. ``hmm``; see :class:`~circuits_llm.heads.MTPHead`).
    """

    name: str
    build: CircuitBuilder
    identity_init: bool = False

    def circuit(self, window: int, rank: int, vocab_size: int) -> Circuit:
        """The kind's circuit over ``window`` tokens of a ``vocab_size`` vocabulary."""
        return self.build(num_variables=window, rank=rank, num_categories=vocab_size)


_KINDS: dict[str, HeadKind] = {
    architecture.value: HeadKind(architecture.value, templates.TEMPLATES[architecture],
                                 identity_init=architecture is Architecture.HMM)
    for architecture in Architecture
}


def register_head_kind(name: str, *, identity_init: bool = False,
                       replace: bool = False) -> Callable[[Builder], Builder]:
    """Decorator: register a :class:`CircuitBuilder` as head kind ``name`` (returned unchanged).

    Args:
        name: lower-case letters, digits, ``-`` and ``_``, starting with a letter.
        identity_init: see :attr:`HeadKind.identity_init`.
        replace: allow replacing a kind registered under ``name`` before (never a built-in).

    Raises:
        HeadConfigError: a malformed name, a built-in name, or a name already registered
            without ``replace=True``.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise HeadConfigError(f"a head kind name must match {_NAME.pattern}, got {name!r}")
    builtin = name in {a.value for a in Architecture}
    if builtin or (name in _KINDS and not replace):
        why = "a built-in kind" if builtin else "registered already (pass replace=True)"
        raise HeadConfigError(f"cannot register head kind {name!r}: {why}")

    def register(build: Builder) -> Builder:
        if not callable(build):
            raise HeadConfigError(f"head kind {name!r} needs a callable circuit builder")
        _KINDS[name] = HeadKind(name, build, identity_init)
        return build

    return register


def unregister_head_kind(name: str) -> None:
    """Remove a kind added by :func:`register_head_kind` (built-ins stay); unknown names are
    ignored."""
    if name not in {a.value for a in Architecture}:
        _KINDS.pop(name, None)


def head_kind(name: str | Architecture) -> HeadKind:
    """The kind registered as ``name`` (any case; an :class:`~circuits.templates.Architecture`
    names a built-in).

    Raises:
        UnknownArchitectureError: listing the registered names.
    """
    key = name.value if isinstance(name, Architecture) else str(name).lower()
    kind = _KINDS.get(key)
    if kind is None:
        raise UnknownArchitectureError(
            f"unknown architecture {name!r}; choose one of: {', '.join(_KINDS)} (a head kind of "
            "your own must be registered with register_head_kind before it is used or loaded)")
    return kind


def head_kind_names() -> tuple[str, ...]:
    """Every registered name: the built-ins first, then the others in registration order."""
    return tuple(_KINDS)
