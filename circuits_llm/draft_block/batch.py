"""A draft block in a batch of prompts: each row keeps its own block state, exact per row.

A :class:`~circuits_llm.draft_block.follower.BlockCacheFollower` (a
:class:`~circuits_llm.draft_block.drafter.BlockDrafter` or a
:class:`~circuits_llm.draft_block.circuit_drafter.BlockCircuitDrafter`) keeps ONE sequence's state:
the block's KV cache, how many of its positions hold verified pairs, and the pending pairs of the
last round's kept positions. A batch (:mod:`circuits_llm.decoding.batch`) gives every row its own
state, which lives exactly the single-prompt decoder's life on that row:

* begun with the row's prefill pairs (the batched prefill's features at the row's own positions,
  equal to a prefill of the row alone: :mod:`circuits_llm.backbone.ragged_cache`);
* each round, the row's draft from its own state, its uniforms drawn from its generator in row
  order before any row drafts (as the batch does for heads);
* after the round, the kept positions' pairs from the row's own slice of the batch's verify
  forward (the speculative entries cropped);
* a row that leaves the batch drops its state (the batch loop forgets it).

Two ways to run a round's block steps (:data:`ONE_BLOCK_CALL`, :func:`block_rows`):

* :class:`RaggedBlockRows` (default): every row's block step in ONE call of the block's decode
  step (:meth:`~circuits_llm.draft_block.step.BlockStep.batch`): the rows' new pairs concatenated
  (not padded) through the fusion, projections and MLP, each row's attention on its own
  preallocated cache as in its single-prompt call. Recursive drafting then costs ``k`` block calls
  a round whatever the batch size; the circuit on the block one block call and one circuit pass
  for every row (:func:`~circuits_llm.decoding.batch_draft.draft_rows` on the rows' block outputs
  ``o_1``).
* :class:`BlockRows`: each row a shallow copy of the decoder's drafter (the block's weights, and a
  circuit drafter's head, shared; ``begin`` gives it its own empty cache), drafting with the
  drafter's own round program bound to the copy (the circuit on the block: each row's block
  step on its copy, then one circuit pass for every row): ``B`` block calls a step. The plain
  reference, and what a subclass of the two drafters (whose round program this module does not
  know) gets.

The decoder's copy of the context and its draft-length rule apply per row as in the
single-prompt round: each row's copy component comes from its own output, a row whose round
drafts the copy feeds the proposal's tokens to the block in place of draws, and each row's ``L``
is the rule on its own drafts and ``q``.

Exactness per row is the single-prompt argument (docs/decoder-exactness.md): every row's drafts
are drawn from exactly the ``q`` its own history gives (up to the float rounding of a linear
kernel given more rows), and verified by the shared accept program.
``tests/test_batch_block.py`` checks both ways: greedy output against ``generate``, draws against
the single-prompt decoder's, every draft against a fresh drafter's on the row's history, the law
by enumeration, and each row's cache against a fresh prefill.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from circuits_llm.decoding.batch_draft import draft_in_passes
from circuits_llm.decoding.lookup import mixed_conditionals, unpack
from circuits_llm.decoding.round_data import DraftResult
from circuits_llm.decoding.warping import DecoderError, SamplingConfig
from circuits_llm.draft_block.block import check_pairs
from circuits_llm.draft_block.circuit_drafter import BlockCircuitDrafter, BlockCircuitRoundProgram
from circuits_llm.draft_block.drafter import BlockDrafter, BlockRoundProgram
from circuits_llm.draft_block.draws import draw_step
from circuits_llm.draft_block.follower import BlockCacheFollower
from circuits_llm.draft_block.step import BlockKVCache

__all__ = ["ONE_BLOCK_CALL", "BlockRow", "BlockRows", "RaggedBlockRows", "RaggedRow", "batch_drafts",
           "block_rows"]

#: run every row's block step in one block call (:class:`RaggedBlockRows`); False: one call per
#: row (:class:`BlockRows`, the plain reference the tests compare with)
ONE_BLOCK_CALL = True


def block_rows(drafter: object) -> BlockRows | RaggedBlockRows:
    """The batch's per-row draft-block state for the decoder's ``drafter``: every row's block
    steps in one call (:class:`RaggedBlockRows`) when :data:`ONE_BLOCK_CALL` and the drafter is
    a ``BlockDrafter`` or ``BlockCircuitDrafter`` itself, else one call per row
    (:class:`BlockRows`: a subclass drafts with its own round program).

    Raises:
        DecoderError: ``drafter`` is not a draft block's ``BlockDrafter`` or
            ``BlockCircuitDrafter``.
    """
    if ONE_BLOCK_CALL and type(drafter) in (BlockDrafter, BlockCircuitDrafter):
        return RaggedBlockRows(drafter)
    return BlockRows(drafter)


def batch_drafts(drafter: object, rows: int, window: int) -> int:
    """The drafts a row draws in a round where ``rows`` rows draft with ``window``: the recursive
    drafter's :attr:`~circuits_llm.draft_block.drafter.BlockDrafter.batch_depth`, else all
    ``window - 1`` (a circuit on the block drafts its whole window)."""
    depth = getattr(drafter, "batch_depth", None)
    return window - 1 if depth is None else depth.drafts(rows, window - 1)


def _circuit_drafts(program: BlockCircuitRoundProgram, outputs: Tensor, c: Tensor,
                    uniforms: Tensor | None, components: list[Tensor] | None
                    ) -> list[DraftResult]:
    """The circuit on the block for every row: the rows' block outputs ``o_1`` (B, d) read by the
    circuit head as hidden states, with ``c`` (B,), ``uniforms`` (B, T) (``None`` when greedy)
    and each row's copy component (with the program's lookup), in passes of at most
    :func:`~circuits_llm.decoding.batch_draft.rows_per_pass` rows on a CPU -> one draft per
    row."""
    device = program.circuit.device
    return draft_in_passes(program, outputs.to(device), c.to(device), uniforms, components)


@dataclass
class BlockRow:
    """One row's draft-block state in a batch.

    Attributes:
        drafter: the row's own copy of the decoder's drafter (its cache, verified length and
            pending pairs; the block's weights shared).
        programs: the row's round programs by sampling configuration (recursive drafting only:
            a program reads the state of the drafter it was built for; a decoder's rule and
            lookup are fixed, so the configuration identifies the program).
    """

    drafter: BlockCacheFollower
    programs: dict[SamplingConfig, Any] = field(default_factory=dict)

    def program(self, like: Any) -> Any:
        """The round program of this row's drafter with the options of the decoder's program
        ``like`` (its configuration, draft-length rule and copy lookup; built once, eager)."""
        program = self.programs.get(like.config)
        if program is None:
            program = self.programs[like.config] = self.drafter.round_program(  # type: ignore[attr-defined]
                like.config, draft_length=like.draft_length, lookup=like.lookup)
        return program


class BlockRows:
    """The draft-block side of a batch round (see the module docstring).

    Args:
        drafter: the decoder's context drafter, a
            :class:`~circuits_llm.draft_block.follower.BlockCacheFollower` (``BlockDrafter`` or
            ``BlockCircuitDrafter``); it is only copied, its own state is never touched.

    Raises:
        DecoderError: ``drafter`` is another kind of context drafter, whose per-sequence state
            this module cannot give each row.
    """

    def __init__(self, drafter: object) -> None:
        if not isinstance(drafter, BlockCacheFollower) or not callable(
                getattr(drafter, "round_program", None)):
            raise DecoderError(
                f"a batch of prompts drafts with a draft block's BlockDrafter or "
                f"BlockCircuitDrafter (one cache per row), not {type(drafter).__name__}: decode "
                f"these prompts one at a time")
        self.drafter = drafter

    def start(self, features: Tensor, tokens: Tensor) -> BlockRow:
        """A row's state for a new sequence: ``features`` (1, m, d) the prefill's draft hidden
        states of its prompt's positions but the last two, ``tokens`` (m,) the token after each
        (as the single-prompt decoder begins its drafter)."""
        row = copy.copy(self.drafter)  # the weights shared; begin gives it its own empty cache
        row.begin(features, tokens)
        return BlockRow(row)

    @staticmethod
    def follow(row: BlockRow, features: Tensor, tokens: Tensor) -> None:
        """After a round: the row's cache drops its speculative entries and takes the kept
        positions' pairs ``features`` (1, m, d), ``tokens`` (m,) as pending."""
        row.drafter.follow(features, tokens)

    @staticmethod
    def flushed(row: BlockRow) -> tuple[Any, int]:
        """Run the row's pending pairs into its cache now (the next round would have) -> its
        cache and how many of its positions hold verified pairs (the tests compare it with a
        fresh prefill)."""
        row.drafter.flush()
        return row.drafter.cache, row.drafter.length

    def draft(self, program: Any, rows: list[BlockRow], hidden: Tensor, c: Tensor,
              uniforms: Tensor | None, components: list[Tensor] | None = None
              ) -> list[DraftResult]:
        """Every row's draft of one round.

        Args:
            program: the decoder's round program for this configuration (built on the decoder's
                own drafter; only its options and circuit are read here).
            rows: the drafting rows' states.
            hidden: (B, F) each row's seed feature (the backbone's draft hidden state at its last
                cached token; F the block's ``feature_size``).
            c: (B,) long each row's verified token.
            uniforms: (B, T) float64 each row's round uniforms (``None`` when greedy).
            components: each row's copy component (n+1,) float64, exactly when the program has
                a ``ContextLookup``.

        Returns:
            One :class:`~circuits_llm.decoding.round_data.DraftResult` per row, what the
            single-prompt round drafts from that row's state.
        """
        if type(program) is BlockCircuitRoundProgram:
            return self._draft_circuit(program, rows, hidden, c, uniforms, components)
        depth = batch_drafts(self.drafter, len(rows), program.window)
        return [row.program(program).draft(hidden[b:b + 1], c[b:b + 1],
                                           None if uniforms is None else uniforms[b],
                                           None if components is None else components[b],
                                           depth=depth)
                for b, row in enumerate(rows)]

    def drafts(self, rows: int, window: int) -> int:
        """Drafts each row draws in a round of ``rows`` drafting rows with ``window``."""
        return batch_drafts(self.drafter, rows, window)

    @staticmethod
    def _draft_circuit(program: BlockCircuitRoundProgram, rows: list[BlockRow], hidden: Tensor,
                       c: Tensor, uniforms: Tensor | None, components: list[Tensor] | None
                       ) -> list[DraftResult]:
        """Each row's block step on its own cache (``o_1``, what
        :meth:`~circuits_llm.draft_block.circuit_drafter.BlockCircuitRoundProgram.block_output`
        gives), then the circuit's passes for every row at once (in passes of at most
        :func:`~circuits_llm.decoding.batch_draft.rows_per_pass` rows on a CPU)."""
        with torch.no_grad():
            outputs = torch.cat([row.drafter.first_step(hidden[b:b + 1], c[b:b + 1])
                                 for b, row in enumerate(rows)])
        return _circuit_drafts(program, outputs, c, uniforms, components)


# ---------------------------------------------------------------- every row's block step in one call
@dataclass
class RaggedRow:
    """One row's draft-block state for :class:`RaggedBlockRows`: what a
    :class:`~circuits_llm.draft_block.follower.BlockCacheFollower` keeps for one sequence.

    Attributes:
        cache: the row's own preallocated block KV cache
            (:class:`~circuits_llm.draft_block.step.BlockKVCache`).
        length: its positions holding verified pairs (speculative ones come after).
        pending: the pairs not yet run, ``(hidden (m, d), tokens (m,))``, or ``None``.
    """

    cache: BlockKVCache
    length: int = 0
    pending: tuple[Tensor, Tensor] | None = None


class RaggedBlockRows:
    """The draft-block side of a batch round with every row's block step in ONE call.

    Each row keeps its own KV cache (:class:`RaggedRow`, the single-prompt drafter's state). A
    step is :meth:`~circuits_llm.draft_block.step.BlockStep.batch` of the drafter's own decode
    step: the rows' new pairs, of different counts, run through the block's row-wise layers
    together, and each row attends over its own cache at its own positions, as the single-prompt
    drafter's call on that row does. So a round costs ``k`` block calls whatever ``B``
    (recursive drafting), or one (the circuit on the block, then one circuit pass:
    :func:`~circuits_llm.decoding.batch_draft.draft_rows`), without gathering the rows' caches
    into a padded one (which cost a batch of 4 as much drafting as 2 single prompts;
    docs/journal.md, section 17).

    Each recursive step's draws are :func:`~circuits_llm.draft_block.draws.draw_step` on the
    batched logits, shared with the single-prompt drafter.

    Args:
        drafter: the decoder's ``BlockDrafter`` or ``BlockCircuitDrafter`` (its block, its decode
            step and its kind are read; its own state is never touched).
    """

    def __init__(self, drafter: object) -> None:
        BlockRows(drafter)  # the same refusal of other context drafters
        self.drafter: BlockCacheFollower = drafter  # type: ignore[assignment]
        self.block = self.drafter.block
        self.step = self.drafter.step

    def drafts(self, rows: int, window: int) -> int:
        """As :meth:`BlockRows.drafts`."""
        return batch_drafts(self.drafter, rows, window)

    def _pairs(self, features: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """``features`` (1, m, F) and ``tokens`` (m,) checked -> the ``h`` the block reads (m, d)
        (:meth:`~circuits_llm.draft_block.block.DraftBlock.read_features`) and (m,), on the
        block's device."""
        hidden, tokens = check_pairs(features, tokens, self.block.feature_size,
                                     self.drafter.device)
        return self.block.read_features(hidden)[0], tokens

    def start(self, features: Tensor, tokens: Tensor) -> RaggedRow:
        """A row's state for a new sequence (as ``BlockCacheFollower.begin``)."""
        hidden, tokens = self._pairs(features, tokens)
        return RaggedRow(self.step.new_cache(), 0, (hidden, tokens) if tokens.numel() else None)

    def follow(self, row: RaggedRow, features: Tensor, tokens: Tensor) -> None:
        """As ``BlockCacheFollower.follow``: crop the speculative entries, the kept pairs pending."""
        hidden, tokens = self._pairs(features, tokens)
        if row.pending is not None:
            hidden = torch.cat([row.pending[0], hidden])
            tokens = torch.cat([row.pending[1], tokens])
        row.cache.truncate(row.length)
        row.pending = (hidden, tokens) if tokens.numel() else None

    def flushed(self, row: RaggedRow) -> tuple[Any, int]:
        """As :meth:`BlockRows.flushed`: the row's pending pairs run -> its cache and length."""
        row.cache.truncate(row.length)
        if row.pending is not None:
            self._step([row], [row.pending[0]], [row.pending[1]])
            row.length += row.pending[1].numel()
            row.pending = None
        return row.cache, row.length

    def draft(self, program: Any, rows: list[RaggedRow], hidden: Tensor, c: Tensor,
              uniforms: Tensor | None, components: list[Tensor] | None = None
              ) -> list[DraftResult]:
        """Every row's draft (see :meth:`BlockRows.draft` for the arguments)."""
        device = self.drafter.device
        with torch.no_grad():
            features, tokens = [], []
            for b, row in enumerate(rows):  # the pending pairs, then the round's own pair
                seed = self.block.read_features(hidden[b:b + 1].to(device))
                token = c[b:b + 1].to(device, torch.long)
                if row.pending is not None:
                    seed = torch.cat([row.pending[0], seed.to(row.pending[0].dtype)])
                    token = torch.cat([row.pending[1], token])
                    row.pending = None
                row.length += token.numel()
                features.append(seed)
                tokens.append(token)
            output = self._step(rows, features, tokens)
            if type(program) is BlockCircuitRoundProgram:
                return _circuit_drafts(program, output, c, uniforms, components)
            if type(program) is not BlockRoundProgram:
                raise DecoderError(f"one block call for every row knows the BlockRoundProgram and "
                                   f"the BlockCircuitRoundProgram, not {type(program).__name__}")
            return self._recursive(program, rows, output, c.to(device), uniforms, components)

    def _recursive(self, program: BlockRoundProgram, rows: list[RaggedRow], output: Tensor,
                   c: Tensor, uniforms: Tensor | None, components: list[Tensor] | None
                   ) -> list[DraftResult]:
        """``k`` recursive steps for every row: (B, d) outputs -> each row's draft, ``q`` and
        ``L``, as :meth:`BlockRoundProgram.draft` makes them for one row: a row whose round
        drafts the copy's proposal (``program.copying``: its component and its uniform) feeds the
        proposal's tokens to the block in place of draws, its ``q`` is the mixture's
        (:func:`~circuits_llm.decoding.lookup.mixed_conditionals`), and its ``L`` is the
        program's rule on it."""
        block, config, window = self.block, program.config, program.window
        ids, device, batch = block.draft_tokens, c.device, len(rows)
        drafts = window - 1
        depth = self.drafts(batch, window)  # drawn this round; the rest stay zeros, unverified
        given = torch.zeros(batch, drafts, dtype=torch.bool, device=device)
        proposals = torch.zeros(batch, drafts, dtype=torch.long, device=device)
        for b in range(batch if components is not None else 0):
            copying, proposal = program.copying(components[b], None if uniforms is None
                                                else uniforms[b])
            count = min(int(unpack(components[b])[1]), drafts) if copying else 0
            given[b, :count] = True
            proposals[b, :count] = proposal[:count].to(device)
        wants_laws = uniforms is not None or program.draft_length.needs_conditionals
        indices, laws, finite = [], [], []
        # greedy steps the copy proposes in every row need no logits, and no block step is
        # needed after the last step that reads them (as in the single-prompt round)
        copied = [not wants_laws and bool(given[:, step].all()) for step in range(depth)]
        for step in range(depth):
            if copied[step]:
                index = proposals[:, step]
            else:
                logits = block.logits(output)  # (B, K)
                finite.append(torch.isfinite(logits).all(-1))
                index, _, law = draw_step(logits, config, None if uniforms is None
                                          else uniforms[:, step], ids, with_law=wants_laws)
                index = torch.where(given[:, step], proposals[:, step], index)
                if law is not None:
                    laws.append(law)
            token = index if ids is None else ids.to(device)[index]
            indices.append(index)
            if step < depth - 1 and not all(copied[step + 1:]):
                output = self._step(rows, list(output[:, None]), list(token[:, None]))
        for _ in range(drafts - depth):  # never verified (L <= depth), as after a dead end
            indices.append(torch.zeros_like(indices[0]))
            if laws:
                laws.append(torch.zeros_like(laws[0]))
        chosen = torch.stack(indices, 1)  # (B, k) draft-vocabulary indices
        tokens = chosen if ids is None else ids.to(device)[chosen]
        blocks = torch.cat([c[:, None], tokens], 1)
        head_ok = torch.stack(finite, 1).all(1) if finite else \
            torch.ones(batch, dtype=torch.bool, device=device)
        q = torch.stack(laws, 1) if wants_laws else None  # (B, k, K)
        possible = torch.ones((), dtype=torch.bool, device=device)
        results = []
        for b in range(batch):
            q_b = None if q is None else q[b]
            if components is not None and q_b is not None:
                q_b = mixed_conditionals(q_b, chosen[b], components[b].to(device))
            length = program.draft_length.decide(q_b, chosen[b]).clamp(max=depth)
            results.append(DraftResult(blocks[b, 1:], blocks[b:b + 1],
                                       None if uniforms is None else q_b, head_ok[b], possible,
                                       length))
        return results

    def _step(self, rows: list[RaggedRow], features: list[Tensor], tokens: list[Tensor]
              ) -> Tensor:
        """One block call appending row ``b``'s ``features[b]`` (m_b, d) and ``tokens[b]``
        (m_b,) to its own cache -> (B, d) each row's output at its last new pair."""
        return self.step.batch([row.cache for row in rows], features, tokens)
