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

The LM's own law as the target (``teacher``, :mod:`circuits_llm.training.teacher`): slot ``j``
also gets the cross-entropy ``S_j = -sum_c p(c | x_{<=t+j-1}) log q_t(c | x_{t+1..t+j-1})`` over
the teacher's ``k`` most likely categories ``c``, and trains on ``(1 - w) L_j + w S_j``. The same
pass gives it: each window's parameter set also serves ``n k`` candidate rows (slot ``i`` read
at candidate ``c``, the prefix before it at the targets), and the tiled input pass reads each
unit at its target and its slot's ``k`` candidates from one computation of its logits.

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
from typing import Any

import torch
from torch import Tensor

from circuits.errors import InvalidInputError
from circuits_llm.heads.vocab import draft_positions
from circuits_llm.protocols import DraftHead, draft_parameters
from circuits_llm.training.teacher import TeacherLaw, teacher_candidates

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
        teacher_nll: (n,) detached, ``S_j``: the cross-entropy of slot ``j`` to the teacher's
            law (nats; None without a teacher).
    """

    loss: Tensor
    nll: Tensor
    nll_sum: Tensor
    count: Tensor
    weights: Tensor
    teacher_nll: Tensor | None = None

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
@dataclass(frozen=True)
class _WindowPass:
    """What one pass over a batch's windows gives (see :func:`_window_pass`)."""

    log_cond: Tensor  # (B, T, n) log q_t(x_{t+j} | x_{t+1..t+j-1}), 0 where invalid
    valid: Tensor  # (B, T, n) bool
    any_real: bool  # some window had a valid first slot before the draft vocabulary's restriction
    teacher_ce: Tensor | None  # (B, T, n) cross-entropy to the teacher's law, 0 where invalid
    teacher_valid: Tensor | None  # (B, T, n) bool


def _prefix_rows(window: int, count: int, device: torch.device) -> Tensor:
    """(count * window, n) bool: row ``i`` of each block observes variables ``0..i``."""
    steps = torch.arange(window, device=device)
    return (steps[None, :] <= steps[:, None]).repeat(count, 1)


def _evaluate_windows(head: DraftHead, prepared: Any, data: Tensor, candidates: Tensor | None,
                      ) -> tuple[Tensor, Tensor | None]:
    """Prefix marginals, and each candidate's joint with its slot's prefix, in one pass.

    ``data`` (N, n) the categories every row reads (``0`` with one-column tables), ``candidates``
    (N, n, k) the categories slot ``i`` is read at instead in the candidate rows. Rows of window
    ``s`` share its parameter set: ``n`` prefix rows, then ``n k`` candidate rows.

    Returns ``(log q(x_{<=i}) (N, n), log q(x_{<i}, X_i = c_{i,r}) (N, n, k) or None)``.
    """
    count, window = data.shape
    circuit = head.circuit
    rows = data[:, None, :].expand(count, window, window)
    mask = _prefix_rows(window, count, data.device).view(count, window, window)
    if candidates is not None:
        picks = candidates.shape[-1]
        swapped = data[:, None, None, :].repeat(1, window, picks, 1)  # (N, n, k, n)
        slot = torch.arange(window, device=data.device)
        swapped[:, slot, :, slot] = candidates.transpose(0, 1)
        rows = torch.cat([rows, swapped.view(count, window * picks, window)], dim=1)
        cand_mask = mask[:, :, None, :].expand(count, window, picks, window)
        mask = torch.cat([mask, cand_mask.reshape(count, window * picks, window)], dim=1)
    per_set = rows.shape[1]
    values = circuit.evaluate(rows.reshape(-1, window), mask.reshape(-1, window), prepared)
    values = values.view(count, per_set)
    if candidates is None:
        return values, None
    return values[:, :window], values[:, window:].view(count, window, -1)


def _window_pass(head: DraftHead, hidden: Tensor, tokens: Tensor, mask: Tensor | None,
                 chunk_rows: int | None, materialise: bool,
                 teacher: TeacherLaw | None = None) -> _WindowPass:
    """Every window's conditionals of its targets, and with ``teacher`` the cross-entropy of
    every slot's conditional to the teacher's law (its candidates only)."""
    mask = _check_inputs(head, hidden, tokens, mask)
    targets, valid = window_targets(tokens, head.window, mask)
    batch, length, window = targets.shape
    starts = valid[..., 0].reshape(-1).nonzero().squeeze(1)  # windows with a valid first slot
    any_real = starts.numel() > 0
    teacher_valid = valid  # the teacher's law at slot j needs x_{t+1..t+j-1} inside the draft
    draft = getattr(head, "draft_tokens", None)
    if draft is not None:  # model ids -> draft indices; a prefix outside the draft vocabulary ends
        index = draft_positions(draft.to(targets.device), head.vocab_size)[targets]
        inside = (index >= 0).cumprod(-1).bool()
        before = torch.cat([torch.ones_like(inside[..., :1]), inside[..., :-1]], dim=-1)
        teacher_valid = valid & before
        if getattr(head, "reads_token", False):  # it reads x_{t+1}: inside the draft vocabulary
            teacher_valid = teacher_valid & inside[..., :1]
        valid = valid & inside
        targets = index.clamp_min(0)
    flat_hidden = hidden.reshape(batch * length, -1).index_select(0, starts.to(hidden.device))
    device = head.circuit.device
    x = targets.reshape(-1, window).index_select(0, starts).to(device)
    candidates = probs = None
    categories = head.vocab_size if draft is None else int(draft.numel())
    if teacher is not None:
        cand, prob = teacher_candidates(teacher, window, batch, length, categories)
        picks = cand.shape[-1]
        candidates = cand.reshape(-1, window, picks).index_select(0, starts.to(cand.device))
        probs = prob.reshape(-1, window, picks).index_select(0, starts.to(prob.device))
        candidates, probs = candidates.to(device), probs.to(device)
    observed = getattr(head, "observed_log_parameters", None)
    # the column tables hold the target and k candidates: k + 1 columns, at most the categories
    columns_fit = candidates is None or candidates.shape[-1] < categories
    if observed is not None and not materialise and columns_fit:
        # each input unit at its target (column 0) and at its slot's candidates (1..k) only
        columns = x if candidates is None else torch.cat([x[..., None], candidates], dim=-1)
        prepared = observed(flat_hidden, columns, chunk_rows)
        data = torch.zeros_like(x)
        read = None if candidates is None else \
            torch.arange(1, candidates.shape[-1] + 1, device=device).expand_as(candidates)
    else:
        params = draft_parameters(head, flat_hidden, x[:, 0])
        prepared = head.circuit.resolve_params(params, x.shape[0])
        data, read = x, candidates
    marginals, joint = _evaluate_windows(head, prepared, data, read)
    cond = torch.cat([marginals[:, :1], marginals[:, 1:] - marginals[:, :-1]], dim=1)

    def spread(values: Tensor, keep: Tensor) -> Tensor:
        kept = keep.reshape(-1, window).index_select(0, starts).to(device)
        values = torch.where(kept, values, values.new_zeros(()))
        full = values.new_zeros(batch * length, window).index_copy(0, starts.to(device), values)
        return full.view(batch, length, window)

    teacher_ce = None
    if joint is not None and probs is not None:
        before = torch.cat([marginals.new_zeros(marginals.shape[0], 1), marginals[:, :-1]], dim=1)
        teacher_ce = spread(-(probs * (joint - before[..., None])).sum(-1), teacher_valid)
    return _WindowPass(spread(cond, valid), valid.to(device), any_real, teacher_ce,
                       None if teacher is None else teacher_valid.to(device))


def _log_conditionals(head: DraftHead, hidden: Tensor, tokens: Tensor, mask: Tensor | None,
                      chunk_rows: int | None, materialise: bool) -> tuple[Tensor, Tensor, bool]:
    """:func:`window_log_conditionals` and whether any target was valid before the draft
    vocabulary's restriction (a batch of real tokens whose targets all fall outside it is not an
    input error: its loss is 0)."""
    out = _window_pass(head, hidden, tokens, mask, chunk_rows, materialise)
    return out.log_cond, out.valid, out.any_real


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


def _slot_means(per_position: Tensor, valid: Tensor) -> Tensor:
    """Eq. 4's normalisation: (B, T, n) per-target values -> (n,) mean over sequences of each
    sequence's mean over its valid targets (sequences without one left out)."""
    total = per_position.sum(1)  # (B, n), summed over positions
    per_seq = valid.sum(1)  # (B, n): V_{i,j}
    has = per_seq > 0
    mean = torch.where(has, total / per_seq.clamp_min(1), total.new_zeros(()))
    return mean.sum(0) / has.sum(0).clamp_min(1)


def mtp_loss(head: DraftHead, hidden: Tensor, tokens: Tensor, mask: Tensor | None = None,
             gamma: float | None = None, *, chunk_rows: int | None = None,
             materialise: bool = False, teacher: TeacherLaw | None = None) -> MTPLossOutput:
    """The discounted MTP loss of Eq. 4 and the per-slot NLLs (see the module docstring).

    Args:
        head: the draft head.
        hidden: (B, T, d) draft hidden states (``HFBackbone.hidden_states(tokens)[1]``).
        tokens: (B, T) the same sequences' token ids.
        mask: (B, T) 0/1 attention mask, 1 for real tokens (right or any padding).
        gamma: discount in ``(0, 1]`` (None: :func:`default_gamma` of the head's window).
        chunk_rows, materialise: see :func:`window_log_conditionals`.
        teacher: the LM's law at every position (:class:`~circuits_llm.training.teacher.TeacherLaw`,
            logits ``(B, T, C)``). Slot ``j``'s loss becomes ``(1 - w) L_j + w S_j`` with ``S_j``
            the cross-entropy ``-sum_c p(c | x_{<=t+j-1}) log q_t(c | x_{t+1..t+j-1})`` over the
            teacher's top-k categories ``c``, normalised like ``L_j``. ``S_j`` needs the prefix
            ``x_{t+1..t+j-1}`` inside a compressed head's draft vocabulary, not ``x_{t+j}``.

    Returns:
        :class:`MTPLossOutput`.

    Raises:
        InvalidInputError: mismatched shapes, bad dtypes, ids outside the vocabulary where the
            mask is 1, a bad ``gamma``, teacher logits of the wrong shape, or a batch without any
            valid target.
    """
    if gamma is None:
        gamma = default_gamma(head.window)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
        raise InvalidInputError(f"gamma must be a number in (0, 1], got {gamma!r}")
    out = _window_pass(head, hidden, tokens, mask, chunk_rows, materialise, teacher)
    if not out.any_real:
        raise InvalidInputError("no valid target in the batch: every sequence needs at least two "
                                "real tokens")
    slot = _slot_means(-out.log_cond, out.valid)  # (n,): L_j
    weights = gamma ** torch.arange(head.window, dtype=slot.dtype, device=slot.device)
    if getattr(head, "reads_token", False):  # X_0 is the head's own input: nothing to learn
        weights[0] = 0.0
    teacher_nll = None
    trained = slot
    if teacher is not None and out.teacher_ce is not None and out.teacher_valid is not None:
        soft = _slot_means(out.teacher_ce, out.teacher_valid)  # (n,): S_j
        teacher_nll = soft.detach()
        trained = (1 - teacher.weight) * slot + teacher.weight * soft
    return MTPLossOutput(loss=(weights * trained).sum(), nll=slot.detach(),
                         nll_sum=(-out.log_cond).sum((0, 1)).detach(),
                         count=out.valid.sum((0, 1)), weights=weights, teacher_nll=teacher_nll)
