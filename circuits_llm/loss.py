"""The MTP training loss of the MTPC paper (Section 4.1, Eq. 4) for circuit draft heads.

For a batch of sequences with draft hidden states ``e_t`` (B, T, d) and tokens ``x`` (B, T), the
head applied to ``e_t`` is a circuit ``q_t`` over the window ``(x_{t+1}, .., x_{t+n})`` (variable
``j-1`` is ``x_{t+j}``, the alignment of :mod:`circuits_llm.protocols`). Every position ``t``
starts a window (overlapping windows: a composite log-likelihood). The loss of window slot ``j``
is the exact conditional NLL

    -log q_t(x_{t+j} | x_{t+1}, .., x_{t+j-1})
        = -(log q_t(x_{t+1..t+j}) - log q_t(x_{t+1..t+j-1})),

a difference of prefix marginals. A target ``(t, j)`` is *valid* when ``x_t .. x_{t+j}`` are all
real tokens: inside the sequence and not padding. Eq. 4 normalises per sequence ``i`` and slot
``j`` by the number of valid targets ``V_{i,j}``:

    L_j = (1 / N_j) sum_i (1 / V_{i,j}) sum_t -log q_t(x_{t+j} | x_{t+1..t+j-1}),

where ``N_j`` counts the sequences with ``V_{i,j} > 0`` (the paper's ``N`` whenever every
sequence has more than ``j`` tokens), and the loss is ``L = sum_j gamma^(j-1) L_j`` with
``gamma = 0.8`` for ``n <= 8`` and ``0.9`` above.

Efficiency: all prefix marginals of all windows come from ONE bottom-up pass over the head's
compiled circuit in which the ``n`` prefixes of a window share that window's parameters: input
folds are normalised and read once per window (then masked per prefix), and every sum fold is one
batched matmul of ``(n, D)`` prefix values against the window's ``(D, K)`` weights. Nothing of
size ``V`` (vocabulary) is copied ``n`` times, unlike ``CompiledCircuit.log_prefix_marginals``,
which replicates every parameter tensor once per prefix (identical values; the tests compare).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits.compiled import CompiledCircuit
from circuits.compiled.folding import FoldKind, FoldPlan
from circuits.errors import InvalidInputError
from circuits.symbolic import ProductKind
from circuits_llm.protocols import DraftHead

__all__ = [
    "MTPLossOutput", "default_gamma", "evaluate_shared", "mtp_loss", "shared_prefix_log_marginals",
    "window_log_conditionals", "window_targets",
]

LN2 = math.log(2.0)


def default_gamma(window: int) -> float:
    """The paper's discount: 0.8 for windows ``n <= 8``, 0.9 for longer ones (footnote 8)."""
    return 0.8 if window <= 8 else 0.9


@dataclass(frozen=True)
class MTPLossOutput:
    """What :func:`mtp_loss` returns.

    Attributes:
        loss: scalar, ``sum_j gamma^(j-1) L_j`` (differentiable; minimise it).
        nll: (n,) detached, ``L_j`` of Eq. 4 in nats (0 where no sequence has a valid target).
        nll_sum: (n,) detached, the summed NLL of all valid targets of slot ``j`` (nats).
        count: (n,) long, the number of valid targets of slot ``j``. ``nll_sum / count`` pooled
            over validation batches is the token-weighted NLL per slot.
        weights: (n,) the discounts ``gamma^(j-1)`` used.
    """

    loss: Tensor
    nll: Tensor
    nll_sum: Tensor
    count: Tensor
    weights: Tensor

    @property
    def bits_per_token(self) -> Tensor:
        """(n,) ``L_j`` in bits per token (``nll / ln 2``)."""
        return self.nll / LN2


# --------------------------------------------------------------------------- inputs
def _check_inputs(head: DraftHead, hidden: Tensor, tokens: Tensor,
                  mask: Tensor | None) -> Tensor:
    """Validate the loss inputs; returns the (B, T) bool mask of real tokens."""
    if not isinstance(hidden, Tensor) or not hidden.is_floating_point() or hidden.dim() != 3:
        got = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
        raise InvalidInputError(f"hidden must be a float tensor of shape (B, T, d), got {got}")
    if hidden.shape[2] != head.hidden_size:
        raise InvalidInputError(f"hidden has size {hidden.shape[2]} in its last dimension but the "
                                f"head reads hidden states of size {head.hidden_size}")
    if not isinstance(tokens, Tensor) or tokens.is_floating_point() or tokens.is_complex() \
            or tokens.dtype == torch.bool:
        raise InvalidInputError("tokens must be an integer tensor of shape (B, T)")
    if tuple(tokens.shape) != tuple(hidden.shape[:2]):
        raise InvalidInputError(f"tokens must have shape (B, T) = {tuple(hidden.shape[:2])} like "
                                f"hidden's first two dimensions, got {tuple(tokens.shape)}")
    if mask is None:
        mask = torch.ones_like(tokens, dtype=torch.bool)
    else:
        if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(tokens.shape):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise InvalidInputError(f"mask must be a (B, T) = {tuple(tokens.shape)} tensor of "
                                    f"0/1 (1 = real token), got {got}")
        if mask.is_floating_point() or bool(((mask != 0) & (mask != 1)).any()):
            raise InvalidInputError("mask must hold only 0 and 1 (bool or integer dtype)")
        mask = mask.to(device=tokens.device, dtype=torch.bool)
    bad = mask & ((tokens < 0) | (tokens >= head.vocab_size))
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise InvalidInputError(f"tokens[{b}, {t}] = {int(tokens[b, t])} is outside the "
                                f"vocabulary [0, {head.vocab_size}) (mask it out if it is padding)")
    return mask


def window_targets(tokens: Tensor, window: int, mask: Tensor | None = None,
                   ) -> tuple[Tensor, Tensor]:
    """The window of every position and which of its slots are valid targets.

    Args:
        tokens: (B, T) token ids.
        window: ``n``.
        mask: (B, T) bool, True for real tokens (None: all real).

    Returns:
        ``(targets (B, T, n) long, valid (B, T, n) bool)``: ``targets[b, t, j-1] = x_{t+j}``
        (0 where it does not exist or is padding) and ``valid[b, t, j-1]`` is True when
        ``x_t, .., x_{t+j}`` are all real tokens.
    """
    batch, length = tokens.shape
    if mask is None:
        mask = torch.ones_like(tokens, dtype=torch.bool)
    pad = tokens.new_zeros(batch, window)
    padded = torch.cat([torch.where(mask, tokens, 0), pad], dim=1)  # (B, T + n)
    targets = padded.unfold(1, window, 1)[:, 1:length + 1]  # (B, T, n)
    real = torch.cat([mask, mask.new_zeros(batch, window)], dim=1).long()
    valid = real.unfold(1, window + 1, 1)[:, :length].cumprod(-1)[..., 1:].bool()
    return targets.contiguous(), valid


# --------------------------------------------------------------------------- circuit pass
def _gather(outputs: list[Tensor], plan: FoldPlan) -> list[Tensor]:
    """A fold's inputs, each ``(F, N, n, K_h)``, read from earlier folds' outputs."""
    gathered = []
    for address in plan.inputs:
        sources = [outputs[s] for s in address.sources]
        source = sources[0] if len(sources) == 1 else torch.cat(sources, dim=0)
        if address.index == tuple(range(source.shape[0])):
            gathered.append(source)
        else:
            index = torch.tensor(address.index, device=source.device)
            gathered.append(source.index_select(0, index))
    return gathered


def _log_matmul_shared(inputs: Tensor, log_weights: Tensor) -> Tensor:
    """``log(exp(inputs) @ exp(log_weights)^T)`` with weights shared by the ``n`` prefixes.

    Args:
        inputs: (F, N, n, D) log-values.
        log_weights: (N, F, K, D) one weight set per window.

    Returns:
        (F, N, n, K); stable (both operands shifted by their maxima), ``-inf`` for zero values.
    """
    weights = log_weights.transpose(0, 1)  # (F, N, K, D)
    in_max = inputs.detach().amax(-1, keepdim=True)
    in_max = torch.where(torch.isfinite(in_max), in_max, torch.zeros_like(in_max))
    w_max = weights.detach().amax(-1, keepdim=True)
    w_max = torch.where(torch.isfinite(w_max), w_max, torch.zeros_like(w_max))
    total = torch.matmul(torch.exp(inputs - in_max), torch.exp(weights - w_max).transpose(-1, -2))
    shift = in_max + w_max.transpose(-1, -2)  # (F, N, n, 1) + (F, N, 1, K)
    positive = total > 0
    safe = torch.where(positive, total, torch.ones_like(total))
    return torch.where(positive, torch.log(safe) + shift, torch.full_like(total, -torch.inf))


def evaluate_shared(circuit: CompiledCircuit, params: dict[str, Tensor], x: Tensor,
                    observed: Tensor, input_leaves: dict[int, Tensor] | None = None) -> Tensor:
    """Bottom-up pass where each row is evaluated under ``C`` evidence patterns at once.

    The ``C`` patterns of a row share that row's parameters: input folds are normalised and
    read once per row (then masked per pattern) and every sum fold is one batched matmul of
    ``(C, D)`` pattern values against the row's ``(D, K)`` weights. Requires a normalised
    circuit without integrated input layers (every head's circuit).

    Args:
        circuit: the compiled circuit (e.g. ``head.circuit``).
        params: external raw parameters for every fold, batch N (e.g. ``head(hidden)``).
        x: (N, V) long, the values of the variables (read where observed).
        observed: (C, V) bool, evidence pattern ``c`` observes the variables set in row ``c``.
        input_leaves: when given, every input fold's masked output ``(F, N, C, K)`` is made a
            leaf that requires grad and stored by fold id (for derivative-based conditionals).

    Returns:
        (N, C) log-marginals ``log q(x_{observed[c]})``. Differentiable in ``params``.
    """
    x, _ = circuit.validate_data(x)
    if not circuit.normalized:
        raise InvalidInputError("evaluate_shared needs a normalised circuit (Softmax parameters)")
    if not isinstance(observed, Tensor) or observed.dtype != torch.bool or observed.dim() != 2 \
            or observed.shape[1] != circuit.num_variables:
        raise InvalidInputError(f"observed must be a (C, {circuit.num_variables}) bool tensor")
    params = circuit.validate_params(params, x.shape[0])
    missing = sorted(set(circuit.parameter_shapes()) - set(params))
    if missing:
        raise InvalidInputError(f"params must give every fold's parameters; missing {missing}")
    observed = observed.to(x.device)
    outputs: list[Tensor] = []
    for plan, module in zip(circuit.plans, circuit.folds, strict=True):
        if plan.kind is FoldKind.INPUT:
            if bool(module.integrated.any()):
                raise InvalidInputError("evaluate_shared cannot evaluate integrated input layers")
            log_probs = module.log_probs(params[plan.name])  # (N, F, K, C)
            values = x[:, module.variables]  # (N, F)
            index = values[:, :, None, None].expand(-1, -1, log_probs.shape[2], 1)
            picked = log_probs.gather(3, index).squeeze(3).transpose(0, 1)  # (F, N, K)
            seen = observed[:, module.variables].T  # (F, C)
            out = torch.where(seen[:, None, :, None], picked[:, :, None, :],
                              picked.new_zeros(()))  # normalised: a free variable sums to 1
            if input_leaves is not None:
                out = out.detach().requires_grad_(True)
                input_leaves[plan.fold_id] = out
        elif plan.kind is FoldKind.SUM:
            inputs = _gather(outputs, plan)
            joined = inputs[0] if len(inputs) == 1 else torch.cat(inputs, dim=-1)
            out = _log_matmul_shared(joined, module.log_weights(params[plan.name]))
        else:
            inputs = _gather(outputs, plan)
            out = inputs[0]
            for other in inputs[1:]:
                if plan.product_kind is ProductKind.HADAMARD:
                    out = out + other
                else:
                    out = (out[..., :, None] + other[..., None, :]).flatten(-2)
        outputs.append(out)
    return outputs[-1][0, :, :, 0]


def shared_prefix_log_marginals(circuit: CompiledCircuit, params: dict[str, Tensor],
                                x: Tensor) -> Tensor:
    """``log q(x_0, .., x_i)`` for every prefix ``i = 0..n-1`` of every row, in one pass.

    :func:`evaluate_shared` with the ``n`` prefix patterns, for a circuit over variables
    ``0 .. n-1``: one circuit evaluation per row plus ``n``-wide sum products.

    Args:
        circuit: the compiled circuit (e.g. ``head.circuit``).
        params: external raw parameters, every fold, batch N (e.g. ``head(hidden)``).
        x: (N, n) long, complete windows.

    Returns:
        (N, n): column ``i`` marginalises variables ``i+1 .. n-1``. Differentiable in ``params``.
    """
    if tuple(circuit.scope) != tuple(range(circuit.num_variables)):
        raise InvalidInputError(f"shared_prefix_log_marginals needs a circuit over variables "
                                f"0..n-1, got scope {list(circuit.scope)}")
    steps = torch.arange(circuit.num_variables, device=circuit.device)
    return evaluate_shared(circuit, params, x, steps[None, :] <= steps[:, None])


# --------------------------------------------------------------------------- loss
def window_log_conditionals(head: DraftHead, hidden: Tensor, tokens: Tensor,
                            mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Exact ``log q_t(x_{t+j} | x_{t+1..t+j-1})`` for every position and slot.

    Args:
        head: the draft head (its circuit is evaluated with ``head(e_t)``).
        hidden: (B, T, d) hidden states ``e_t``.
        tokens: (B, T) token ids.
        mask: (B, T) 0/1, 1 for real tokens (None: no padding).

    Returns:
        ``(log_cond (B, T, n), valid (B, T, n) bool)``; invalid entries of ``log_cond`` are 0.
        Only positions with at least one valid target run through the head.
    """
    mask = _check_inputs(head, hidden, tokens, mask)
    targets, valid = window_targets(tokens, head.window, mask)
    batch, length, window = targets.shape
    starts = valid[..., 0].reshape(-1).nonzero().squeeze(1)  # windows with a valid first slot
    flat_hidden = hidden.reshape(batch * length, -1).index_select(0, starts.to(hidden.device))
    params = head(flat_hidden)
    device = head.circuit.device
    x = targets.reshape(-1, window).index_select(0, starts).to(device)
    marginals = shared_prefix_log_marginals(head.circuit, params, x)  # (N, n)
    cond = torch.cat([marginals[:, :1], marginals[:, 1:] - marginals[:, :-1]], dim=1)
    keep = valid.reshape(-1, window).index_select(0, starts).to(device)
    cond = torch.where(keep, cond, cond.new_zeros(()))
    full = cond.new_zeros(batch * length, window).index_copy(0, starts.to(device), cond)
    return full.view(batch, length, window), valid.to(device)


def mtp_loss(head: DraftHead, hidden: Tensor, tokens: Tensor, mask: Tensor | None = None,
             gamma: float | None = None) -> MTPLossOutput:
    """The discounted MTP loss of Eq. 4 and the per-slot NLLs (see the module docstring).

    Args:
        head: the draft head.
        hidden: (B, T, d) draft hidden states (``HFBackbone.hidden_states(tokens)[1]``).
        tokens: (B, T) the same sequences' token ids.
        mask: (B, T) 0/1 attention mask, 1 for real tokens (right or any padding).
        gamma: discount in ``(0, 1]`` (None: :func:`default_gamma` of the head's window).

    Returns:
        :class:`MTPLossOutput`.

    Raises:
        InvalidInputError: mismatched shapes, bad dtypes, ids outside the vocabulary where the
            mask is 1, a bad ``gamma``, or a batch without any valid target.
    """
    if gamma is None:
        gamma = default_gamma(head.window)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
        raise InvalidInputError(f"gamma must be a number in (0, 1], got {gamma!r}")
    log_cond, valid = window_log_conditionals(head, hidden, tokens, mask)
    if not bool(valid.any()):
        raise InvalidInputError("no valid target in the batch: every sequence needs at least two "
                                "real tokens")
    nll = -log_cond.sum(1)  # (B, n), summed over positions
    per_seq = valid.sum(1)  # (B, n): V_{i,j}
    has = per_seq > 0
    mean = torch.where(has, nll / per_seq.clamp_min(1), nll.new_zeros(()))
    slot = mean.sum(0) / has.sum(0).clamp_min(1)  # (n,): L_j
    weights = gamma ** torch.arange(head.window, dtype=slot.dtype, device=slot.device)
    return MTPLossOutput(loss=(weights * slot).sum(), nll=slot.detach(),
                         nll_sum=nll.sum(0).detach(), count=per_seq.sum(0), weights=weights)
