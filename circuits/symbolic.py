"""The symbolic circuit IR: layers of input, sum and product units over scoped variables.

A *layer* groups units that share one scope (set of variables). Layers are immutable values that
point to their inputs, so a circuit is the DAG reachable from its output layer. This is the layer
a PC researcher writes by hand, checks (:mod:`circuits.structure`) and transforms
(:mod:`circuits.operations`); :func:`circuits.compile` turns it into folded torch modules.

Example (a mixture of two factorised distributions over two ternary variables)::

    x0 = InputLayer(variable=0, num_units=2, distribution=Categorical(3))
    x1 = InputLayer(variable=1, num_units=2, distribution=Categorical(3))
    prod = ProductLayer((x0, x1), kind=ProductKind.HADAMARD)   # 2 units, scope {0, 1}
    root = SumLayer((prod,), num_units=1)                       # the mixture
    circuit = Circuit(root)

Input layers carry a distribution *family* (:class:`InputDistribution`): :class:`Categorical`
(categories ``0 .. C-1``, logits through a :class:`~circuits.parameterizations.Parameterization`),
:class:`Bernoulli` (``{0, 1}``, one success logit per unit), :class:`Binomial` (``0 .. n``, one
success logit per unit) or :class:`Gaussian` (real values, a mean and a log-standard-deviation per
unit). They are defined in :mod:`circuits.distributions` and re-exported here; the three
non-categorical families hold their own raw parameters
(:class:`~circuits.parameterizations.Native`); their math lives in
:mod:`circuits.compiled.input_families`. Every input layer of one variable must share its domain
(the same number of values, or real values).

Unit numbering inside a layer is part of the IR's contract: a sum layer's weight matrix has shape
``(num_units, total_input_units)`` where inputs are concatenated in order; a Kronecker product's
unit ``(i_1, ..., i_h)`` has index ``((i_1 * K_2 + i_2) * K_3 + ...)`` (first input most
significant).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from enum import Enum

from torch import Tensor

from circuits.distributions import (  # the IR's input families, defined on their own
    FAMILIES,
    Bernoulli,
    Binomial,
    Categorical,
    Gaussian,
    InputDistribution,
)
from circuits.errors import StructureError
from circuits.parameterizations import Native, Parameterization, Softmax

Scope = frozenset[int]

_layer_ids = itertools.count()


class ProductKind(Enum):
    """How a product layer combines the units of its inputs."""

    #: Element-wise: unit k multiplies unit k of every input (all inputs have equal width).
    HADAMARD = "hadamard"
    #: Outer product: one unit per tuple of input units (width = product of input widths).
    KRONECKER = "kronecker"


def _check_initial(name: str, value: Tensor | None, shape: tuple[int, ...]) -> None:
    if value is not None and tuple(value.shape) != shape:
        raise StructureError(
            f"{name}: initial parameters must have shape {shape}, got {tuple(value.shape)}")


class Layer:
    """Base class of all layers. Layers are immutable and compare by identity.

    ``uid`` is a process-unique integer used to name the layer in messages.
    """

    __slots__ = ("uid",)

    def __init__(self) -> None:
        self.uid = next(_layer_ids)

    @property
    def inputs(self) -> tuple[Layer, ...]:
        return ()

    @property
    def num_units(self) -> int:
        raise NotImplementedError

    @property
    def scope(self) -> Scope:
        raise NotImplementedError

    def describe(self) -> str:
        """A short human-readable name used in error messages."""
        return f"{type(self).__name__}#{self.uid}(units={self.num_units}, scope={sorted(self.scope)})"

    def __repr__(self) -> str:
        if not hasattr(self, "uid"):  # an __init__ that raised before the base class ran
            return f"<unfinished {type(self).__name__}>"
        return self.describe()


class InputLayer(Layer):
    """``num_units`` input units over one variable, each with its own distribution parameters.

    Args:
        variable: index of the variable (``>= 0``); data columns are indexed by it.
        num_units: how many input units (e.g. mixture components) this layer holds.
        distribution: the family: :class:`Categorical` for token/pixel data, :class:`Bernoulli`,
            :class:`Binomial` or :class:`Gaussian`.
        parameterization: for :class:`Categorical`, maps raw logits ``(num_units,
            num_categories)`` to log-probabilities (default
            :class:`~circuits.parameterizations.Softmax`); the other families use their own raw
            parameters (None or :class:`~circuits.parameterizations.Native`).
        initial: optional raw parameters of shape :attr:`parameter_shape`.
        integrated: when True the variable is summed out: the layer's scope is empty and each
            unit outputs its total mass (1 for normalised parameters). See
            :func:`circuits.operations.integrate`.
    """

    __slots__ = (
        "_num_units",
        "distribution",
        "initial",
        "integrated",
        "parameterization",
        "variable",
    )

    def __init__(self, variable: int, num_units: int, distribution: InputDistribution,
                 parameterization: Parameterization | None = None,
                 initial: Tensor | None = None, integrated: bool = False) -> None:
        if not isinstance(variable, int) or variable < 0:
            raise StructureError(f"InputLayer: variable must be an int >= 0, got {variable!r}")
        if not isinstance(num_units, int) or num_units < 1:
            raise StructureError(f"InputLayer: num_units must be an int >= 1, got {num_units!r}")
        if not isinstance(distribution, FAMILIES):
            known = ", ".join(f.__name__ for f in FAMILIES)
            raise StructureError(
                f"InputLayer: distribution must be one of {known} (an instance, e.g. "
                f"Gaussian()), got {distribution!r}")
        if parameterization is not None and not isinstance(parameterization, Parameterization):
            raise StructureError(
                f"InputLayer: parameterization must be a Parameterization or None, got "
                f"{parameterization!r}")
        if isinstance(distribution, Categorical):
            if isinstance(parameterization, Native):
                raise StructureError(
                    "InputLayer: Categorical logits need a table parameterisation (Softmax or "
                    "Exp); Native() is for the Bernoulli, Binomial and Gaussian families")
            parameterization = parameterization or Softmax()
        elif parameterization is None or isinstance(parameterization, Native):
            parameterization = Native()
        else:
            raise StructureError(
                f"InputLayer: {distribution.describe()} inputs hold their own raw parameters "
                f"({_RAW_NAMES[type(distribution)]}); give parameterization=None (or Native()), "
                f"not {parameterization!r}")
        super().__init__()
        self.variable = variable
        self._num_units = num_units
        self.distribution = distribution
        self.parameterization = parameterization
        self.initial = initial
        self.integrated = integrated
        _check_initial(f"InputLayer(variable={variable})", initial, self.parameter_shape)

    @property
    def num_units(self) -> int:
        return self._num_units

    @property
    def num_categories(self) -> int:
        """The number of values of a discrete family (StructureError for a Gaussian layer)."""
        size = self.distribution.support_size
        if size is None:
            raise StructureError(
                f"{self.describe()} is real-valued: it has no categories")
        return size

    @property
    def scope(self) -> Scope:
        return frozenset() if self.integrated else frozenset((self.variable,))

    @property
    def parameter_shape(self) -> tuple[int, int]:
        """Shape of the raw parameters: ``(num_units, distribution.num_parameters)`` (for a
        Categorical layer ``(num_units, num_categories)``)."""
        return (self.num_units, self.distribution.num_parameters)

    def describe(self) -> str:
        extra = ", integrated" if self.integrated else ""
        family = "" if isinstance(self.distribution, Categorical) else f", {self.distribution.describe()}"
        return f"InputLayer#{self.uid}(variable={self.variable}, units={self.num_units}{family}{extra})"


#: what each non-categorical family's raw parameters are, for messages
_RAW_NAMES: dict[type[InputDistribution], str] = {
    Bernoulli: "one success logit per unit",
    Binomial: "one success logit per unit",
    Gaussian: "mean and log-standard-deviation per unit",
}


def _domain(layer: InputLayer) -> str:
    size = layer.distribution.support_size
    return "real values" if size is None else f"{size} categories"


class _InnerLayer(Layer):
    """What sum and product layers share: their input layers, and the scope those cover."""

    __slots__ = ("_inputs", "_scope")

    def __init__(self, inputs: tuple[Layer, ...]) -> None:
        super().__init__()
        self._inputs = inputs
        self._scope: Scope = frozenset().union(*(i.scope for i in inputs))

    @property
    def inputs(self) -> tuple[Layer, ...]:
        return self._inputs

    @property
    def scope(self) -> Scope:
        return self._scope

    @property
    def input_widths(self) -> tuple[int, ...]:
        return tuple(i.num_units for i in self._inputs)


class SumLayer(_InnerLayer):
    """``num_units`` weighted sums, each over all units of all its inputs (concatenated).

    Args:
        inputs: one or more layers (arity >= 1); for a smooth circuit they share one scope.
        num_units: number of sum units.
        parameterization: maps raw weights ``(num_units, total_input_units)`` to log-weights
            (default :class:`~circuits.parameterizations.Softmax`, i.e. normalised mixtures).
        initial: optional raw weights of that shape.
    """

    __slots__ = ("_num_units", "initial", "parameterization")

    def __init__(self, inputs: Sequence[Layer], num_units: int,
                 parameterization: Parameterization | None = None,
                 initial: Tensor | None = None) -> None:
        inputs = tuple(inputs)
        if not inputs or not all(isinstance(i, Layer) for i in inputs):
            raise StructureError("SumLayer: inputs must be a non-empty sequence of layers")
        if not isinstance(num_units, int) or num_units < 1:
            raise StructureError(f"SumLayer: num_units must be an int >= 1, got {num_units!r}")
        if parameterization is not None and (not isinstance(parameterization, Parameterization)
                                             or isinstance(parameterization, Native)):
            raise StructureError(
                f"SumLayer: parameterization must be Softmax, Exp or another table "
                f"parameterisation (Native is for input families), got {parameterization!r}")
        super().__init__(inputs)
        self._num_units = num_units
        self.parameterization = parameterization or Softmax()
        self.initial = initial
        _check_initial("SumLayer", initial, self.parameter_shape)

    @property
    def num_units(self) -> int:
        return self._num_units

    @property
    def parameter_shape(self) -> tuple[int, int]:
        """Shape of the raw weights: ``(num_units, sum of input widths)``."""
        return (self.num_units, sum(self.input_widths))


class ProductLayer(_InnerLayer):
    """Products of units of its inputs, element-wise (Hadamard) or outer (Kronecker)."""

    __slots__ = ("kind",)

    def __init__(self, inputs: Sequence[Layer], kind: ProductKind = ProductKind.HADAMARD) -> None:
        inputs = tuple(inputs)
        if not inputs or not all(isinstance(i, Layer) for i in inputs):
            raise StructureError("ProductLayer: inputs must be a non-empty sequence of layers")
        if not isinstance(kind, ProductKind):
            raise StructureError(f"ProductLayer: kind must be a ProductKind, got {kind!r}")
        if kind is ProductKind.HADAMARD and len({i.num_units for i in inputs}) > 1:
            raise StructureError(
                "ProductLayer(HADAMARD): all inputs need the same number of units; got "
                + ", ".join(i.describe() for i in inputs)
                + ". Use ProductKind.KRONECKER or give the inputs equal widths.")
        super().__init__(inputs)
        self.kind = kind

    @property
    def num_units(self) -> int:
        if self.kind is ProductKind.HADAMARD:
            return self._inputs[0].num_units
        return math.prod(i.num_units for i in self._inputs)


class Circuit:
    """A circuit: the DAG of layers reachable from one output layer.

    Attributes:
        output: the output layer. Probability queries need it to hold exactly one unit.
        layers: every layer, inputs before the layers that use them (topological order).
        num_variables: ``1 + max variable index`` over all input layers: data tensors given to a
            compiled circuit have this many columns.
    """

    def __init__(self, output: Layer) -> None:
        if not isinstance(output, Layer):
            raise StructureError(f"Circuit needs an output Layer, got {type(output).__name__}")
        self.output = output
        self.layers: tuple[Layer, ...] = tuple(_topological_order(output))
        inputs = [layer for layer in self.layers if isinstance(layer, InputLayer)]
        if not inputs:
            raise StructureError("Circuit has no input layer")
        self.num_variables = 1 + max(layer.variable for layer in inputs)
        first: dict[int, InputLayer] = {}
        for layer in inputs:
            known = first.setdefault(layer.variable, layer)
            size, known_size = layer.distribution.support_size, known.distribution.support_size
            if size is not None and known_size is not None and size != known_size:
                raise StructureError(
                    f"variable {layer.variable} has input layers with {known_size} and {size} "
                    f"categories ({layer.describe()}); use one size")
            if (size is None) != (known_size is None):
                raise StructureError(
                    f"variable {layer.variable} has input layers with {_domain(known)} "
                    f"({known.describe()}) and {_domain(layer)} ({layer.describe()}); every "
                    "input layer of a variable must share its domain")
        #: ``{variable: number of values}`` of the discrete variables (real-valued ones are absent)
        self.num_categories: dict[int, int] = {
            v: size for v, layer in sorted(first.items())
            if (size := layer.distribution.support_size) is not None}
        #: the variables with real values (Gaussian inputs), in increasing order
        self.continuous_variables: tuple[int, ...] = tuple(
            sorted(v for v, layer in first.items() if not layer.distribution.discrete))

    @property
    def scope(self) -> Scope:
        return self.output.scope

    @property
    def input_layers(self) -> tuple[InputLayer, ...]:
        return tuple(layer for layer in self.layers if isinstance(layer, InputLayer))

    @property
    def sum_layers(self) -> tuple[SumLayer, ...]:
        return tuple(layer for layer in self.layers if isinstance(layer, SumLayer))

    @property
    def product_layers(self) -> tuple[ProductLayer, ...]:
        return tuple(layer for layer in self.layers if isinstance(layer, ProductLayer))

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def num_parameters(self) -> int:
        """Total number of raw parameters of the input and sum layers."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, (InputLayer, SumLayer)):
                total += math.prod(layer.parameter_shape)
        return total

    def depth(self) -> int:
        """Longest path length (in layers) from an input layer to the output."""
        depth: dict[Layer, int] = {}
        for layer in self.layers:
            depth[layer] = 1 + max((depth[i] for i in layer.inputs), default=-1)
        return depth[self.output]

    def __repr__(self) -> str:
        counts = {name: sum(isinstance(layer, cls) for layer in self.layers)
                  for name, cls in (("input", InputLayer), ("sum", SumLayer),
                                    ("product", ProductLayer))}
        return (f"Circuit(variables={len(self.scope)}, layers={len(self.layers)} {counts}, "
                f"depth={self.depth()}, parameters={self.num_parameters()})")


def _topological_order(output: Layer) -> list[Layer]:
    """Layers reachable from ``output``, inputs first (iterative DFS: deep circuits are fine)."""
    order: list[Layer] = []
    state: dict[int, int] = {}  # uid -> 1 (on stack) / 2 (done)
    stack: list[tuple[Layer, int]] = [(output, 0)]
    while stack:
        layer, child = stack.pop()
        if child == 0:
            if state.get(layer.uid) == 2:
                continue
            state[layer.uid] = 1
        if child < len(layer.inputs):
            stack.append((layer, child + 1))
            nxt = layer.inputs[child]
            if state.get(nxt.uid) == 1:  # cannot happen with immutable layers, kept as a guard
                raise StructureError(f"cycle through {nxt.describe()}")
            if state.get(nxt.uid) != 2:
                stack.append((nxt, 0))
        else:
            state[layer.uid] = 2
            order.append(layer)
    return order
