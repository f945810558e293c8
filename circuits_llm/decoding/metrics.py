"""Per-round statistics and summaries of a decoding run (MTPC paper Section 4.2, vLLM's metrics).

* mean latency ``mu_lat``: seconds per round (draft + verify), split into head parameterisation,
  drafting, draft conditionals, the verifier forward and the accept/reject step;
* ``tokens_per_round`` (the paper's ``mu_acc``: tokens produced per round, in ``[1, L + 1]`` for a
  round that verifies ``L`` drafts),
  ``acceptance_rate`` (accepted drafts / drafted tokens, vLLM's "draft acceptance rate") and
  per-position acceptance rates;
* throughput ``mu_tok/s`` = new tokens / decoding seconds (= ``mu_acc / mu_lat``), and the
  wall-time speed-up of one run over a baseline measured in the same process.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from torch import Tensor


class RoundKind(Enum):
    """What a round did: a speculative draft/verify cycle or one plain autoregressive step."""

    SPECULATIVE = "speculative"
    AUTOREGRESSIVE = "autoregressive"


@dataclass(frozen=True)
class RoundStats:
    """One round of decoding (one backbone call).

    Attributes:
        kind: speculative or autoregressive.
        drafted: number of drafted tokens verified this round, ``L`` (``window - 1`` under the
            default :class:`~circuits_llm.decoding.draft_length.DraftLength`, fewer under a
            shorter or confidence rule; 0 for AR).
        accepted: number of drafted tokens accepted (0..drafted).
        emitted: tokens appended to the output by this round (before any final truncation).
        head_s, draft_s, conditionals_s, verify_s, accept_s: seconds spent computing the circuit
            parameters, drafting, computing the draft's exact conditionals, in the backbone
            forward (plus warping), and in the accept/reject/residual step.
        constraint_s: seconds of constraint work inside the round (``generate(constraint=)``:
            automaton steps, masks, the product draft; part of the phases above).
        product_size: entries of the head x constraint product drafted from this round (its
            lifted matrices over the reachable automaton states; 0 without one).
        total_s: wall seconds of the whole round.
    """

    kind: RoundKind
    drafted: int
    accepted: int
    emitted: int
    head_s: float = 0.0
    draft_s: float = 0.0
    conditionals_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    total_s: float = 0.0
    constraint_s: float = 0.0
    product_size: int = 0


@dataclass(frozen=True)
class DecodeSummary:
    """Aggregates over the rounds of one ``generate`` call.

    Attributes:
        new_tokens: generated tokens returned.
        rounds: decoding rounds (= backbone calls after the prefill).
        backbone_calls: rounds plus the prefill call (if the prompt had >= 2 tokens).
        drafted, accepted: total drafted and accepted draft tokens.
        acceptance_rate: ``accepted / drafted`` (0 when nothing was drafted).
        tokens_per_round: the paper's ``mu_acc``: ``new_tokens / rounds``.
        tokens_per_call: ``new_tokens / backbone_calls``.
        acceptance_by_position: for draft position ``k = 1..n-1``, the fraction of speculative
            rounds in which the ``k``-th draft was accepted (vLLM's per-position rate).
        conditional_acceptance_by_position: the same, among rounds that verified and reached
            position ``k`` (under a dynamic draft length a round may verify fewer than ``n-1``).
        mean_latency_s: the paper's ``mu_lat``: mean seconds per round.
        mean_split_s: mean seconds per round of each phase (head, draft, conditionals, verify,
            accept).
        prefill_s: seconds of the prefill call.
        decode_s: seconds of all rounds.
        throughput: ``new_tokens / decode_s`` (tokens per second, prefill excluded).
    """

    new_tokens: int
    rounds: int
    backbone_calls: int
    drafted: int
    accepted: int
    acceptance_rate: float
    tokens_per_round: float
    tokens_per_call: float
    acceptance_by_position: tuple[float, ...]
    conditional_acceptance_by_position: tuple[float, ...]
    mean_latency_s: float
    mean_split_s: dict[str, float] = field(default_factory=dict)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    throughput: float = 0.0

    def reported(self) -> dict[str, Any]:
        """The fields of :data:`REPORTED` by name, as a pooled report row carries them (a row of
        :class:`~circuits_llm.app.rows.DecoderRow` is made from exactly these; its containers are
        copies)."""
        values = {name: getattr(self, name) for name in REPORTED}
        values["acceptance_by_position"] = tuple(self.acceptance_by_position)
        values["mean_split_s"] = dict(self.mean_split_s)
        return values


#: The fields of a :class:`DecodeSummary` that a decoder comparison reports per decoder and mode
#: (:meth:`DecodeSummary.reported`); the others (drafted and accepted totals, backbone calls,
#: conditional acceptance, prefill and decode seconds) stay in the summary.
REPORTED: tuple[str, ...] = (
    "new_tokens", "rounds", "mean_latency_s", "tokens_per_round", "tokens_per_call",
    "acceptance_rate", "acceptance_by_position", "throughput", "mean_split_s",
)


@dataclass(frozen=True)
class DecodeResult:
    """What ``generate`` returns.

    Attributes:
        tokens: (T,) long, the generated tokens only (the prompt is not repeated).
        rounds: per-round statistics, in order.
        summary: aggregates (see :class:`DecodeSummary`).
    """

    tokens: Tensor
    rounds: list[RoundStats]
    summary: DecodeSummary


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


def summarize(rounds: list[RoundStats], new_tokens: int, prefill_calls: int,
              prefill_s: float) -> DecodeSummary:
    """Aggregate per-round statistics into a :class:`DecodeSummary`."""
    speculative = [r for r in rounds if r.kind is RoundKind.SPECULATIVE]
    depth = max((r.drafted for r in speculative), default=0)
    reached = [sum(1 for r in speculative if r.drafted >= k and r.accepted >= k - 1)
               for k in range(1, depth + 1)]
    hits = [sum(1 for r in speculative if r.accepted >= k) for k in range(1, depth + 1)]
    drafted = sum(r.drafted for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    decode_s = sum(r.total_s for r in rounds)
    phases = ("head_s", "draft_s", "conditionals_s", "verify_s", "accept_s")
    split = {p: _ratio(sum(getattr(r, p) for r in rounds), len(rounds)) for p in phases}
    return DecodeSummary(
        new_tokens=new_tokens,
        rounds=len(rounds),
        backbone_calls=len(rounds) + prefill_calls,
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=_ratio(accepted, drafted),
        tokens_per_round=_ratio(new_tokens, len(rounds)),
        tokens_per_call=_ratio(new_tokens, len(rounds) + prefill_calls),
        acceptance_by_position=tuple(_ratio(h, len(speculative)) for h in hits),
        conditional_acceptance_by_position=tuple(_ratio(h, n) for h, n in zip(hits, reached,
                                                                               strict=True)),
        mean_latency_s=_ratio(decode_s, len(rounds)),
        mean_split_s=split,
        prefill_s=prefill_s,
        decode_s=decode_s,
        throughput=_ratio(new_tokens, decode_s),
    )


def speedup(result: DecodeResult | DecodeSummary, baseline: DecodeResult | DecodeSummary) -> float:
    """Wall-time speed-up ratio: throughput of ``result`` over that of ``baseline``.

    Both should be measured in the same process on the same prompts (e.g. a
    :class:`~circuits_llm.decoding.decoder.SpeculativeDecoder` run against an
    :class:`~circuits_llm.decoding.decoder.AutoregressiveDecoder` run on the same backbone).
    """
    ours = result.summary if isinstance(result, DecodeResult) else result
    base = baseline.summary if isinstance(baseline, DecodeResult) else baseline
    if base.throughput <= 0:
        raise ValueError("the baseline has no measured throughput (no tokens or no time)")
    return ours.throughput / base.throughput


def aggregate(results: list[DecodeResult]) -> DecodeSummary:
    """Pool the rounds of several runs (e.g. one per prompt) into one summary."""
    rounds = [r for result in results for r in result.rounds]
    return summarize(
        rounds,
        new_tokens=sum(result.summary.new_tokens for result in results),
        prefill_calls=sum(result.summary.backbone_calls - result.summary.rounds
                          for result in results),
        prefill_s=sum(result.summary.prefill_s for result in results),
    )


@dataclass(frozen=True)
class BatchRoundStats:
    """One round of batch decoding: one backbone call for every row still decoding.

    Attributes:
        rows: rows in the call (finished rows have left the batch).
        block: tokens appended to every row (the longest row's verify block; shorter blocks are
            padded and the padding rolled back).
        emitted: tokens the round appended to the rows' outputs (before final truncation).
        draft_s, verify_s, accept_s, total_s: seconds drafting every row, in the backbone call,
            accepting every row (and the per-row rollback), and in all.
    """

    rows: int
    block: int
    emitted: int
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True)
class BatchSummary:
    """Totals over a batch of prompts decoded together.

    Attributes:
        batch_size: prompts in the batch.
        new_tokens: generated tokens returned, over every row.
        rounds: batch rounds (backbone calls after the prefill).
        backbone_calls: rounds plus the prefill call (when some prompt had >= 2 tokens).
        drafted, accepted: draft tokens verified and accepted, over every row.
        acceptance_rate: ``accepted / drafted`` (0 when nothing was drafted).
        tokens_per_round: ``new_tokens / rounds``: tokens over the batch per backbone call.
        mean_rows: rows per round, on average (finished rows leave the batch).
        mean_latency_s: seconds per round.
        mean_split_s: seconds per round of each phase (draft, verify, accept).
        prefill_s, decode_s: seconds of the prefill call and of all rounds.
        throughput: ``new_tokens / decode_s``: tokens per second over the batch (prefill excluded).
    """

    batch_size: int
    new_tokens: int
    rounds: int
    backbone_calls: int
    drafted: int
    accepted: int
    acceptance_rate: float
    tokens_per_round: float
    mean_rows: float
    mean_latency_s: float
    mean_split_s: dict[str, float] = field(default_factory=dict)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    throughput: float = 0.0


@dataclass(frozen=True)
class BatchResult:
    """What ``generate`` returns for a batch of prompts.

    Attributes:
        rows: one :class:`DecodeResult` per prompt, in the input's order: its new tokens and its
            own summary (its rounds are the batch rounds it took part in, each timed as the
            whole batch round: a row's throughput is its tokens over the batch's time).
        rounds: per batch round statistics, in order (:class:`BatchRoundStats`).
        summary: batch totals (:class:`BatchSummary`).
    """

    rows: tuple[DecodeResult, ...]
    rounds: list[BatchRoundStats]
    summary: BatchSummary

    @property
    def tokens(self) -> list[list[int]]:
        """Each row's new tokens as a list of ids."""
        return [row.tokens.tolist() for row in self.rows]


def summarize_batch(rows: tuple[DecodeResult, ...], rounds: list[BatchRoundStats],
                    prefill_calls: int, prefill_s: float) -> BatchSummary:
    """Aggregate a batch's rows and rounds into a :class:`BatchSummary`."""
    new_tokens = sum(row.summary.new_tokens for row in rows)
    drafted = sum(row.summary.drafted for row in rows)
    accepted = sum(row.summary.accepted for row in rows)
    decode_s = sum(r.total_s for r in rounds)
    phases = ("draft_s", "verify_s", "accept_s")
    return BatchSummary(
        batch_size=len(rows),
        new_tokens=new_tokens,
        rounds=len(rounds),
        backbone_calls=len(rounds) + prefill_calls,
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=_ratio(accepted, drafted),
        tokens_per_round=_ratio(new_tokens, len(rounds)),
        mean_rows=_ratio(sum(r.rows for r in rounds), len(rounds)),
        mean_latency_s=_ratio(decode_s, len(rounds)),
        mean_split_s={p: _ratio(sum(getattr(r, p) for r in rounds), len(rounds)) for p in phases},
        prefill_s=prefill_s,
        decode_s=decode_s,
        throughput=_ratio(new_tokens, decode_s),
    )


def single_row_batch(result: DecodeResult) -> BatchResult:
    """A one-prompt batch's result from the single-prompt path's :class:`DecodeResult` (a batch
    of one decodes as one prompt: no padding, no per-row bookkeeping)."""
    summary = result.summary
    rounds = [BatchRoundStats(1, r.drafted + 1, r.emitted, r.draft_s, r.verify_s, r.accept_s,
                              r.total_s) for r in result.rounds]
    return BatchResult((result,), rounds, summarize_batch(
        (result,), rounds, summary.backbone_calls - summary.rounds, summary.prefill_s))


def pool_batches(results: list[BatchResult]) -> DecodeSummary:
    """Several batches' results as one :class:`DecodeSummary` over their batch rounds (what a
    decoder comparison reports for a decoder that decoded its prompts in batches).

    Acceptance (``drafted``, ``accepted``, the rate and the per-position rates) is pooled over
    every row's rounds; time is the batches' (a batch round is one backbone call for every row,
    so ``rounds``, ``backbone_calls``, ``mean_latency_s``, the phase split, ``decode_s`` and
    ``throughput`` count batch rounds: tokens over the whole batch per second)."""
    rows = aggregate([row for result in results for row in result.rows])
    rounds = [r for result in results for r in result.rounds]
    calls = sum(result.summary.backbone_calls for result in results)
    decode_s = sum(r.total_s for r in rounds)
    split = {p: _ratio(sum(getattr(r, p) for r in rounds), len(rounds))
             for p in ("draft_s", "verify_s", "accept_s")}
    return replace(rows, rounds=len(rounds), backbone_calls=calls,
                   tokens_per_round=_ratio(rows.new_tokens, len(rounds)),
                   tokens_per_call=_ratio(rows.new_tokens, calls),
                   mean_latency_s=_ratio(decode_s, len(rounds)), mean_split_s=split,
                   prefill_s=sum(result.summary.prefill_s for result in results),
                   decode_s=decode_s, throughput=_ratio(rows.new_tokens, decode_s))
