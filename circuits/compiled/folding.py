"""Folding: group the layers of a symbolic circuit into stacks that run as one tensor op.

Two layers are folded together when they sit at the same depth (longest path from the inputs)
and have the same *signature* (kind, width, input widths, parameterisation, ...); input layers
fold only with input layers of the same family and shape (``Categorical(3)`` with
``Categorical(3)``, ``Binomial(4)`` with ``Binomial(4)``, equal numbers of units). A fold of ``F``
layers with ``K`` units each produces one tensor of shape ``(F, B, K)`` for a batch of ``B``.

The order of the folds, and of the layers inside each, depends on the circuit's structure alone:
folds by depth, then by the position of their first layer in :attr:`Circuit.layers
<circuits.symbolic.Circuit.layers>` (a depth-first walk from the output through each layer's
inputs in order). Two structurally equal circuits therefore get the same fold names (``"sum_3"``)
and parameter layouts, whatever order their layers were created in.

A fold reads each of its ``H`` inputs (``H`` = arity) through an :class:`InputAddress`: the ids of
the folds whose outputs are concatenated along the fold dimension, and an index into that
concatenation picking, for each of the ``F`` stacked layers, the layer that feeds it.

With ``fold=False`` every layer is its own fold: the naive, unfolded evaluation used as a
reference in tests and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from circuits.parameterizations import Parameterization
from circuits.symbolic import (
    Circuit,
    InputDistribution,
    InputLayer,
    Layer,
    ProductKind,
    ProductLayer,
    SumLayer,
)


class FoldKind(Enum):
    INPUT = "input"
    SUM = "sum"
    PRODUCT = "product"


@dataclass(frozen=True)
class InputAddress:
    """Where one input slot of a fold reads from.

    Attributes:
        sources: fold ids whose outputs are concatenated (along the fold dimension).
        index: for each stacked layer ``f`` of the reading fold, the position in that
            concatenation of the layer feeding it.
        slots: for each ``f``, ``(source fold id, slot inside that fold)``; used top-down.
    """

    sources: tuple[int, ...]
    index: tuple[int, ...]
    slots: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class FoldPlan:
    """One fold: ``len(layers)`` symbolic layers of identical signature evaluated together."""

    fold_id: int
    kind: FoldKind
    layers: tuple[Layer, ...]
    depth: int
    num_units: int
    input_widths: tuple[int, ...] = ()
    inputs: tuple[InputAddress, ...] = ()
    product_kind: ProductKind | None = None
    parameterization: Parameterization | None = None
    #: an input fold's number of values (0 for a real-valued family)
    num_categories: int = 0
    #: an input fold's family (equal for every layer of the fold)
    distribution: InputDistribution | None = None

    @property
    def num_folded(self) -> int:
        return len(self.layers)

    @property
    def name(self) -> str:
        """Stable name of this fold's parameters, e.g. ``"sum_3"``."""
        return f"{self.kind.value}_{self.fold_id}"


def _signature(layer: Layer) -> tuple[object, ...]:
    if isinstance(layer, InputLayer):
        return (FoldKind.INPUT, layer.num_units, layer.distribution,
                type(layer.parameterization), layer.parameterization.normalized)
    if isinstance(layer, SumLayer):
        return (FoldKind.SUM, layer.num_units, layer.input_widths,
                type(layer.parameterization), layer.parameterization.normalized)
    if isinstance(layer, ProductLayer):
        return (FoldKind.PRODUCT, layer.kind, layer.input_widths)
    raise TypeError(f"unknown layer type {type(layer).__name__}")


def plan_folds(circuit: Circuit, fold: bool = True) -> tuple[FoldPlan, ...]:
    """Group the circuit's layers into folds, in an order where inputs come first.

    Returns the folds sorted by depth, then structurally (see the module docstring); the last
    fold holds only the circuit's output layer.
    """
    depth: dict[Layer, int] = {}
    position: dict[Layer, int] = {}  # structural: the depth-first order of circuit.layers
    for layer in circuit.layers:
        depth[layer] = 1 + max((depth[i] for i in layer.inputs), default=-1)
        position[layer] = len(position)

    groups: dict[tuple[object, ...], list[Layer]] = {}
    for layer in circuit.layers:
        key: tuple[object, ...] = (depth[layer], *_signature(layer))
        if not fold:
            key = (depth[layer], position[layer])
        groups.setdefault(key, []).append(layer)
    ordered = sorted(groups.values(), key=lambda ls: (depth[ls[0]], position[ls[0]]))

    location: dict[Layer, tuple[int, int]] = {}
    plans: list[FoldPlan] = []
    for fold_id, layers in enumerate(ordered):
        for slot, layer in enumerate(layers):
            location[layer] = (fold_id, slot)
        first = layers[0]
        if isinstance(first, InputLayer):
            plans.append(FoldPlan(fold_id, FoldKind.INPUT, tuple(layers), depth[first],
                                  first.num_units, parameterization=first.parameterization,
                                  num_categories=first.distribution.support_size or 0,
                                  distribution=first.distribution))
            continue
        arity = len(first.inputs)
        addresses = []
        for h in range(arity):
            feeders = [location[layer.inputs[h]] for layer in layers]
            sources = tuple(sorted({fid for fid, _ in feeders}))
            offsets: dict[int, int] = {}
            total = 0
            for fid in sources:
                offsets[fid] = total
                total += plans[fid].num_folded
            index = tuple(offsets[fid] + slot for fid, slot in feeders)
            addresses.append(InputAddress(sources, index, tuple(feeders)))
        if isinstance(first, SumLayer):
            plans.append(FoldPlan(fold_id, FoldKind.SUM, tuple(layers), depth[first],
                                  first.num_units, first.input_widths, tuple(addresses),
                                  parameterization=first.parameterization))
        else:
            assert isinstance(first, ProductLayer)
            plans.append(FoldPlan(fold_id, FoldKind.PRODUCT, tuple(layers), depth[first],
                                  first.num_units, first.input_widths, tuple(addresses),
                                  product_kind=first.kind))
    if plans[-1].layers != (circuit.output,):
        raise AssertionError("the output layer must be alone in the last fold")
    return tuple(plans)
