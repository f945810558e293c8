"""Decoding a batch of prompts together, each row exactly as if it were decoded alone.

One round runs one backbone call for every row still decoding:

1. the rows with a hidden state draft together, each exactly as the single-prompt round drafts
   it (:class:`SpeculativeRows`: one head forward and one set of circuit passes for all of them,
   :func:`~circuits_llm.decoding.batch_draft.draft_rows`, each row with its own hidden state,
   next token ``c``, uniforms, copy component and draft length ``L_b``); the others take an
   autoregressive step (block ``[c]``: the autoregressive decoder, and a speculative row whose
   prompt had one token);
2. the blocks ``[c, d_1..d_{L_b}]`` are padded to the longest and appended to every row in one
   call of the :class:`~circuits_llm.backbone.ragged_cache.RaggedBackbone` (per-row positions and
   attention masks: each row sees only its own tokens);
3. each row accepts from its own verifier rows exactly as the single-prompt round does (the same
   accept program, :func:`~circuits_llm.decoding.acceptance.transition`, the same
   autoregressive draw); the padding after a row's block is never read (causal attention: it
   cannot change the rows before it);
4. each row keeps its own number of the block's tokens (``RaggedBackbone.keep``: rollback per
   row), records its round, and checks its own stop condition (EOS, stop strings,
   ``max_new_tokens``); rows that finish leave the batch (``RaggedBackbone.select``), so they
   cost the others nothing.

Each row's state (cache contents, hidden state, ``c``, output) is therefore the single-prompt
decoder's after the same round, and its round is that decoder's round given the same logits:
exactness per row is the single-prompt proof (docs/decoder-exactness.md). Randomness: one
generator for the batch (the rows draw from it in turn each round) or one per row, which makes
each row draw exactly what the single-prompt decoder draws from that generator.

A draft block (a :class:`~circuits_llm.protocols.ContextDrafter` with a KV cache of its own) keeps
one state per row (:func:`~circuits_llm.draft_block.batch.block_rows`): each row's block cache is
begun on its own prefill features (``RaggedBackbone.prefill_features``), drafts from its own state
(every row's block step in one block call) and follows its own kept positions' features, exactly
as the single-prompt decoder's does; a row that leaves drops it.

In batch mode, options whose state is tied to a single sequence raise
:class:`~circuits_llm.decoding.warping.DecoderError` saying so (a constraint, forced runs): decode
those prompts one at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from circuits_llm.backbone.ragged_cache import ragged_backbone
from circuits_llm.decoding.acceptance import Transition, greedy_batch_outcomes, transition
from circuits_llm.decoding.batch_draft import draft_in_passes
from circuits_llm.decoding.constraint_path import round_component
from circuits_llm.decoding.context_drafting import kept_pairs, prefill_pairs
from circuits_llm.decoding.lookup import LookupIndex
from circuits_llm.decoding.metrics import (
    BatchResult,
    BatchRoundStats,
    DecodeResult,
    RoundKind,
    RoundStats,
    summarize,
    summarize_batch,
)
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.round_data import DraftResult
from circuits_llm.decoding.stopping import StopCondition, StopScanner
from circuits_llm.decoding.warping import DecoderError, SamplingConfig
from circuits_llm.protocols import BackboneStep

__all__ = ["BatchDecoder", "BatchDrafter", "RowDraft", "SpeculativeRows", "decode_batch"]


class BatchDecoder(Protocol):
    """What the batch loop reads of a decoder
    (:class:`~circuits_llm.decoding.autoregressive.AutoregressiveDecoder`)."""

    backbone: Any

    @property
    def device(self) -> torch.device:
        """Where token tensors are made."""
        ...

    def _clock(self) -> float:
        """Seconds after the device's queued work."""
        ...

    def _decide_token(self, row: Tensor, config: SamplingConfig,
                      generator: torch.Generator | None) -> int:
        """An autoregressive step's token from the logits ``row`` (V,)."""
        ...


@dataclass
class RowState:
    """One row of a batch between rounds (the single-prompt decoder's state, per row).

    Attributes:
        index: the row's place in the input.
        prompt: its prompt ids.
        scanner: its stop condition's scanner.
        generator: its randomness (shared with other rows, or its own).
        c: the decided, uncached next token.
        hidden: (1, d) the draft hidden state at the last cached token (``None``: none yet, a
            one-token prompt).
        lookup: its output indexed for the context copy (with a ``ContextLookup``).
        context: its own state of the decoder's context drafter (a draft block's cache:
            :class:`~circuits_llm.draft_block.batch.RaggedRow`), ``None`` without one or once the
            row has left the batch.
    """

    index: int
    prompt: list[int]
    scanner: StopScanner
    generator: torch.Generator | None
    c: int
    hidden: Tensor | None
    lookup: LookupIndex | None = None
    context: Any = None
    output: list[int] = field(default_factory=list)
    rounds: list[RoundStats] = field(default_factory=list)


@dataclass(frozen=True)
class RowDraft:
    """A row's draft for one round: the program that made it, the draft, the round's uniforms
    (``None`` when greedy) and ``L``, the drafts it verifies."""

    program: RoundProgram
    draft: DraftResult
    uniforms: Tensor | None
    length: int

    @property
    def block(self) -> Tensor:
        """(L + 1,) long: ``[c, d_1..d_L]``, the row's verify block."""
        return self.draft.block[0, :self.length + 1]


class BatchDrafter(Protocol):
    """Drafts and accepts the speculative rows of a batch round (:class:`SpeculativeRows`).

    Attributes:
        reads_prefill: whether :meth:`start` needs each row's prefill features (a draft block).
    """

    reads_prefill: bool

    def draft(self, rows: list[RowState], config: SamplingConfig) -> list[RowDraft]:
        """The drafts of ``rows`` (each with a hidden state), in order."""
        ...

    def accept(self, rows: list[RowState], drafts: list[RowDraft], step: BackboneStep,
               at: list[int], config: SamplingConfig) -> list[tuple[Transition, RoundKind, int,
                                                                     int]]:
        """Each drafting row's outcome, ``rows[i]`` from the verifier rows ``at[i]`` of the
        batch's ``step`` (B, m, .) -> per row (the transition, the round's kind, drafts verified,
        drafts accepted)."""
        ...

    def start(self, row: RowState, features: Tensor | None) -> None:
        """Give ``row`` its per-sequence drafting state: the context copy's index
        (``row.lookup``), a draft block's cache (``row.context``, begun on ``features`` (1, n, d)
        the draft hidden states of the prefill of ``row.prompt[:-1]``; ``None`` for a one-token
        prompt, or when :attr:`reads_prefill` is false)."""
        ...

    def follow(self, row: RowState, features: Tensor, move: Transition) -> None:
        """After ``row``'s round: its drafting state follows what it kept (``move``;
        ``features`` (1, move.keep - 1, d) the verify forward's draft hidden states of the kept
        block's positions but the last)."""
        ...


class SpeculativeRows:
    """The speculative decoder's round around one batched backbone call: the drafts of every
    drafting row in one pass (exact per row: :mod:`~circuits_llm.decoding.batch_draft`), then
    the accept program, the copy component and the transition of the single-prompt round
    (:class:`~circuits_llm.decoding.decoder.SpeculativeDecoder`) on each row's values. With a
    draft block, each row drafts from its own block state
    (:func:`~circuits_llm.draft_block.batch.block_rows`).

    Args:
        decoder: the speculative decoder (its programs, policy, lookup, context drafter and error
            reports).

    Raises:
        DecoderError: the decoder's context drafter is not a draft block's (whose state this
            batch cannot give each row).
    """

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        drafter = getattr(decoder, "_context_drafter", None)
        #: each row's draft-block state (with a context drafter), else None
        self.block_rows: Any = None
        if drafter is not None:
            # imported here: the draft block's room builds on this floor, not the other way
            from circuits_llm.draft_block.batch import block_rows
            self.block_rows = block_rows(drafter)
        self.reads_prefill = self.block_rows is not None

    def start(self, row: RowState, features: Tensor | None) -> None:
        lookup = self.decoder.lookup
        row.lookup = None if lookup is None else LookupIndex(lookup.max_ngram, row.prompt)
        if self.block_rows is not None:  # the single-prompt decoder's begin: the prefill's pairs
            row.context = self.block_rows.start(*prefill_pairs(
                row.prompt, features, self.decoder.backbone.hidden_size, self.decoder.device))

    def follow(self, row: RowState, features: Tensor, move: Transition) -> None:
        if row.lookup is not None:
            row.lookup.extend(move.emitted)
        if row.context is not None:  # the kept positions' pairs, from this round's verify
            self.block_rows.follow(row.context, *kept_pairs(features, move))

    def draft(self, rows: list[RowState], config: SamplingConfig) -> list[RowDraft]:
        """Every row's draft in one pass (:func:`~circuits_llm.decoding.batch_draft.draft_rows`:
        one head forward and one set of circuit passes for the rows; on a CPU in passes of at
        most :func:`~circuits_llm.decoding.batch_draft.rows_per_pass` rows, which keep a big
        head's outputs within the caches), each row's uniforms drawn from its generator in row
        order, as the single-prompt round draws them. A draft block drafts each row from its
        own state (:meth:`~circuits_llm.draft_block.batch.RaggedBlockRows.draft`)."""
        if not rows:
            return []
        decoder = self.decoder
        program: RoundProgram = decoder._program(config)
        device = decoder.device
        uniforms = None if config.greedy else [program.draw_uniforms(row.generator)
                                               for row in rows]
        hidden = torch.cat([row.hidden for row in rows])  # type: ignore[misc]
        c = torch.tensor([row.c for row in rows], device=device)
        tapes = None if uniforms is None else torch.stack(uniforms)
        if self.block_rows is not None:
            drafts = self.block_rows.draft(program, [row.context for row in rows], hidden, c,
                                           tapes, self._components(program, rows))
        else:
            drafts = self._draft_heads(program, rows, hidden, c, tapes)
        static = program.static_length
        if static is not None and self.block_rows is not None:  # a batch may draft fewer
            static = min(static, self.block_rows.drafts(len(rows), program.window))
        lengths = [static] * len(rows) if static is not None \
            else torch.stack([draft.length for draft in drafts]).tolist()  # one host read
        return [RowDraft(program, draft, None if uniforms is None else uniforms[b], lengths[b])
                for b, draft in enumerate(drafts)]

    def _components(self, program: RoundProgram, rows: list[RowState]) -> list[Tensor] | None:
        """Each row's copy component of this round (from its own output), or ``None`` without a
        lookup: what the single-prompt decoder's ``_component`` gives without a constraint."""
        decoder = self.decoder
        if decoder.lookup is None:
            return None
        return [round_component(decoder.lookup, row.lookup, None, -1, decoder._position,
                                program.window - 1, decoder.device, False) for row in rows]

    def _draft_heads(self, program: RoundProgram, rows: list[RowState], hidden: Tensor, c: Tensor,
                     tapes: Tensor | None) -> list[DraftResult]:
        """The circuit head's drafts of ``rows`` in passes of at most ``rows_per_pass`` rows."""
        return draft_in_passes(program, hidden, c, tapes, self._components(program, rows))

    def accept(self, rows: list[RowState], drafts: list[RowDraft], step: BackboneStep,
               at: list[int], config: SamplingConfig) -> list[tuple[Transition, RoundKind, int,
                                                                     int]]:
        """Greedy rows of one program without an extra draft column are decided together
        (:func:`~circuits_llm.decoding.acceptance.greedy_batch_outcomes`: one pass and one
        host read for the batch, which at batch 8 cost 3.2 ms a round one row at a time); the
        others through the accept program of the single-prompt round, row by row."""
        logits = step.verifier_logits
        programs = {id(draft.program) for draft in drafts}
        if config.greedy and len(programs) == 1 and all(d.draft.extra is None for d in drafts):
            outcomes = greedy_batch_outcomes(drafts[0].program.window, logits, at,
                                             [d.draft for d in drafts], [d.length for d in drafts])
        else:
            outcomes = [d.program.outcome(d.program.accept(logits[b, :d.length + 1], d.draft,
                                                           d.uniforms))
                        for b, d in zip(at, drafts, strict=True)]
        decided = []
        for row, draft, b, outcome in zip(rows, drafts, at, outcomes, strict=True):
            verified = BackboneStep(logits[b:b + 1, :draft.length + 1],
                                    step.draft_hidden[b:b + 1])
            self.decoder._explain_failure(outcome, draft.program, row.hidden, row.c, verified,
                                          config)
            move = transition(self.decoder.policy, outcome.draft, outcome.accepted, outcome.token)
            if not outcome.possible:  # every draft rejected, p_1 decided: an AR step in law
                decided.append((move, RoundKind.AUTOREGRESSIVE, 0, outcome.accepted))
            else:
                decided.append((move, RoundKind.SPECULATIVE, len(outcome.draft),
                                outcome.accepted))
        return decided


def decode_batch(decoder: BatchDecoder, drafter: BatchDrafter | None, prompts: list[list[int]],
                 conditions: Sequence[StopCondition], config: SamplingConfig,
                 generators: Sequence[torch.Generator | None]) -> BatchResult:
    """Decode ``prompts`` together (see the module docstring); arguments checked by the caller.

    Args:
        decoder: the decoder (its backbone, device, clock and autoregressive draw).
        drafter: drafts the rows with a hidden state (``None``: every row takes autoregressive
            steps).
        prompts: the prompts (B of them, non-empty).
        conditions: each row's stop condition.
        config: the sampling configuration of every row.
        generators: each row's generator (the same object for rows that share one).

    Returns:
        The :class:`~circuits_llm.decoding.metrics.BatchResult`: each row's tokens and summary,
        in the input's order, and the batch's rounds and totals.
    """
    backbone = ragged_backbone(decoder.backbone)
    device = decoder.device
    start = decoder._clock()
    hidden = backbone.start([prompt[:-1] for prompt in prompts])
    prefill_calls = int(any(len(prompt) > 1 for prompt in prompts))
    prefill_s = decoder._clock() - start if prefill_calls else 0.0
    rows = [RowState(b, prompt, condition.scanner(prompt), generator, prompt[-1],
                     hidden[b:b + 1] if len(prompt) > 1 else None)
            for b, (prompt, condition, generator) in
            enumerate(zip(prompts, conditions, generators, strict=True))]
    if drafter is not None:
        features = _prefill_features(backbone) if drafter.reads_prefill else None
        for row in rows:
            drafter.start(row, None if features is None or len(row.prompt) < 2
                          else features(row.index))
    results: dict[int, DecodeResult] = {}
    active = _finish(rows, results, prefill_s)
    if len(active) < len(rows):
        backbone.select([row.index for row in active])
    batch_rounds: list[BatchRoundStats] = []
    while active:
        t0 = decoder._clock()
        drafting = [row for row in active if drafter is not None and row.hidden is not None]
        made = iter([] if drafter is None else drafter.draft(drafting, config))
        drafts = [next(made) if drafter is not None and row.hidden is not None else None
                  for row in active]
        blocks = [torch.tensor([row.c], device=device) if draft is None else draft.block
                  for row, draft in zip(active, drafts, strict=True)]
        width = max(block.shape[0] for block in blocks)
        tokens = torch.zeros(len(active), width, dtype=torch.long, device=device)
        for b, block in enumerate(blocks):  # padding: the row's own c, rolled back after
            tokens[b] = block[0]
            tokens[b, :block.shape[0]] = block
        t1 = decoder._clock()
        step = backbone.extend(tokens)
        t2 = decoder._clock()
        at = [b for b, draft in enumerate(drafts) if draft is not None]
        decided = iter([] if drafter is None or not at else drafter.accept(
            [active[b] for b in at], [drafts[b] for b in at], step, at, config))
        moves, kinds = [], []
        for b, (row, draft) in enumerate(zip(active, drafts, strict=True)):
            if draft is None:
                token = decoder._decide_token(step.verifier_logits[b, 0], config, row.generator)
                moves.append(Transition((token,), token, 1))
                kinds.append((RoundKind.AUTOREGRESSIVE, 0, 0))
            else:
                move, kind, drafted, accepted = next(decided)
                moves.append(move)
                kinds.append((kind, drafted, accepted))
        backbone.keep([move.keep for move in moves])
        t3 = decoder._clock()
        for b, (row, move, (kind, drafted, accepted)) in enumerate(
                zip(active, moves, kinds, strict=True)):
            row.hidden = step.draft_hidden[b:b + 1, move.keep - 1]
            row.c = move.next_token
            row.output.extend(move.emitted)
            if drafter is not None:
                drafter.follow(row, step.draft_hidden[b:b + 1, :move.keep - 1], move)
            row.rounds.append(RoundStats(kind, drafted, accepted, len(move.emitted),
                                         draft_s=t1 - t0, verify_s=t2 - t1, accept_s=t3 - t2,
                                         total_s=t3 - t0))
        batch_rounds.append(BatchRoundStats(len(active), width, sum(len(m.emitted) for m in moves),
                                            t1 - t0, t2 - t1, t3 - t2, t3 - t0))
        still = _finish(active, results, prefill_s)
        if len(still) < len(active):
            place = {id(row): b for b, row in enumerate(active)}
            backbone.select([place[id(row)] for row in still])
        active = still
    ordered = tuple(results[b] for b in range(len(rows)))
    return BatchResult(ordered, batch_rounds,
                       summarize_batch(ordered, batch_rounds, prefill_calls, prefill_s))


def _prefill_features(backbone: Any) -> Any:
    """The backbone's ``prefill_features`` (row -> (1, n, d)), or one clear error without it."""
    features = getattr(backbone, "prefill_features", None)
    if not callable(features):
        raise DecoderError(
            f"a draft block in a batch begins each row's cache with its prefill features, which "
            f"{type(backbone).__name__} does not keep (no prefill_features method): decode these "
            f"prompts one at a time")
    return features


def _finish(rows: list[RowState], results: dict[int, DecodeResult], prefill_s: float
            ) -> list[RowState]:
    """Record the result of every row whose stop condition is met (its output cut where
    ``generate`` stops) and drop its drafting state; the rows still decoding, in order."""
    active = []
    for row in rows:
        keep = row.scanner.keep(row.output)
        if keep is None:
            active.append(row)
            continue
        row.context, row.lookup = None, None  # a row that leaves drops its cache
        output = row.output[:keep]
        calls = int(len(row.prompt) > 1)
        results[row.index] = DecodeResult(
            torch.tensor(output, dtype=torch.long), row.rounds,
            summarize(row.rounds, len(output), calls, prefill_s if calls else 0.0))
    return active
