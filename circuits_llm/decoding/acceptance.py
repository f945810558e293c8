"""The exact law of one round's verification, and how its outcome moves the decoder.

:func:`round_law` is a pure function of the target's probabilities ``p``, the draft's exact
conditionals ``q`` and the drafts: the acceptance ratios, the residuals and the bonus law
(:class:`RoundLaw`). :func:`transition` maps an outcome (how many drafts were accepted, the token
emitted) to the decoder's next state, under a :class:`CorrectionPolicy`. The compiled accept
program (:mod:`circuits_llm.decoding.round`) computes the same quantities on the device through
:func:`usable_conditionals` and :func:`acceptance_ratios`, and the tests' exact-law enumerator calls
:func:`round_law` and :func:`transition` themselves, so the law the tests check is the law the
decoder runs (docs/decoder-exactness.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from circuits_llm.decoding.round_data import DraftResult, RoundOutcome
from circuits_llm.decoding.warping import DecoderError

__all__ = ["CorrectionPolicy", "RoundLaw", "Transition", "acceptance_ratios", "blockwise_argmax",
           "draw_from_row", "round_decisions", "round_law", "transition", "usable_conditionals"]

#: block length of :func:`blockwise_argmax`
ARGMAX_BLOCK = 256


@dataclass(frozen=True)
class RoundLaw:
    """Everything random about one verification, given ``p``, ``q`` and the draft.

    Attributes:
        accept: (n-1,) float64, ``a_k = min(1, p_k(d_k) / q_k(d_k))`` (0 where ``q_k(d_k) = 0``).
        fallback: (n, V) float64; row ``k < n-1``: the law of the token emitted when draft
            ``k+1`` is the first rejected one (the residual); row ``n-1``: the bonus law ``p_n``.
    """

    accept: Tensor
    fallback: Tensor

    def outcome_probs(self) -> Tensor:
        """(n, V): ``P[s, y]`` = probability of accepting exactly ``s`` drafts, then emitting ``y``."""
        ones = self.accept.new_ones(1)
        reach = torch.cat([ones, torch.cumprod(self.accept, 0)])
        stop = torch.cat([1 - self.accept, ones])
        return (reach * stop)[:, None] * self.fallback


def usable_conditionals(q: Tensor) -> Tensor:
    """``q`` (n-1, K) with negative entries clamped to 0 and every row that is not a finite vector
    (evidence impossible under the circuit) replaced by zeros: such a draft is never accepted."""
    return torch.where(torch.isfinite(q).all(-1, keepdim=True), q.clamp_min(0), 0.0)


def acceptance_ratios(p_drafted: Tensor, q_drafted: Tensor) -> Tensor:
    """``min(1, p_k(d_k) / q_k(d_k))`` per drafted position (0 where ``q_k(d_k) = 0``)."""
    safe = torch.where(q_drafted > 0, q_drafted, 1.0)
    return torch.where(q_drafted > 0, p_drafted / safe, 0.0).clamp(max=1.0)


def round_law(p: Tensor, q: Tensor, draft: Tensor) -> RoundLaw:
    """The verification law of one round (pure; no randomness, no host synchronisation).

    Args:
        p: (n, V) target (warped) probabilities at window positions ``1..n``.
        q: (n-1, V) the draft's exact conditionals ``q(X_k | c, d_1..d_{k-1})``. A row that is not
            a finite vector (evidence impossible under the circuit) is treated as ``0``: its draft
            is always rejected and the residual is ``p_k`` itself, which is exact whatever the
            draft was.
        draft: (n-1,) long, the drafted tokens.

    Returns:
        The :class:`RoundLaw`. A residual with zero mass is replaced by ``p_k``: it only occurs
        when ``p_k <= q_k`` everywhere, i.e. ``p_k == q_k``, where rejection has probability 0.
    """
    p, q = p.double(), q.double().to(p.device)
    drafted = draft.shape[0]
    if p.shape[0] != drafted + 1 or q.shape != (drafted, p.shape[1]):
        raise DecoderError(f"round_law needs p (n, V), q (n-1, V), draft (n-1,); got "
                           f"{tuple(p.shape)}, {tuple(q.shape)}, {tuple(draft.shape)}")
    q = usable_conditionals(q)
    rows = torch.arange(drafted, device=p.device)
    ratio = acceptance_ratios(p[rows, draft], q[rows, draft])
    residual = (p[:drafted] - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / torch.where(mass > 0, mass, 1.0), p[:drafted])
    return RoundLaw(accept=ratio, fallback=torch.cat([residual, p[drafted:]]))


class CorrectionPolicy(Enum):
    """What a round does with the verifier's correction/bonus token.

    ``EXACT``: always keep it (this decoder; lossless). ``DROP_AFTER_ACCEPT``: the MTPC paper's
    Algorithm 2 semantics mapped onto this round structure: keep it only when no draft was
    accepted, otherwise drop it and restart after the last accepted token. It is **biased** when
    sampling (see ``docs/decoder-exactness.md``) and exists only as the tests' negative control.
    """

    EXACT = "exact"
    DROP_AFTER_ACCEPT = "drop_after_accept"


@dataclass(frozen=True)
class Transition:
    """How a round's outcome changes the decoder state.

    Attributes:
        emitted: tokens appended to the output.
        next_token: the new ``c`` (decided, not cached).
        keep: how many tokens of the verified block ``[c, d_1, ..]`` stay cached; the draft hidden
            state at block index ``keep - 1`` seeds the next round.
    """

    emitted: tuple[int, ...]
    next_token: int
    keep: int


def transition(policy: CorrectionPolicy, draft: Sequence[int], accepted: int,
               token: int) -> Transition:
    """The state change after accepting ``accepted`` drafts and sampling ``token``."""
    if policy is CorrectionPolicy.DROP_AFTER_ACCEPT and accepted > 0:
        return Transition(tuple(draft[:accepted]), int(draft[accepted - 1]), accepted)
    return Transition((*draft[:accepted], token), token, accepted + 1)


def round_decisions(p: Tensor, q: Tensor, tokens: Tensor, tests: Tensor,
                    length: Tensor | int | None, position: Tensor | None,
                    draft_tokens: Tensor | None, extra: Tensor | None = None
                    ) -> tuple[Tensor, Tensor]:
    """The decisions of :func:`round_law`, computing only what one round reads (the accept
    program's core; fixed shapes, no host read).

    Args:
        p: (n, V) float64 target probabilities.
        q: (n-1, K) the draft's conditionals over the draft vocabulary; with ``extra``,
            (n-1, K + 1): column ``K`` of row ``k`` is the probability of the model id
            ``extra[k]`` (a proposal's token, possibly outside the draft vocabulary; a token in
            it then has 0 in its own column), added to the row's law.
        tokens: (n-1,) the drafts (model ids).
        tests: (n-1,) uniforms of the accept tests.
        length: ``L``, the verified drafts (``None``: ``n - 1``).
        position: (V,) model id -> draft-vocabulary index, ``None`` without a compressed
            vocabulary; ``draft_tokens`` (K,) its model ids.
        extra: (n-1,) long model ids of the extra column, or ``None`` (no extra column).

    Returns:
        (the number of accepted drafts (), the law of the emitted token (V,)): the same
        acceptance ratios as ``round_law(p[:L+1], q[:L], draft[:L])``: a position after ``L`` has
        ratio 0 (never accepted), and when all ``L`` are accepted the bonus row is ``p_{L+1}``. Of
        the fallback rows only the one that is used (the residual after the first rejection, or
        the bonus row) is built, so a round touches ``V`` entries once instead of ``(n-1) V``
        times (large vocabularies).
    """
    drafted = tokens.shape[0]
    length = drafted if length is None else length
    q = usable_conditionals(q.double())
    q, added = (q, None) if extra is None else (q[:, :-1], q[:, -1])
    index = tokens if position is None else position[tokens]  # draft indices (-1: outside)
    rows = torch.arange(drafted, device=p.device)
    q_drafted = torch.where(index >= 0, q[rows, index.clamp(min=0)], 0.0)
    if added is not None:
        assert extra is not None
        q_drafted = q_drafted + torch.where(tokens == extra, added, 0.0)
    ratio = acceptance_ratios(p[rows, tokens], q_drafted)
    ratio = torch.where(rows < length, ratio, 0.0)  # after L: not drafted, never accepted
    accepted = torch.cumprod((tests < ratio).long(), 0).sum()
    p_row = p.index_select(0, accepted[None])[0]  # (V,)
    q_row = torch.cat([q, q.new_zeros(1, q.shape[1])]).index_select(0, accepted[None])[0]
    if added is None:
        if draft_tokens is None:
            residual = (p_row - q_row).clamp_min(0)
        else:  # q = 0 outside the draft vocabulary: the residual is p there
            inside = (p_row.index_select(0, draft_tokens) - q_row).clamp_min(0)
            residual = p_row.index_copy(0, draft_tokens, inside)
    else:  # the row's law over every id: the draft vocabulary's entries, plus the extra one
        assert extra is not None
        full = q_row if draft_tokens is None else \
            torch.zeros_like(p_row).index_copy(0, draft_tokens, q_row)
        pad = q.new_zeros(1)
        extra_id = torch.cat([extra, extra[:1]]).index_select(0, accepted[None])
        extra_q = torch.cat([added, pad]).index_select(0, accepted[None])
        residual = (p_row - full.index_add(0, extra_id, extra_q)).clamp_min(0)
    mass = residual.sum()
    residual = torch.where(mass > 0, residual / torch.where(mass > 0, mass, 1.0), p_row)
    return accepted, torch.where(accepted == length, p_row, residual)


def blockwise_argmax(row: Tensor, block: int = ARGMAX_BLOCK) -> Tensor:
    """``row.argmax()`` of a (V,) row, computed as a maximum per block of ``block`` entries and then
    the best block: the same index (the first maximal entry), from reductions over a
    ``(ceil(V / block), block)`` layout.

    Why: in a compiled program that also scans the row (the inverse-CDF draw of
    :func:`draw_from_row`), inductor on CUDA (torch 2.11) fuses a reduction over the row into the
    scan's split kernel and refuses to compile it ("NYI TritonSplitDimKernel reductions"); a
    reduction over another layout is never fused with it.
    """
    size = row.shape[0]
    blocks = -(-size // block)
    padded = torch.nn.functional.pad(row, (0, blocks * block - size), value=-math.inf)
    best, where = padded.view(blocks, block).max(1)  # (blocks,): the first maximum of each block
    chosen = best.argmax()
    return chosen * block + where.index_select(0, chosen[None])[0]


def draw_from_row(row: Tensor, uniform: Tensor) -> Tensor:
    """The inverse-CDF draw of one token from the unnormalised law ``row`` (V,) (non-negative, some
    entry positive) with ``uniform`` (() in [0, 1)): () long. Fixed shapes, no host read.

    Never a zero-probability token: ``uniform x total`` can round up to the total (no index found),
    and a parallel cumulative sum (CUDA) may not be exactly flat across a zero entry; either way the
    most probable token is taken, an event of probability ~1e-16 that leaves the law unchanged.
    """
    cdf = row.cumsum(0)
    token = torch.searchsorted(cdf, (uniform * cdf[-1])[None], right=True)[0]
    token = token.clamp(max=row.shape[0] - 1)
    return torch.where(row.index_select(0, token[None])[0] > 0, token, blockwise_argmax(row))


def greedy_batch_outcomes(window: int, logits: Tensor, at: Sequence[int],
                          drafts: Sequence[DraftResult], lengths: Sequence[int]
                          ) -> list[RoundOutcome]:
    """The greedy accept of several rows of a batch in one pass: ``logits`` (B, W, V) the
    batch's verifier logits, row ``at[i]`` verifying ``drafts[i]``'s first ``lengths[i]`` drafts
    of a round of ``window`` (its columns after them are padding), each decided on its own ``L``
    (the draft's ``length``, as the single-row accept program reads it) -> each row's
    :class:`~circuits_llm.decoding.round_data.RoundOutcome`: the decisions
    :meth:`AcceptProgram.accept <circuits_llm.decoding.round.AcceptProgram.accept>` makes for it
    alone (the first maximum, the same flags), read in one host transfer instead of one a row."""
    drafted = window - 1
    with torch.no_grad():
        top, best = logits.index_select(0, torch.tensor(list(at), device=logits.device)
                                        ).max(-1)  # (R, W): one pass over every row
        device = best.device
        length = torch.stack([torch.full((), drafted, device=device) if d.length is None
                              else d.length.to(device) for d in drafts])
        length = torch.minimum(length, torch.tensor(list(lengths), device=device))
        columns = torch.arange(best.shape[1], device=device)
        ok = (torch.isfinite(top) | (columns[None] > length[:, None])).all(1)
        if best.shape[1] < window:  # the batch's widest block verified fewer drafts
            best = torch.nn.functional.pad(best, (0, window - best.shape[1]), value=-1)
        tokens = torch.stack([draft.tokens for draft in drafts])  # (R, n-1)
        possible = torch.stack([draft.possible for draft in drafts])
        verified = torch.arange(drafted, device=device)[None] < length[:, None]
        matches = (tokens == best[:, :drafted]) & possible[:, None] & verified
        accepted = torch.cumprod(matches.long(), 1).sum(1)
        token = best.gather(1, accepted[:, None])[:, 0]
        flags = torch.stack([torch.stack([draft.head_ok for draft in drafts]), ok, possible])
        packed = torch.cat([tokens, length[:, None], accepted[:, None], token[:, None],
                            flags.T.long()], 1)
    return [RoundOutcome(tuple(values[:values[-6]]), values[-5], values[-4], bool(values[-3]),
                         bool(values[-2]), bool(values[-1]))
            for values in packed.tolist()]
