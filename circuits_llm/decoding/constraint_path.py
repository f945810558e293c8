"""Drafting what a constraint spells out: the text it fixes, and the output's own habits at its choices.

A JSON schema fixes most of a document's structure in *characters* (``"address": {"city": "``),
but seldom in *tokens*: a token automaton allows every tokenization of a fixed string, and the
optional whitespace between JSON tokens leaves a choice after every colon and comma. So the
automaton rarely has a single allowed token (forced runs, :mod:`~circuits_llm.decoding.constrained`)
and the head x automaton product drafts the fixed text only as well as the head guesses its
tokenization.

This module proposes the rest of a window from the automaton alone, walking from the current
state and taking at each state

* the **fixed token**, when the allowed tokens all spell prefixes of one token (``"``, ``"ci``,
  ``"city``): the longest, which spells the most of the fixed text; else
* the **habit**: the token the output emitted the last time it was in a state with exactly the
  same allowed tokens (after ``"name":`` the output wrote ``' "'``, so after ``"city":`` it
  probably does too; inside a string the last string token), when there was such a time; else
* nothing: the walk stops.

The proposal is one more component of the draft's mixture, exactly like a copy of the context
(:mod:`~circuits_llm.decoding.lookup`), and takes the copy's place in a round where the copy
proposes no draftable token (:func:`round_component`): a deterministic function of the verified
output and the automaton's state, fixed before the round draws anything, so the output law stays
exactly the constrained LM's whatever it proposes; a wrong proposal only costs acceptance.

Measured on the constrained benchmark's greedy outputs (359 positions; ``docs/journal.md``
section 9): the walk's proposal starts with the next token at 47% of positions, the context
copy's at 27%; but the head x automaton product already drafts most of what the walk gets right,
so decoding gains little.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from circuits_llm.constraints import ConstraintError, TokenAutomaton
from circuits_llm.decoding.lookup import (
    ContextLookup,
    LookupIndex,
    copy_component,
    proposal_component,
)

__all__ = ["ConstraintPath", "ConstraintSteps", "round_component"]


class ConstraintSteps:
    """What the walk reads of one automaton, computed once per state on first use.

    Args:
        automaton: the constraint's token automaton.
    """

    def __init__(self, automaton: TokenAutomaton) -> None:
        self.automaton = automaton
        spelled = automaton.vocabulary.token_bytes
        self._spelled = spelled
        #: bytes each id spells (0 for ids that spell nothing: EOS, specials, ids past the tokenizer)
        lengths = np.zeros(automaton.vocab_size, dtype=np.int64)
        for token in range(min(automaton.vocab_size, len(spelled))):
            text = spelled[token]
            lengths[token] = 0 if text is None else len(text)
        self._lengths = lengths
        self._fixed: dict[int, int | None] = {}
        self._keys: dict[int, tuple[int, int]] = {}

    def fixed_token(self, state: int) -> int | None:
        """The longest allowed token when every allowed token spells a prefix of it; None when
        the allowed tokens diverge (or include EOS, or there is none)."""
        if state in self._fixed:
            return self._fixed[state]
        allowed = self.automaton.allowed(state).numpy()
        token: int | None = None
        if allowed.size:
            lengths = self._lengths[allowed]
            longest = int(allowed[int(lengths.argmax())])
            text = self._spelled[longest]
            # at most len(text) distinct non-empty prefixes: a larger set cannot be one chain
            if text and allowed.size <= len(text) and all(
                    lengths[i] > 0 and text.startswith(self._spelled[int(t)])  # type: ignore[arg-type]
                    for i, t in enumerate(allowed)):
                token = longest
        self._fixed[state] = token
        return token

    def choice_key(self, state: int) -> tuple[int, int]:
        """A key equal for states whose allowed token sets are equal (their size and a hash)."""
        key = self._keys.get(state)
        if key is None:
            allowed = self.automaton.allowed(state).numpy()
            key = self._keys[state] = (int(allowed.size), hash(allowed.tobytes()))
        return key


class ConstraintPath:
    """The walk of one generation: the output's habits so far, and the proposal of a round.

    Args:
        steps: the automaton's :class:`ConstraintSteps` (shared by generations).
    """

    def __init__(self, steps: ConstraintSteps) -> None:
        self.steps = steps
        #: choice key -> the token the output emitted the last time in a state with that key
        self._habits: dict[tuple[int, int], int] = {}

    def record(self, state: int, tokens: Sequence[int]) -> None:
        """Remember ``tokens``, emitted one after another from automaton state ``state``."""
        automaton = self.steps.automaton
        for token in tokens:
            if state == automaton.done_state:
                return
            self._habits[self.steps.choice_key(state)] = int(token)
            state = automaton.advance(state, int(token))

    def propose(self, state: int, limit: int) -> list[int]:
        """At most ``limit`` model ids walked from ``state`` (module docstring); ``[]`` when the
        state has neither a fixed token nor a habit."""
        automaton, proposal = self.steps.automaton, []
        while len(proposal) < limit and state != automaton.done_state:
            token = self.steps.fixed_token(state)
            if token is None:
                token = self._habits.get(self.steps.choice_key(state))
            if token is None or token == automaton.eos_token_id:
                break
            try:  # a habit's key matched by hash alone is checked here
                state = automaton.advance(state, token)
            except ConstraintError:
                break
            proposal.append(token)
        return proposal


def round_component(lookup: ContextLookup, index: LookupIndex, path: ConstraintPath | None,
                    state: int, position: Sequence[int] | None, drafts: int,
                    device: torch.device, beyond: bool = False) -> Tensor:
    """A round's proposal component (:func:`~circuits_llm.decoding.lookup.copy_component`'s
    (drafts + 2,) float64 form): the context copy of ``index`` when it proposes a token with a
    weight above 0, else the constraint's walk from ``state`` with ``lookup.constraint_weight``
    (when ``path`` is given). Both read only the verified output, so the choice does too.
    ``beyond``: keep tokens outside the draft vocabulary (``copy_component``)."""
    proposal, ngram = index.propose(drafts)
    component = copy_component(proposal, ngram, lookup, position, drafts, device, beyond)
    if path is None or lookup.constraint_weight == 0 or \
            (component[-2] > 0 and component[-1] > 0):
        return component
    return proposal_component(path.propose(state, drafts), lookup.constraint_weight, position,
                              drafts, device, beyond)
