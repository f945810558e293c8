"""Named architectures over ``n`` categorical variables, as general probabilistic circuits.

These are the MTP architectures of the MTPC paper (Section 3.2), usable by any PC researcher:

* ``ff``: fully factorised, ``prod_i p(x_i)`` (one input unit per variable);
* ``cp``: a CP decomposition / shallow mixture of ``rank`` factorised components;
* ``hmm``: an inhomogeneous HMM with ``rank`` hidden states, chained over variables ``0..n-1``;
* ``btree``: a balanced binary tree of latent variables with ``rank`` units per region.

Retrieve them by function (``btree(16, rank=32, num_categories=256)``) or by name
(``build("btree", num_variables=16, rank=32, num_categories=256)``). All are smooth, decomposable
and normalised (softmax parameters), so their partition function is 1.

One architecture is learned from data rather than fixed by its sizes, so it has a function but no
:class:`Architecture` name (``build`` takes no data): :func:`hclt`, the hidden Chow-Liu tree of
Liu & Van den Broeck (2021), as pyjuice builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch

from circuits.errors import StructureError, UnknownArchitectureError
from circuits.parameterizations import Parameterization
from circuits.region_graphs.build import SumProductPattern, build_circuit
from circuits.region_graphs.chow_liu import DEFAULT_NUM_BINS, chow_liu, discretize
from circuits.symbolic import (
    Categorical,
    Circuit,
    InputDistribution,
    InputLayer,
    Layer,
    ProductKind,
    ProductLayer,
    SumLayer,
)


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


def _families(num_variables: int, num_categories: int | Sequence[int] | None,
              input_distribution: InputDistribution | Mapping[int, InputDistribution] | None
              ) -> list[InputDistribution]:
    """The input family of each of the ``num_variables`` columns, from either argument."""
    if (num_categories is None) == (input_distribution is None):
        raise StructureError(
            "give either num_categories (Categorical inputs) or input_distribution (e.g. "
            "Gaussian()), exactly one of them")
    if input_distribution is None:
        if isinstance(num_categories, Sequence) and not isinstance(num_categories, str):
            if len(num_categories) != num_variables:
                raise StructureError(
                    f"num_categories lists {len(num_categories)} sizes but data has "
                    f"{num_variables} columns; give one per column (or one int for all)")
            sizes = list(num_categories)
        else:
            sizes = [num_categories] * num_variables
        for variable, size in enumerate(sizes):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise StructureError(
                    f"num_categories of variable {variable} must be an int >= 1, got {size!r}")
        return [Categorical(size) for size in sizes]
    if isinstance(input_distribution, InputDistribution):
        return [input_distribution] * num_variables
    if isinstance(input_distribution, Mapping):
        if set(input_distribution) != set(range(num_variables)):
            raise StructureError(
                f"input_distribution must map every column 0 .. {num_variables - 1} of the data to "
                f"a family, got keys {sorted(input_distribution)}")
        families = [input_distribution[v] for v in range(num_variables)]
        for variable, family in enumerate(families):
            if not isinstance(family, InputDistribution):
                raise StructureError(
                    f"input_distribution[{variable}] must be an InputDistribution (e.g. "
                    f"Categorical(3), Gaussian()), got {family!r}")
        return families
    raise StructureError(
        f"input_distribution must be an InputDistribution (Categorical(C), Bernoulli(), "
        f"Binomial(n), Gaussian()) or {{variable: family}}, got {input_distribution!r}")


def hclt(data: Any, num_units: int, num_categories: int | Sequence[int] | None = None, *,
         input_distribution: InputDistribution | Mapping[int, InputDistribution] | None = None,
         root: int | None = None, num_bins: int = DEFAULT_NUM_BINS,
         input_parameterization: Parameterization | None = None,
         sum_parameterization: Parameterization | None = None) -> Circuit:
    """A hidden Chow-Liu tree (HCLT) over the columns of ``data``, learned from it.

    The Chow-Liu tree of the data (pairwise empirical mutual information, maximum spanning tree:
    :func:`circuits.region_graphs.chow_liu_tree`) is rooted at ``root`` and every tree node ``v``
    becomes a latent variable ``z_v`` with ``num_units`` states, with ``x_v`` observed below it.
    As in pyjuice, a node with children is the layer ``S_v(I_v * M_c1 * ... * M_ck)``: its input
    layer ``I_v`` (``p(x_v | z_v)``, ``num_units`` units) times, element-wise, the messages of its
    children in increasing variable order, under a ``num_units x num_units`` sum layer holding
    ``p(z_v | z_parent)`` (one unit, ``p(z_root)``, at the root). A leaf child's message is its
    input layer itself: its latent transition folds into its emission. This is exactly
    ``build_circuit(chow_liu(data, ..., root=root), "cp", num_units, num_units, ...)``: smooth,
    decomposable and structured-decomposable, normalised, with one sum layer per inner tree node
    and one input layer per variable. In every product layer the node's own input layer comes
    first.

    The structure is a function of the data alone (not of the row order); parameters are drawn at
    :func:`circuits.compile` from its ``seed``.

    Args:
        data: (N, n) numpy array or torch tensor, one column per variable ``0 .. n-1``: integer
            categories for discrete families, real values for Gaussian ones (binned into
            ``num_bins`` equal-frequency bins to estimate mutual information).
        num_units: latent states per tree node (units of every input and inner sum layer).
        num_categories: categories of every variable (an int) or one per column: Categorical
            inputs. Leave None when ``input_distribution`` is given.
        input_distribution: the family of every input layer (``Bernoulli()``, ``Binomial(n)``,
            ``Gaussian()``, ``Categorical(C)``), or ``{column: family}``.
        root: the variable at the root; None (the default, as pyjuice) a center of the tree, which
            makes the circuit as shallow as the tree allows.
        num_bins: bins per real-valued column for the mutual information.
        input_parameterization, sum_parameterization: as in
            :func:`~circuits.region_graphs.build_circuit` (default Softmax).

    Raises:
        StructureError: bad sizes or families; RegionGraphError: bad data (shape, values outside
            a variable's categories, non-finite values), naming the variable and the value.
    """
    if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
        raise StructureError(f"num_units must be an int >= 1, got {num_units!r}")
    if not isinstance(data, (np.ndarray, torch.Tensor)) or data.ndim != 2:
        shape = tuple(data.shape) if isinstance(data, (np.ndarray, torch.Tensor)) else type(data).__name__
        raise StructureError(
            f"hclt needs data as a 2-D numpy array or torch tensor (rows x variables), got {shape}")
    families = _families(int(data.shape[1]), num_categories, input_distribution)
    codes, sizes = discretize(data, [f.support_size for f in families], num_bins)
    region_graph = chow_liu(codes, sizes, root=root)
    if input_distribution is None:
        return build_circuit(region_graph, SumProductPattern.CP, num_units, num_units,
                             num_categories=dict(enumerate(sizes)),
                             input_parameterization=input_parameterization,
                             sum_parameterization=sum_parameterization)
    return build_circuit(region_graph, SumProductPattern.CP, num_units, num_units,
                         input_distribution=dict(enumerate(families)),
                         input_parameterization=input_parameterization,
                         sum_parameterization=sum_parameterization)


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
        hint = ""
        if str(name).lower() == "hclt":
            hint = (". HCLT is learned from data, so it is built by a function: "
                    "circuits.templates.hclt(data, num_units, num_categories)")
        raise UnknownArchitectureError(
            f"unknown architecture {name!r}; choose one of: {known}{hint}") from None


def build(name: str | Architecture, num_variables: int, num_categories: int,
          rank: int = 1) -> Circuit:
    """Build a named architecture, e.g. ``build("btree", num_variables=16, rank=32,
    num_categories=256)``."""
    architecture = parse_architecture(name)
    return TEMPLATES[architecture](num_variables=num_variables, rank=rank,
                                   num_categories=num_categories)
