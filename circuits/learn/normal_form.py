"""The normalised equivalent of a circuit's parameters: the probabilities that EM moves.

A smooth, decomposable circuit with unnormalised parameters (the :class:`~circuits.Exp`
parameterisation, or input units whose mass is not 1) defines the distribution
``p(x) = c(x) / Z``. The same distribution has a *normalised* form in which every sum unit's
weights and every input unit's distribution sum to one: with ``Z_u`` the partition function of
unit ``u`` (its value with every variable summed out),

    w'_kd = w_kd Z_d / Z_k        (sum unit k, input unit d)
    phi'_u(c) = phi_u(c) / Z_u    (input unit u)

gives ``c'(x) = c(x) / Z_root`` unit by unit. EM updates these probabilities and writes them back
as raw parameters that the layers' parameterisations map onto them exactly, so after a step
every unit of the circuit has mass 1. For circuits whose layers are all normalised (the default
:class:`~circuits.Softmax`), ``Z_u = 1`` and the normal form is the log-weights as they are.

One gradient-free bottom-up pass with every variable unobserved and a batch of one row gives
every unit's ``log Z_u`` at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits.compiled import CircuitCore, LogParameters, Trace
from circuits.compiled.layers import FoldedInput, FoldedSum


@torch.no_grad()
def unit_log_partitions(circuit: CircuitCore, prepared: LogParameters) -> Trace:
    """The trace of a one-row pass with every variable summed out: ``outputs[i][:, 0]`` is the
    ``(F, K)`` ``log Z`` of fold ``i``'s units and ``sum_inputs[i][:, 0]`` that of its inputs."""
    x = torch.zeros(1, circuit.num_variables, dtype=torch.long, device=circuit.device)
    trace = Trace()
    circuit.evaluate(x, torch.zeros_like(x, dtype=torch.bool), prepared, trace=trace)
    return trace


@torch.no_grad()
def normalised_log_parameters(circuit: CircuitCore, prepared: LogParameters) -> dict[int, Tensor]:
    """``{fold id: (F, K, D)}`` normalised log-parameters of every sum and categorical input fold
    (rows ``logsumexp`` to 0 up to rounding; exact zeros stay exact zeros), and the raw parameters
    of the other input families (Bernoulli, Binomial, Gaussian: normalised densities).

    Args:
        circuit: the compiled circuit.
        prepared: its own log-parameters (``circuit.resolve_params(None, None)``).
    """
    folds = [(plan.fold_id, module) for plan, module in zip(circuit.plans, circuit.folds, strict=True)
             if isinstance(module, (FoldedInput, FoldedSum))]
    result: dict[int, Tensor] = {}
    if circuit.normalized:
        for fold_id, _ in folds:
            value = prepared.values[fold_id]
            assert isinstance(value, Tensor) and value.dim() == 3, "own parameters are (F, K, D)"
            result[fold_id] = value
        return result
    trace = unit_log_partitions(circuit, prepared)
    for fold_id, module in folds:
        value = prepared.values[fold_id]
        assert isinstance(value, Tensor) and value.dim() == 3, "own parameters are (F, K, D)"
        if isinstance(module, FoldedInput):  # other families are normalised densities already
            result[fold_id] = value - torch.logsumexp(value, -1, keepdim=True) \
                if module.categorical else value
        else:
            inputs = trace.sum_inputs[fold_id][:, 0, None, :]  # (F, 1, D) log Z_d
            units = trace.outputs[fold_id][:, 0, :, None]  # (F, K, 1) log Z_k
            result[fold_id] = value + inputs - units
    return result


__all__ = ["normalised_log_parameters", "unit_log_partitions"]
