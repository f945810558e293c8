"""Optional bridge to libcirkit (``pip install -c constraints.txt libcirkit``), the reference PC library.

Two ways to get the same circuit in cirkit:

* :func:`translate` rewrites a ``circuits`` symbolic circuit layer by layer into cirkit's
  symbolic IR (Categorical inputs, dense sum layers, Hadamard/Kronecker products) and copies the
  raw parameters of a compiled ``circuits`` module, so both libraries compute *the same numbers*
  (checked by the benchmark) and have the same parameter count by construction;
* :func:`native_from_region_graph` converts a region graph to cirkit's ``RegionGraph`` and lets
  cirkit's own ``build_circuit`` build it with the named sum-product pattern; its parameter count
  is the cross-check that the ``circuits`` builder realises the same architecture.

Everything here imports cirkit lazily; :func:`available` says whether it is installed.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch
from torch import Tensor

from circuits import CompiledCircuit
from circuits.compiled.layers import FoldedInput
from circuits.parameterizations import Softmax
from circuits.symbolic import Circuit, InputLayer, ProductKind, ProductLayer, SumLayer


class RegionGraphLike(Protocol):
    """The part of :class:`circuits.region_graphs.RegionGraph` the converter reads."""

    root: Hashable

    def regions(self) -> tuple[Hashable, ...]: ...

    def partitions_of(self, region: Hashable) -> tuple[Hashable, ...]: ...

    def children_of(self, partition: Hashable) -> tuple[Hashable, ...]: ...

    def scope_of(self, node: Hashable) -> frozenset[int]: ...


def available() -> bool:
    """True when libcirkit (module ``cirkit``) can be imported."""
    return importlib.util.find_spec("cirkit") is not None


def version() -> str | None:
    """The installed libcirkit version, or None."""
    try:
        from importlib.metadata import version as dist_version
        return dist_version("libcirkit")
    except Exception:
        return None


def raw_parameters(compiled: CompiledCircuit) -> dict[int, Tensor]:
    """``{layer uid: raw parameter (K, D)}`` of every input and sum layer of a compiled circuit."""
    table: dict[int, Tensor] = {}
    for plan, module in zip(compiled.plans, compiled.folds, strict=True):
        raw = getattr(module, "raw", None)
        if raw is None:
            continue
        for slot, layer in enumerate(plan.layers):
            table[layer.uid] = raw[slot].detach()
    return table


def _softmax_parameter(raw: Tensor) -> Any:
    from cirkit.symbolic.initializers import ConstantTensorInitializer
    from cirkit.symbolic.parameters import Parameter, SoftmaxParameter, TensorParameter

    shape = tuple(raw.shape)
    value = raw.detach().to(torch.float64).cpu().numpy()
    tensor = TensorParameter(*shape, initializer=ConstantTensorInitializer(value))
    return Parameter.from_unary(SoftmaxParameter(shape, axis=-1), tensor)


def translate(circuit: Circuit, compiled: CompiledCircuit) -> Any:
    """The cirkit symbolic circuit computing exactly what ``compiled`` (built from ``circuit``) does.

    Only what the benchmarks use is supported: categorical inputs and sum layers with the
    :class:`~circuits.parameterizations.Softmax` parameterisation, sum layers whose inputs have
    equal widths (cirkit's dense layers concatenate equal-width inputs), Hadamard and Kronecker
    products. Raises ValueError otherwise.
    """
    from cirkit.symbolic.circuit import Circuit as CirkitCircuit
    from cirkit.symbolic.layers import (
        CategoricalLayer,
        HadamardLayer,
        KroneckerLayer,
    )
    from cirkit.symbolic.layers import SumLayer as CirkitSum
    from cirkit.utils.scope import Scope

    raws = raw_parameters(compiled)
    made: dict[int, Any] = {}
    layers: list[Any] = []
    in_layers: dict[Any, list[Any]] = {}
    for layer in circuit.layers:
        if isinstance(layer, InputLayer):
            if layer.integrated or not isinstance(layer.parameterization, Softmax):
                raise ValueError(f"cannot translate {layer.describe()} (integrated or not softmax)")
            new = CategoricalLayer(Scope([layer.variable]), layer.num_units,
                                   num_categories=layer.num_categories,
                                   probs=_softmax_parameter(raws[layer.uid]))
        elif isinstance(layer, SumLayer):
            widths = set(layer.input_widths)
            if len(widths) != 1 or not isinstance(layer.parameterization, Softmax):
                raise ValueError(f"cannot translate {layer.describe()} (unequal widths or not softmax)")
            new = CirkitSum(widths.pop(), layer.num_units, arity=len(layer.inputs),
                            weight=_softmax_parameter(raws[layer.uid]))
        elif isinstance(layer, ProductLayer):
            width = layer.inputs[0].num_units
            if layer.kind is ProductKind.HADAMARD:
                new = HadamardLayer(width, arity=len(layer.inputs))
            else:
                if len(set(layer.input_widths)) != 1:
                    raise ValueError(f"cannot translate {layer.describe()} (unequal widths)")
                new = KroneckerLayer(width, arity=len(layer.inputs))
        else:  # pragma: no cover - the IR has three layer kinds
            raise ValueError(f"unknown layer {layer!r}")
        made[layer.uid] = new
        layers.append(new)
        in_layers[new] = [made[i.uid] for i in layer.inputs]
    return CirkitCircuit(layers, in_layers, [made[circuit.output.uid]])


def native_from_region_graph(rg: RegionGraphLike, pattern: str, num_sum_units: int,
                             num_input_units: int, num_categories: int) -> Any:
    """Convert ``rg`` to a cirkit ``RegionGraph`` and build it with cirkit's own builder.

    ``pattern`` is cirkit's name of the sum-product layer: ``"cp"``, ``"cp-t"`` or ``"tucker"``.
    """
    from cirkit.symbolic.initializers import NormalInitializer
    from cirkit.symbolic.layers import CategoricalLayer
    from cirkit.symbolic.parameters import Parameter, SoftmaxParameter, TensorParameter
    from cirkit.templates.region_graph import PartitionNode, RegionGraph, RegionNode

    def softmax_factory(shape: tuple[int, ...]) -> Any:
        tensor = TensorParameter(*shape, initializer=NormalInitializer())
        return Parameter.from_unary(SoftmaxParameter(shape), tensor)

    nodes: list[Any] = []
    in_nodes: dict[Any, list[Any]] = {}
    converted: dict[Hashable, Any] = {}

    def convert(region: Hashable) -> Any:
        if region in converted:
            return converted[region]
        node = RegionNode(sorted(rg.scope_of(region)))
        converted[region] = node
        nodes.append(node)
        partitions = []
        for partition in rg.partitions_of(region):
            pnode = PartitionNode(sorted(rg.scope_of(region)))
            nodes.append(pnode)
            in_nodes[pnode] = [convert(child) for child in rg.children_of(partition)]
            partitions.append(pnode)
        in_nodes[node] = partitions
        return node

    root = convert(rg.root)
    graph = RegionGraph(nodes, in_nodes, outputs=[root])
    return graph.build_circuit(
        input_factory=functools.partial(CategoricalLayer, num_categories=num_categories),
        sum_product=pattern, sum_weight_factory=softmax_factory,
        num_input_units=num_input_units, num_sum_units=num_sum_units, num_classes=1)


def symbolic_num_parameters(symbolic: Any) -> int:
    """Number of learnable scalars of a cirkit symbolic circuit (sum of its tensor parameters)."""
    from cirkit.symbolic.parameters import TensorParameter

    seen: set[int] = set()
    total = 0
    for layer in symbolic.layers:
        for parameter in layer.params.values():
            for node in parameter.nodes:
                if isinstance(node, TensorParameter) and id(node) not in seen and node.learnable:
                    seen.add(id(node))
                    total += int(torch.Size(node.shape).numel())
    return total


def compile_circuit(symbolic: Any) -> Any:
    """Compile with cirkit's recommended settings: torch backend, ``lse-sum``, folded, optimised."""
    from cirkit.pipeline import PipelineContext

    context = PipelineContext(backend="torch", semiring="lse-sum", fold=True, optimize=True)
    with context:
        return context.compile(symbolic)


def num_parameters(compiled: Any) -> int:
    """Learnable scalars of a compiled cirkit circuit."""
    return sum(p.numel() for p in compiled.parameters() if p.requires_grad)


def log_likelihood(compiled: Any, x: Tensor) -> Tensor:
    """``(B,)`` log-likelihoods of the complete data ``x`` (B, V), as cirkit computes them.

    cirkit's ``lse-sum`` semiring clamps every log-value at ``LOG_CLAMP_MIN`` (about -708.4,
    the log of the smallest float64), so circuits over many variables read -708.4.
    """
    return compiled(x)[:, 0, 0]


#: cirkit's floor on log-values (see :func:`log_likelihood`).
LOG_CLAMP_MIN = -708.3964185322641


def log_likelihood_unclamped(compiled: Any, x: Tensor) -> Tensor:
    """:func:`log_likelihood` with cirkit's clamp of log-values lifted (for verification only).

    Temporarily sets cirkit's module constant ``LOG_CLAMP_MIN`` to ``-inf``; the timed runs use
    cirkit unmodified.
    """
    import cirkit.backend.torch.semiring as semiring
    import cirkit.backend.torch.utils as utils

    saved = (semiring.LOG_CLAMP_MIN, utils.LOG_CLAMP_MIN)
    semiring.LOG_CLAMP_MIN = utils.LOG_CLAMP_MIN = -math.inf
    try:
        return compiled(x)[:, 0, 0]
    finally:
        semiring.LOG_CLAMP_MIN, utils.LOG_CLAMP_MIN = saved


def sampler(compiled: Any) -> Any:
    """A callable ``n -> (n, V)`` samples (cirkit's ``SamplingQuery``)."""
    from cirkit.backend.torch.queries import SamplingQuery

    query = SamplingQuery(compiled)
    return lambda n: query(num_samples=n)[0]


# ------------------------------------------------------------------------- the benchmark's use
#: cirkit's sampler materialises (input folds, units, samples, variables) int64 tensors; above
#: this many bytes we sample fewer rows from cirkit (and from ours, for a like-for-like ratio).
SAMPLING_BYTES = 600 * 2**20


def setup(circuit: Circuit, folded: CompiledCircuit, x: Tensor, units: tuple[int, int, int],
          region_graph: Callable[[], RegionGraphLike],
          native_note: str | None) -> tuple[dict[str, Any], Any]:
    """Translate and compile ``circuit`` in cirkit and compare it with ``folded``, its compiled
    ``circuits`` module, on rows ``x``; returns (report, compiled cirkit circuit).

    The report has the compile time, the parameter counts (ours, the translation's, and that of
    cirkit's own builder on ``region_graph()`` with ``units`` = (sum units, input units,
    categories)) and how far the two log-likelihoods are apart.
    """
    info: dict[str, Any] = {"installed": True, "version": version()}
    start = time.perf_counter()
    symbolic = translate(circuit, folded)
    compiled = compile_circuit(symbolic)
    info["compile_seconds"] = time.perf_counter() - start
    ours = sum(p.numel() for p in folded.parameters())
    info["num_parameters"] = {"circuits": ours, "cirkit_translated": num_parameters(compiled)}
    try:
        sum_units, input_units, categories = units
        native = native_from_region_graph(region_graph(), "cp-t", sum_units, input_units,
                                          categories)
        info["num_parameters"]["cirkit_native_builder"] = symbolic_num_parameters(native)
    except Exception as error:
        info["num_parameters"]["cirkit_native_builder"] = None
        info["native_error"] = repr(error)
    counts = info["num_parameters"]
    info["parameters_match"] = counts["cirkit_translated"] == ours
    info["native_parameters_match"] = counts["cirkit_native_builder"] == ours
    info["native_note"] = native_note
    with torch.inference_mode():
        ours_ll = folded.log_likelihood(x)
        theirs_ll = log_likelihood_unclamped(compiled, x)
        clamped = log_likelihood(compiled, x) <= LOG_CLAMP_MIN + 1e-3
    info["loglik_max_abs_diff"] = float((ours_ll - theirs_ll).abs().max())
    info["loglik_match"] = bool(torch.allclose(ours_ll, theirs_ll, rtol=1e-4, atol=1e-3))
    info["rows_clamped_by_cirkit"] = int(clamped.sum())
    return info, compiled


def sampling_rows(folded: CompiledCircuit, batch: int) -> int:
    """Rows (at most ``batch``) cirkit can sample at once within :data:`SAMPLING_BYTES`."""
    inputs = [m for m in folded.folds if isinstance(m, FoldedInput)]
    units = max(m.raw.shape[1] for m in inputs)
    layers = sum(m.raw.shape[0] for m in inputs)
    per_row = layers * units * folded.num_variables * 8
    return max(1, min(batch, SAMPLING_BYTES // per_row))
