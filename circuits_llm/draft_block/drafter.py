"""Recursive drafting from a draft block (FastMTP), exact under the decoder's verifier, with a KV
cache that follows the verifier's.

Alignment (as for the heads): between rounds the backbone caches ``x_0..x_{N-2}``, the seed
``hidden`` is its feature ``h_{N-2}`` and ``c = x_{N-1}`` is decided. The block's position ``j``
reads ``(h_j, x_{j+1})`` and gives the law of ``x_{j+2}``; its cache holds the positions whose
pair is *verified*.

A round (:class:`BlockRoundProgram`):

1. step 1 runs the positions still pending (the features of the previous round's accepted
   positions, see below) and the round's first position ``(h_{N-2}, c)`` in one block call; these
   are all real pairs and stay cached. Its last output ``o_1`` gives ``q_1``, the law of ``d_1``
   over the draft vocabulary (sampling: the warped softmax of the block's logits; greedy: its
   argmax);
2. step ``i = 2..k`` runs ``(o_{i-1}, d_{i-1})`` (the block's own output and draft, as in
   FastMTP) at the next position, attending to the cache, and gives ``q_i`` and ``d_i``; these
   entries are speculative;
3. the verifier accepts with ``min(1, p/q)`` and the residual (:class:`~circuits_llm.decoding.
   round.AcceptProgram`, shared with the circuit heads): each ``d_i`` is a draw of exactly the
   ``q_i`` handed to it, given everything drawn before, which is all the lemma of
   docs/decoder-exactness.md needs.

The decoder's other modes (issue 44, item 2(b)) apply to the recursion as to a head's draft: a
``draft_length`` rule reads the laws the drafts were drawn from; the context copy is one more
component of the draft's mixture (its proposal fed to the block as drafts, the recursion after
it, ``q`` the mixture's conditionals); under a constraint with ``PRODUCT`` drafting every step's
law is restricted to the tokens the automaton allows, renormalised
(:meth:`BlockRoundProgram.constrained_draft`). Every path runs the first step exactly once a round.

After the round (:meth:`BlockDrafter.follow`) the speculative entries are cropped and the kept
positions' pairs, whose features the verify forward already computed (``step.draft_hidden``),
become pending: they join the next round's first block call, so the cache follows the verifier
with no extra backbone call and no extra block call. :meth:`BlockDrafter.flush` runs the pending
pairs at once (the tests compare the cache with a fresh prefill of the block after it). That cache
following is :class:`~circuits_llm.draft_block.follower.BlockCacheFollower`, shared with the
circuit on the block
(:class:`~circuits_llm.draft_block.circuit_drafter.BlockCircuitDrafter`, whose round runs only the
first step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_llm.decoding.constrained import ConstraintTracker
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup, mixed_conditionals, unpack
from circuits_llm.decoding.round import AcceptProgram
from circuits_llm.decoding.round_data import DraftResult
from circuits_llm.decoding.warping import DecoderError, SamplingConfig
from circuits_llm.draft_block.batch_depth import BatchDepth
from circuits_llm.draft_block.block import DraftBlock, DraftBlockError
from circuits_llm.draft_block.draws import draw_step
from circuits_llm.draft_block.follower import BlockCacheFollower
from circuits_llm.draft_block.step import BlockStepMode
from circuits_llm.draft_block.weights import DraftWeights
from circuits_llm.runtime.compiling import Compiler

__all__ = ["BlockDrafter", "BlockRoundProgram"]


class BlockDrafter(BlockCacheFollower):
    """A :class:`~circuits_llm.protocols.ContextDrafter` over a :class:`DraftBlock`: recursive
    drafting (FastMTP) from the block's KV cache and the pending features of one sequence
    (:class:`BlockCacheFollower`).

    With the decoder it takes every ``draft_length`` rule (the rule reads the recursion's own
    laws, as it reads a head's conditionals), the context copy (``lookup``: the recursion mixed
    with the copy, :class:`BlockRoundProgram`) and a constraint, ``FREE`` or ``PRODUCT`` (each
    step's law restricted to the tokens the automaton allows after the drafts so far:
    :meth:`BlockRoundProgram.constrained_draft`).

    Args:
        block: the draft block.
        steps: ``k``, recursive drafts per round (default: the ``block.steps`` it was trained
            for). The weights are shared across steps, so the recursion runs to any depth; beyond
            the trained depths each further draft is accepted less often, and a longer window pays
            where the text repeats (greedy decoding of code, with the context copy).
        step_mode: when the block's calls run compiled (:class:`BlockCacheFollower`).
        weights: how the block's projections are held (:class:`BlockCacheFollower`; default: int8
            on a CPU).
        batch_depth: in a batch of prompts, the recursion's depth by the number of rows drafting
            (:class:`~circuits_llm.draft_block.batch_depth.BatchDepth`; ``None``: ``k`` always).
            One prompt alone always drafts ``k``.
        sampled_steps: the drafts of a sampled round (``None``: ``k``): its round program is a
            window of ``sampled_steps + 1``, so its rounds are those of a drafter of that depth.
            Greedy rounds draft ``k``: the drafts the context copy proposes cost no readout there and
            are accepted in long runs where the text repeats, while a sampled draft costs a
            readout and its draw, and past the trained depth is rarely accepted (journal sections
            17-18: in bfloat16, 9 drafts greedy and 4 sampled).
        greedy_exit: a probability in (0, 1), or ``None`` (default: never): a greedy round of one
            prompt stops drafting after a draft to which the block gives its argmax less than
            this (never while the drafts follow the copy's proposal). Greedy output is the argmax chain
            whatever is drafted, so this only saves the readouts and steps of drafts that are
            rarely accepted: on text the block does not know, most of a deep window (journal
            section 20: chat prompts 1.01-1.09x -> 1.12-1.17x plain decoding at 0.3). One host
            read a step; a batch's rows draft to their depth as before.
        sampled_exit: the same rule for a sampled round of one prompt (``None``, the default:
            never). Where a round stops depends only on the drafts (the block's law at each is a
            function of the drafts before it), never on the target's law nor on which of the
            copy's mixture components drew them, so ``L`` stays a stopping time of the drafts and
            the law stays exact (docs/decoder-exactness.md). The unsure draft is still verified;
            the drafts after it are not drawn. A sampled draft is accepted with probability
            ``sum min(p, q)``, which a flat ``q`` rarely makes large, and the drafts after a
            rejected one are never read.

    A round that stops early verifies only what it drafted (:meth:`BlockRoundProgram.verified`).

    Attributes:
        window: ``k + 1``: the verified token and the block's ``k`` recursive drafts.
        draft_tokens: the block's draft vocabulary (``None``: all ``V``).

    Raises:
        DraftBlockError: ``steps`` is not a positive integer.
    """

    def __init__(self, block: DraftBlock, steps: int | None = None, *,
                 step_mode: BlockStepMode = BlockStepMode.AUTO,
                 weights: DraftWeights = DraftWeights.AUTO,
                 batch_depth: BatchDepth | None = None,
                 sampled_steps: int | None = None, greedy_exit: float | None = None,
                 sampled_exit: float | None = None) -> None:
        super().__init__(block, step_mode, weights)
        for name, value in (("greedy_exit", greedy_exit), ("sampled_exit", sampled_exit)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not 0.0 < value < 1.0):
                raise DraftBlockError(f"{name} must be None or a probability in (0, 1), got "
                                      f"{value!r}")
        self.greedy_exit = greedy_exit
        self.sampled_exit = sampled_exit
        if batch_depth is not None and not isinstance(batch_depth, BatchDepth):
            raise DraftBlockError(f"batch_depth must be a BatchDepth or None, got "
                                  f"{batch_depth!r}")
        self.batch_depth = batch_depth
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                                  or steps < 1):
            raise DraftBlockError(f"steps must be a positive integer (recursive drafts per "
                                  f"round), got {steps!r}")
        self.window: int = block.window if steps is None else steps + 1
        if sampled_steps is not None and (isinstance(sampled_steps, bool)
                                          or not isinstance(sampled_steps, int)
                                          or not 1 <= sampled_steps <= self.window - 1):
            raise DraftBlockError(f"sampled_steps must be an int in 1..{self.window - 1} (the "
                                  f"drafts of a round), got {sampled_steps!r}")
        self.sampled_steps = sampled_steps
        self.draft_tokens: Tensor | None = block.draft_tokens

    def exit_below(self, greedy: bool) -> float | None:
        """The exit threshold of a greedy or a sampled round (``greedy_exit`` or
        ``sampled_exit``; ``None``: the round drafts its whole window)."""
        return self.greedy_exit if greedy else self.sampled_exit

    @property
    def stops_early(self) -> bool:
        """Whether some round may verify fewer drafts than its window (an exit is set): the
        decoder then prepares verify blocks of every length."""
        return self.greedy_exit is not None or self.sampled_exit is not None

    @property
    def batch_most(self) -> int:
        """The most drafts a round of a batch draws: the sampled depth when the drafter has one
        (deeper greedy rounds pay for one prompt, not in a batch, whose verify and drafting grow
        with its rows: journal section 17, 7 drafts at batch 4 1.24x batched plain decoding
        against 1.28x at 5), else ``k``."""
        return self.sampled_steps or self.window - 1

    def next_step(self, output: Tensor, token: Tensor) -> Tensor:
        """A recursive step: the block's own ``output`` (1, d) and the draft ``token`` (1,) at the
        next position (a speculative entry, cropped by :meth:`follow`) -> (1, d)."""
        return self.step(self.cache, output[:, None], token[None])[:, -1]

    # ------------------------------------------------------------------ the decoder's contract
    @staticmethod
    def decoding_problem(lookup: ContextLookup | None, draft_length: DraftLength) -> str | None:
        """Why the decoder cannot draft with this drafter given ``lookup`` and ``draft_length``,
        or ``None``: the recursion takes the context copy and every rule."""
        return None

    def round_program(self, config: SamplingConfig, *, compile: bool = False,
                      compiler: Compiler | None = None, draft_length: DraftLength | None = None,
                      lookup: ContextLookup | None = None) -> BlockRoundProgram:
        """The round's program for ``config`` (:class:`BlockRoundProgram`) verifying as many
        drafts as ``draft_length`` says (``None``: all ``k``), mixed with the context copy when
        ``lookup`` is given."""
        return BlockRoundProgram(self, config, compile=compile, compiler=compiler,
                                 draft_length=draft_length, lookup=lookup)


class BlockRoundProgram(AcceptProgram):
    """One round with a draft block: :meth:`draft` (``k`` recursive block steps) or, under a
    constraint with ``PRODUCT`` drafting, :meth:`constrained_draft`, and the shared accept
    program. ``compile`` compiles the accept part and the block's calls
    (:meth:`BlockCacheFollower.compile_steps`); the readouts and draws run eager.

    Args:
        drafter: the :class:`BlockDrafter` whose block and cache the drafts come from.
        config: the sampling configuration (greedy when ``temperature == 0``).
        draft_length: how many drafts a round verifies
            (:class:`~circuits_llm.decoding.draft_length.DraftLength`; ``None``: all ``k``). A
            rule that reads conditionals reads the laws the recursion drew from (greedy: the
            block's plain softmax); every ``k`` drafts are drawn, and ``L`` is a stopping time of
            them (that module's argument), so the law stays exact.
        lookup: mix the context copy into the recursion
            (:class:`~circuits_llm.decoding.lookup.ContextLookup`; every draft then takes the
            round's copy component ``[s_1..s_k, m, w]``). The mixture is ``(1 - w)`` the recursion
            and ``w`` the proposal ``s_1..s_m`` followed by the recursion from it: one more uniform
            picks the copy (greedy: whenever ``m > 0`` and ``w > 0``), whose tokens are fed to the
            block as drafts, and ``q`` is the mixture's exact conditionals along the drafts
            (:func:`~circuits_llm.decoding.lookup.mixed_conditionals` of the recursion's laws:
            after the proposal both components continue with the recursion, so no cut is needed).
            Under a constraint the proposal is cut before its first token outside the draft
            vocabulary or forbidden by the automaton (a function of the history: exact).
    """

    #: :meth:`draft` takes a ``depth`` and draws only that many drafts (the decoder's
    #: :class:`~circuits_llm.decoding.draft_depth.AdaptiveDepth` asks for it)
    draws_by_depth = True

    def __init__(self, drafter: BlockDrafter, config: SamplingConfig, *, compile: bool = False,
                 compiler: Compiler | None = None, draft_length: DraftLength | None = None,
                 lookup: ContextLookup | None = None) -> None:
        rule = DraftLength.fixed() if draft_length is None else draft_length
        if not isinstance(rule, DraftLength):
            raise DraftBlockError(f"draft_length must be a DraftLength, got {draft_length!r}")
        # a sampled round drafts at most the drafter's sampled_steps: its program is that window
        window = drafter.window if config.greedy or drafter.sampled_steps is None \
            else drafter.sampled_steps + 1
        try:
            rule.check(window)
        except DecoderError as error:
            raise DraftBlockError(str(error)) from error
        label = f"draft block, window {window}, {'greedy' if config.greedy else 'sampling'}"
        super().__init__(config, window, drafter.vocab_size, drafter.draft_tokens,
                         drafter.device, compile=compile, compiler=compiler, label=label)
        if lookup is not None and not isinstance(lookup, ContextLookup):
            raise DraftBlockError(f"lookup must be None or a ContextLookup, got {lookup!r}")
        self.drafter = drafter
        if compile:
            drafter.compile_steps(compiler)
        self.lookup = lookup
        self.draft_length = rule
        #: the number of drafts every round verifies, when the rule fixes it (else None)
        self.static_length = rule.static_length(self.window)
        self.tape_length = self.window - 1

    def draw_uniforms(self, generator: torch.Generator | None) -> Tensor:
        """One round's float64 uniforms: ``k`` for the drafts' inverse-CDF draws, the one that
        picks the copy (with a ``lookup``), then ``n`` for acceptance (read from the end by the
        accept program)."""
        extra = 0 if self.lookup is None else 1
        return torch.rand(self.tape_length + extra + self.window, generator=generator,
                          dtype=torch.float64, device=self.drafter.device)

    def verified(self, draft: DraftResult) -> int:
        """``L`` on the host without a constraint: the rule's fixed number, or a read of
        ``draft.length`` (under a constraint the decoder reads ``draft.length``). A round that
        may stop early (the drafter's exit for this mode) is read too: the drafts it did not draw
        are not verified."""
        if self.static_length is not None and \
                self.drafter.exit_below(self.config.greedy) is None:
            return self.static_length
        return self.window - 1 if draft.length is None else int(draft.length)

    def draft(self, hidden: Tensor, c: Tensor, uniforms: Tensor | None,
              component: Tensor | None = None, *, depth: int | None = None) -> DraftResult:
        """``hidden`` (1, d) the seed feature, ``c`` (1,) long the verified token, ``uniforms``
        from :meth:`draw_uniforms` (None when greedy), ``component`` the round's copy component
        (n+1,) float64 (exactly with a ``lookup``) -> :class:`DraftResult` with ``q`` (k, K)
        float64, the law each draft was drawn from (None when greedy).

        ``depth``: draw only the first ``depth <= k`` drafts this round (a batch's
        :class:`~circuits_llm.draft_block.batch.BatchDepth`, fixed before the round's draws, so
        ``L`` stays a stopping time): ``L`` is at most ``depth``; the rows of ``q`` and the
        tokens after it are zeros, never verified (as after a constraint's dead end)."""
        return self._recurse(hidden, c, uniforms, None, component, depth)

    def constrained_draft(self, hidden: Tensor, c: Tensor, uniforms: Tensor | None,
                          constraint: ConstraintTracker, component: Tensor | None = None
                          ) -> DraftResult:
        """:meth:`draft` under a constraint (``PRODUCT`` drafting): step ``i``'s law is the
        block's restricted to the draft-vocabulary tokens the automaton allows after ``c,
        d_1..d_{i-1}`` (``constraint.state`` is the state after ``c``) and renormalised, the
        greedy draft its argmax. The recursion stops before a state that allows no draftable
        token: ``L`` is at most the drafts before it (a stopping time of the drafts), and a round
        that can draft nothing verifies ``[c]`` alone (``possible`` false: an autoregressive
        round). ``q``'s row ``i`` is exactly the restricted law ``d_i`` was drawn from (with a
        ``lookup``: that law mixed with the copy ``component``, cut where the constraint forbids
        it)."""
        return self._recurse(hidden, c, uniforms, constraint, component)

    def _unsure(self, logits: Tensor, step: int, limit: int) -> bool:
        """Whether the round stops drafting after this step's draft: with the drafter's exit
        for this mode (``greedy_exit`` or ``sampled_exit``), when the block's own law (``logits``
        (K,), before any warping or mixture) gives its argmax less than that probability (not at
        the last draft, which ends the round anyway). It reads nothing of the target."""
        exit_below = self.drafter.exit_below(self.config.greedy)
        if exit_below is None or step == limit - 1:
            return False
        peak = torch.exp(logits.max().double() - torch.logsumexp(logits.double(), -1))
        return float(peak) < exit_below

    def _allowed(self, constraint: ConstraintTracker, state: int) -> Tensor:
        """(K,) bool: the draft-vocabulary tokens the automaton allows in ``state``."""
        mask = constraint.automaton.mask(state, self.drafter.device)
        return mask if self.draft_tokens is None else mask[self.draft_tokens]

    def _allowed_copy(self, component: Tensor, constraint: ConstraintTracker) -> Tensor:
        """``component`` with its proposal cut before its first token outside the draft
        vocabulary (a negative entry) or forbidden by the automaton from ``constraint.state``."""
        proposal, count, _ = unpack(component)
        state, allowed = constraint.state, 0
        for entry in proposal[:int(count)].tolist():
            if entry < 0 or not bool(self._allowed(constraint, state)[entry]):
                break
            token = entry if self.draft_tokens is None else int(self.draft_tokens[entry])
            state = constraint.automaton.advance(state, token)
            allowed += 1
        if allowed == int(count):
            return component
        cut = component.clone()
        cut[allowed:proposal.shape[0]] = 0
        cut[-2] = allowed
        if allowed == 0:
            cut[-1] = 0.0
        return cut

    def copying(self, component: Tensor | None, uniforms: Tensor | None) -> tuple[bool, Tensor]:
        """Whether this round drafts the copy's proposal (``component`` (n+1,) float64, the
        round's uniforms ``uniforms`` or ``None`` when greedy), and the proposal (k,) long
        (shared with the batch's ``RaggedBlockRows``)."""
        if (component is None) != (self.lookup is None):
            raise DraftBlockError("a block round program built with a ContextLookup drafts with "
                                  "a copy component, and only then: pass one exactly when lookup "
                                  "is set")
        if component is None:
            return False, torch.zeros(0, dtype=torch.long)
        proposal, count, weight = unpack(component)
        active = int(count) > 0 and float(weight) > 0
        chosen = uniforms is None or float(weight) > float(uniforms[self.tape_length])
        return active and chosen, proposal.to(self.drafter.device)

    def _recurse(self, hidden: Tensor, c: Tensor, uniforms: Tensor | None,
                 constraint: ConstraintTracker | None, component: Tensor | None,
                 depth: int | None = None) -> DraftResult:
        """The recursion: the block's first step, then a step per further draft, up to ``depth``
        drafts (see :meth:`draft` and :meth:`constrained_draft`)."""
        greedy = uniforms is None
        if greedy != self.config.greedy:
            raise DraftBlockError("uniforms must be given exactly when sampling")
        if component is not None and constraint is not None:
            component = self._allowed_copy(component, constraint)
        copying, proposal = self.copying(component, uniforms)
        count = 0 if component is None else int(unpack(component)[1])
        drafts, device = self.window - 1, self.drafter.device
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)
                                  or not 1 <= depth <= drafts):
            raise DraftBlockError(f"depth must be an int in 1..{drafts} (the drafts a round "
                                  f"draws), got {depth!r}")
        limit = drafts if depth is None else depth
        wants_laws = not greedy or self.draft_length.needs_conditionals
        with torch.no_grad():
            output = self.drafter.first_step(hidden, c)  # once a round, whatever follows
            indices = torch.zeros(drafts, dtype=torch.long, device=device)
            size = self.vocab_size if self.draft_tokens is None else self.draft_tokens.numel()
            q = torch.zeros(drafts, size, dtype=torch.float64, device=device) \
                if wants_laws else None
            finite, reachable = [], limit
            # an exit never stops a round while its drafts follow the copy's proposal (they cost
            # no readout greedy, and are accepted in runs); a function of the drafts, not of which
            # component drew them, so that L stays a stopping time of the drafts
            exits, following = self.drafter.exit_below(greedy) is not None, count > 0
            state = -1 if constraint is None else constraint.state
            # greedy drafts the copy proposes need no logits (nothing reads them), and when the
            # proposal fills the round no later step needs the block's output either
            copied = count if copying and not wants_laws and constraint is None else 0
            for step in range(limit):
                if step < copied:
                    indices[step] = proposal[step]
                    if copied < limit:  # a later draft reads the block's output
                        token = proposal[step] if self.draft_tokens is None else \
                            self.draft_tokens[proposal[step]]
                        output = self.drafter.next_step(output, token[None])
                    continue
                logits = self.drafter.block.logits(output)[0]  # (K,)
                finite.append(torch.isfinite(logits).all())
                if constraint is not None:
                    allowed = self._allowed(constraint, state)
                    if not bool(allowed.any()):  # nothing draftable: stop before this position
                        reachable = step
                        break
                    logits = logits.masked_fill(~allowed, float("-inf"))
                # the proposal's token (fed to the block as a draft), else a draw
                given = proposal[step] if copying and step < count else None
                index, token, law = draw_step(logits, self.config,
                                              None if uniforms is None else uniforms[step],
                                              self.draft_tokens, with_law=wants_laws, given=given)
                indices[step] = index
                if q is not None:
                    q[step] = law
                if constraint is not None:
                    state = constraint.automaton.advance(state, int(token))
                if exits:
                    following = following and step < count and (
                        given is not None or int(index) == int(proposal[step]))
                    if not following and self._unsure(logits, step, limit):
                        reachable = step + 1
                        break
                if step < limit - 1:
                    output = self.drafter.next_step(output, token[None])
            tokens = indices if self.draft_tokens is None else self.draft_tokens[indices]
            block = torch.cat([c.to(tokens.device), tokens])[None]
            head_ok = torch.stack(finite).all() if finite else torch.ones((), dtype=torch.bool,
                                                                           device=device)
            if component is not None and q is not None and count > 0 \
                    and float(unpack(component)[2]) > 0:  # else the mixture is q itself
                q = mixed_conditionals(q, indices, component.to(device))
            length = self.draft_length.decide(q, indices)
            possible = torch.ones((), dtype=torch.bool, device=device)
            if constraint is not None or reachable < drafts:
                length = length.clamp(max=reachable)
                possible = torch.tensor(reachable > 0, device=device)
            return DraftResult(block[0, 1:], block, None if greedy else q, head_ok, possible,
                               length)
