"""Expectation-maximisation for compiled circuits, as a :class:`torch.optim.Optimizer`.

Design. EM needs, per batch, the expected counts of every sum weight and the flows of every input
unit (:mod:`circuits.learn.flows`). They are the gradients of ``sum_b log p(x_b)`` with respect to
the *normalised* log-parameters; the gradients that ``loss.backward()`` leaves in the raw
parameters are not enough (through a softmax, ``d/d raw = n - w N`` loses each unit's total flow
``N``), and autograd would cost more than the dedicated pass. So EM has its own statistics pass::

    em = EM(model, step_size=0.1, pseudocount=0.01)
    for x in batches:
        em.accumulate(x)          # one forward + one flow pass; returns log p(x) (B,)
        em.step()                 # parameters move toward the estimate; statistics cleared

``accumulate`` may be called several times before ``step``: the counts add up, so accumulating
over the whole data set and stepping once with ``step_size=1`` is classical (full-batch) EM, and
stepping after every mini-batch with a smaller step is stochastic (mini-batch) EM::

    new = (1 - step_size) * old + step_size * estimate        (in probability space)

Sum weights and categorical inputs are updated from their expected counts
(:mod:`circuits.learn.update`); Bernoulli, Binomial and Gaussian inputs through their fold's
``em_estimate`` (:mod:`circuits.learn.families`), mixing sufficient statistics (means, second
moments) the same way.

:func:`circuits.learn.fit` detects EM and runs this loop (and, under ``torchrun``, sums the
statistics over processes with :meth:`EM.all_reduce` before each step). ``step()`` without
statistics raises: EM reads no gradients. ``param_groups[0]["lr"]`` holds the step size, so
:mod:`torch.optim.lr_scheduler` schedules (e.g. a decaying step) apply to it.

Every parameterisation that :func:`~circuits.region_graphs.build_circuit` and the templates
produce is supported: the update works on the circuit's normal form
(:mod:`circuits.learn.normal_form`), so unnormalised (``Exp``) circuits are fitted by their
normalised likelihood ``c(x) / Z``, and new probabilities are written back as ``log p``, which both
:class:`~circuits.Softmax` and :class:`~circuits.Exp` map exactly onto ``p``. A fold whose raw
parameter has ``requires_grad=False`` is kept fixed (normalised circuits only: in an unnormalised
one, fixing a fold would change the distribution when the others move to their normal form).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from circuits.compiled import CircuitCore, LogParameters
from circuits.compiled.layers import FoldedInput, FoldedSum, SoftmaxParts
from circuits.errors import InvalidInputError
from circuits.learn.distributed import LearningContext
from circuits.learn.families import (
    CategoricalCounts,
    FamilyEstimate,
    InputUpdate,
    input_update_for,
    statistics_tensors,
)
from circuits.learn.flows import InputTables, circuit_flows, input_rows
from circuits.learn.normal_form import normalised_log_parameters
from circuits.learn.update import em_log_update
from circuits.parameterizations import Exp, Softmax

#: parameterisations whose raw value ``log p`` gives the probabilities ``p`` of a normalised row
_WRITABLE = (Softmax, Exp)


class EM(torch.optim.Optimizer):
    """Expectation-maximisation over a compiled circuit's own parameters (see the module docs).

    Args:
        model: a compiled circuit (:func:`circuits.compile`).
        step_size: in (0, 1]; 1 is classical EM (the estimate replaces the parameters).
        pseudocount: >= 0, added to every expected count on the parameters' support (Laplace
            smoothing): with a positive pseudocount every parameter stays strictly positive.
    """

    def __init__(self, model: CircuitCore, step_size: float = 0.1, pseudocount: float = 0.01) -> None:
        if not isinstance(model, CircuitCore):
            raise InvalidInputError(
                f"EM needs a compiled circuit (circuits.compile(...)), got {type(model).__name__}")
        _check_hyper(step_size, pseudocount)
        self.model = model
        self._sums: list[FoldedSum] = []
        self._inputs: list[tuple[FoldedInput, InputUpdate]] = []
        frozen: list[str] = []
        for plan, module in zip(model.plans, model.folds, strict=True):
            if isinstance(module, FoldedSum):
                _check_writable(plan.name, module.parameterization)
                self._sums.append(module)
            elif isinstance(module, FoldedInput):
                update = input_update_for(module)
                if update is None:
                    raise InvalidInputError(
                        f"EM cannot update input fold {plan.name!r} ({plan.layers[0].describe()}): "
                        "its distribution is not categorical and its module has no em_estimate")
                if not isinstance(update, FamilyEstimate):
                    _check_writable(plan.name, module.parameterization)
                self._inputs.append((module, update))
            else:
                continue
            if not module.raw.requires_grad:
                frozen.append(plan.name)
        if frozen and not model.normalized:
            raise InvalidInputError(
                f"folds {frozen} are frozen (requires_grad=False) in an unnormalised circuit; EM "
                "writes every fold in normal form, which would change the distribution there. "
                "Unfreeze them, or use Softmax parameterisations")
        params = [m.raw for m in self._sums] + [m.raw for m, _ in self._inputs]
        super().__init__(params, {"lr": step_size, "pseudocount": pseudocount})
        self._pending = 0  # rows accumulated since the last step (this process)
        #: the log-parameters of the last accumulate, and the raw tensors' versions they belong to
        self._prepared: tuple[LogParameters, tuple[tuple[int, int, torch.dtype], ...]] | None = None
        self._tables = InputTables()  # categorical inputs as (F * C, K) tables, per version

    # ------------------------------------------------------------------ statistics
    @property
    def step_size(self) -> float:
        return float(self.param_groups[0]["lr"])

    @property
    def pseudocount(self) -> float:
        return float(self.param_groups[0]["pseudocount"])

    def _ensure_state(self) -> None:
        for module in self._sums:
            state = self.state[module.raw]
            if "counts" not in state:
                state["counts"] = torch.zeros(module.raw.shape, dtype=torch.float64,
                                              device=module.raw.device)
        for module, update in self._inputs:
            state = self.state[module.raw]
            if not state:
                update.reset(state)

    def _reset(self) -> None:
        for module in self._sums:
            self.state[module.raw]["counts"].zero_()
        for module, update in self._inputs:
            state = self.state[module.raw]
            if "counts" in state:
                state["counts"].zero_()
            else:
                update.reset(state)
        self._pending = 0

    def accumulate(self, x: Tensor, observed: Tensor | None = None) -> Tensor:
        """Add the expected counts of rows ``x`` (B, V) to the statistics of the next step.

        Args:
            x: data as the model reads it (categories as integers).
            observed: optional (B, V) or (V,) bool mask; unobserved entries are summed out, so
                EM maximises the exact marginal likelihood of the observed ones.

        Returns:
            (B,) the rows' normalised log-likelihoods (log-marginals) under the parameters the
            statistics were computed with (before the step).

        Raises:
            InvalidInputError: bad data (nothing is accumulated).
        """
        x, observed = self.model.validate_data(x, observed)
        return self.accumulate_checked(x, observed)

    @torch.no_grad()
    def accumulate_checked(self, x: Tensor, observed: Tensor) -> Tensor:
        """:meth:`accumulate` on data that ``model.validate_data`` returned (no check again)."""
        model = self.model
        prepared = self._current()
        self._ensure_state()
        batch = x.shape[0]
        if batch == 0:
            return torch.zeros(0, dtype=model.dtype, device=model.device)
        weights = None
        if not model.normalized:  # one extra row, everything summed out: log Z in the same pass
            x = torch.cat([x, x.new_zeros((1, x.shape[1]))])
            observed = torch.cat([observed, observed.new_zeros((1, observed.shape[1]))])
            weights = torch.ones(batch + 1, dtype=model.dtype, device=model.device)
            weights[-1] = 0.0
        flows = circuit_flows(model, prepared, x, observed, weights, self._tables)
        log_likelihood = flows.log_values[:batch]
        if weights is not None:
            log_likelihood = log_likelihood - flows.log_values[batch]
            x, observed = x[:batch], observed[:batch]
        for module in self._sums:
            if module.raw.requires_grad:
                self.state[module.raw]["counts"] += flows.sum_counts[module.plan.fold_id]
        for module, update in self._inputs:
            if not module.raw.requires_grad:
                continue
            fold_id = module.plan.fold_id
            fold_flows, rows = flows.input_flows[fold_id], flows.inputs[fold_id]
            if weights is not None:  # drop the extra row
                fold_flows = fold_flows[:, :batch]
                rows = input_rows(module, x, observed)
            log_probs = prepared.values[fold_id]
            assert isinstance(log_probs, Tensor)
            update.accumulate(self.state[module.raw], rows, fold_flows, log_probs)
        self._pending += batch
        return log_likelihood

    def expected_counts(self) -> dict[str, Tensor]:
        """``{fold name: (F, K, D) float64}``: the expected counts accumulated since the last step,
        in the layout of the fold's raw parameters (sum folds: edge flows; categorical input
        folds: category counts). Row-kept families (``em_estimate``) are absent."""
        self._ensure_state()
        out = {m.plan.name: self.state[m.raw]["counts"].clone() for m in self._sums}
        for module, update in self._inputs:
            if isinstance(update, CategoricalCounts):
                out[module.plan.name] = self.state[module.raw]["counts"].transpose(1, 2).clone()
        return out

    def all_reduce(self, context: LearningContext) -> None:
        """Sum the statistics over the processes of ``context`` (every rank must call it)."""
        self._ensure_state()
        counts = [self.state[m.raw]["counts"] for m in self._sums]
        for module, update in self._inputs:
            state = self.state[module.raw]
            counts.extend(statistics_tensors(update, state))
            if isinstance(update, FamilyEstimate):
                for key in ("values", "observed", "flows"):
                    rows = torch.cat(state[key]) if state[key] else None
                    state[key] = [] if rows is None else [context.gather_rows(rows)]
        context.all_sum_(counts)
        pending = torch.tensor([float(self._pending)], dtype=torch.float64, device=self.model.device)
        context.all_sum_([pending])
        self._pending = int(pending.item())

    def _current(self) -> LogParameters:
        """The model's own log-parameters: those of the last step or accumulate while no raw
        tensor changed in place since, else the model's checked, cached normalisation."""
        versions = self._versions()
        if self._prepared is not None and self._prepared[1] == versions:
            return self._prepared[0]
        prepared = self.model.resolve_params(None, None)
        self._prepared = (prepared, versions)
        return prepared

    def _normalise_written(self) -> tuple[LogParameters, tuple[tuple[int, int, torch.dtype], ...]]:
        """The log-parameters of what :meth:`step` just wrote (valid by construction: finite or
        exact zeros, rows with mass), so the next pass skips the model's check of them."""
        values: dict[int, Tensor | SoftmaxParts] = {}
        for plan, module in zip(self.model.plans, self.model.folds, strict=True):
            if isinstance(module, FoldedSum):
                values[plan.fold_id] = module.log_weights(None).detach()
            elif isinstance(module, FoldedInput):
                values[plan.fold_id] = module.log_probs(None).detach()
        return LogParameters(values, None), self._versions()

    def _versions(self) -> tuple[tuple[int, int, torch.dtype], ...]:
        """Per raw parameter: its in-place modification counter (an optimiser step, copy_,
        load_state_dict...), storage and dtype (``.to()``)."""
        return tuple((p._version, p.data_ptr(), p.dtype)
                     for group in self.param_groups for p in group["params"])

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, object]:  # type: ignore[override]
        """torch's optimiser state plus the number of rows accumulated since the last step."""
        state = super().state_dict()
        state["em_pending_rows"] = self._pending
        return state

    def load_state_dict(self, state_dict: dict[str, object]) -> None:  # type: ignore[override]
        """Restore :meth:`state_dict`; statistics keep their dtypes (float64 counts, bool masks)."""
        state_dict = dict(state_dict)
        pending = int(state_dict.pop("em_pending_rows", 0))  # type: ignore[call-overload]
        saved = state_dict.get("state", {})
        assert isinstance(saved, dict)
        super().load_state_dict({**state_dict, "state": {}})  # torch would cast every tensor
        params = [p for group in self.param_groups for p in group["params"]]
        for index, entry in saved.items():
            param = params[int(index)]
            self.state[param] = {key: _to_device(value, param.device) for key, value in entry.items()}
        self._pending = pending

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Move every parameter toward its EM estimate from the accumulated statistics.

        ``closure`` (torch's optimiser protocol) is called, with gradients enabled, and its value
        returned; EM itself does not use it.

        Raises:
            InvalidInputError: nothing was accumulated since the last step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._pending == 0:
            raise InvalidInputError(
                "EM.step() has no statistics: call optimizer.accumulate(x) (or "
                "accumulate(x, observed)) on the batch first; EM reads expected counts, not "
                "gradients (circuits.learn.fit does this for you)")
        step_size, pseudocount = self.step_size, self.pseudocount
        _check_hyper(step_size, pseudocount)
        model = self.model
        normal = normalised_log_parameters(model, self._current())
        new: list[tuple[Tensor, Tensor]] = []
        for module in self._sums:
            if module.raw.requires_grad:
                counts = self.state[module.raw]["counts"]
                value = em_log_update(normal[module.plan.fold_id], counts, step_size, pseudocount)
                new.append((module.raw, value))
        for module, update in self._inputs:
            if module.raw.requires_grad:
                value = update.new_raw(self.state[module.raw], normal[module.plan.fold_id],
                                       step_size, pseudocount)
                new.append((module.raw, value))
        for raw, value in new:  # written only once every estimate is computed
            raw.copy_(value.to(raw.dtype))
        self._prepared = self._normalise_written()
        self._reset()
        return loss


def _to_device(value: object, device: torch.device) -> object:
    if isinstance(value, Tensor):
        return value.detach().to(device).clone()
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    return value


def _check_hyper(step_size: float, pseudocount: float) -> None:
    if not isinstance(step_size, (int, float)) or not 0.0 < float(step_size) <= 1.0:
        raise InvalidInputError(f"step_size must be in (0, 1], got {step_size!r}")
    if not isinstance(pseudocount, (int, float)) or not 0.0 <= float(pseudocount) < float("inf"):
        raise InvalidInputError(f"pseudocount must be a finite number >= 0, got {pseudocount!r}")


def _check_writable(name: str, parameterization: object) -> None:
    if not isinstance(parameterization, _WRITABLE):
        raise InvalidInputError(
            f"EM writes probabilities p back as raw parameters log p, which "
            f"{type(parameterization).__name__} (fold {name!r}) does not map onto p; use Softmax "
            "or Exp for the folds EM learns")


__all__ = ["EM"]
