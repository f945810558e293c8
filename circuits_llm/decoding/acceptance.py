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
from circuits_llm.decoding.warping import DecoderError, SamplingConfig, warp_logits

__all__ = ["CorrectionPolicy", "RoundLaw", "SampledAccept", "Transition", "acceptance_ratios",
           "blockwise_argmax", "drafted_conditionals", "draw_from_row", "draw_from_row_on_host",
           "residual_law", "round_decisions", "round_law", "row_by_row_decisions",
           "row_by_row_outcome", "transition", "usable_conditionals", "usable_row"]

#: block length of :func:`blockwise_argmax`
ARGMAX_BLOCK = 256


class SampledAccept(Enum):
    """How a sampled round's accept computes the target's law (the same decisions either way).

    ``WHOLE_WINDOW``: the fixed-shape program (:func:`round_decisions`): every verified row's
    float64 softmax, no host read, compiled when the decoder compiles; what an accelerator runs.
    ``ROW_BY_ROW``: eager (:func:`row_by_row_decisions`): a row's softmax only when the test
    before it passed, each test read on the host. On a CPU it touches the rows of the accepted
    drafts and one more instead of all ``L + 1``. ``AUTO`` (the decoder's default):
    ``ROW_BY_ROW`` on a CPU, else ``WHOLE_WINDOW``.
    """

    AUTO = "auto"
    WHOLE_WINDOW = "whole-window"
    ROW_BY_ROW = "row-by-row"

    def resolve(self, device: torch.device) -> SampledAccept:
        """``WHOLE_WINDOW`` or ``ROW_BY_ROW``: what this choice means on ``device``."""
        if self is not SampledAccept.AUTO:
            return self
        return SampledAccept.ROW_BY_ROW if device.type == "cpu" else SampledAccept.WHOLE_WINDOW


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


def drafted_conditionals(q: Tensor, tokens: Tensor, position: Tensor | None,
                         extra: Tensor | None) -> tuple[Tensor, Tensor]:
    """The draft's side of a round's decisions (:func:`round_decisions`' arguments), without
    building the whole of :func:`usable_conditionals`: only the row a round reads is made usable
    (:func:`usable_row`).

    Returns:
        ``(finite, q_drafted)``: (n-1,) bool, whether each row of ``q`` is a finite vector, and
        (n-1,) float64 ``q_k(d_k)`` under the usable conditionals: the probability each draft was
        drawn with.
    """
    drafted = tokens.shape[0]
    q = q.double()
    finite = torch.isfinite(q).all(-1)
    main, added = (q, None) if extra is None else (q[:, :-1], q[:, -1])
    index = tokens if position is None else position[tokens]  # draft indices (-1: outside)
    rows = torch.arange(drafted, device=q.device)
    q_drafted = torch.where(finite & (index >= 0), main[rows, index.clamp(min=0)].clamp_min(0),
                            0.0)
    if added is not None:
        assert extra is not None
        q_drafted = q_drafted + torch.where(finite & (tokens == extra), added.clamp_min(0), 0.0)
    return finite, q_drafted


def usable_row(row: Tensor, finite: Tensor) -> Tensor:
    """One row of :func:`usable_conditionals`: ``row`` in float64 with negative entries clamped
    to 0, or zeros when ``finite`` (() bool) says the row is not a finite vector."""
    return torch.where(finite, row.double().clamp_min(0), 0.0)


def residual_law(p_row: Tensor, q_row: Tensor, draft_tokens: Tensor | None,
                 extra_id: Tensor | None = None, extra_q: Tensor | None = None) -> Tensor:
    """(V,) float64: the law of the token emitted when a draft drawn from ``q_row`` is rejected
    under the target row ``p_row`` (V,): ``max(p - q, 0)`` normalised, or ``p_row`` itself when
    that has no mass (``p <= q`` everywhere, i.e. ``p == q``, where rejection has probability 0).

    ``q_row`` (K,) is over the draft vocabulary ``draft_tokens`` (``None``: ``K = V``; ``q = 0``
    outside it), plus, with ``extra_id`` (1,) long, the probability ``extra_q`` (1,) of that model
    id (a proposal's token outside the vocabulary: :func:`round_decisions`' extra column)."""
    if extra_id is None:
        if draft_tokens is None:
            residual = (p_row - q_row).clamp_min(0)
        else:  # q = 0 outside the draft vocabulary: the residual is p there
            inside = (p_row.index_select(0, draft_tokens) - q_row).clamp_min(0)
            residual = p_row.index_copy(0, draft_tokens, inside)
    else:  # the row's law over every id: the draft vocabulary's entries, plus the extra one
        assert extra_q is not None
        full = q_row if draft_tokens is None else \
            torch.zeros_like(p_row).index_copy(0, draft_tokens, q_row)
        residual = (p_row - full.index_add(0, extra_id, extra_q)).clamp_min(0)
    mass = residual.sum()
    return torch.where(mass > 0, residual / torch.where(mass > 0, mass, 1.0), p_row)


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
    finite, q_drafted = drafted_conditionals(q, tokens, position, extra)
    rows = torch.arange(drafted, device=p.device)
    ratio = acceptance_ratios(p[rows, tokens], q_drafted)
    ratio = torch.where(rows < length, ratio, 0.0)  # after L: not drafted, never accepted
    accepted = torch.cumprod((tests < ratio).long(), 0).sum()
    p_row = p.index_select(0, accepted[None])[0]  # (V,)
    # past the last draft (the bonus row) q is a zero row, whose residual is never used
    chosen = torch.cat([q.double(), q.new_zeros(1, q.shape[1], dtype=torch.float64)]
                       ).index_select(0, accepted[None])[0]
    q_row = usable_row(chosen, torch.cat([finite, finite.new_ones(1)]).index_select(
        0, accepted[None])[0])
    extra_id = extra_q = None
    if extra is not None:
        q_row, extra_q = q_row[:-1], q_row[-1:]
        extra_id = torch.cat([extra, extra[:1]]).index_select(0, accepted[None])
    residual = residual_law(p_row, q_row, draft_tokens, extra_id, extra_q)
    return accepted, torch.where(accepted == length, p_row, residual)


def row_by_row_decisions(warped: Tensor, q: Tensor, tokens: Tensor, tests: Tensor, length: int,
                         position: Tensor | None, draft_tokens: Tensor | None,
                         extra: Tensor | None = None) -> tuple[int, Tensor]:
    """:func:`round_decisions` computed one target row at a time, stopping at the first rejected
    draft: the same decisions and the same law of the emitted token (bit for bit: a row's
    float64 softmax is the same alone as among others), from the target's rows ``1..a+1`` when
    ``a`` drafts are accepted, instead of all ``L + 1``.

    Why: on a CPU the float64 softmax of a whole window is most of a sampled round's accept
    (SmolLM2: 5 rows of 49,152 logits) while a sampled round accepts about one draft, and a host
    read per row costs nothing there. On an accelerator the fixed-shape
    :func:`round_decisions`, with no host read, is the one to run.

    Args:
        warped: (n, V) the warped target logits (:func:`~circuits_llm.decoding.warping.
            warp_logits`); row ``k`` is softmaxed in float64 only when it is reached.
        length: ``L`` on the host. The other arguments are :func:`round_decisions`'.

    Returns:
        (the number of accepted drafts, the law of the emitted token (V,) float64).
    """
    drafts, passes = tokens.tolist(), tests.tolist()
    indices = drafts if position is None else position[tokens].tolist()  # -1: outside
    proposed = None if extra is None else extra.tolist()
    accepted, p_row, finite = length, warped.new_zeros(0), True
    for k in range(length):  # q's row k is read only when reached; host arithmetic, the same
        row = q[k].double()  # values as drafted_conditionals and acceptance_ratios (tested)
        finite = bool(torch.isfinite(row).all())
        drawn = max(float(row[indices[k]]), 0.0) if finite and indices[k] >= 0 else 0.0
        if finite and proposed is not None and drafts[k] == proposed[k]:
            drawn += max(float(row[-1]), 0.0)
        p_row = torch.softmax(warped[k].double(), -1)
        ratio = min(float(p_row[drafts[k]]) / drawn, 1.0) if drawn > 0 else 0.0
        if not passes[k] < ratio:
            accepted = k
            break
    if accepted == length:  # every verified draft accepted: the bonus row
        return accepted, torch.softmax(warped[length].double(), -1)
    q_row = usable_row(q[accepted], torch.tensor(finite))
    extra_id = extra_q = None
    if extra is not None:
        q_row, extra_q = q_row[:-1], q_row[-1:]
        extra_id = extra[accepted:accepted + 1]
    return accepted, residual_law(p_row, q_row, draft_tokens, extra_id, extra_q)


def row_by_row_outcome(logits: Tensor, draft: DraftResult, uniforms: Tensor,
                       config: SamplingConfig, window: int, position: Tensor | None,
                       draft_tokens: Tensor | None) -> Tensor:
    """A sampled round's accept with :func:`row_by_row_decisions`, packed as the accept program
    packs its own (:meth:`~circuits_llm.decoding.round.AcceptProgram.accept`: the drafts, ``L``,
    the accepted count, the emitted token, the head, verifier and evidence flags), built on the
    host: the same tensor as the whole-window program's from the same uniforms.

    Args:
        logits: (L+1, V) the verifier's logits for ``[c, d_1..d_L]``.
        draft: the round's :class:`~circuits_llm.decoding.round_data.DraftResult` (with ``q``).
        uniforms: the round's tape; its last ``window`` entries are the tests and the draw's.
        config: the sampling configuration; ``window``: ``n``.
        position, draft_tokens: as for :func:`round_decisions`.
    """
    assert draft.q is not None
    drafted = window - 1
    length = drafted if draft.length is None else int(draft.length)
    warped = warp_logits(logits[:length + 1], config)
    ok = bool(torch.isfinite(warped.amax(-1)).all())
    tests = uniforms[-window:]
    accepted, row = row_by_row_decisions(warped, draft.q, draft.tokens, tests[:drafted], length,
                                         position, draft_tokens, draft.extra)
    token = draw_from_row_on_host(row, float(tests[drafted]))
    flags = [bool(draft.head_ok), ok, bool(draft.possible)]
    return torch.tensor([*draft.tokens.tolist(), length, accepted, token, *flags],
                        dtype=torch.long)


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


def draw_from_row_on_host(row: Tensor, uniform: float) -> int:
    """:func:`draw_from_row`'s token, read on the host: the row's maximum is computed only in the
    rare case that needs it (the inverse CDF landing on a zero entry), not at every draw. For
    eager code on a CPU, where a host read costs nothing."""
    cdf = row.cumsum(0)
    token = min(int(torch.searchsorted(cdf, (uniform * cdf[-1])[None], right=True)[0]),
                row.shape[0] - 1)
    return token if float(row[token]) > 0 else int(blockwise_argmax(row))


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
