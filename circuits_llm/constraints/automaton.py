"""A constraint compiled into a deterministic automaton over a model's token ids.

``outlines-core`` builds the index (the DFA of the constraint's regex, lifted from bytes to the
tokens of a vocabulary); :class:`TokenAutomaton` renumbers its states densely, prunes the states
from which no final state can be reached (so every allowed prefix can still be completed), turns
EOS into a move to an absorbing DONE state, and keeps each state's transitions as sorted id
arrays. The decoder reads it host-side: the allowed ids of a state, the verifier's ``(V,)`` mask,
one step, and the table of a window of ``n`` draft positions (:meth:`TokenAutomaton.window`) that
the draft circuit is multiplied with.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from circuits_llm.constraints.errors import ConstraintError
from circuits_llm.constraints.spec import Constraint
from circuits_llm.constraints.vocabulary import TokenizerVocabulary, build_vocabulary
from circuits_llm.text.tokens import tokenizer_fingerprint

#: How many built automata stay cached in-process (an index over a 49k vocabulary costs 0.2-2 s).
AUTOMATON_CACHE_SIZE = 16
#: How many draft vocabularies each automaton keeps restricted transitions for.
DRAFT_CACHE_SIZE = 4
#: What ``outlines-core`` says when a reachable state has no token (its error text, matched).
_OUTLINES_DEAD_END = "incompatible with the regex"


@dataclass(frozen=True)
class WindowTable:
    """The automaton restricted to ``steps`` draft positions from one state.

    Token ``i`` (``i = 1 .. steps``) moves from position ``i-1`` to position ``i``. Local state
    indices number the automaton states met in the window (0 = ``start``).

    Attributes:
        start: the automaton state the window starts in.
        steps: the number of token positions.
        states: ``(S,)`` long, the automaton state of each local index.
        next_state: ``(S, K)`` long, the local index reached from local state ``s`` by draft
            category ``k`` (model id ``draft_tokens[k]``), -1 where the category is not allowed.
            Rows of states met only at position ``steps`` are not expanded (all -1; see
            ``expanded``).
        expanded: ``(S,)`` bool, whether the row of ``next_state`` was filled (the state occurs
            at some position ``< steps``).
        final: ``(S,)`` bool, whether the state is final (EOS allowed, or DONE).
        reachable: ``steps + 1`` sorted long tensors: the local indices reachable at each
            position (position 0: ``[0]``).
    """

    start: int
    steps: int
    states: Tensor
    next_state: Tensor
    expanded: Tensor
    final: Tensor
    reachable: list[Tensor]

    @property
    def num_categories(self) -> int:
        """K, the number of draft categories (columns of ``next_state``)."""
        return int(self.next_state.shape[1])


@dataclass
class _DraftView:
    """One draft vocabulary's restricted transitions: state -> (categories, next states)."""

    tokens: np.ndarray | None
    rows: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


class TokenAutomaton:
    """A constraint's DFA over model token ids ``0 .. V-1``: states ``0 .. num_states-1``.

    State 0 is the initial state and ``done_state`` (the last) the absorbing state after EOS,
    whose only allowed token is EOS. Every state but DONE can still reach a final state; EOS is
    allowed exactly in final states and leads to DONE. Build with :meth:`build` (cached).

    Attributes:
        constraint: what the generations must match.
        vocab_size: V, the model's vocabulary size (the length of :meth:`mask`).
        eos_token_id: the EOS id.
        initial_state: 0.
        done_state: the absorbing state after EOS (``num_states - 1``).
        build_seconds: how long building the ``outlines-core`` index took.
    """

    initial_state: int = 0

    def __init__(self, constraint: Constraint, vocabulary: TokenizerVocabulary, index: Any,
                 build_seconds: float) -> None:
        """Prune and renumber ``index`` (an ``outlines_core.Index`` over ``vocabulary``)."""
        self.constraint = constraint
        self.vocabulary = vocabulary
        self.vocab_size = vocabulary.vocab_size
        self.eos_token_id = vocabulary.eos_token_id
        self.build_seconds = build_seconds
        self._tokens, self._next, self._final = _compile(index, vocabulary, constraint)
        self.done_state = len(self._tokens) - 1
        self._allowed: dict[int, Tensor] = {}
        self._next_tensors: dict[int, Tensor] = {}
        self._masks: dict[tuple[int, str], Tensor] = {}
        self._drafts: OrderedDict[object, _DraftView] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def build(cls, constraint: Constraint, tokenizer: Any, *, eos_token_id: int | None = None,
              vocab_size: int | None = None) -> TokenAutomaton:
        """The automaton of ``constraint`` over ``tokenizer``'s ids, cached in-process.

        Args:
            constraint: a :class:`~circuits_llm.constraints.spec.Regex` or
                :class:`~circuits_llm.constraints.spec.JsonSchema`.
            tokenizer: a Hugging Face tokenizer (fast or slow).
            eos_token_id: the EOS id (None: the tokenizer's).
            vocab_size: the model's vocabulary size V (None: ``len(tokenizer)``); ids the
                tokenizer does not have are never allowed.

        Raises:
            ConstraintError: an invalid regex or schema, no EOS, or a constraint that cannot be
                completed with this tokenizer.
        """
        fingerprint = tokenizer_fingerprint(tokenizer)
        vocabulary = build_vocabulary(tokenizer, eos_token_id=eos_token_id, vocab_size=vocab_size,
                                      fingerprint=fingerprint)
        key = (fingerprint, constraint, vocabulary.vocab_size, vocabulary.eos_token_id)
        with _CACHE_LOCK:
            if key in _CACHE:
                _CACHE.move_to_end(key)
                return _CACHE[key]
        from outlines_core import Index
        regex = constraint.regex()
        started = time.perf_counter()
        try:
            index = Index(regex, vocabulary.outlines)
        except ValueError as error:
            if _OUTLINES_DEAD_END in str(error):
                raise ConstraintError(
                    f"The {constraint.describe()} cannot be completed with this tokenizer: a state of "
                    f"its automaton allows no token ({error}). Give the tokenizer tokens for those "
                    "characters or loosen the constraint") from error
            raise ConstraintError(f"The {constraint.describe()} is not a valid regular expression for "
                                  f"outlines-core ({error}); it uses Rust regex syntax (no look-around "
                                  "or back-references)") from error
        automaton = cls(constraint, vocabulary, index, time.perf_counter() - started)
        with _CACHE_LOCK:
            _CACHE[key] = automaton
            while len(_CACHE) > AUTOMATON_CACHE_SIZE:
                _CACHE.popitem(last=False)
        return automaton

    # ----------------------------------------------------------------- states and single steps
    @property
    def num_states(self) -> int:
        """The number of states, DONE included."""
        return len(self._tokens)

    @property
    def num_transitions(self) -> int:
        """The number of (state, allowed token) pairs."""
        return sum(len(tokens) for tokens in self._tokens)

    def _check_state(self, state: int) -> int:
        state = int(state)
        if not 0 <= state < self.num_states:
            raise ConstraintError(f"State {state} is not a state of this automaton "
                                  f"(0..{self.num_states - 1})")
        return state

    def is_final(self, state: int) -> bool:
        """Whether the text so far fully matches the constraint (EOS allowed), or EOS was emitted."""
        return bool(self._final[self._check_state(state)])

    def allowed(self, state: int) -> Tensor:
        """``(A,)`` long, sorted: the model ids allowed in ``state`` (cached; do not modify)."""
        state = self._check_state(state)
        if state not in self._allowed:
            self._allowed[state] = torch.from_numpy(self._tokens[state])
        return self._allowed[state]

    def next_states(self, state: int) -> Tensor:
        """``(A,)`` long: the state each id of :meth:`allowed` leads to (cached; do not modify)."""
        state = self._check_state(state)
        if state not in self._next_tensors:
            self._next_tensors[state] = torch.from_numpy(self._next[state])
        return self._next_tensors[state]

    def mask(self, state: int, device: torch.device | str = "cpu") -> Tensor:
        """``(V,)`` bool on ``device``: True at the ids allowed in ``state`` (cached per state and device).

        The verifier sets the logits outside the mask to -inf.
        """
        key = (state, str(device))
        cached = self._masks.get(key)  # a state met before: one lookup
        if cached is None:
            allowed = np.zeros(self.vocab_size, dtype=np.bool_)
            allowed[self._tokens[self._check_state(state)]] = True
            cached = self._masks[key] = torch.from_numpy(allowed).to(device)
        return cached

    def advance(self, state: int, token: int | Tensor) -> int:
        """The state after emitting ``token`` in ``state``.

        Raises:
            ConstraintError: ``token`` is not allowed in ``state``.
        """
        state = self._check_state(state)
        token = int(token)
        tokens = self._tokens[state]
        position = int(np.searchsorted(tokens, token))
        if position < len(tokens) and tokens[position] == token:
            return int(self._next[state][position])
        raise ConstraintError(f"Token {token} is not allowed in state {state} of the "
                              f"{self.constraint.describe()} ({len(tokens)} ids are); mask the logits "
                              "with mask(state) before sampling")

    # ----------------------------------------------------------------- windows of draft positions
    def _draft_view(self, draft_tokens: Tensor | None) -> _DraftView:
        """The cached restricted transitions of a draft vocabulary (None: the whole vocabulary)."""
        if draft_tokens is None:
            key: object = None
            tokens = None
        else:
            if draft_tokens.dim() != 1 or draft_tokens.dtype not in (torch.int64, torch.int32):
                raise ConstraintError("draft_tokens must be a 1-D integer tensor of model ids (K,), got "
                                      f"shape {tuple(draft_tokens.shape)} dtype {draft_tokens.dtype}")
            tokens = draft_tokens.detach().to("cpu", torch.int64).numpy()
            if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
                raise ConstraintError(f"draft_tokens must be model ids in [0, {self.vocab_size}), got "
                                      f"[{tokens.min()}, {tokens.max()}]")
            key = (len(tokens), hashlib.sha1(tokens.tobytes()).hexdigest())
        with self._lock:
            view = self._drafts.get(key)
            if view is None:
                view = self._drafts[key] = _DraftView(tokens)
                while len(self._drafts) > DRAFT_CACHE_SIZE:
                    self._drafts.popitem(last=False)
            else:
                self._drafts.move_to_end(key)
        return view

    def _row(self, view: _DraftView, state: int) -> tuple[np.ndarray, np.ndarray]:
        """(categories allowed in ``state``, the states they lead to) under a draft vocabulary."""
        row = view.rows.get(state)
        if row is None:
            tokens, nexts = self._tokens[state], self._next[state]
            if view.tokens is None:
                row = (tokens, nexts)
            elif len(tokens) == 0:
                row = (np.zeros(0, np.int64), np.zeros(0, np.int64))
            else:
                position = np.minimum(np.searchsorted(tokens, view.tokens), len(tokens) - 1)
                categories = np.flatnonzero(tokens[position] == view.tokens)
                row = (categories, nexts[position[categories]])
            view.rows[state] = row
        return row

    def draft_table(self, draft_tokens: Tensor | None = None) -> Tensor:
        """``(num_states, K)`` long: the state every draft category leads to from every state,
        -1 where it is not allowed (category ``k`` = model id ``draft_tokens[k]``; None: the
        whole vocabulary, ``K = V``). One pass over the states (each row cached); what a drafter
        restarts in every round, where :meth:`window` explores from one state."""
        view = self._draft_view(draft_tokens)
        width = self.vocab_size if view.tokens is None else len(view.tokens)
        table = np.full((self.num_states, width), -1, dtype=np.int64)
        for state in range(self.num_states):
            categories, nexts = self._row(view, state)
            table[state, categories] = nexts
        return torch.from_numpy(table)

    def window(self, start: int, steps: int, draft_tokens: Tensor | None = None) -> WindowTable:
        """The automaton from ``start`` over ``steps`` positions, on the draft vocabulary.

        Args:
            start: the automaton state before the first drafted token.
            steps: the number of drafted tokens (>= 0).
            draft_tokens: ``(K,)`` model ids; category ``k`` is id ``draft_tokens[k]`` (None: the
                whole vocabulary, K = V). Restricted transitions are cached per draft vocabulary.
        """
        start = self._check_state(start)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConstraintError(f"steps must be an int >= 0, got {steps!r}")
        view = self._draft_view(draft_tokens)
        width = self.vocab_size if view.tokens is None else len(view.tokens)
        local = np.full(self.num_states, -1, np.int64)
        local[start] = 0
        order = [start]
        frontier = np.array([start], np.int64)
        reachable = [torch.zeros(1, dtype=torch.long)]
        rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for _ in range(steps):
            met: list[np.ndarray] = []
            for state in frontier.tolist():
                if state not in rows:
                    rows[state] = self._row(view, state)
                met.append(rows[state][1])
            frontier = np.unique(np.concatenate(met)) if met else np.zeros(0, np.int64)
            for state in frontier[local[frontier] < 0].tolist():
                local[state] = len(order)
                order.append(state)
            reachable.append(torch.from_numpy(np.sort(local[frontier])))
        next_state = np.full((len(order), width), -1, np.int64)
        expanded = np.zeros(len(order), bool)
        for state, (categories, nexts) in rows.items():
            next_state[local[state], categories] = local[nexts]
            expanded[local[state]] = True
        states = np.array(order, np.int64)
        return WindowTable(start=start, steps=steps, states=torch.from_numpy(states),
                           next_state=torch.from_numpy(next_state), expanded=torch.from_numpy(expanded),
                           final=torch.from_numpy(self._final[states].copy()), reachable=reachable)

    def describe(self) -> str:
        """A one-line summary for logs."""
        finals = int(self._final.sum())
        return (f"TokenAutomaton({self.constraint.describe()}: {self.num_states} states ({finals} final, "
                f"DONE={self.done_state}), {self.num_transitions} transitions, V={self.vocab_size}, "
                f"eos={self.eos_token_id}, {self.vocabulary.spelling.value} tokenizer, "
                f"index built in {self.build_seconds:.2f} s)")

    def __repr__(self) -> str:
        return self.describe()


_CACHE: OrderedDict[tuple[object, ...], TokenAutomaton] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def clear_cache() -> None:
    """Forget every cached automaton (tests, or to free memory)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def _compile(index: Any, vocabulary: TokenizerVocabulary, constraint: Constraint
             ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """``index``'s transitions, pruned and renumbered: per state sorted ids, next states, finality.

    Drops EOS (outlines-core loops it on final states) and ids ``>= V``; keeps the states that are
    reachable from the initial state through states that can reach a final state; numbers them in
    breadth-first order (initial = 0), appends DONE and the EOS moves into it.

    Raises:
        ConstraintError: no final state is reachable from the initial state.
    """
    eos, size = vocabulary.eos_token_id, vocabulary.vocab_size
    transitions: dict[int, dict[int, int]] = index.get_transitions()
    initial = index.get_initial_state()
    finals = set(index.get_final_states())
    predecessors: dict[int, set[int]] = {}
    for state, moves in transitions.items():
        for target in set(moves.values()):
            predecessors.setdefault(target, set()).add(state)
    alive = set(finals)
    stack = list(finals)
    while stack:
        for state in predecessors.get(stack.pop(), ()):
            if state not in alive:
                alive.add(state)
                stack.append(state)
    if initial not in alive:
        raise ConstraintError(f"The {constraint.describe()} cannot be completed with this tokenizer: "
                              f"no token sequence leads from the initial state to a complete match. "
                              "Check that the tokenizer can spell the required characters")
    order, seen = [initial], {initial}
    for state in order:
        for target in set(transitions.get(state, {}).values()):
            if target in alive and target not in seen:
                seen.add(target)
                order.append(target)
    ids = np.array(sorted(order), np.int64)
    local_of_sorted = np.empty(len(ids), np.int64)
    local_of_sorted[np.searchsorted(ids, np.array(order, np.int64))] = np.arange(len(order))
    done = len(order)
    tokens_of, next_of = [], []
    final = np.zeros(done + 1, bool)
    for number, state in enumerate(order):
        moves = transitions.get(state, {})
        tokens = np.fromiter(moves.keys(), np.int64, len(moves))
        targets = np.fromiter(moves.values(), np.int64, len(moves))
        position = np.minimum(np.searchsorted(ids, targets), len(ids) - 1)
        keep = (ids[position] == targets) & (tokens != eos) & (tokens < size)
        tokens, targets = tokens[keep], local_of_sorted[position[keep]]
        if state in finals:
            final[number] = True
            tokens, targets = np.append(tokens, eos), np.append(targets, done)
        elif len(tokens) == 0:
            raise ConstraintError(f"State {number} of the {constraint.describe()} is a dead end: it is not "
                                  "final and allows no token, so the constraint cannot be completed with "
                                  "this tokenizer")
        sort = np.argsort(tokens, kind="stable")
        tokens_of.append(tokens[sort])
        next_of.append(targets[sort])
    tokens_of.append(np.array([eos], np.int64))
    next_of.append(np.array([done], np.int64))
    final[done] = True
    return tokens_of, next_of, final
