"""The automaton side of an automaton product: reachable states, category classes, transitions.

For a DFA started in ``start`` that reads the variables ``first .. n-1``, a :class:`Lifting` holds
everything that depends on the automaton alone (not on the circuit's parameters):

* the state sets ``R_0 .. R_n``: ``R_t`` are the states reachable from ``start`` after the
  variables before ``t`` (``R_t = {start}`` for ``t <= first``); the lifted matrices of the
  interval ``[i, j)`` are ``(units, |R_i|, |R_j|)``. The states of ``R_n`` are merged into one
  local state: the product only ever sums over the exit state (``Z = sum_b M_root[start, b]``),
  so the layers that end with the last variable keep vectors ``(units, |R_i|, 1)`` (their
  matrices times ones), which is exact and saves a factor ``|R_n|`` along the right spine;
* the category classes: categories ``x`` and ``y`` are in one class when ``next(a, x) =
  next(a, y)`` in every state ``a`` the automaton can be in before a read variable (both
  :data:`~circuits.automata.REJECT` included). The transition matrices then only need each class's
  summed probability ``P_u(c) = sum_{x in c} p_u(x)``, which is exact: ``sum_x p_u(x) [next(a, x)
  = b] = sum_c P_u(c) [next(a, c) = b]``. Inside a JSON string almost every token keeps the state,
  so a schema automaton has a few hundred classes instead of the ``K`` categories;
* per read variable, its :class:`Transitions` from ``R_v`` to ``R_{v+1}``; variables with the same
  state sets share one object (one sparse product computes all their input matrices).

:class:`LiftingCache` keeps them per (automaton table, start state, first read variable), so a
decoder that restarts one automaton every round builds each at most once.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits.automata import Automaton
from circuits.errors import InvalidInputError

#: how many liftings (automaton table x start x first read variable) a cache keeps
LIFTING_CACHE_SIZE = 64
#: how many automaton tables a cache keeps transitions for, and how many per table
TABLE_CACHE_SIZE = 4
TRANSITIONS_PER_TABLE = 256
#: transition matrices with at most this many entries, at least this fraction of them 1, are
#: kept dense
DENSE_TRANSITIONS_LIMIT = 1 << 22
DENSE_TRANSITIONS_FILL = 0.05
#: labels are packed into int64 keys while below this bound (:func:`category_classes`)
_PACK_LIMIT = 1 << 62


@dataclass(frozen=True)
class Transitions:
    """The DFA's moves from the states ``R_a`` before a variable to ``R_b`` after it.

    Attributes:
        local_next: (|R_a|, K) long: the local index in ``R_b`` after category ``x``, or
            ``|R_b|`` when ``x`` is not allowed (a padding column).
        matrix: (|R_a| |R_b|, C) float64 over the ``C`` category classes: row ``a |R_b| + b``
            is 1 at the classes ``c`` with ``next(a, c) = b``; sparse CSR, or dense when small
            and well filled (:data:`DENSE_TRANSITIONS_FILL`).
    """

    local_next: Tensor
    matrix: Tensor


@dataclass(frozen=True)
class Lifting:
    """The state sets at the boundaries ``0..n``, the category classes and the moves.

    Attributes:
        states: ``n + 1`` sorted long tensors of global state ids, ``R_0 .. R_n``.
        widths: ``|R_0| .. |R_{n-1}|, 1``: the local widths (``R_n`` is one merged state).
        moves: per variable: its :class:`Transitions`, or None when it is not read.
        classes: (K,) long: the class of every category, or None when every category is its own
            class (then the classes are the categories).
        num_classes: ``C``.
    """

    states: tuple[Tensor, ...]
    widths: tuple[int, ...]
    moves: tuple[Transitions | None, ...]
    classes: Tensor | None
    num_classes: int

    def width(self, boundary: int) -> int:
        """``|R_boundary|``."""
        return self.widths[boundary]

    def class_sums(self, probs: Tensor) -> Tensor:
        """``P (C, columns)`` from ``probs (K, columns)``: each class's rows summed (one
        ``index_add``); ``probs`` itself when every category is its own class."""
        if self.classes is None:
            return probs
        return probs.new_zeros(self.num_classes, probs.shape[1]).index_add_(0, self.classes, probs)


def category_classes(rows: Tensor, num_states: int) -> tuple[Tensor, int]:
    """The classes of the columns of ``rows``: equal columns share one class.

    Args:
        rows: (U, K) long in ``-1 .. num_states - 1``: the next states of ``U`` states.
        num_states: ``S``.

    Returns:
        ``(classes (K,) long, C)``: column ``x``'s class in ``0 .. C-1`` (classes numbered in
        the order of their sorted column labels).

    Rows are folded into an int64 label per column, several at a time (``label * (S + 1) +
    next + 1`` stays below 2^62), and re-numbered with a 1-D ``unique`` between batches: exact, and
    much faster than ``unique(dim=1)``.
    """
    size = rows.shape[1]
    base = num_states + 1
    labels = torch.zeros(size, dtype=torch.long, device=rows.device)
    bound = 1  # labels lie in 0 .. bound - 1
    for row in rows + 1:
        if bound * base >= _PACK_LIMIT:
            labels = torch.unique(labels, return_inverse=True)[1]
            bound = size
        labels = labels * base + row
        bound *= base
    classes = torch.unique(labels, return_inverse=True)[1]
    return classes, int(classes.max()) + 1 if size else 0


def _transitions(table: Tensor, before: Tensor, after: Tensor,
                 representatives: Tensor | None, merged: bool) -> Transitions:
    """The :class:`Transitions` from ``before`` to ``after`` under ``table`` (S, K), with the
    matrix over the classes whose representative categories are ``representatives`` (C,);
    ``merged``: every state of ``after`` is the one local state 0."""
    device = table.device
    rows, cols = before.shape[0], 1 if merged else after.shape[0]
    position = torch.full((table.shape[0] + 1,), cols, dtype=torch.long, device=device)
    position[after] = 0 if merged else torch.arange(cols, device=device)
    local = position[table[before]]  # REJECT = -1 reads the padding slot at the end
    per_class = local if representatives is None else local[:, representatives]
    size = per_class.shape[1]
    keys = torch.where(per_class < cols, torch.arange(rows, device=device)[:, None] * cols
                       + per_class, rows * cols).view(-1)
    counts = torch.bincount(keys, minlength=rows * cols + 1)[:rows * cols]
    order = torch.argsort(keys.to(torch.int32), stable=True)[:int(counts.sum())]
    crow = torch.zeros(rows * cols + 1, dtype=torch.long, device=device)
    torch.cumsum(counts, 0, out=crow[1:])
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        matrix = torch.sparse_csr_tensor(
            crow, order % size, torch.ones(order.shape[0], dtype=torch.float64, device=device),
            (rows * cols, size), check_invariants=False)
    entries = rows * cols * size
    if entries <= DENSE_TRANSITIONS_LIMIT and order.shape[0] >= DENSE_TRANSITIONS_FILL * entries:
        matrix = matrix.to_dense()  # dense products beat sparse ones on well-filled matrices
    return Transitions(local, matrix)


def build_lifting(automaton: Automaton, num_variables: int, first: int, device: torch.device,
                  shared: dict[tuple[object, ...], Transitions] | None = None) -> Lifting:
    """The :class:`Lifting` of ``automaton`` reading the variables ``first .. n-1``.

    ``shared``: transitions by (state sets, merged, class representatives), looked up and filled
    (pass one per automaton table to share them between start states); None: a fresh one.
    """
    n = num_variables
    table = automaton.next_state.to(device)
    reach = automaton.reachable(n - first)
    states = tuple(reach[max(0, v - first)].to(device) for v in range(n + 1))
    # after the last variable only the total over exit states counts: one merged state
    widths = (*(int(s.shape[0]) for s in states[:n]), 1)
    classes: Tensor | None = None
    num_classes = automaton.num_categories
    representatives: Tensor | None = None
    if first < n:
        read = torch.unique(torch.cat(states[first:n]))
        found, count = category_classes(table[read], automaton.num_states)
        if count < num_classes:
            classes, num_classes = found, count
            representatives = torch.full(  # the first category of each class
                (count,), automaton.num_categories, dtype=torch.long, device=device
            ).scatter_reduce_(0, found, torch.arange(found.shape[0], device=device), "amin")
    shared = {} if shared is None else shared
    classes_key = b"" if representatives is None else representatives.cpu().numpy().tobytes()
    moves: list[Transitions | None] = []
    for v in range(n):
        if v < first:
            moves.append(None)
            continue
        merged = v == n - 1
        key = (states[v].cpu().numpy().tobytes(), states[v + 1].cpu().numpy().tobytes(), merged,
               classes_key)
        if key not in shared:
            shared[key] = _transitions(table, states[v], states[v + 1], representatives, merged)
        moves.append(shared[key])
    return Lifting(states, widths, tuple(moves), classes, num_classes)


class LiftingCache:
    """Liftings per (automaton table, start state, first read variable), least recently used
    dropped past :data:`LIFTING_CACHE_SIZE`; the transitions of the last
    :data:`TABLE_CACHE_SIZE` tables are shared between their start states (a new start whose
    state sets were met before only computes its reachable sets and classes).

    A table is recognised by identity (:meth:`Automaton.restart
    <circuits.automata.Automaton.restart>` shares it): do not modify one in place.
    """

    def __init__(self, num_variables: int, num_categories: int, device: torch.device,
                 capacity: int = LIFTING_CACHE_SIZE) -> None:
        self.num_variables = num_variables
        self.num_categories = num_categories
        self.device = device
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, int, int], tuple[Tensor, Lifting]] = OrderedDict()
        #: per table (by identity): its transitions by state sets (shared between start states)
        self._moves: OrderedDict[int, tuple[Tensor, dict[tuple[object, ...], Transitions]]] = \
            OrderedDict()

    def get(self, automaton: Automaton, consume_from: int) -> Lifting:
        """The (cached) lifting of ``automaton`` reading the variables ``consume_from .. n-1``.

        Raises:
            InvalidInputError: not an :class:`Automaton`, another number of categories than the
                circuit's, or ``consume_from`` not an int >= 0.
        """
        if not isinstance(automaton, Automaton):
            raise InvalidInputError(f"automaton must be a circuits.automata.Automaton, got "
                                    f"{type(automaton).__name__}")
        if automaton.num_categories != self.num_categories:
            raise InvalidInputError(
                f"the automaton reads {automaton.num_categories} categories but the circuit's "
                f"variables have {self.num_categories}")
        if isinstance(consume_from, bool) or not isinstance(consume_from, int) or consume_from < 0:
            raise InvalidInputError(f"consume_from must be an int >= 0, got {consume_from!r}")
        first = min(consume_from, self.num_variables)
        table = automaton.next_state
        key = (id(table), automaton.start, first)
        hit = self._entries.get(key)
        if hit is not None and hit[0] is table:
            self._entries.move_to_end(key)
            return hit[1]
        moves = self._moves.get(id(table))
        if moves is None or moves[0] is not table:
            moves = self._moves[id(table)] = (table, {})
        self._moves.move_to_end(id(table))
        while len(self._moves) > TABLE_CACHE_SIZE:
            self._moves.popitem(last=False)
        if len(moves[1]) > TRANSITIONS_PER_TABLE:
            moves[1].clear()
        lifting = build_lifting(automaton, self.num_variables, first, self.device, moves[1])
        self._entries[key] = (table, lifting)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return lifting


__all__ = ["LIFTING_CACHE_SIZE", "Lifting", "LiftingCache", "Transitions", "build_lifting",
           "category_classes"]
