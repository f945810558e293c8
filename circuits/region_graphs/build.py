"""Turn a region graph into a smooth, decomposable circuit: every region becomes a layer of units
over its scope, following a CP or Tucker "sum-product layer" pattern.

* **Leaf region** of one variable: an :class:`~circuits.symbolic.InputLayer` with
  ``num_input_units`` units of the variable's family (``Categorical(num_categories)`` by default;
  ``input_distribution`` chooses Bernoulli, Binomial, Gaussian or a family per variable). A leaf
  of several variables is fully factorised: a Hadamard product of one such input layer per
  variable (in increasing variable order).
* **Partition**: a product layer over its child regions' layers (in the partition's child
  order): Hadamard for :attr:`SumProductPattern.CP`, Kronecker for
  :attr:`SumProductPattern.TUCKER`.
* **Inner region**: a :class:`~circuits.symbolic.SumLayer` with ``num_sum_units`` units (one at
  the root) over the product layers of all its partitions (concatenated in partition order).
* **Root leaf** (a one-region graph): the leaf's layer under a one-unit sum, so that the output
  always has exactly one unit.

Widths under CP: leaf regions have ``num_input_units`` units and inner regions
``num_sum_units``, and a Hadamard product needs equal widths. When a partition mixes a leaf child
with an inner child and the two numbers differ, the leaf is resized by a SumLayer of
``num_sum_units`` units over it (one per leaf region, shared by all partitions that use it);
partitions whose children are all leaves, or all inner, need no resizing. With
``num_input_units == num_sum_units`` no layer is added, so ``balanced_binary_tree(n)`` with CP
gives exactly :func:`circuits.templates.btree`, and ``linear(n)`` gives an inhomogeneous HMM
(:func:`circuits.templates.hmm` with the last transition folded into the last emission).

The circuit is smooth and decomposable for every region graph (a partition's children have
disjoint scopes covering the region); when :meth:`RegionGraph.is_structured_decomposable` holds
(e.g. for trees) it is structured-decomposable too. All units are normalised by the default
:class:`~circuits.parameterizations.Softmax` parameterisations (and the other families' densities
are normalised), so the partition function is 1.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from enum import Enum

from circuits.errors import RegionGraphError
from circuits.parameterizations import Parameterization
from circuits.region_graphs.constructors import check_positive_int
from circuits.region_graphs.graph import NodeKind, RegionGraph, format_scope
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


class SumProductPattern(Enum):
    """How a partition's child layers are multiplied before the region's sum layer."""

    #: Element-wise (Hadamard) products: CP decompositions, ``num_sum_units`` units per product.
    CP = "cp"
    #: Outer (Kronecker) products: Tucker decompositions, ``prod(child widths)`` units per product.
    TUCKER = "tucker"


_PRODUCT_KIND = {SumProductPattern.CP: ProductKind.HADAMARD,
                 SumProductPattern.TUCKER: ProductKind.KRONECKER}


def _category_table(region_graph: RegionGraph, num_categories: int | Mapping[int, int]
                    ) -> dict[int, int]:
    """The number of categories of every variable of the graph."""
    if isinstance(num_categories, Mapping):
        missing = region_graph.scope - num_categories.keys()
        if missing:
            raise RegionGraphError(
                f"num_categories has no entry for variables {format_scope(missing)}; give one "
                "per variable of the region graph (or a single int for all)")
        return {v: check_positive_int(f"num_categories[{v}]", num_categories[v])
                for v in region_graph.scope}
    size = check_positive_int("num_categories", num_categories)
    return dict.fromkeys(region_graph.scope, size)


def _check_distribution(name: str, value: object) -> InputDistribution:
    if isinstance(value, InputDistribution):
        return value
    if isinstance(value, type) and issubclass(value, InputDistribution):
        raise RegionGraphError(
            f"{name} must be an instance such as {value.__name__}(...), got the class "
            f"{value.__name__} itself")
    raise RegionGraphError(
        f"{name} must be an InputDistribution (Categorical(C), Bernoulli(), Binomial(n), "
        f"Gaussian()), got {value!r}")


def _distribution_table(region_graph: RegionGraph, num_categories: int | Mapping[int, int] | None,
                        input_distribution: InputDistribution | Mapping[int, InputDistribution] | None
                        ) -> dict[int, InputDistribution]:
    """The input family of every variable of the graph."""
    if input_distribution is None:
        if num_categories is None:
            raise RegionGraphError(
                "give num_categories (Categorical inputs) or input_distribution (e.g. Gaussian())")
        return {v: Categorical(size)
                for v, size in _category_table(region_graph, num_categories).items()}
    if num_categories is not None:
        raise RegionGraphError(
            "give either num_categories (Categorical inputs) or input_distribution, not both: "
            "a Categorical family is input_distribution=Categorical(C)")
    if isinstance(input_distribution, Mapping):
        missing = region_graph.scope - input_distribution.keys()
        if missing:
            raise RegionGraphError(
                f"input_distribution has no entry for variables {format_scope(missing)}; give one "
                "per variable of the region graph (or a single family for all)")
        return {v: _check_distribution(f"input_distribution[{v}]", input_distribution[v])
                for v in region_graph.scope}
    family = _check_distribution("input_distribution", input_distribution)
    return dict.fromkeys(region_graph.scope, family)


def _parse_pattern(pattern: SumProductPattern | str) -> SumProductPattern:
    if isinstance(pattern, SumProductPattern):
        return pattern
    if isinstance(pattern, str):
        try:
            return SumProductPattern(pattern.lower())
        except ValueError:
            pass
    known = ", ".join(p.name for p in SumProductPattern)
    raise RegionGraphError(f"unknown sum-product pattern {pattern!r}; use SumProductPattern.{{{known}}}")


def build_circuit(region_graph: RegionGraph, pattern: SumProductPattern | str,
                  num_sum_units: int, num_input_units: int,
                  num_categories: int | Mapping[int, int] | None = None,
                  input_parameterization: Parameterization | None = None,
                  sum_parameterization: Parameterization | None = None,
                  input_distribution: InputDistribution | Mapping[int, InputDistribution] | None = None
                  ) -> Circuit:
    """Build the circuit of ``region_graph`` (see the module docstring for the construction).

    Args:
        region_graph: a validated :class:`RegionGraph`.
        pattern: :attr:`SumProductPattern.CP` (Hadamard) or :attr:`SumProductPattern.TUCKER`
            (Kronecker); the strings ``"cp"`` / ``"tucker"`` are accepted too.
        num_sum_units: units of every inner, non-root region (the root has one).
        num_input_units: units of every input layer.
        num_categories: categories of every variable (an int), or ``{variable: size}``: Categorical
            inputs. Leave it None when ``input_distribution`` is given.
        input_parameterization: of every Categorical input layer (default Softmax); the other
            families hold their own parameters.
        sum_parameterization: of every sum layer (default Softmax).
        input_distribution: the family of every input layer (e.g. ``Gaussian()``,
            ``Binomial(16)``), or ``{variable: family}``; default ``Categorical(num_categories)``.

    Returns:
        A smooth, decomposable :class:`~circuits.symbolic.Circuit` with a one-unit output.
    """
    if not isinstance(region_graph, RegionGraph):
        raise RegionGraphError(
            f"build_circuit needs a RegionGraph, got {type(region_graph).__name__}; wrap a "
            "networkx graph with RegionGraph.from_networkx")
    pattern = _parse_pattern(pattern)
    num_sum_units = check_positive_int("num_sum_units", num_sum_units)
    num_input_units = check_positive_int("num_input_units", num_input_units)
    distributions = _distribution_table(region_graph, num_categories, input_distribution)
    for name, value in (("input_parameterization", input_parameterization),
                        ("sum_parameterization", sum_parameterization)):
        if value is not None and not isinstance(value, Parameterization):
            raise RegionGraphError(f"{name} must be a Parameterization or None, got {value!r}")
    if input_parameterization is not None and \
            not any(isinstance(d, Categorical) for d in distributions.values()):
        raise RegionGraphError(
            "input_parameterization applies to Categorical input layers, and this circuit has "
            "none; the other families hold their own raw parameters: leave it None")
    builder = _CircuitBuilder(region_graph, _PRODUCT_KIND[pattern], num_sum_units,
                              num_input_units, distributions, input_parameterization,
                              sum_parameterization)
    return Circuit(builder.run())


class _CircuitBuilder:
    """One pass over the regions, children before parents, memoising each region's layer."""

    def __init__(self, region_graph: RegionGraph, kind: ProductKind, num_sum_units: int,
                 num_input_units: int, distributions: dict[int, InputDistribution],
                 input_parameterization: Parameterization | None,
                 sum_parameterization: Parameterization | None) -> None:
        self.rg = region_graph
        self.kind = kind
        self.num_sum_units = num_sum_units
        self.num_input_units = num_input_units
        self.distributions = distributions
        self.input_parameterization = input_parameterization
        self.sum_parameterization = sum_parameterization
        self.layers: dict[Hashable, Layer] = {}
        self.resized: dict[Hashable, Layer] = {}

    def run(self) -> Layer:
        rg = self.rg
        for node in reversed(rg.topological_order()):
            if rg.kind(node) is NodeKind.REGION:
                self.layers[node] = self._region(node)
        return self.layers[rg.root]

    def _sum(self, inputs: list[Layer], units: int) -> SumLayer:
        return SumLayer(inputs, units, self.sum_parameterization)

    def _leaf(self, region: Hashable) -> Layer:
        inputs = [self._input(v) for v in sorted(self.rg.scope_of(region))]
        return inputs[0] if len(inputs) == 1 else ProductLayer(inputs, ProductKind.HADAMARD)

    def _input(self, variable: int) -> InputLayer:
        family = self.distributions[variable]
        parameterization = self.input_parameterization if isinstance(family, Categorical) else None
        return InputLayer(variable, self.num_input_units, family, parameterization)

    def _region(self, region: Hashable) -> Layer:
        is_root = region == self.rg.root
        if self.rg.is_leaf(region):
            leaf = self._leaf(region)
            return self._sum([leaf], 1) if is_root else leaf
        products = [self._product(p) for p in self.rg.partitions_of(region)]
        return self._sum(products, 1 if is_root else self.num_sum_units)

    def _product(self, partition: Hashable) -> ProductLayer:
        children = self.rg.children_of(partition)
        inputs = [self.layers[c] for c in children]
        if self.kind is ProductKind.HADAMARD and len({layer.num_units for layer in inputs}) > 1:
            inputs = [self._resized(c) if self.rg.is_leaf(c) else self.layers[c] for c in children]
        return ProductLayer(inputs, self.kind)

    def _resized(self, leaf: Hashable) -> Layer:
        """The leaf's layer brought to ``num_sum_units`` units by a sum layer (made once)."""
        if leaf not in self.resized:
            self.resized[leaf] = self._sum([self.layers[leaf]], self.num_sum_units)
        return self.resized[leaf]


__all__ = ["SumProductPattern", "build_circuit"]
