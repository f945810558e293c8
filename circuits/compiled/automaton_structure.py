"""The interval structure an automaton product needs (:mod:`circuits.compiled.automaton_product`).

:class:`ProductStructure` checks, once per compiled circuit, that every layer's scope is an
interval ``[lo, hi)`` of the variable order and that every product's children tile it from left
to right, and records what the lifted passes walk: one :class:`Node` per symbolic layer (its
interval, its children in interval order, how a product's units pick its children's units), the
layers that contain each variable (top-down), the layers that end at each variable (bottom-up),
and which child of each product contains a variable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from circuits.compiled.circuit import CompiledCircuit
from circuits.compiled.folding import FoldKind
from circuits.errors import InvalidInputError, StructureError
from circuits.symbolic import Categorical, InputLayer, Layer, ProductKind, ProductLayer, SumLayer

#: which circuits the product supports, for messages
SUPPORTED_SHAPES = (
    "circuits whose every layer covers a contiguous interval of variables and whose products "
    "split it into consecutive intervals work: linear/HMM-shaped, CP and fully factorised "
    "circuits, and balanced trees over contiguous intervals (circuits.templates ff, cp, hmm, btree)")


@dataclass(frozen=True)
class Node:
    """One symbolic layer with the interval ``[lo, hi)`` of variables it covers.

    Attributes:
        kind: input, sum or product.
        lo, hi: the interval.
        units: the layer's number of units.
        children: sums: the inputs in order; products: the inputs in interval order (indices into
            :attr:`ProductStructure.nodes`).
        unit_maps: products, per child: (units,) long, output unit -> child unit, or None (the
            same unit: a Hadamard product).
        offsets: sums: the weight column of each input's first unit.
        fold_id, slot: where an input or sum layer's parameters live in the compiled circuit
            (``-1`` for products).
    """

    kind: FoldKind
    lo: int
    hi: int
    units: int
    children: tuple[int, ...] = ()
    unit_maps: tuple[Tensor | None, ...] = ()
    offsets: tuple[int, ...] = ()
    fold_id: int = -1
    slot: int = -1


def interval(layer: Layer) -> tuple[int, int]:
    """``(lo, hi)`` with ``layer.scope == {lo, ..., hi - 1}``; StructureError otherwise."""
    scope = sorted(layer.scope)
    if not scope:
        raise StructureError(f"{layer.describe()} has an empty scope (an integrated input?); an "
                             f"automaton product needs every layer over some variables; "
                             f"{SUPPORTED_SHAPES}")
    lo, hi = scope[0], scope[-1] + 1
    if hi - lo != len(scope):
        raise StructureError(
            f"{layer.describe()} covers variables {scope}, which are not a contiguous interval: an "
            f"automaton reads the variables in order, so the product with it needs every layer "
            f"over an interval [i, j]; {SUPPORTED_SHAPES}")
    return lo, hi


class ProductStructure:
    """The checked interval structure of a compiled circuit (module docstring).

    Attributes:
        circuit: the compiled circuit.
        num_variables: ``n``.
        num_categories: ``K``, shared by every variable.
        nodes: one :class:`Node` per symbolic layer, children before parents.
        root: the output's index in :attr:`nodes`.
        containing: per variable, the layers whose interval contains it, outputs first.
        ending: per variable ``v``, the layers whose interval ends with it (``hi == v + 1``),
            inputs first.
        path_child: ``(product layer, v)`` -> the position of the child that contains ``v``.

    Raises:
        InvalidInputError: ``circuit`` is not a :class:`CompiledCircuit`.
        StructureError: a layer's scope is not an interval, a product's children do not tile it,
            an input is not Categorical or is integrated, the variables do not share one number
            of categories, or the output does not cover ``0 .. n-1``.
    """

    def __init__(self, circuit: CompiledCircuit) -> None:
        if not isinstance(circuit, CompiledCircuit):
            raise InvalidInputError(
                f"AutomatonProduct needs a CompiledCircuit (circuits.compile), got "
                f"{type(circuit).__name__}")
        self.circuit = circuit
        symbolic = circuit.circuit
        self.num_variables: int = symbolic.num_variables
        sizes = set(symbolic.num_categories.values())
        if len(sizes) != 1 or len(symbolic.num_categories) != self.num_variables:
            raise StructureError(
                f"an automaton product needs every variable Categorical with one number of "
                f"categories; this circuit has {symbolic.num_categories}")
        self.num_categories: int = sizes.pop()
        location = {layer: (plan.fold_id, slot) for plan in circuit.plans
                    for slot, layer in enumerate(plan.layers)}
        index = {layer: i for i, layer in enumerate(symbolic.layers)}
        self.nodes: list[Node] = [self._node(layer, index, location) for layer in symbolic.layers]
        self.root: int = index[symbolic.output]
        if (self.nodes[self.root].lo, self.nodes[self.root].hi) != (0, self.num_variables):
            raise StructureError(f"the output {symbolic.output.describe()} must cover variables "
                                 f"0..{self.num_variables - 1}")
        n = self.num_variables
        order = range(len(self.nodes))
        self.containing: list[list[int]] = [
            [i for i in reversed(order) if self.nodes[i].lo <= v < self.nodes[i].hi]
            for v in range(n)]
        self.ending: list[list[int]] = [[i for i in order if self.nodes[i].hi == v + 1]
                                        for v in range(n)]
        self.path_child: dict[tuple[int, int], int] = {}
        for i, node in enumerate(self.nodes):
            if node.kind is FoldKind.PRODUCT:
                for t, child in enumerate(node.children):
                    for v in range(self.nodes[child].lo, self.nodes[child].hi):
                        self.path_child[(i, v)] = t

    def _node(self, layer: Layer, index: dict[Layer, int],
              location: dict[Layer, tuple[int, int]]) -> Node:
        lo, hi = interval(layer)
        if isinstance(layer, InputLayer):
            if not isinstance(layer.distribution, Categorical):
                raise StructureError(f"{layer.describe()} is not Categorical; an automaton "
                                     "product reads categories")
            return Node(FoldKind.INPUT, lo, hi, layer.num_units, fold_id=location[layer][0],
                        slot=location[layer][1])
        children = [index[child] for child in layer.inputs]
        if isinstance(layer, SumLayer):
            for child in layer.inputs:
                if interval(child) != (lo, hi):
                    raise StructureError(f"{layer.describe()} mixes inputs over different scopes "
                                         f"({child.describe()}): it is not smooth")
            offsets = [sum(layer.input_widths[:k]) for k in range(len(children))]
            return Node(FoldKind.SUM, lo, hi, layer.num_units, tuple(children),
                        offsets=tuple(offsets), fold_id=location[layer][0], slot=location[layer][1])
        if not isinstance(layer, ProductLayer):
            raise StructureError(f"{layer.describe()}: unknown layer type {type(layer).__name__}")
        ranked = sorted(range(len(children)), key=lambda k: interval(layer.inputs[k]))
        edge = lo
        for k in ranked:
            child_lo, child_hi = interval(layer.inputs[k])
            if child_lo != edge:
                raise StructureError(
                    f"{layer.describe()} has children over "
                    f"{[sorted(c.scope) for c in layer.inputs]}, which do not split its interval "
                    f"[{lo}, {hi - 1}] into consecutive intervals; {SUPPORTED_SHAPES}")
            edge = child_hi
        units = torch.arange(layer.num_units)
        maps: list[Tensor | None] = []
        for k in ranked:
            if layer.kind is ProductKind.HADAMARD:
                maps.append(None)
            else:  # first input most significant (circuits.compiled.layers.FoldedProduct)
                stride = 1
                for width in layer.input_widths[k + 1:]:
                    stride *= width
                maps.append(((units // stride) % layer.input_widths[k]).to(self.circuit.device))
        return Node(FoldKind.PRODUCT, lo, hi, layer.num_units,
                    tuple(children[k] for k in ranked), tuple(maps))

    def gathered(self, node: Node, t: int, values: dict[int, Tensor]) -> Tensor:
        """Child ``t``'s entry of ``values`` (matrices or circuit values, units first) for each of
        ``node``'s units: ``(node.units, ...)``."""
        unit_map = node.unit_maps[t]
        value = values[node.children[t]]
        return value if unit_map is None else value.index_select(0, unit_map)

    def to_child(self, node: Node, t: int, value: Tensor) -> Tensor:
        """A top-down quantity ``(node.units, ...)`` summed onto the units of child ``t``."""
        unit_map = node.unit_maps[t]
        if unit_map is None:
            return value
        width = self.nodes[node.children[t]].units
        return value.new_zeros((width, *value.shape[1:])).index_add_(0, unit_map, value)


__all__ = ["SUPPORTED_SHAPES", "Node", "ProductStructure", "interval"]
