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
``gamma = 0.8`` for ``n <= 8`` and ``0.9`` above. A head that reads the verified token
(``reads_token``: ``x_{t+1}`` is its input) gets weight 0 on slot 1, which it would learn by
copying; its ``L_1`` is still reported.

Efficiency: all prefix marginals of all windows come from ONE differentiable bottom-up pass,
:meth:`circuits.compiled.CompiledCircuit.log_prefix_marginals`, in which the ``n`` prefixes of a
window share that window's parameters: every sum fold is one batched matmul of ``(n, D)`` prefix
values against the window's ``(D, K)`` weights. The pass reads each input unit only at its
variable's target, so a head that offers ``observed_log_parameters`` (:class:`MTPHead`) gives
just those log-probabilities, computed in tiles of ``chunk_rows`` (position, unit) pairs: memory
``O(chunk_rows x V)`` for the logits, never ``O(positions x units x V)``, with exact gradients
(:mod:`circuits_llm.heads.chunked`). ``materialise=True`` (and any other head) takes the
reference path: the head's full ``(N, F, K, V)`` input logits, normalised by the circuit.

Compressed draft vocabularies (a head with ``draft_tokens``, K model ids): the circuit's
categories are draft-vocabulary indices, so targets are mapped through them, and a target
``(t, j)`` is valid only when ``x_{t+1} .. x_{t+j}`` all lie inside the draft vocabulary (the
head can neither score nor condition on other ids). The head thus learns the LM's law
conditioned on the draft vocabulary, the best a draft restricted to it can propose; the decoder
gives ``q = 0`` to the other ids and the verifier's residual covers them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits.errors import InvalidInputError
from circuits_llm.heads.vocab import draft_positions
from circuits_llm.protocols import DraftHead, draft_parameters

__all__ = [
    "MTPLossOutput", "default_gamma", "mtp_loss", "window_log_conditionals", "window_targets",
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
        count: (n,) long, the number of valid targets of slot ``j`` (inside the draft vocabulary
            of a compressed head). ``nll_sum / count`` pooled over validation batches is the
            token-weighted NLL per slot.
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


# --------------------------------------------------------------------------- loss
def _log_conditionals(head: DraftHead, hidden: Tensor, tokens: Tensor, mask: Tensor | None,
                      chunk_rows: int | None, materialise: bool) -> tuple[Tensor, Tensor, bool]:
    """:func:`window_log_conditionals` and whether any target was valid before the draft
    vocabulary's restriction (a batch of real tokens whose targets all fall outside it is not an
    input error: its loss is 0)."""
    mask = _check_inputs(head, hidden, tokens, mask)
    targets, valid = window_targets(tokens, head.window, mask)
    batch, length, window = targets.shape
    starts = valid[..., 0].reshape(-1).nonzero().squeeze(1)  # windows with a valid first slot
    any_real = starts.numel() > 0
    draft = getattr(head, "draft_tokens", None)
    if draft is not None:  # model ids -> draft indices; a prefix outside the draft vocabulary ends
        index = draft_positions(draft.to(targets.device), head.vocab_size)[targets]
        valid = valid & (index >= 0).cumprod(-1).bool()
        targets = index.clamp_min(0)
    flat_hidden = hidden.reshape(batch * length, -1).index_select(0, starts.to(hidden.device))
    device = head.circuit.device
    x = targets.reshape(-1, window).index_select(0, starts).to(device)
    observed = getattr(head, "observed_log_parameters", None)
    if observed is not None and not materialise:
        prepared = observed(flat_hidden, x, chunk_rows)  # each input unit at its target only
        marginals = head.circuit.log_prefix_marginals(torch.zeros_like(x), params=prepared)
    else:
        params = draft_parameters(head, flat_hidden, x[:, 0])
        marginals = head.circuit.log_prefix_marginals(x, params=params)  # (N, n), prefixes share
    cond = torch.cat([marginals[:, :1], marginals[:, 1:] - marginals[:, :-1]], dim=1)
    keep = valid.reshape(-1, window).index_select(0, starts).to(device)
    cond = torch.where(keep, cond, cond.new_zeros(()))
    full = cond.new_zeros(batch * length, window).index_copy(0, starts.to(device), cond)
    return full.view(batch, length, window), valid.to(device), any_real


def window_log_conditionals(head: DraftHead, hidden: Tensor, tokens: Tensor,
                            mask: Tensor | None = None, *, chunk_rows: int | None = None,
                            materialise: bool = False) -> tuple[Tensor, Tensor]:
    """Exact ``log q_t(x_{t+j} | x_{t+1..t+j-1})`` for every position and slot.

    Args:
        head: the draft head (its circuit is evaluated with ``head(e_t)``, or with
            ``head.observed_log_parameters`` when it has that method).
        hidden: (B, T, d) hidden states ``e_t``.
        tokens: (B, T) token ids (model ids, also for a compressed head).
        mask: (B, T) 0/1, 1 for real tokens (None: no padding).
        chunk_rows: (position, input unit) pairs whose logits are held at once (None: about
            16M logits; see :mod:`circuits_llm.heads.chunked`).
        materialise: take the reference path through ``head(e_t)`` (full input logits).

    Returns:
        ``(log_cond (B, T, n), valid (B, T, n) bool)``; invalid entries of ``log_cond`` are 0.
        Only positions with at least one valid target (ignoring the draft vocabulary) run
        through the head.
    """
    full, valid, _ = _log_conditionals(head, hidden, tokens, mask, chunk_rows, materialise)
    return full, valid


def mtp_loss(head: DraftHead, hidden: Tensor, tokens: Tensor, mask: Tensor | None = None,
             gamma: float | None = None, *, chunk_rows: int | None = None,
             materialise: bool = False) -> MTPLossOutput:
    """The discounted MTP loss of Eq. 4 and the per-slot NLLs (see the module docstring).

    Args:
        head: the draft head.
        hidden: (B, T, d) draft hidden states (``HFBackbone.hidden_states(tokens)[1]``).
        tokens: (B, T) the same sequences' token ids.
        mask: (B, T) 0/1 attention mask, 1 for real tokens (right or any padding).
        gamma: discount in ``(0, 1]`` (None: :func:`default_gamma` of the head's window).
        chunk_rows, materialise: see :func:`window_log_conditionals`.

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
    log_cond, valid, any_real = _log_conditionals(head, hidden, tokens, mask, chunk_rows,
                                                  materialise)
    if not any_real:
        raise InvalidInputError("no valid target in the batch: every sequence needs at least two "
                                "real tokens")
    nll = -log_cond.sum(1)  # (B, n), summed over positions
    per_seq = valid.sum(1)  # (B, n): V_{i,j}
    has = per_seq > 0
    mean = torch.where(has, nll / per_seq.clamp_min(1), nll.new_zeros(()))
    slot = mean.sum(0) / has.sum(0).clamp_min(1)  # (n,): L_j
    weights = gamma ** torch.arange(head.window, dtype=slot.dtype, device=slot.device)
    if getattr(head, "reads_token", False):  # X_0 is the head's own input: nothing to learn
        weights[0] = 0.0
    return MTPLossOutput(loss=(weights * slot).sum(), nll=slot.detach(),
                         nll_sum=nll.sum(0).detach(), count=per_seq.sum(0), weights=weights)
