"""Deterministic finite automata (DFAs) over the categories of a sequence of variables.

An :class:`Automaton` reads a sequence ``x_0, x_1, ...`` of categories ``0 .. K-1`` one at a
time: from state ``a``, category ``x`` moves it to ``next_state[a, x]``, or is not allowed there
(``-1``). A sequence is accepted when every one of its transitions is allowed; there are no
accepting states (a constraint such as "the output is a prefix of valid JSON" is exactly this).
:class:`~circuits.compiled.automaton_product.AutomatonProduct` multiplies a compiled circuit over
the variables ``0 .. n-1`` with one, which gives a distribution supported on accepted sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from circuits.errors import InvalidInputError

#: ``next_state`` entry of a category that is not allowed in a state
REJECT = -1


@dataclass(frozen=True, eq=False)  # identity equality: tensors have no truth value
class Automaton:
    """A DFA over categories ``0 .. K-1`` with states ``0 .. S-1``.

    Attributes:
        next_state: (S, K) long: the state after reading category ``x`` in state ``a``, or
            ``-1`` (:data:`REJECT`) when ``x`` is not allowed in ``a``. Another integer dtype is
            converted to long. Do not modify it in place after construction (products cache
            structures derived from it).
        start: the state before the first category.
    """

    next_state: Tensor
    start: int = 0

    def __post_init__(self) -> None:
        table = self.next_state
        if not isinstance(table, Tensor) or table.is_floating_point() or table.is_complex() \
                or table.dtype == torch.bool:
            what = table.dtype if isinstance(table, Tensor) else type(table).__name__
            raise InvalidInputError(
                f"Automaton.next_state must be an integer tensor of shape (states, categories), "
                f"got {what}")
        if table.dim() != 2 or table.shape[0] < 1 or table.shape[1] < 1:
            raise InvalidInputError(
                f"Automaton.next_state must have shape (states, categories) with both >= 1, got "
                f"{tuple(table.shape)}")
        table = table.to(torch.long)
        states = table.shape[0]
        bad = (table < REJECT) | (table >= states)
        if bool(bad.any()):
            state, category = (int(i) for i in bad.nonzero()[0])
            raise InvalidInputError(
                f"Automaton.next_state[{state}, {category}] = {int(table[state, category])} is "
                f"neither a state (0..{states - 1}) nor {REJECT} (category not allowed)")
        if isinstance(self.start, bool) or not isinstance(self.start, int) \
                or not 0 <= self.start < states:
            raise InvalidInputError(
                f"Automaton.start must be a state in 0..{states - 1}, got {self.start!r}")
        object.__setattr__(self, "next_state", table)

    @property
    def num_states(self) -> int:
        """``S``."""
        return int(self.next_state.shape[0])

    @property
    def num_categories(self) -> int:
        """``K``."""
        return int(self.next_state.shape[1])

    def reachable(self, steps: int) -> list[Tensor]:
        """The states reachable from :attr:`start` after ``0 .. steps`` allowed transitions.

        Returns:
            ``steps + 1`` sorted long tensors of global state ids; entry ``t`` holds the states
            that some allowed sequence of ``t`` categories leads to (entry 0 is ``[start]``; an
            entry is empty once no sequence of that length is allowed).
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise InvalidInputError(f"steps must be an int >= 0, got {steps!r}")
        moves = self.successors
        frontier = torch.zeros(self.num_states, dtype=torch.bool, device=moves.device)
        frontier[self.start] = True
        result = [frontier.nonzero().squeeze(1)]
        for _ in range(steps):
            frontier = moves[frontier].any(0)
            result.append(frontier.nonzero().squeeze(1))
        return result

    @cached_property
    def successors(self) -> Tensor:
        """(S, S) bool: whether some category moves state ``a`` to state ``b``."""
        states = self.num_states
        table = torch.where(self.next_state == REJECT, states, self.next_state)
        moves = torch.zeros(states, states + 1, dtype=torch.bool, device=table.device)
        moves.scatter_(1, table, True)
        return moves[:, :states]

    def restart(self, start: int) -> Automaton:
        """The same automaton started in ``start``, sharing the checked table and the derived
        :attr:`successors` (no validation pass: cheap enough to call once per decoding round)."""
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < self.num_states:
            raise InvalidInputError(
                f"Automaton.start must be a state in 0..{self.num_states - 1}, got {start!r}")
        other = object.__new__(Automaton)
        object.__setattr__(other, "next_state", self.next_state)
        object.__setattr__(other, "start", start)
        if "successors" in self.__dict__:
            other.__dict__["successors"] = self.__dict__["successors"]
        return other

    def step(self, state: int, category: int) -> int:
        """The state after ``category`` in ``state``, or :data:`REJECT` when it is not allowed."""
        return int(self.next_state[state, category])

    def accepts_path(self, values: Tensor | Sequence[int]) -> bool:
        """Whether every transition of ``values`` (categories, read in order from :attr:`start`)
        is allowed."""
        if isinstance(values, Tensor):
            if values.dim() != 1 or values.is_floating_point() or values.dtype == torch.bool:
                raise InvalidInputError(
                    f"values must be a 1-D integer tensor, got {values.dtype} of shape "
                    f"{tuple(values.shape)}")
            items = [int(v) for v in values.tolist()]
        else:
            items = [int(v) for v in values]
        state = self.start
        for position, value in enumerate(items):
            if not 0 <= value < self.num_categories:
                raise InvalidInputError(
                    f"values[{position}] = {value} is not a category (0..{self.num_categories - 1})")
            state = self.step(state, value)
            if state == REJECT:
                return False
        return True


__all__ = ["REJECT", "Automaton"]
