"""The compiled circuit: a ``torch.nn.Module`` that evaluates a symbolic circuit fold by fold.

:class:`CompiledCircuit` owns the folded layers and their parameters, validates query inputs, and
runs the bottom-up pass that every query builds on (:meth:`CompiledCircuit.evaluate`). The queries
themselves (marginals, conditionals, sampling, MAP) live in :mod:`circuits.compiled.queries` and
:mod:`circuits.compiled.sampling` and are exposed here as methods.

Parameters supplied per call ("external" or "conditional" parameters) are a mapping from a fold's
name to a raw tensor with a leading batch dimension, ``params[name].shape == (B, *shape)`` where
``shape = compiled.parameter_shapes()[name]``. Folds missing from the mapping use the module's
own parameters. This is what lets a neural network (e.g. an LLM head) emit one circuit per row.
Several queries on the same parameters can share one normalisation:
``prepared = compiled.log_parameters(params)`` (:class:`LogParameters`) is accepted wherever
``params`` is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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
from circuits.compiled.prepared import LogParameters, ParamsLike, prepare
from circuits.compiled.validity import check_parameters, parameter_tables
from circuits.errors import InvalidInputError
from circuits.structure import check
from circuits.symbolic import Circuit, Layer


@dataclass(frozen=True)
class ParameterSpec:
    """Describes one parameter tensor of a compiled circuit.

    Attributes:
        name: key to use in an external-parameter mapping (e.g. ``"sum_7"``).
        kind: INPUT (categorical logits) or SUM (mixing weights).
        shape: ``(F, K, D)``: folded layers, units, categories or input units. An external
            tensor for it has shape ``(B, F, K, D)``.
        layers: the symbolic layer behind each of the ``F`` slots.
        variables: for input folds, the variable of each slot.
    """

    name: str
    kind: FoldKind
    shape: tuple[int, int, int]
    layers: tuple[Layer, ...]
    variables: tuple[int, ...] = ()


@dataclass
class Trace:
    """Everything a bottom-up pass computed, for the top-down passes that follow it.

    ``outputs[i]`` is fold ``i``'s output ``(F, B, K)``; ``sum_inputs[i]`` the concatenated input
    of sum fold ``i`` ``(F, B, D)``; ``log_params[i]`` its log-weights or log-probabilities
    (an input fold's may be :class:`~circuits.compiled.layers.SoftmaxParts`);
    ``sum_parts[i]`` (gradient-free SUM passes on the torch path) the ``(probs, total)`` that
    :func:`~circuits.compiled.layers.log_matmul` computed for sum fold ``i``.
    """

    outputs: list[Tensor] = field(default_factory=list)
    sum_inputs: dict[int, Tensor] = field(default_factory=dict)
    log_params: dict[int, Tensor | SoftmaxParts] = field(default_factory=dict)
    sum_parts: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)


class CompiledCircuit(nn.Module):
    """A folded, log-space torch implementation of a smooth and decomposable circuit.

    Build it with :func:`circuits.compile`. Data ``x`` is a ``(B, V)`` integer tensor with
    ``V = circuit.num_variables`` columns; ``observed`` is a ``(B, V)`` or ``(V,)`` bool mask.
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

    # ------------------------------------------------------------------ validation
    def validate_params(self, params: ParamsLike | None,
                        batch_size: int | None) -> dict[str, Tensor] | LogParameters:
        """Check an external-parameter mapping; returns it as a dict (empty when None).

        Names, shapes and batch sizes, then the *values* the query will use: the mapping's and
        the module's own parameters of the folds it leaves out (:mod:`~circuits.compiled.validity`:
        NaN, +inf or a row without mass raise :class:`~circuits.errors.InvalidParameterError`
        naming the tensor, layer and first offending index). That costs one reduction per fold and
        one host synchronisation, so every query calls this once. A :class:`LogParameters` is
        returned as it is (checked when made) once its batch matches ``batch_size``.
        """
        if isinstance(params, LogParameters):
            if params.batch is not None and batch_size is not None and params.batch != batch_size:
                raise InvalidInputError(
                    f"the log-parameters hold {params.batch} parameter sets but the data has "
                    f"{batch_size} rows; give one parameter set per data row")
            return params
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
        check_parameters(parameter_tables(self.plans, self.folds, checked))
        return checked

    def params_batch_size(self, params: Mapping[str, Tensor] | LogParameters) -> int | None:
        if isinstance(params, LogParameters):
            return params.batch
        sizes = {int(v.shape[0]) for v in params.values()}
        if len(sizes) > 1:
            raise InvalidInputError(f"external parameters disagree on the batch size: {sorted(sizes)}")
        return sizes.pop() if sizes else None

    def log_parameters(self, params: ParamsLike | None = None) -> LogParameters:
        """Normalise every fold's parameters once (:class:`LogParameters`) for several queries.

        Args:
            params: optional external raw parameters with batch S (see the module docstring).
        """
        checked = self.validate_params(params, None)
        if isinstance(checked, LogParameters):
            return checked
        return prepare(self.plans, self.folds, checked, self.params_batch_size(checked))

    def validate_data(self, x: Tensor, observed: Tensor | None = None,
                      check_range: bool = True) -> tuple[Tensor, Tensor]:
        """Check ``x`` (B, V) and ``observed`` ((B, V), (V,) or None = all observed).

        Returns ``x`` as long and ``observed`` as a (B, V) bool tensor.
        """
        if not isinstance(x, Tensor):
            raise InvalidInputError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise InvalidInputError(
                f"x must hold integer category indices (e.g. torch.long), got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != self.num_variables:
            raise InvalidInputError(
                f"x must have shape (batch, {self.num_variables}), got {tuple(x.shape)}")
        x = x.to(device=self.categories.device, dtype=torch.long)
        batch = x.shape[0]
        if observed is None:
            observed = torch.ones_like(x, dtype=torch.bool)
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
            bad = observed & ((x < 0) | (x >= self.categories))
            if bool(bad.any()):
                row, col = (int(i) for i in bad.nonzero()[0])
                size = int(self.categories[col])
                raise InvalidInputError(
                    f"x[{row}, {col}] = {int(x[row, col])} is out of range for variable {col} "
                    f"with {size} categories (valid: 0..{size - 1})")
        return x, observed

    # ------------------------------------------------------------------ bottom-up pass
    def evaluate(self, x: Tensor, observed: Tensor,
                 params: Mapping[str, Tensor] | LogParameters | None = None,
                 semiring: Semiring = Semiring.SUM, trace: Trace | None = None,
                 input_leaves: dict[int, Tensor] | None = None) -> Tensor:
        """Bottom-up pass on validated data; returns the output log-value ``(B,)``.

        Args:
            x, observed: as returned by :meth:`validate_data`.
            params: validated external parameters (see :meth:`validate_params`) with batch ``S``
                dividing ``B``: set ``s`` serves rows ``s * B/S .. (s+1) * B/S - 1``. ``S = B`` is
                one set per row; ``S < B`` lets several evidence patterns of one row share its
                parameters without copying them (the prefix queries do this). A
                :class:`LogParameters` (same batch rule) skips the parameterisations.
            semiring: SUM for probabilities, MAX for max-product values.
            trace: when given, filled with every fold's output (used by top-down passes).
            input_leaves: when given, input fold outputs are detached into fresh tensors that
                require grad and are stored here by fold id (used for conditionals).
        """
        prepared = params.values if isinstance(params, LogParameters) else None
        raw: Mapping[str, Tensor] = {} if isinstance(params, LogParameters) else (params or {})
        outputs: list[Tensor] = []
        for plan, module in zip(self.plans, self.folds, strict=True):
            if isinstance(module, FoldedInput):
                log_probs = prepared[plan.fold_id] if prepared is not None else \
                    module.log_probs(raw.get(plan.name))
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
                weights = None
                if prepared is not None:
                    log_weights = prepared[plan.fold_id]
                    assert isinstance(log_weights, Tensor), "sum folds always hold tensors"
                    if semiring is Semiring.SUM and not log_weights.requires_grad:
                        assert isinstance(params, LogParameters)
                        weights = params.exp_weights(plan.fold_id)  # shared by passes
                else:
                    log_weights = module.log_weights(raw.get(plan.name))
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

    # ------------------------------------------------------------------ queries
    def forward(self, x: Tensor, observed: Tensor | None = None,
                params: ParamsLike | None = None) -> Tensor:
        """Log-likelihood (all observed) or log-marginal (``observed`` mask) per row: ``(B,)``."""
        x, observed = self.validate_data(x, observed)
        return self.evaluate(x, observed, self.validate_params(params, x.shape[0]))

    def log_likelihood(self, x: Tensor, params: ParamsLike | None = None) -> Tensor:
        """``log c(x)`` for complete data ``x`` (B, V): ``(B,)``."""
        return self.forward(x, None, params)

    def log_marginal(self, x: Tensor, observed: Tensor, params: ParamsLike | None = None) -> Tensor:
        """``log sum_{unobserved} c(x)``: the marginal of the observed variables, ``(B,)``."""
        return self.forward(x, observed, params)

    def log_partition(self, params: ParamsLike | None = None) -> Tensor:
        """``log Z``: a scalar, or ``(B,)`` when external parameters with batch B are given."""
        checked = self.validate_params(params, None)
        sets = self.params_batch_size(checked)
        batch = 1 if sets is None else sets  # 0 parameter sets: 0 values, not 1
        x = torch.zeros(batch, self.num_variables, dtype=torch.long, device=self.categories.device)
        observed = torch.zeros_like(x, dtype=torch.bool)
        value = self.evaluate(x, observed, checked)
        return value if sets is not None else value[0]

    def log_conditional(self, x: Tensor, observed: Tensor, variables: Sequence[int] | None = None,
                        params: ParamsLike | None = None) -> Tensor:
        """See :func:`circuits.compiled.queries.log_conditional`."""
        from circuits.compiled.queries import log_conditional
        return log_conditional(self, x, observed, variables, params)

    def log_prefix_marginals(self, x: Tensor, order: Sequence[int] | None = None,
                             params: ParamsLike | None = None) -> Tensor:
        """See :func:`circuits.compiled.queries.log_prefix_marginals`."""
        from circuits.compiled.queries import log_prefix_marginals
        return log_prefix_marginals(self, x, order, params)

    def log_prefix_conditionals(self, x: Tensor, order: Sequence[int] | None = None,
                                params: ParamsLike | None = None) -> Tensor:
        """See :func:`circuits.compiled.queries.log_prefix_conditionals`."""
        from circuits.compiled.queries import log_prefix_conditionals
        return log_prefix_conditionals(self, x, order, params)

    def sample(self, num_samples: int | None = None, generator: torch.Generator | None = None,
               params: ParamsLike | None = None) -> Tensor:
        """See :func:`circuits.compiled.sampling.sample`."""
        from circuits.compiled.sampling import sample
        return sample(self, num_samples, generator, params)

    def conditional_sample(self, x: Tensor, observed: Tensor,
                           generator: torch.Generator | None = None,
                           params: ParamsLike | None = None) -> Tensor:
        """See :func:`circuits.compiled.sampling.conditional_sample`."""
        from circuits.compiled.sampling import conditional_sample
        return conditional_sample(self, x, observed, generator, params)

    def map_state(self, x: Tensor | None = None, observed: Tensor | None = None,
                  params: ParamsLike | None = None) -> tuple[Tensor, Tensor]:
        """See :func:`circuits.compiled.sampling.map_state`."""
        from circuits.compiled.sampling import map_state
        return map_state(self, x, observed, params)


def compile(circuit: Circuit, *, fold: bool = True, dtype: torch.dtype = torch.float32,
            device: torch.device | str | None = None, seed: int = 0,
            validate: bool = True) -> CompiledCircuit:
    """Compile a smooth and decomposable symbolic circuit into a folded torch module.

    Args:
        circuit: the symbolic circuit; its output layer must have one unit.
        fold: stack same-signature layers of equal depth (``False``: one fold per layer, the
            naive reference evaluation).
        dtype: float32 or float64 parameters and computation.
        device: where the module lives (``"cpu"``, ``"cuda"``...).
        seed: seeds the random initialisation of layers without ``initial`` parameters.
        validate: run :func:`circuits.structure.check` first (raises StructureError).

    Raises:
        InvalidParameterError: a parameter (after the cast to ``dtype``) is NaN or +inf, or a
            row of them is all -inf; the message names the fold, layer and first bad index.
    """
    if dtype not in (torch.float32, torch.float64):
        raise InvalidInputError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    module = CompiledCircuit(circuit, fold=fold, seed=seed, validate=validate)
    module = module.to(dtype=dtype, device=device)
    module.validate_params(None, None)  # NaN, +inf or no-mass parameters (e.g. from `initial`)
    return module
