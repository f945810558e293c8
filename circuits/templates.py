"""Named architectures over ``n`` categorical variables, as general probabilistic circuits.

These are the MTP architectures of the MTPC paper (Section 3.2), usable by any PC researcher:

* ``ff``: fully factorised, ``prod_i p(x_i)`` (one input unit per variable);
* ``cp``: a CP decomposition / shallow mixture of ``rank`` factorised components;
* ``hmm``: an inhomogeneous HMM with ``rank`` hidden states, chained over variables ``0..n-1``;
* ``btree``: a balanced binary tree of latent variables with ``rank`` units per region.

Retrieve them by function (``btree(16, rank=32, num_categories=256)``) or by name
(``build("btree", num_variables=16, rank=32, num_categories=256)``). All are smooth, decomposable
and normalised (softmax parameters), so their partition function is 1.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from circuits.errors import StructureError, UnknownArchitectureError
from circuits.symbolic import Categorical, Circuit, InputLayer, Layer, ProductKind, ProductLayer, SumLayer


class Architecture(Enum):
    """The named architectures; ``Architecture("btree")`` parses a name."""

    FF = "ff"
    CP = "cp"
    HMM = "hmm"
    BTREE = "btree"


def _validate(num_variables: int, rank: int, num_categories: int) -> None:
    for name, value in (("num_variables", num_variables), ("rank", rank),
                        ("num_categories", num_categories)):
        if not isinstance(value, int) or value < 1:
            raise StructureError(f"{name} must be an int >= 1, got {value!r}")


def _inputs(num_variables: int, units: int, num_categories: int) -> list[InputLayer]:
    return [InputLayer(v, units, Categorical(num_categories)) for v in range(num_variables)]


def fully_factorized(num_variables: int, num_categories: int, rank: int = 1) -> Circuit:
    """``prod_i p(x_i)``: one single-unit input layer per variable under one product.

    ``rank`` is accepted (and must be 1) so every template shares one signature.
    """
    _validate(num_variables, rank, num_categories)
    if rank != 1:
        raise StructureError(f"the fully factorised circuit has rank 1, got rank={rank}")
    inputs = _inputs(num_variables, 1, num_categories)
    if num_variables == 1:
        return Circuit(inputs[0])
    return Circuit(ProductLayer(inputs, ProductKind.HADAMARD))


def cp(num_variables: int, rank: int, num_categories: int) -> Circuit:
    """``sum_z w_z prod_i p(x_i | z)``: a mixture of ``rank`` factorised components."""
    _validate(num_variables, rank, num_categories)
    inputs = _inputs(num_variables, rank, num_categories)
    body: Layer = inputs[0] if num_variables == 1 else ProductLayer(inputs, ProductKind.HADAMARD)
    return Circuit(SumLayer([body], 1))


def hmm(num_variables: int, rank: int, num_categories: int) -> Circuit:
    """An inhomogeneous HMM over ``x_0 .. x_{n-1}`` with ``rank`` hidden states.

    Built backwards: ``g_{n-1} = emit_{n-1}``, ``g_i = emit_i * T_i(g_{i+1})`` (Hadamard), where
    ``T_i`` is a ``rank x rank`` sum layer holding ``p(z_{i+1} | z_i)``, and the output sum
    holds the initial distribution ``p(z_0)``.
    """
    _validate(num_variables, rank, num_categories)
    emissions = _inputs(num_variables, rank, num_categories)
    chain: Layer = emissions[-1]
    for i in range(num_variables - 2, -1, -1):
        transition = SumLayer([chain], rank)
        chain = ProductLayer([emissions[i], transition], ProductKind.HADAMARD)
    return Circuit(SumLayer([chain], 1))


def btree(num_variables: int, rank: int, num_categories: int) -> Circuit:
    """A balanced binary tree: each region of >1 variables splits at ``floor(n/2)``.

    A region's ``rank`` units are ``S(left * right)`` (Hadamard product, then a
    ``rank x rank`` sum layer holding ``p(z_child | z_parent)``); leaves are input layers with
    ``rank`` units; the root sum has one unit.
    """
    _validate(num_variables, rank, num_categories)
    inputs = _inputs(num_variables, rank, num_categories)

    def region(lo: int, hi: int, units: int) -> Layer:
        if hi - lo == 1:
            return inputs[lo] if units == rank else SumLayer([inputs[lo]], units)
        mid = lo + (hi - lo) // 2
        product = ProductLayer([region(lo, mid, rank), region(mid, hi, rank)], ProductKind.HADAMARD)
        return SumLayer([product], units)

    return Circuit(region(0, num_variables, 1))


TEMPLATES: dict[Architecture, Callable[..., Circuit]] = {
    Architecture.FF: fully_factorized,
    Architecture.CP: cp,
    Architecture.HMM: hmm,
    Architecture.BTREE: btree,
}


def parse_architecture(name: str | Architecture) -> Architecture:
    """``"btree"`` -> ``Architecture.BTREE``; raises UnknownArchitectureError for other names."""
    if isinstance(name, Architecture):
        return name
    try:
        return Architecture(str(name).lower())
    except ValueError:
        known = ", ".join(a.value for a in Architecture)
        raise UnknownArchitectureError(
            f"unknown architecture {name!r}; choose one of: {known}") from None


def build(name: str | Architecture, num_variables: int, num_categories: int,
          rank: int = 1) -> Circuit:
    """Build a named architecture, e.g. ``build("btree", num_variables=16, rank=32,
    num_categories=256)``."""
    architecture = parse_architecture(name)
    return TEMPLATES[architecture](num_variables=num_variables, rank=rank,
                                   num_categories=num_categories)
