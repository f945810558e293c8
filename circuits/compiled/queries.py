"""The probability queries on a compiled circuit: marginals, the partition function, conditionals.

Each query is a function over a :class:`~circuits.compiled.core.CircuitCore` and the parameters
it was given, which it turns into one :class:`~circuits.compiled.prepared.LogParameters` on entry
(validated once, normalised once); :class:`~circuits.compiled.circuit.CompiledCircuit` exposes
them as methods.

Conditionals use the derivative identity of smooth, decomposable circuits: the circuit is linear
in the outputs of the input units of any one variable ``X_i``, so with ``X_i`` summed out,

    p(X_i = c | e) = sum_u  g_u * phi_u(c) / l_u,     g_u = d log c(e) / d log l_u,

where ``l_u`` is input unit ``u``'s output (its total mass, 1 when normalised) and ``phi_u`` its
distribution. One bottom-up and one derivative pass (:mod:`circuits.compiled.derivatives`) give
these conditionals for *every* unobserved variable at once, whatever the number of categories: a
constant number of passes.

Prefix queries evaluate ``n`` masked copies of each row in one batched pass; the copies share
their row's parameter set (no parameter tensor is replicated), see :meth:`CompiledCircuit.evaluate`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from circuits.compiled.core import CircuitCore
from circuits.compiled.derivatives import input_gradients
from circuits.compiled.input_families import BinomialFamily
from circuits.compiled.layers import FoldedInput, SoftmaxParts
from circuits.compiled.prepared import LogParameters, ParamsLike, Trace
from circuits.errors import InvalidInputError
from circuits.kernels import rows_per_set
from circuits.kernels.softmax import softmax_mixture


def _uniform_categories(circuit: CircuitCore, variables: Sequence[int]) -> int:
    real = [v for v in variables if v in circuit.continuous_variables]
    if real:
        raise InvalidInputError(
            f"variables {real} are Gaussian (real-valued): conditional queries return probability "
            "vectors over categories and apply to discrete variables only; for a conditional "
            "density use log_marginal with the variable observed minus log_marginal without it, "
            "and conditional_sample to draw from it")
    sizes = {circuit.category_sizes[v] for v in variables}
    if len(sizes) != 1:
        raise InvalidInputError(
            f"conditional queries return one vector per variable and need the queried variables "
            f"to share a number of categories; got sizes {sorted(sizes)}")
    return sizes.pop()


def _check_order(circuit: CircuitCore, order: Sequence[int] | None) -> list[int]:
    if order is None:
        return list(circuit.scope)
    order = [int(v) for v in order]
    if sorted(order) != sorted(set(order)) or not set(order) <= set(circuit.scope):
        raise InvalidInputError(
            f"order must list distinct variables of the circuit's scope {list(circuit.scope)}, "
            f"got {order}")
    return order


def log_marginal(circuit: CircuitCore, x: Tensor, observed: Tensor | None = None,
                 params: ParamsLike | None = None) -> Tensor:
    """``log sum_{unobserved} c(x)`` per row, ``(B,)``: the log-likelihood when ``observed`` is
    None (everything observed)."""
    x, observed = circuit.validate_data(x, observed)
    return circuit.evaluate(x, observed, circuit.resolve_params(params, x.shape[0]))


def log_partition(circuit: CircuitCore, params: ParamsLike | None = None) -> Tensor:
    """``log Z``: a scalar, or ``(B,)`` when external parameters with batch B are given."""
    prepared = circuit.resolve_params(params, None)
    sets = prepared.batch
    batch = 1 if sets is None else sets  # 0 parameter sets: 0 values, not 1
    x = circuit.blank_data(batch)
    observed = torch.zeros_like(x, dtype=torch.bool)
    value = circuit.evaluate(x, observed, prepared)
    return value if sets is not None else value[0]


def _input_table(module: FoldedInput, prepared: LogParameters, fold_id: int) -> Tensor | SoftmaxParts:
    """Fold ``fold_id``'s category probabilities: ``(F, K, C)``, or ``(S, F, K, C)`` with one
    parameter set per group of rows; or its ``SoftmaxParts`` on the triton path."""
    table = prepared.values[fold_id]
    if isinstance(table, SoftmaxParts):  # triton: no softmax table is ever written
        return table
    if isinstance(module.family, BinomialFamily):  # Bernoulli, Binomial: from logits
        return module.family.log_table(table).exp()
    return prepared.probs(fold_id)


def _conditional_folds(circuit: CircuitCore, x: Tensor, observed: Tensor, prepared: LogParameters,
                       num_categories: int
                       ) -> tuple[Tensor, list[tuple[FoldedInput, Tensor, Tensor | SoftmaxParts]]]:
    """One bottom-up and one derivative pass: the root's values (B,) and, per discrete input
    fold with ``num_categories`` categories, ``(module, weight (F, B, K), table)`` with
    ``weight = g_u / l_u`` (0 where ``g_u = 0``) and ``table`` from :func:`_input_table`."""
    trace = Trace()
    root = circuit.evaluate(x, observed, prepared, trace=trace)
    grads = input_gradients(circuit, trace, prepared)
    out = []
    for fold_id, grad in grads.items():
        module = circuit.folds[fold_id]
        assert isinstance(module, FoldedInput)
        if module.num_categories != num_categories or not module.family.discrete:
            continue
        leaf = trace.outputs[fold_id]  # (F, B, K) log-values l_u
        weight = torch.where(grad > 0, grad * torch.exp(-leaf), 0.0)
        out.append((module, weight, _input_table(module, prepared, fold_id)))
    return root, out


def _mixture(weight: Tensor, table: Tensor | SoftmaxParts) -> Tensor:
    """``(F, B, K)`` unit weights x a fold's table -> ``(F, B, C)`` mixtures."""
    if isinstance(table, SoftmaxParts):
        return softmax_mixture(weight, table.logits, table.lse)
    if table.dim() == 3:
        return torch.bmm(weight, table)  # (F, B, C)
    # one parameter set per group of batch // sets rows: (F S) batched matmuls
    sets, fold, units, size = table.shape
    batch = weight.shape[1]
    per_set = table.transpose(0, 1).reshape(fold * sets, units, size)
    grouped = weight.reshape(fold * sets, rows_per_set(batch, sets), units)
    return torch.bmm(grouped, per_set).view(fold, batch, size)


def all_conditionals(circuit: CircuitCore, x: Tensor, observed: Tensor,
                     prepared: LogParameters, num_categories: int) -> Tensor:
    """``(B, V, C)`` probabilities ``p(X_v = c | evidence)`` on validated inputs.

    Rows of variables that are observed (or outside the scope, or real-valued, or with another
    number of categories) hold meaningless values; the callers select the unobserved variables
    they were asked about. Not differentiable. One
    bottom-up pass and one derivative pass (:func:`~circuits.compiled.derivatives.input_gradients`)
    on ``prepared`` (:meth:`~circuits.compiled.core.CircuitCore.resolve_params`): nothing is
    re-normalised and its cached ``exp`` serves repeated calls.
    """
    batch = x.shape[0]
    with torch.no_grad():
        root, folds = _conditional_folds(circuit, x, observed, prepared, num_categories)
        result = torch.zeros(batch, circuit.num_variables, num_categories, dtype=root.dtype,
                             device=x.device)
        for module, weight, table in folds:
            contribution = _mixture(weight, table)
            if module.any_integrated:
                variables, contribution = module.variables[module.live], contribution[module.live]
            else:
                variables = module.variables
            result.index_add_(1, variables, contribution.transpose(0, 1))
    return result


def row_conditionals(circuit: CircuitCore, x: Tensor, observed: Tensor, prepared: LogParameters,
                     num_categories: int, variables: Tensor) -> Tensor:
    """``(B, C)`` probabilities ``p(X_{variables[b]} = c | evidence of row b)``: one queried
    variable per row, on validated inputs (``variables`` (B,) long, each unobserved in its row).

    The same passes as :func:`all_conditionals`, but the last step mixes only the queried
    variable's units of each row (``B K C`` multiply-adds instead of ``F B K C``): what prefix
    conditionals need, where row ``i`` asks about the ``i``-th variable only. Fixed shapes and no
    host synchronisation (it runs inside compiled speculative rounds). Not differentiable.
    """
    batch = x.shape[0]
    rows = torch.arange(batch, device=x.device)
    with torch.no_grad():
        root, folds = _conditional_folds(circuit, x, observed, prepared, num_categories)
        result = torch.zeros(batch, num_categories, dtype=root.dtype, device=x.device)
        for module, weight, table in folds:
            live = module.live if module.any_integrated else \
                torch.ones_like(module.variables, dtype=torch.bool)
            match = (module.variables[:, None] == variables[None, :]) & live[:, None]  # (F, B)
            if isinstance(table, Tensor) and table.dim() == 4 and table.shape[0] == 1:
                table = table[0]  # one parameter set shared by every row
            if isinstance(table, SoftmaxParts) or table.dim() == 4 or module.repeats_variables:
                # per-set or triton tables, or a variable in several slots: mix every slot of the
                # fold, then keep the slots of the row's variable
                mixed = _mixture(weight, table)  # (F, B, C)
                mixed = torch.where(match[..., None], mixed, 0.0)
                result += mixed.sum(0)
            else:  # each variable has at most one slot here: gather it, mix B K C
                where = match.long().argmax(0)  # the slot of each row's variable (0: not here)
                unit_weight = weight[where, rows] * match.any(0)[:, None]  # (B, K)
                result += torch.bmm(unit_weight[:, None, :], table[where]).squeeze(1)
    return result


def log_conditional(circuit: CircuitCore, x: Tensor, observed: Tensor,
                    variables: Sequence[int] | None = None, params: ParamsLike | None = None) -> Tensor:
    """``log p(X_v | evidence)`` for each queried variable, as full vectors over categories.

    Args:
        x: (B, V) data; only observed entries are read.
        observed: (B, V) or (V,) bool evidence mask.
        variables: the variables to query (default: every variable of the scope that is
            unobserved in all rows). They must be unobserved and share a number of categories C.
        params: optional external parameters with batch B.

    Returns:
        (B, len(variables), C) log-probabilities; each vector sums to one. Rows whose evidence has
        probability zero give NaN.
    """
    x, observed = circuit.validate_data(x, observed)
    prepared = circuit.resolve_params(params, x.shape[0])
    if variables is None:
        variables = [v for v in circuit.scope if not bool(observed[:, v].any())]
    variables = [int(v) for v in variables]
    if not variables:
        raise InvalidInputError("no variable to query: every variable is observed")
    for v in variables:
        if v not in circuit.scope:
            raise InvalidInputError(f"variable {v} is not in the circuit's scope {list(circuit.scope)}")
        if bool(observed[:, v].any()):
            raise InvalidInputError(
                f"variable {v} is observed in some rows; a conditional query needs it unobserved")
    size = _uniform_categories(circuit, variables)
    probs = all_conditionals(circuit, x, observed, prepared, size)[:, variables]
    return torch.log(probs / probs.sum(-1, keepdim=True))


def log_prefix_marginals(circuit: CircuitCore, x: Tensor, order: Sequence[int] | None = None,
                         params: ParamsLike | None = None) -> Tensor:
    """``log q(x_{o_1}, ..., x_{o_i})`` for every prefix length ``i = 1..n`` in one pass.

    Args:
        x: (B, V) complete data on the variables of ``order``.
        order: the variable order (default: the scope in increasing order).

    Returns:
        (B, n); column ``i`` marginalises every variable after ``o_{i+1}``.
    """
    order = _check_order(circuit, order)
    x, _ = circuit.validate_data(x)
    batch, steps = x.shape[0], len(order)
    prepared = circuit.resolve_params(params, batch)
    position = torch.full((circuit.num_variables,), steps, dtype=torch.long, device=x.device)
    position[torch.tensor(order, device=x.device)] = torch.arange(steps, device=x.device)
    observed = position[None, :] <= torch.arange(steps, device=x.device)[:, None]  # (n, V)
    rows = x.repeat_interleave(steps, dim=0)
    mask = observed.repeat(batch, 1)
    return circuit.evaluate(rows, mask, prepared).view(batch, steps)  # sets shared by prefixes


def log_prefix_conditionals(circuit: CircuitCore, x: Tensor, order: Sequence[int] | None = None,
                            params: ParamsLike | None = None) -> Tensor:
    """``log q(X_{o_i} | x_{o_1}, ..., x_{o_{i-1}})`` as full vectors, for every ``i`` at once.

    This is what a speculative decoder needs: the draft's exact conditional at each window
    position given the drafted prefix (for acceptance ratios and residual distributions).

    Returns:
        (B, n, C) log-probabilities.
    """
    order = _check_order(circuit, order)
    x, _ = circuit.validate_data(x)
    batch, steps = x.shape[0], len(order)
    prepared = circuit.resolve_params(params, batch)
    size = _uniform_categories(circuit, order)
    order_t = torch.tensor(order, device=x.device)
    position = torch.full((circuit.num_variables,), steps, dtype=torch.long, device=x.device)
    position[order_t] = torch.arange(steps, device=x.device)
    observed = position[None, :] < torch.arange(steps, device=x.device)[:, None]  # (n, V)
    rows = x.repeat_interleave(steps, dim=0)
    picked = row_conditionals(circuit, rows, observed.repeat(batch, 1), prepared, size,
                              order_t.repeat(batch))
    return torch.log(picked / picked.sum(-1, keepdim=True)).view(batch, steps, size)


__all__ = ["all_conditionals", "log_conditional", "log_marginal", "log_partition",
           "log_prefix_conditionals", "log_prefix_marginals", "row_conditionals"]
