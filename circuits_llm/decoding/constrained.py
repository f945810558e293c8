"""Constrained decoding: the output law is the LM masked by a token automaton, renormalised.

A constraint (:class:`~circuits_llm.constraints.Regex`, :class:`~circuits_llm.constraints.JsonSchema`
or a built :class:`~circuits_llm.constraints.TokenAutomaton`) defines, after any output prefix, the
set of allowed next tokens. The **target** at every position is the model's logits with every
other token set to ``-inf``, then warped (temperature, top-k, top-p) and normalised: what outlines
and xgrammar sample from, and what :class:`~circuits_llm.decoding.decoder.AutoregressiveDecoder`
samples from with ``constraint=``.

The speculative decoder keeps that law exactly, whatever it drafts: position ``k`` of a verify
block is masked by the automaton's state after ``c, d_1..d_{k-1}``, and the usual acceptance test
(:mod:`~circuits_llm.decoding.acceptance`) runs on the masked rows. How it drafts is a
:class:`ConstrainedDrafting`:

* ``PRODUCT`` (default): the draft is the head's circuit times the automaton over the window
  (:class:`~circuits.compiled.automaton_product.AutomatonProduct`), so every draft satisfies the
  constraint and a forced token (the only one allowed) is drafted with probability 1. The draft
  vocabulary applies: categories are the head's draft tokens, and a state whose allowed tokens
  all lie outside it ends the draftable part of the window there. Such a state gets a *free* row
  in the window's automaton (every category allowed, leading to a free sink): the product stays
  positive, and the round verifies only the drafts before the free part (``L`` is read from the
  drafts, a draft-side quantity, so the law stays exact; see
  :mod:`~circuits_llm.decoding.draft_length`). The verifier's masked residual covers the tokens
  the head cannot draft, and a copy or walk proposal mixed into the product may carry them
  (:class:`~circuits_llm.decoding.lookup.SequentialCopy`). After a ``c`` outside the draft
  vocabulary the product draws ``X_0`` first, a stand-in for ``c`` (:class:`StandInFirst`), and
  the drafts given it.
  **Forced runs past the draft** (jump-forward): when the automaton, after ``c, d_1..d_L``, allows
  one id only (and again after it, ...), those forced tokens ``f_1..f_J`` join the verify block
  ``[c, d_1..d_L, f_1..f_J]``. Under the masked target each has probability 1, so once the ``L``
  drafts are accepted (the bonus row ``L + 1`` is then a point mass at ``f_1``) they are emitted
  too and the round's last token is drawn from the masked row after ``f_J``; after a rejection
  they are dropped with the rest of the block. The run is a function of the drafts, so the law
  stays exactly the masked LM's (docs/decoder-exactness.md §7b).
* ``FREE``: the head drafts as without a constraint; only the target is masked (a draft that
  breaks the constraint has target probability 0 and is rejected). The baseline of the benchmark.

Everything here is eager and host-driven (the automaton's state is a Python int); with
``compile=True`` the backbone's forwards and the accept program stay compiled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from circuits.automata import Automaton
from circuits.compiled.automaton_product import AutomatonProduct, pick_category
from circuits_llm.constraints import ConstraintError, JsonSchema, Regex, TokenAutomaton
from circuits_llm.decoding.acceptance import Transition
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import SequentialCopy, outside_entry, unpack
from circuits_llm.decoding.round_data import DraftResult
from circuits_llm.decoding.warping import (
    VERIFIER_LOGITS,
    DecoderError,
    SamplingConfig,
    sample_token,
    target_probs,
)

__all__ = ["ConstrainedDrafting", "ConstraintTracker", "ProductDrafter", "resolve_constraint",
           "through_forced"]


class ConstrainedDrafting(Enum):
    """How the speculative decoder drafts under a constraint (see the module docstring)."""

    PRODUCT = "product"
    FREE = "free"


def resolve_constraint(constraint: object, tokenizer: Any, vocab_size: int,
                       eos_token_ids: tuple[int, ...]) -> TokenAutomaton:
    """The :class:`TokenAutomaton` of ``constraint`` over the model's ``vocab_size`` ids.

    A built automaton is used as it is (its vocabulary size must match); a :class:`Regex` or
    :class:`JsonSchema` is built over ``tokenizer`` (cached per tokenizer and constraint), with
    the first of the model's ``eos_token_ids`` as its end of sequence (else the tokenizer's).
    """
    if isinstance(constraint, TokenAutomaton):
        automaton = constraint
    elif isinstance(constraint, (Regex, JsonSchema)):
        if tokenizer is None:
            raise DecoderError(
                f"constraint={constraint.describe()} needs the model's tokenizer to build its "
                "token automaton: pass tokenizer=, or pass a TokenAutomaton built with "
                "TokenAutomaton.build(constraint, tokenizer)")
        eos = eos_token_ids[0] if eos_token_ids else None
        try:
            automaton = TokenAutomaton.build(constraint, tokenizer, eos_token_id=eos,
                                             vocab_size=vocab_size)
        except ConstraintError as error:
            raise DecoderError(f"cannot decode under {constraint.describe()}: {error}") from error
    else:
        raise DecoderError(f"constraint must be a circuits_llm.constraints.Regex, JsonSchema or "
                           f"TokenAutomaton, got {type(constraint).__name__}")
    if automaton.vocab_size != vocab_size:
        raise DecoderError(f"the constraint's automaton covers {automaton.vocab_size} token ids "
                           f"but the model has {vocab_size}: build it with vocab_size={vocab_size}")
    return automaton


@dataclass
class ConstraintTracker:
    """The automaton's state after the output so far, and the masking of verifier rows.

    Attributes:
        automaton: the token automaton.
        state: its state after every emitted token (the prompt is not read).
        pending: host seconds of constraint work (masks, automaton steps, product draws) not yet
            reported (:meth:`take`).
        tokenizer: the tokenizer passed to ``generate`` (None: not given), for greedy drafts
            respelled as it spells them (:mod:`~circuits_llm.decoding.respelling`).
    """

    automaton: TokenAutomaton
    state: int = field(init=False)
    pending: float = 0.0
    tokenizer: Any = None

    def __post_init__(self) -> None:
        self.state = self.automaton.initial_state

    @property
    def eos_token_id(self) -> int:
        return self.automaton.eos_token_id

    def take(self) -> float:
        """The constraint work's seconds since the last call (one round's ``constraint_s``)."""
        seconds, self.pending = self.pending, 0.0
        return seconds

    def emit(self, tokens: tuple[int, ...] | list[int]) -> None:
        """Advance over emitted tokens (each was drawn from a masked row, so it is allowed)."""
        for token in tokens:
            self.state = self.automaton.advance(self.state, int(token))

    def states_along(self, drafts: list[int]) -> list[int]:
        """The states before each verify row of ``[c, d_1..d_L]``: ``L + 1`` states. After a
        draft the automaton does not allow (FREE drafting), the last state is repeated: those
        rows are never read, since that draft's target probability is 0."""
        states = [self.state]
        allowed = True
        for token in drafts:
            if allowed:
                try:
                    states.append(self.automaton.advance(states[-1], token))
                    continue
                except ConstraintError:  # not allowed: the rows after it are never read
                    allowed = False
            states.append(states[-1])
        return states

    def forced_run(self, drafts: list[int], limit: int) -> list[int]:
        """The tokens the automaton forces after ``c, d_1..d_L`` (``drafts``, all allowed): while
        its state allows exactly one id (never EOS), that id; at most ``limit``."""
        start = time.perf_counter()
        state, run = self.states_along(drafts)[-1], []
        while len(run) < limit:
            allowed = self.automaton.allowed(state)
            if allowed.numel() != 1 or int(allowed[0]) == self.eos_token_id:
                break
            run.append(int(allowed[0]))
            state = self.automaton.advance(state, run[-1])
        self.pending += time.perf_counter() - start
        return run

    def masked(self, logits: Tensor, drafts: list[int]) -> Tensor:
        """``logits`` (L+1, V) of the block ``[c, d_1..d_L]`` with row ``k`` masked by the state
        after ``d_1..d_k`` (row 0: the current state): disallowed tokens get ``-inf``."""
        start = time.perf_counter()
        states = self.states_along(drafts)[:logits.shape[0]]
        mask = torch.stack([self.automaton.mask(s, logits.device) for s in states])
        out = torch.where(mask, logits, logits.new_tensor(float("-inf")))
        self.pending += time.perf_counter() - start
        return out


class StandInFirst:
    """A ``choose`` callback for :meth:`AutomatonProduct.draw` that draws ``X_0`` first, a
    stand-in for a ``c`` outside the draft vocabulary (inverse CDF at ``uniform``; its argmax
    when greedy), then hands every draft to ``rest`` (the copy mixture's
    :class:`~circuits_llm.decoding.lookup.SequentialCopy`)."""

    def __init__(self, uniform: float | None, rest: SequentialCopy) -> None:
        self.uniform = uniform
        self.rest = rest
        self.started = False

    def __call__(self, conditional: Tensor) -> int | None:
        if self.started:
            return self.rest(conditional)
        self.started = True
        return pick_category(conditional, self.uniform, None)


class ProductDrafter:
    """Drafts from the head's circuit times the automaton over the window (``PRODUCT`` drafting).

    Built once per (head, automaton): the automaton restricted to the head's draft vocabulary as
    one :class:`~circuits.automata.Automaton` over all its states plus the free sink (see the
    module docstring), restarted at the current state every round; the product prunes it to
    the states reachable within the window. What every start state shares (the table's
    category classes and successor lists) is built here, once
    (:meth:`AutomatonProduct.prepare <circuits.compiled.automaton_product.AutomatonProduct.prepare>`).

    Args:
        head: the draft head (``circuit``, ``window``, ``draft_tokens``, ``vocab_size``).
        automaton: the token automaton.
    """

    def __init__(self, head: Any, automaton: TokenAutomaton) -> None:
        self.head = head
        self.automaton = automaton
        self.window: int = head.window
        self.product = AutomatonProduct(head.circuit)
        device = head.circuit.device
        tokens = getattr(head, "draft_tokens", None)
        self.draft_tokens: Tensor = (torch.arange(head.vocab_size) if tokens is None
                                     else tokens.detach().cpu())
        position = torch.full((head.vocab_size,), -1, dtype=torch.long)
        position[self.draft_tokens] = torch.arange(self.draft_tokens.numel())
        self.position = position
        start = time.perf_counter()
        local = automaton.draft_table(self.draft_tokens)
        sink = local.shape[0]
        # a state with no draftable token: every category leads to the free sink
        local[(local < 0).all(1)] = sink
        local = torch.cat([local, torch.full((1, local.shape[1]), sink, dtype=torch.long)])
        #: automaton state -> the drafter's state index (the same numbers, plus the sink)
        self.local = {s: s for s in range(automaton.num_states)}
        self.sink = sink
        self.table = Automaton(local.to(device), 0)
        self.product.prepare(self.table)
        self.device = device
        self.last_size = 0
        #: seconds it took to build the drafter (once per head and automaton)
        self.build_seconds = time.perf_counter() - start

    def draft(self, params: object, c: int, state: int, uniforms: Tensor | None,
              rule: DraftLength | None = None, component: Tensor | None = None,
              stand_in_uniform: float | None = None) -> tuple[DraftResult, float]:
        """One round's draft after the known token ``c`` from automaton state ``state``.

        ``params``: the head's checked parameters for this round; ``uniforms``: (n-1,) float64
        (sampling) or None (greedy); ``rule``: the decoder's draft-length rule, applied to the
        draft's conditionals (``None``: verify every draft before the free part); ``component``:
        a copy of the context (:func:`~circuits_llm.decoding.lookup.copy_component`, possibly
        with tokens outside the draft vocabulary) mixed into the product
        (:class:`~circuits_llm.decoding.lookup.SequentialCopy`; cut here before its first token
        the automaton forbids from ``state``); ``stand_in_uniform``: when ``c`` is outside the
        draft vocabulary, the uniform in [0, 1) that draws ``X_0``'s stand-in from the product's
        marginal (sampling; greedy: its argmax), on which the drafts and ``q`` then condition
        (:mod:`~circuits_llm.decoding.round`; exact). Returns the :class:`DraftResult` the accept
        program reads (``length``: the drafts before the free part, or the proposal's end when
        the draft left the vocabulary with it, at most the rule's; ``q`` (n-1, K + 1) with
        ``extra``, the model ids of its last column) and the seconds it took.
        """
        start = time.perf_counter()
        n, device = self.window, self.device
        size = self.draft_tokens.numel()
        index = int(self.position[c])
        tokens = torch.zeros(n - 1, dtype=torch.long, device=device)
        q = torch.zeros(n - 1, size + 1, dtype=torch.float64, device=device)
        extra = torch.zeros(n - 1, dtype=torch.long, device=device)
        length, self.last_size = 0, 0
        possible = state in self.local
        if possible:
            automaton = self.table.restart(self.local[state])
            copy = None
            if component is not None:
                allowed, free_outside = self.allowed_copy(component, self.local[state])
                copy = SequentialCopy(allowed, uniforms, self.draft_tokens, free_outside)
            # c outside the draft vocabulary: X_0 is drawn first, a stand-in for c
            lead = 1 if index < 0 else 0
            prefix = torch.tensor([index] if lead == 0 else [], dtype=torch.long, device=device)
            tape = uniforms
            if lead and uniforms is not None:
                if stand_in_uniform is None:
                    raise DecoderError("a sampled round after a token outside the draft "
                                       "vocabulary needs stand_in_uniform")
                tape = torch.cat([uniforms.new_tensor([stand_in_uniform]), uniforms])
            choose: SequentialCopy | StandInFirst | None = copy
            if lead and copy is not None:
                choose = StandInFirst(None if uniforms is None else stand_in_uniform, copy)
            drawn = self.product.draw(params, automaton, prefix,  # type: ignore[arg-type]
                                      consume_from=1, uniforms=tape if choose is None else None,
                                      choose=choose)
            self.last_size = drawn.size
            drafted = drawn.length - lead
            outside = None if copy is None else copy.outside
            possible = drafted > 0 or outside is not None
            if possible:
                values = drawn.values[1:].clone()
                if outside is not None:  # the proposal's tokens from row ``outside`` on
                    tail = copy.tail()  # type: ignore[union-attr]
                    length = outside + len(tail)
                    values[outside:] = 0
                    values[outside:length] = size  # the extra column
                    chosen = self.draft_tokens.to(device)[values.clamp(max=size - 1)]
                    chosen[outside:length] = torch.tensor(tail, dtype=torch.long)
                else:
                    walk, local = [], self.local[state]
                    for value in values[:drafted].tolist():
                        local = int(self.table.next_state[local, value])
                        walk.append(local)
                    length = next((k for k, s in enumerate(walk) if s == self.sink), drafted)
                    # the drafts after the free part are never verified: any draft-vocabulary ids
                    chosen = self.draft_tokens.to(device)[values]
                if copy is None:
                    q[:, :size] = drawn.conditionals[lead:]
                else:
                    q, extra = copy.conditionals().to(device), copy.extra().to(device)
                if rule is not None and rule != DraftLength.fixed():
                    # a draft-side stopping time of the draft: the law stays exact
                    length = min(length, int(rule.decide(q, values)))
                tokens = chosen.to(device)
                q = q.to(device)
        block = torch.cat([torch.tensor([c], device=device), tokens])[None]
        flags = torch.tensor([True, possible], device=device)
        result = DraftResult(block[0, 1:], block, None if uniforms is None else q, flags[0],
                             flags[1], torch.tensor(length, device=device), extra)
        return result, time.perf_counter() - start

    def allowed_copy(self, component: Tensor, local: int) -> tuple[Tensor, bool]:
        """``component`` with its proposal cut before the first draft the drafter's automaton
        forbids (or whose state has no draftable token) from its state ``local``, and, from the
        proposal's first token outside the draft vocabulary on, before the first token the
        constraint's automaton forbids; and whether the drafter's state before that first
        outside token has no draftable token (``free_outside`` of
        :class:`~circuits_llm.decoding.lookup.SequentialCopy`). A function of the history, so the
        mixture stays a law fixed before the round."""
        proposal, length, _ = unpack(component)
        count, allowed = int(length), 0
        outside: int | None = None
        free_outside, state = False, local  # drafter states are the automaton's (plus the sink)
        for value in proposal[:count].tolist():
            if value >= 0 and outside is None:
                local = int(self.table.next_state[local, value])
                if local < 0 or local == self.sink:
                    break
                state = local
            else:
                if outside is None:
                    outside = allowed
                    free_outside = int(self.table.next_state[local, 0]) == self.sink
                token = outside_entry(value) if value < 0 else int(self.draft_tokens[value])
                try:
                    state = self.automaton.advance(state, token)
                except ConstraintError:
                    break
            allowed += 1
        free_outside = free_outside and outside is not None and allowed > outside
        if allowed == count:
            return component, free_outside
        cut = component.clone()
        cut[allowed:proposal.shape[0]] = 0
        cut[-2] = allowed
        if allowed == 0:
            cut[-1] = 0.0
        return cut, free_outside


def through_forced(move: Transition, forced: list[int], row: Tensor, config: SamplingConfig,
                   generator: torch.Generator | None) -> Transition:
    """A round whose drafts were all accepted before a run the constraint forces: the bonus was
    drawn from a point mass at ``forced[0]``; emit the whole forced run, then a token drawn from
    the masked verifier row ``row`` (V,) after its end."""
    if move.emitted[-1] != forced[0]:
        raise DecoderError(f"the constraint forces token {forced[0]} but the verifier drew "
                           f"{move.emitted[-1]}: the masked row was not a point mass")
    token = sample_token(target_probs(row, config, VERIFIER_LOGITS), config.greedy, generator)
    return Transition((*move.emitted, *forced[1:], token), token, move.keep + len(forced))
