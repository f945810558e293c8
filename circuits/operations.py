"""Symbolic operations on circuits: parameter snapshots, integration, and products.

* :func:`snapshot` turns a (trained) compiled circuit back into a symbolic one whose input and sum
  layers carry the learned raw parameters as ``initial``, so the operations below can use them.
* :func:`integrate` sums out variables: their input layers become ``integrated`` (empty scope,
  output = total mass), which is exact for normalised and unnormalised parameters alike.
* :func:`multiply` builds the product ``c1(x) * c2(x)`` of two *compatible* circuits in time
  polynomial in their sizes (Vergari et al., 2021). Squaring a circuit is ``multiply(c, c)``.

Unit ordering contract of a product: a layer built from a pair ``(a, b)`` has ``K_a * K_b`` units
and unit ``i * K_b + j`` computes ``a_i(x) * b_j(x)`` (first circuit's unit most significant).
Internally a pair may be built in another order and carry a permutation; sum layers absorb it by
permuting their weight columns, and only where no sum can absorb it is a one-hot permuting sum
layer (log-weights ``0`` / ``-inf``) inserted. All parameters of a product use :class:`Exp`
(log-weights stored as they are, ``-inf`` for exact zeros) in float64.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from circuits.compiled.circuit import CompiledCircuit
from circuits.errors import InvalidInputError, StructureError
from circuits.parameterizations import Exp
from circuits.structure import compatibility_violations
from circuits.symbolic import Categorical, Circuit, InputLayer, Layer, ProductKind, ProductLayer, SumLayer

#: A built pair: the layer, and ``perm`` with ``perm[u]`` = canonical index ``i * K_b + j`` of the
#: pair computed by the layer's unit ``u`` (``None`` when the layer is in canonical order).
_Built = tuple[Layer, Tensor | None]


# ---------------------------------------------------------------------------------- copying
def _copy_input(layer: InputLayer, initial: Tensor | None, integrated: bool) -> InputLayer:
    return InputLayer(layer.variable, layer.num_units, layer.distribution, layer.parameterization,
                      initial=initial, integrated=integrated)


def _rebuild(circuit: Circuit, make_input: Callable[[InputLayer], InputLayer],
             sum_initial: Callable[[SumLayer], Tensor | None]) -> Circuit:
    """A structural copy of ``circuit`` with new input layers and new sum ``initial`` values."""
    new: dict[Layer, Layer] = {}
    for layer in circuit.layers:
        if isinstance(layer, InputLayer):
            new[layer] = make_input(layer)
        elif isinstance(layer, SumLayer):
            new[layer] = SumLayer([new[i] for i in layer.inputs], layer.num_units,
                                  layer.parameterization, initial=sum_initial(layer))
        elif isinstance(layer, ProductLayer):
            new[layer] = ProductLayer([new[i] for i in layer.inputs], layer.kind)
        else:
            raise StructureError(f"cannot copy {layer.describe()}: unknown layer type "
                                 f"{type(layer).__name__}")
    return Circuit(new[circuit.output])


def _clone(value: Tensor | None) -> Tensor | None:
    return None if value is None else value.detach().clone()


def snapshot(compiled: CompiledCircuit) -> Circuit:
    """A copy of ``compiled.circuit`` whose input and sum layers hold the module's current raw
    parameters as ``initial`` (detached float64 CPU clones, shape ``(K, D)`` per layer).

    Use it to hand learned parameters to :func:`multiply` or to save them with
    :func:`circuits.serialization.save_circuit`; ``compile(snapshot(m))`` reproduces ``m``.
    """
    if not isinstance(compiled, CompiledCircuit):
        raise InvalidInputError(
            f"snapshot expects a CompiledCircuit (from circuits.compile), got {type(compiled).__name__}")
    values: dict[Layer, Tensor] = {}
    for plan, module in zip(compiled.plans, compiled.folds, strict=True):
        raw = getattr(module, "raw", None)
        if isinstance(raw, Tensor):
            for slot, layer in enumerate(plan.layers):  # slot f of the fold is plan.layers[f]
                values[layer] = raw[slot].detach().to(device="cpu", dtype=torch.float64).clone()
    return _rebuild(compiled.circuit,
                    lambda layer: _copy_input(layer, values[layer], layer.integrated),
                    lambda layer: values[layer])


# ---------------------------------------------------------------------------------- integration
def integrate(circuit: Circuit, variables: Iterable[int]) -> Circuit:
    """Sum ``circuit`` over every value of ``variables``: ``c'(x_rest) = sum_{x_S} c(x)``.

    Returns a new circuit whose input layers over those variables are ``integrated`` (empty scope;
    each unit outputs its total mass), exact for unnormalised parameters too. Data for the result
    keeps ``circuit.num_variables`` columns; the integrated ones are ignored.

    Raises:
        InvalidInputError: a variable is not an int or not in the circuit's scope (e.g. integrated
            already: summing a function over a variable it does not depend on is ambiguous).
    """
    if not isinstance(circuit, Circuit):
        raise InvalidInputError(f"integrate expects a Circuit, got {type(circuit).__name__}")
    if isinstance(variables, (str, bytes)) or not isinstance(variables, Iterable):
        raise InvalidInputError(f"variables must be an iterable of ints, got {variables!r}")
    chosen: set[int] = set()
    for value in variables:
        if isinstance(value, bool):
            raise InvalidInputError(f"variables must be ints, got {value!r}")
        try:
            chosen.add(operator.index(value))
        except TypeError:
            raise InvalidInputError(f"variables must be ints, got {value!r}") from None
    missing = chosen - circuit.scope
    if missing:
        raise InvalidInputError(
            f"cannot integrate variables {sorted(missing)}: they are not in the circuit's scope "
            f"{sorted(circuit.scope)} (never present or already integrated)")
    return _rebuild(circuit,
                    lambda layer: _copy_input(layer, _clone(layer.initial),
                                              layer.integrated or layer.variable in chosen),
                    lambda layer: _clone(layer.initial))


# ---------------------------------------------------------------------------------- products
def _arange(n: int) -> Tensor:
    return torch.arange(n, dtype=torch.long)


def _log_identity(n: int) -> Tensor:
    """Log-weights of the identity map: ``0`` on the diagonal, ``-inf`` (exact zero) elsewhere."""
    eye = torch.full((n, n), -math.inf, dtype=torch.float64)
    return eye.fill_diagonal_(0.0)


def _digit(layer: ProductLayer, position: int, units: Tensor) -> Tensor:
    """For each unit in ``units`` of ``layer``, the unit of input ``position`` it multiplies."""
    if layer.kind is ProductKind.HADAMARD:
        return units
    widths = layer.input_widths
    return (units // math.prod(widths[position + 1:])) % widths[position]


def _select(layer: Layer, perm: Tensor | None, target: Tensor | None) -> Layer:
    """A layer whose unit ``u`` is the pair with canonical index ``target[u]`` (``None`` = all, in
    canonical order) of ``layer`` (which stores pair ``perm[u]`` at unit ``u``).

    Returns ``layer`` itself when that is the identity, else a one-hot sum layer over it.
    """
    width = layer.num_units
    position = _arange(width)
    if perm is not None:
        position = torch.empty_like(perm)
        position[perm] = _arange(width)
    wanted = position if target is None else position[target]
    if wanted.shape[0] == width and torch.equal(wanted, _arange(width)):
        return layer
    weights = torch.full((wanted.shape[0], width), -math.inf, dtype=torch.float64)
    weights[_arange(wanted.shape[0]), wanted] = 0.0
    return SumLayer([layer], int(wanted.shape[0]), Exp(), initial=weights)


class _Multiplier:
    """Memoised construction of the pairwise products of two circuits' layers."""

    def __init__(self) -> None:
        self.done: dict[tuple[int, int], _Built] = {}
        self.log_cache: dict[int, Tensor] = {}

    def log_weights(self, layer: InputLayer | SumLayer) -> Tensor:
        """The layer's log-weights in float64 (``initial`` was checked to be present)."""
        if layer.uid not in self.log_cache:
            assert layer.initial is not None
            raw = layer.initial.detach().to(device="cpu", dtype=torch.float64)
            self.log_cache[layer.uid] = layer.parameterization.log_weights(raw)
        return self.log_cache[layer.uid]

    def run(self, first: Layer, second: Layer) -> Layer:
        """The product of two layers with equal scopes, units in canonical order."""
        stack = [(first, second)]
        while stack:  # iterative post-order: deep circuits do not hit the recursion limit
            a, b = stack[-1]
            if (a.uid, b.uid) in self.done:
                stack.pop()
                continue
            needed = self.children(a, b)
            missing = [pair for pair in needed if (pair[0].uid, pair[1].uid) not in self.done]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            built = [self.done[(x.uid, y.uid)] for x, y in needed]
            self.done[(a.uid, b.uid)] = self.build(a, b, built)
        layer, perm = self.done[(first.uid, second.uid)]
        return _select(layer, perm, None)

    @staticmethod
    def match(a: ProductLayer, b: ProductLayer) -> list[tuple[Layer, Layer]]:
        """Pair the inputs of two products by scope, in ``a``'s input order."""
        by_scope = {child.scope: child for child in b.inputs}
        if len(by_scope) != len(b.inputs) or {c.scope for c in a.inputs} != set(by_scope):
            raise StructureError(
                f"cannot multiply {a.describe()} and {b.describe()}: they split their scope into "
                f"{[sorted(c.scope) for c in a.inputs]} and {[sorted(c.scope) for c in b.inputs]}")
        return [(child, by_scope[child.scope]) for child in a.inputs]

    def children(self, a: Layer, b: Layer) -> list[tuple[Layer, Layer]]:
        """The layer pairs whose products the product of ``a`` and ``b`` is built from."""
        if isinstance(a, ProductLayer) and len(a.inputs) == 1:
            return [(a.inputs[0], b)]  # a unary product is its input
        if isinstance(b, ProductLayer) and len(b.inputs) == 1:
            return [(a, b.inputs[0])]
        if isinstance(a, SumLayer) or isinstance(b, SumLayer):
            first = a.inputs if isinstance(a, SumLayer) else (a,)
            second = b.inputs if isinstance(b, SumLayer) else (b,)
            return [(x, y) for x in first for y in second]
        if isinstance(a, InputLayer) and isinstance(b, InputLayer):
            return []
        if isinstance(a, ProductLayer) and isinstance(b, ProductLayer):
            return self.match(a, b)
        raise StructureError(
            f"cannot multiply {a.describe()} and {b.describe()}: a product of several inputs "
            "meets an input layer over the same scope")

    def build(self, a: Layer, b: Layer, built: list[_Built]) -> _Built:
        if (isinstance(a, ProductLayer) and len(a.inputs) == 1) or (
                isinstance(b, ProductLayer) and len(b.inputs) == 1):
            return built[0]
        if isinstance(a, SumLayer) or isinstance(b, SumLayer):
            return self.sum_pair(a, b, built), None
        if isinstance(a, InputLayer) and isinstance(b, InputLayer):
            return self.input_pair(a, b), None
        assert isinstance(a, ProductLayer) and isinstance(b, ProductLayer)
        return self.product_pair(a, b, built)

    def input_pair(self, a: InputLayer, b: InputLayer) -> InputLayer:
        """Units ``(i, j)`` with log-probabilities ``log a_i(c) + log b_j(c)`` (unnormalised)."""
        if a.variable != b.variable or a.num_categories != b.num_categories:
            raise StructureError(f"cannot multiply {a.describe()} and {b.describe()}: different "
                                 "variables or numbers of categories")
        la, lb = self.log_weights(a), self.log_weights(b)
        raw = (la[:, None, :] + lb[None, :, :]).reshape(a.num_units * b.num_units, -1)
        return InputLayer(a.variable, a.num_units * b.num_units, a.distribution, Exp(), initial=raw)

    def sum_pair(self, a: Layer, b: Layer, built: list[_Built]) -> SumLayer:
        """``(W_a x A)(W_b x B) = (W_a kron W_b)(A x B)``; a non-sum side uses identity weights."""
        la = self.log_weights(a) if isinstance(a, SumLayer) else _log_identity(a.num_units)
        lb = self.log_weights(b) if isinstance(b, SumLayer) else _log_identity(b.num_units)
        first = a.inputs if isinstance(a, SumLayer) else (a,)
        second = b.inputs if isinstance(b, SumLayer) else (b,)
        offsets_a = [sum(x.num_units for x in first[:k]) for k in range(len(first))]
        offsets_b = [sum(y.num_units for y in second[:k]) for k in range(len(second))]
        inputs, blocks = [], []
        pairs = iter(built)
        for k in range(len(first)):
            for y, offset_b in zip(second, offsets_b, strict=True):
                layer, perm = next(pairs)
                canon = _arange(layer.num_units) if perm is None else perm
                rows_a = la[:, offsets_a[k] + canon // y.num_units]  # (K_a, U)
                rows_b = lb[:, offset_b + canon % y.num_units]  # (K_b, U)
                blocks.append((rows_a[:, None, :] + rows_b[None, :, :]).reshape(-1, layer.num_units))
                inputs.append(layer)
        return SumLayer(inputs, a.num_units * b.num_units, Exp(), initial=torch.cat(blocks, dim=1))

    def product_pair(self, a: ProductLayer, b: ProductLayer, built: list[_Built]) -> _Built:
        """Products of the pairwise products of inputs matched by scope."""
        pairs = self.match(a, b)
        hadamard = ProductKind.HADAMARD
        if a.kind is hadamard and b.kind is hadamard:  # align every input to the first's order
            reference = built[0][1]
            layers = [_select(layer, perm, reference) for layer, perm in built]
            return ProductLayer(layers, hadamard), reference
        positions_b = [b.inputs.index(y) for _, y in pairs]
        if a.kind is ProductKind.KRONECKER and b.kind is ProductKind.KRONECKER:
            strides_b = [math.prod(b.input_widths[p + 1:]) for p in range(len(b.inputs))]
            first_index = torch.zeros(1, dtype=torch.long)
            second_index = torch.zeros(1, dtype=torch.long)
            for (x, y), (layer, perm), pos in zip(pairs, built, positions_b, strict=True):
                canon = _arange(layer.num_units) if perm is None else perm
                first_index = (first_index[:, None] * x.num_units
                               + (canon // y.num_units)[None, :]).reshape(-1)
                second_index = (second_index[:, None]
                                + (canon % y.num_units * strides_b[pos])[None, :]).reshape(-1)
            order = first_index * b.num_units + second_index
            product = ProductLayer([layer for layer, _ in built], ProductKind.KRONECKER)
            return product, (None if torch.equal(order, _arange(order.shape[0])) else order)
        # mixed Hadamard x Kronecker: expand each pair to the K_a * K_b output units, then Hadamard
        units_a, units_b = _arange(a.num_units)[:, None], _arange(b.num_units)[None, :]
        layers = []
        for k, ((_, y), (layer, perm), pos) in enumerate(zip(pairs, built, positions_b, strict=True)):
            target = _digit(a, k, units_a) * y.num_units + _digit(b, pos, units_b)
            layers.append(_select(layer, perm, target.reshape(-1)))
        return ProductLayer(layers, hadamard), None


def _require_parameters(circuit: Circuit, which: str) -> None:
    for layer in circuit.layers:
        if isinstance(layer, (InputLayer, SumLayer)) and layer.initial is None:
            raise InvalidInputError(
                f"multiply needs parameter values, but {layer.describe()} of the {which} circuit has "
                "no `initial`; pass snapshot(compiled) for a compiled (trained) circuit, or set "
                "`initial` on every input and sum layer")


def multiply(first: Circuit, second: Circuit) -> Circuit:
    """The circuit computing ``first(x) * second(x)`` for two compatible circuits.

    Both circuits must be smooth, decomposable and split every common scope the same way
    (:func:`circuits.structure.are_compatible`), cover the same variables with the same numbers of
    categories, have no integrated inputs (multiply first, then :func:`integrate`), and carry
    ``initial`` parameters on every input and sum layer (see :func:`snapshot`).

    Returns:
        A smooth, decomposable circuit with :class:`Exp` (unnormalised) float64 parameters whose
        output has ``K_1 * K_2`` units (``1`` for two probability circuits); its log partition
        function is ``log sum_x first(x) second(x)``.

    Raises:
        StructureError: the circuits are not compatible (the message lists why), cover different
            variables or categories, or have integrated inputs.
        InvalidInputError: an argument is not a Circuit or a layer has no ``initial``.
    """
    for name, circuit in (("first", first), ("second", second)):
        if not isinstance(circuit, Circuit):
            raise InvalidInputError(f"multiply: {name} must be a Circuit, got {type(circuit).__name__}")
    problems = compatibility_violations(first, second)
    if problems:
        raise StructureError("cannot multiply circuits that are not compatible:\n- "
                             + "\n- ".join(problems))
    for name, circuit in (("first", first), ("second", second)):
        other = [layer for layer in circuit.input_layers
                 if not isinstance(layer.distribution, Categorical)]
        if other:
            raise StructureError(
                f"multiply supports Categorical inputs only; {other[0].describe()} in the {name} "
                "circuit is not (products of Bernoulli, Binomial or Gaussian inputs are not "
                "implemented)")
        integrated = [layer for layer in circuit.input_layers if layer.integrated]
        if integrated:
            raise StructureError(
                f"multiply does not support integrated inputs ({integrated[0].describe()} in the "
                f"{name} circuit): multiply the circuits first, then integrate the product")
    if first.scope != second.scope:
        raise StructureError(f"multiply needs circuits over the same variables, got "
                             f"{sorted(first.scope)} and {sorted(second.scope)}")
    for variable, size in first.num_categories.items():
        if second.num_categories[variable] != size:
            raise StructureError(
                f"variable {variable} has {size} categories in the first circuit but "
                f"{second.num_categories[variable]} in the second")
    _require_parameters(first, "first")
    _require_parameters(second, "second")
    return Circuit(_Multiplier().run(first.output, second.output))


def square(circuit: Circuit) -> Circuit:
    """``circuit(x) ** 2``: shorthand for ``multiply(circuit, circuit)``."""
    return multiply(circuit, circuit)


__all__ = ["integrate", "multiply", "snapshot", "square"]
