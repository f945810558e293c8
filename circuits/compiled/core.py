"""The folded circuit itself: layers, parameters, input checks and the bottom-up pass.

:class:`CircuitCore` owns the folded layers and their parameters, validates query inputs, turns
the parameters a query is given into the one type the passes read
(:class:`~circuits.compiled.prepared.LogParameters`, :meth:`CircuitCore.resolve_params`) and runs
the bottom-up pass that every query builds on (:meth:`CircuitCore.evaluate`). The queries are
functions over a core and its parameters (:mod:`circuits.compiled.queries`,
:mod:`circuits.compiled.sampling`); :class:`~circuits.compiled.circuit.CompiledCircuit` adds
them as methods. Nothing here imports a query module.

Parameters supplied per call ("external" or "conditional" parameters) are a mapping from a fold's
name to a raw tensor with a leading batch dimension, ``params[name].shape == (B, *shape)`` where
``shape = compiled.parameter_shapes()[name]``. Folds missing from the mapping use the module's
own parameters, normalised once per change of their values
(:class:`~circuits.compiled.prepared.OwnParameterCache`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from circuits.compiled.folding import FoldKind, FoldPlan, plan_folds
from circuits.compiled.layers import (
    FoldedInput,
    FoldedProduct,
    FoldedSum,
    Semiring,
    SoftmaxParts,
    gather_inputs,
)
from circuits.compiled.prepared import (
    LogParameters,
    OwnEntry,
    OwnParameterCache,
    Params,
    ParamsLike,
    Trace,
)
from circuits.compiled.validity import ParameterTable, check_parameters, parameter_tables
from circuits.errors import InvalidInputError
from circuits.structure import check
from circuits.symbolic import Circuit, Layer


@dataclass(frozen=True)
class ParameterSpec:
    """Describes one parameter tensor of a compiled circuit.

    Attributes:
        name: key to use in an external-parameter mapping (e.g. ``"sum_7"``).
        kind: INPUT (an input family's raw parameters) or SUM (mixing weights).
        shape: ``(F, K, D)``: folded layers, units, raw parameters per input unit (categories of
            a Categorical one) or input units. An external tensor for it has shape
            ``(B, F, K, D)``.
        layers: the symbolic layer behind each of the ``F`` slots.
        variables: for input folds, the variable of each slot.
    """

    name: str
    kind: FoldKind
    shape: tuple[int, int, int]
    layers: tuple[Layer, ...]
    variables: tuple[int, ...] = ()


class CircuitCore(nn.Module):
    """A folded, log-space torch implementation of a smooth and decomposable circuit.

    Data ``x`` is a ``(B, V)`` integer tensor with ``V = circuit.num_variables`` columns, or a
    floating-point one when the circuit has a Gaussian (real-valued) variable, its discrete
    columns then holding integral values; ``observed`` is a ``(B, V)`` or ``(V,)`` bool mask.
    """

    def __init__(self, circuit: Circuit, fold: bool = True, seed: int = 0,
                 validate: bool = True) -> None:
        super().__init__()
        if validate:
            check(circuit)
        if circuit.output.num_units != 1:
            raise InvalidInputError(
                f"the output layer {circuit.output.describe()} has {circuit.output.num_units} "
                "units; probability queries need one: add SumLayer([output], num_units=1)")
        self.circuit = circuit
        self.num_variables = circuit.num_variables
        self.scope = tuple(sorted(circuit.scope))
        categories = torch.zeros(circuit.num_variables, dtype=torch.long)
        for variable, size in circuit.num_categories.items():
            categories[variable] = size
        #: ``categories`` as Python ints (checks read it without device round trips)
        self.category_sizes: tuple[int, ...] = tuple(int(c) for c in categories)
        self.register_buffer("categories", categories, persistent=False)
        #: the Gaussian (real-valued) variables; x is a float tensor when there is one
        self.continuous_variables: tuple[int, ...] = circuit.continuous_variables
        continuous = torch.zeros(circuit.num_variables, dtype=torch.bool)
        continuous[list(self.continuous_variables)] = True
        #: (V,) bool: which columns of x are real-valued
        self.register_buffer("continuous", continuous, persistent=False)
        generator = torch.Generator().manual_seed(seed)
        self.plans: tuple[FoldPlan, ...] = plan_folds(circuit, fold=fold)
        folds: list[nn.Module] = []
        for plan in self.plans:
            if plan.kind is FoldKind.INPUT:
                folds.append(FoldedInput(plan, generator))
            elif plan.kind is FoldKind.SUM:
                folds.append(FoldedSum(plan, generator))
            else:
                folds.append(FoldedProduct(plan))
        self.folds = nn.ModuleList(folds)
        self.specs: dict[str, ParameterSpec] = {}
        for plan, module in zip(self.plans, folds, strict=True):
            if isinstance(module, (FoldedInput, FoldedSum)):
                variables = tuple(int(v) for v in module.variables) if isinstance(
                    module, FoldedInput) else ()
                self.specs[plan.name] = ParameterSpec(
                    plan.name, plan.kind, tuple(module.raw.shape), plan.layers, variables)
        self.normalized = all(
            plan.parameterization.normalized for plan in self.plans
            if plan.parameterization is not None)
        #: the module's own parameters, checked and normalised once per change of their values
        self.own_cache = OwnParameterCache()

    def _apply(self, *args: object, **kwargs: object) -> CircuitCore:  # type: ignore[override]
        """``.to()``, ``.double()``, ``.cuda()``...: the cached tensors would only be stale copies."""
        self.own_cache.clear()
        return super()._apply(*args, **kwargs)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ parameters
    def parameter_shapes(self) -> dict[str, tuple[int, int, int]]:
        """``{name: (F, K, D)}`` for every parameterised fold; external tensors add a batch dim."""
        return {name: spec.shape for name, spec in self.specs.items()}

    def parameter_specs(self) -> dict[str, ParameterSpec]:
        """Full descriptions of the parameter tensors (see :class:`ParameterSpec`)."""
        return dict(self.specs)

    def internal_parameters(self, batch_size: int) -> dict[str, Tensor]:
        """The module's own raw parameters expanded to ``batch_size`` rows (an external mapping)."""
        return {plan.name: module.raw.unsqueeze(0).expand(batch_size, *module.raw.shape)
                for plan, module in zip(self.plans, self.folds, strict=True)
                if isinstance(module, (FoldedInput, FoldedSum))}

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def resolve_params(self, params: ParamsLike | None, batch_size: int | None,
                       check: bool = True, cache: bool = True) -> LogParameters:
        """The :class:`LogParameters` a query runs on, from the parameters it was given.

        A :class:`LogParameters` is returned as it is (checked when made) once its batch matches
        ``batch_size``. A raw mapping (None: empty) has its names, shapes and batch sizes checked,
        then the *values* the query will use, its own and the module's own of the folds it leaves
        out (:mod:`~circuits.compiled.validity`: NaN, +inf or a row without mass raise
        :class:`~circuits.errors.InvalidParameterError` naming the tensor, layer and first
        offending index; one call of the check, one host synchronisation), and is normalised.
        The module's own parameters come from :attr:`own_cache` when unchanged since last checked.

        Args:
            check: False for callers that validated already (:meth:`evaluate`).
            cache: False to build fresh own tensors (:meth:`log_parameters` hands them out).
        """
        if isinstance(params, LogParameters):  # the one place that tells the two types apart
            if params.batch is not None and batch_size is not None and params.batch != batch_size:
                raise InvalidInputError(
                    f"the log-parameters hold {params.batch} parameter sets but the data has "
                    f"{batch_size} rows; give one parameter set per data row")
            return params
        external = self._check_mapping(params, batch_size) if check else dict(params or {})
        return self._normalise(external, check, cache)

    def _check_mapping(self, params: Params | None, batch_size: int | None) -> dict[str, Tensor]:
        """Names, types, shapes and batch sizes of a raw external mapping; returns it as a dict."""
        if params is not None and not isinstance(params, Mapping):
            raise InvalidInputError(
                f"params must be a mapping from fold names to tensors, got {type(params).__name__}")
        checked: dict[str, Tensor] = {}
        for name, value in (params or {}).items():
            spec = self.specs.get(name)
            if spec is None:
                raise InvalidInputError(
                    f"unknown parameter {name!r}; this circuit has {sorted(self.specs)} "
                    "(see parameter_shapes())")
            if not isinstance(value, Tensor) or not value.is_floating_point():
                raise InvalidInputError(f"params[{name!r}] must be a floating-point tensor")
            if value.dim() != 4 or tuple(value.shape[1:]) != spec.shape:
                raise InvalidInputError(
                    f"params[{name!r}] must have shape (batch, {', '.join(map(str, spec.shape))}),"
                    f" got {tuple(value.shape)}")
            if batch_size is not None and value.shape[0] != batch_size:
                raise InvalidInputError(
                    f"params[{name!r}] has {value.shape[0]} rows but the data has {batch_size}; "
                    "give one parameter set per data row")
            checked[name] = value
        sizes = {int(v.shape[0]) for v in checked.values()}
        if len(sizes) > 1:
            raise InvalidInputError(f"external parameters disagree on the batch size: {sorted(sizes)}")
        return checked

    def _normalise(self, external: dict[str, Tensor], check: bool, cache: bool) -> LogParameters:
        """Check (when ``check``) and normalise ``external`` and the own parameters it leaves out."""
        hits: dict[int, OwnEntry] = {}  # own folds unchanged, bit for bit, since last checked
        if cache:
            for plan, module in zip(self.plans, self.folds, strict=True):
                if isinstance(module, (FoldedInput, FoldedSum)) and plan.name not in external:
                    entry = self.own_cache.lookup(plan.fold_id, module.raw)
                    if entry is not None:
                        hits[plan.fold_id] = entry
        if check:  # once per call, on every table not known to be valid
            tables: list[ParameterTable] = parameter_tables(self.plans, self.folds, external,
                                                            verified=hits)
            check_parameters(tables)
        values: dict[int, Tensor | SoftmaxParts] = {}
        derived: dict[tuple[str, int], object] = {}
        for plan, module in zip(self.plans, self.folds, strict=True):
            if not isinstance(module, (FoldedInput, FoldedSum)):
                continue
            raw = external.get(plan.name)
            entry = hits.get(plan.fold_id)
            if entry is not None:
                values[plan.fold_id] = entry.value
                if entry.weights is not None:
                    derived[("exp_weights", plan.fold_id)] = entry.weights
            elif isinstance(module, FoldedInput) and module.lazy_softmax(raw):
                assert raw is not None
                values[plan.fold_id] = module.softmax_parts(raw)
            else:
                value = module.log_probs(raw) if isinstance(module, FoldedInput) else \
                    module.log_weights(raw)
                values[plan.fold_id] = value
                if raw is None and check and cache:
                    self.own_cache.store(plan.fold_id, module.raw, value, isinstance(module, FoldedSum))
        batch = next(iter(external.values())).shape[0] if external else None
        return LogParameters(values, batch, derived)

    def log_parameters(self, params: ParamsLike | None = None) -> LogParameters:
        """Normalise every fold's parameters once (:class:`LogParameters`) for several queries.

        Args:
            params: optional external raw parameters with batch S (see the module docstring).
        """
        return self.resolve_params(params, None, cache=False)

    @property
    def real_valued(self) -> bool:
        """Whether data are real-valued (some variable is Gaussian): ``x`` is then a float tensor."""
        return bool(self.continuous_variables)

    def blank_data(self, batch: int) -> Tensor:
        """A ``(batch, V)`` data tensor of zeros of the dtype queries take (long, or the circuit's
        float dtype when it is real-valued), for passes where nothing is observed."""
        dtype = self.dtype if self.real_valued else torch.long
        return torch.zeros(batch, self.num_variables, dtype=dtype, device=self.categories.device)

    def validate_data(self, x: Tensor, observed: Tensor | None = None,
                      check_range: bool = True) -> tuple[Tensor, Tensor]:
        """Check ``x`` (B, V) and ``observed`` ((B, V), (V,) or None = all observed).

        Returns ``x`` as long (as a float tensor of at least the circuit's precision when the
        circuit is real-valued) and ``observed`` as a (B, V) bool tensor. Only observed entries
        are checked: unobserved ones may hold anything (NaN for a missing real value).
        """
        if not isinstance(x, Tensor):
            raise InvalidInputError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if self.real_valued:
            if not x.is_floating_point():
                raise InvalidInputError(
                    f"x must be a floating-point tensor: variables {list(self.continuous_variables)} "
                    f"are Gaussian (real-valued); discrete variables take integral values in it; got "
                    f"{x.dtype}")
        elif x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise InvalidInputError(
                f"x must hold integer category indices (e.g. torch.long), got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != self.num_variables:
            raise InvalidInputError(
                f"x must have shape (batch, {self.num_variables}), got {tuple(x.shape)}")
        if self.real_valued:
            x = x.to(device=self.categories.device, dtype=torch.promote_types(x.dtype, self.dtype))
        else:
            x = x.to(device=self.categories.device, dtype=torch.long)
        batch = x.shape[0]
        if observed is None:
            observed = torch.ones(x.shape, dtype=torch.bool, device=x.device)
        else:
            if not isinstance(observed, Tensor) or observed.dtype != torch.bool:
                raise InvalidInputError("observed must be a bool tensor (True = observed)")
            if observed.dim() == 1 and observed.shape[0] == self.num_variables:
                observed = observed.unsqueeze(0)
            if observed.dim() != 2 or observed.shape[1] != self.num_variables or \
                    observed.shape[0] not in (1, batch):
                raise InvalidInputError(
                    f"observed must have shape ({self.num_variables},) or ({batch}, "
                    f"{self.num_variables}), got {tuple(observed.shape)}")
            observed = observed.to(self.categories.device).expand(batch, -1)
        if check_range:
            if self.real_valued:
                self._check_real_data(x, observed)
            else:
                bad = observed & ((x < 0) | (x >= self.categories))
                if bool(bad.any()):
                    row, col = (int(i) for i in bad.nonzero()[0])
                    size = int(self.categories[col])
                    raise InvalidInputError(
                        f"x[{row}, {col}] = {int(x[row, col])} is out of range for variable {col} "
                        f"with {size} categories (valid: 0..{size - 1})")
        return x, observed

    def _check_real_data(self, x: Tensor, observed: Tensor) -> None:
        """Observed real values finite; observed discrete values integral and in range (one
        host synchronisation when all is well)."""
        discrete = observed & ~self.continuous
        finite = torch.isfinite(x)
        bad = observed & ~finite
        bad |= discrete & finite & ((x != torch.floor(x)) | (x < 0) | (x >= self.categories))
        if not bool(bad.any()):
            return
        row, col = (int(i) for i in bad.nonzero()[0])
        value = float(x[row, col])
        shown = str(int(value)) if value.is_integer() else repr(value)
        if bool(self.continuous[col]):
            raise InvalidInputError(
                f"x[{row}, {col}] = {value} is not a real number: variable {col} is Gaussian; mark "
                f"a missing value unobserved (observed[{row}, {col}] = False) instead")
        size = int(self.categories[col])
        if not math.isfinite(value) or not value.is_integer():
            raise InvalidInputError(
                f"x[{row}, {col}] = {shown} is not an integer: variable {col} is discrete with "
                f"{size} categories (valid: 0..{size - 1}); mark a missing value unobserved "
                f"(observed[{row}, {col}] = False) instead")
        raise InvalidInputError(
            f"x[{row}, {col}] = {shown} is out of range for variable {col} with {size} categories "
            f"(valid: 0..{size - 1})")

    # ------------------------------------------------------------------ bottom-up pass
    def evaluate(self, x: Tensor, observed: Tensor, params: ParamsLike | None = None,
                 semiring: Semiring = Semiring.SUM, trace: Trace | None = None,
                 input_leaves: dict[int, Tensor] | None = None) -> Tensor:
        """Bottom-up pass on validated data; returns the output log-value ``(B,)``.

        Args:
            x, observed: as returned by :meth:`validate_data`.
            params: the :class:`LogParameters` of :meth:`resolve_params` (or validated raw
                external parameters, normalised here unchecked) with batch ``S`` dividing ``B``:
                set ``s`` serves rows ``s * B/S .. (s+1) * B/S - 1``. ``S = B`` is one set per
                row; ``S < B`` lets several evidence patterns of one row share its parameters
                without copying them (the prefix queries do this).
            semiring: SUM for probabilities, MAX for max-product values.
            trace: when given, filled with every fold's output (used by top-down passes).
            input_leaves: when given, input fold outputs are detached into fresh tensors that
                require grad and are stored here by fold id (used for conditionals).
        """
        prepared = self.resolve_params(params, None, check=False)
        outputs: list[Tensor] = []
        for plan, module in zip(self.plans, self.folds, strict=True):
            if isinstance(module, FoldedInput):
                log_probs = prepared.values[plan.fold_id]
                out = module(x, observed, log_probs, semiring)
                if input_leaves is not None:
                    out = out.detach().requires_grad_(True)
                    input_leaves[plan.fold_id] = out
                if trace is not None:
                    trace.log_params[plan.fold_id] = log_probs
            elif isinstance(module, FoldedSum):
                inputs = gather_inputs(outputs, plan, module.index_buffers(),
                                       module.input_slices, module.routes)
                joined = inputs[0] if len(inputs) == 1 else torch.cat(inputs, dim=-1)
                log_weights = prepared.values[plan.fold_id]
                assert isinstance(log_weights, Tensor), "sum folds always hold tensors"
                weights = None
                if semiring is Semiring.SUM and not log_weights.requires_grad:
                    weights = partial(prepared.exp_weights, plan.fold_id)  # shared by passes
                keep: dict[str, Tensor] | None = {} if trace is not None else None
                out = module(joined, log_weights, semiring, weights, keep)
                if trace is not None:
                    trace.sum_inputs[plan.fold_id] = joined
                    trace.log_params[plan.fold_id] = log_weights
                    if keep:
                        trace.sum_parts[plan.fold_id] = (keep["probs"], keep["total"])
            else:
                assert isinstance(module, FoldedProduct)
                out = module(gather_inputs(outputs, plan, module.index_buffers(),
                                           module.input_slices, module.routes))
            outputs.append(out)
        if trace is not None:
            trace.outputs = outputs
        return outputs[-1][0, :, 0]


__all__ = ["CircuitCore", "ParameterSpec"]
