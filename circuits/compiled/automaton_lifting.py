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
  so a schema automaton has a few tens of classes instead of the ``K`` categories;
* per read variable, its :class:`Transitions` from ``R_v`` to ``R_{v+1}``; variables with the same
  state sets share one object (one sparse product computes all their input matrices).

Everything a start state does not change is computed once per automaton table
(:class:`TableIndex`): the table's own classes (the classes of all its states, ``G`` of them,
which every start's classes coarsen), its ``(S, G)`` table over them and every state's distinct
successors. A lifting then works on small host arrays of ``(states, G)`` blocks instead of
``(states, K)`` ones: a breadth-first search over the successor lists for the state sets, one
hash for its classes (:func:`~circuits.compiled.automaton_classes.host_column_classes`), and one
pass of array operations for the transitions of all variables (:func:`_all_transitions`).

:class:`LiftingCache` keeps the liftings per (automaton table, start state, first read variable),
and the table indices per table, so a decoder that restarts one automaton every round pays the
per-table work once and builds each start state's lifting at most once.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from circuits.automata import REJECT, Automaton
from circuits.compiled.automaton_classes import (
    category_classes,
    column_classes,
    host_column_classes,
    representatives,
    sparse_column_classes,
)
from circuits.errors import InvalidInputError

#: how many liftings (automaton table x start x first read variable) a cache keeps
LIFTING_CACHE_SIZE = 64
#: how many automaton tables a cache keeps indices for
TABLE_CACHE_SIZE = 4
#: transition matrices with at most this many entries, at least this fraction of them 1, are
#: kept dense
DENSE_TRANSITIONS_LIMIT = 1 << 22
DENSE_TRANSITIONS_FILL = 0.25
#: a state allowing at most this fraction of the categories gets its conditionals' scores
#: computed on those categories only (:meth:`TableIndex.few_allowed`)
FEW_ALLOWED = 0.25


@dataclass(frozen=True)
class Transitions:
    """The DFA's moves from the states ``R_a`` before a variable to ``R_b`` after it.

    The lifted matrix of an input with class sums ``P (C, units)`` is ``M[u, a, b] = sum_c P[c, u]
    [next(a, c) = b]``; it is stored sparse, as its values at the ``E`` pairs ``(a, b)`` that
    some class connects (:mod:`~circuits.compiled.automaton_matrices`). Inside a JSON string a
    state moves to a few tens of states, so ``E`` is far below ``|R_a| |R_b|``.

    Attributes:
        class_next: (|R_a|, C) long: the local index in ``R_b`` after a category of class ``c``,
            or ``|R_b|`` when the class is not allowed (a padding column).
        matrix: (E, C) float64: row ``e`` is 1 at the classes that move ``pair_row[e]`` to
            ``pair_col[e]``, so the values are ``matrix @ P``; sparse CSR, or dense when small and
            well filled (:data:`DENSE_TRANSITIONS_FILL`).
        pair_row, pair_col: (E,) long: the pairs ``(a, b)``, sorted by ``a`` then ``b``.
        row_counts: (|R_a|,) long: how many pairs each ``a`` has.
        width_after: ``|R_b|``.
        classes: (K,) long: the class of every category, or None (every category its own class).
    """

    class_next: Tensor
    matrix: Tensor
    pair_row: Tensor
    pair_col: Tensor
    row_counts: Tensor
    width_after: int
    classes: Tensor | None

    @property
    def width_before(self) -> int:
        """``|R_a|``."""
        return int(self.class_next.shape[0])

    def next_category(self, state: int, x: int) -> int:
        """The local index in ``R_b`` after category ``x`` from local state ``state``."""
        c = x if self.classes is None else int(self.classes[x])
        return int(self.class_next[state, c])

    def next_column(self, x: int) -> Tensor:
        """(|R_a|,) long: the local index in ``R_b`` after category ``x`` from every state."""
        return self.class_next[:, x if self.classes is None else int(self.classes[x])]

    def local_next(self) -> Tensor:
        """(|R_a|, K) long: the local index in ``R_b`` after every category from every state
        (``|R_b|`` where it is not allowed)."""
        return self.class_next if self.classes is None else \
            self.class_next.index_select(1, self.classes)


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
        index: the :class:`TableIndex` of the automaton's table.
    """

    states: tuple[Tensor, ...]
    widths: tuple[int, ...]
    moves: tuple[Transitions | None, ...]
    classes: Tensor | None
    num_classes: int
    index: TableIndex

    def allowed_categories(self, v: int, state: int) -> Tensor | None:
        """The sorted categories allowed in local state ``state`` before variable ``v`` when
        they are few (:data:`FEW_ALLOWED` of them at most), else None."""
        return self.index.few_allowed(int(self.states[v][state]))

    def width(self, boundary: int) -> int:
        """``|R_boundary|``."""
        return self.widths[boundary]

    def class_sums(self, probs: Tensor) -> Tensor:
        """``P (C, rows)`` from ``probs (rows, K)``: each class's columns summed (one
        ``index_add`` along the contiguous dimension), transposed (a view); ``probs.T`` when
        every category is its own class."""
        if self.classes is None:
            return probs.T
        return probs.new_zeros(probs.shape[0], self.num_classes).index_add_(
            1, self.classes, probs).T


@dataclass(frozen=True)
class TableIndex:
    """What every lifting of one automaton table shares, whatever its start state.

    Attributes:
        classes: (K,) long: each category's table class (equal columns of the whole table), or
            None when every category is its own class.
        num_classes: ``G``, the number of table classes.
        host_table: (S, G) int64 host array: the next state per table class
            (:data:`~circuits.automata.REJECT` where not allowed).
        host_classes: ``classes`` as a host array.
        offsets, targets: the distinct successors of every state as CSR host arrays, for the
            breadth-first search of the state sets (:func:`_successor_lists`).
        device: the circuit's device.
        allowed: per global state met, :meth:`few_allowed` (cached).
    """

    classes: Tensor | None
    num_classes: int
    host_table: np.ndarray
    host_classes: np.ndarray | None
    offsets: np.ndarray
    targets: np.ndarray
    device: torch.device
    allowed: dict[int, Tensor | None] = field(default_factory=dict, repr=False)

    def few_allowed(self, state: int) -> Tensor | None:
        """The sorted categories global state ``state`` allows, or None when more than
        :data:`FEW_ALLOWED` of all do (cached per state)."""
        if state in self.allowed:
            return self.allowed[state]
        moves = self.host_table[state] != REJECT
        if self.host_classes is not None:
            moves = moves[self.host_classes]
        found = np.flatnonzero(moves)
        result = torch.from_numpy(found).to(self.device) \
            if found.shape[0] <= FEW_ALLOWED * moves.shape[0] else None
        self.allowed[state] = result
        return result

    @staticmethod
    def build(automaton: Automaton, device: torch.device) -> TableIndex:
        """The index of ``automaton``'s table (one pass over its allowed entries)."""
        table = automaton.next_state.to(device)
        classes, count = sparse_column_classes(table, automaton.num_states)
        if count == automaton.num_categories:
            class_table, found = table, None
        else:
            class_table, found = table.index_select(1, representatives(classes, count)), classes
        host = class_table.cpu().numpy()
        return TableIndex(found, count, host, None if found is None else found.cpu().numpy(),
                          *_successor_lists(host), device)


def _all_transitions(rows: np.ndarray, num_states: int, befores: list[np.ndarray],
                     afters: list[np.ndarray], merged: list[bool], classes: Tensor | None,
                     device: torch.device) -> list[Transitions]:
    """The :class:`Transitions` of several variables, built together on the host (one pass of
    a few array operations over all of them, then a slice per variable).

    Args:
        rows: (|R|, C) int64: the next global state of every read state per class (REJECT -1).
        num_states: ``S``.
        befores: per variable, the indices into ``rows`` of its states before.
        afters: per variable, the global states after it (sorted).
        merged: per variable, whether its states after are merged into one local state.
        classes: (K,) long category classes on ``device``, or None.
        device: where the transitions' tensors live.
    """
    size = rows.shape[1]
    heights = [b.shape[0] for b in befores]
    widths = [1 if m else a.shape[0] for a, m in zip(afters, merged, strict=True)]
    count, stride, span = len(befores), max(widths) + 1, num_states + 1
    pad = np.array(widths, dtype=np.int64)
    # position[k, 1 + s]: the local index of state s after variable k, its padding elsewhere and
    # in column 0, which REJECT (-1) reads
    position = np.repeat(pad[:, None], span, axis=1)
    slots = [np.zeros_like(a) if m else np.arange(a.shape[0]) for a, m in
             zip(afters, merged, strict=True)]
    position[np.repeat(np.arange(count), [a.shape[0] for a in afters]),
             np.concatenate(afters) + 1] = np.concatenate(slots)
    row_of = np.repeat(np.arange(count), heights)
    following = rows[np.concatenate(befores)] + (row_of * span + 1)[:, None]
    local = position.reshape(-1)[following]  # (H, C)
    allowed = np.flatnonzero(local < pad[row_of][:, None])  # by row, then class
    keys = (allowed // size) * stride + local.reshape(-1)[allowed]
    order = np.argsort(keys, kind="stable")  # by row, then state after, then class
    keys = keys[order]
    starts = np.flatnonzero(np.diff(keys, prepend=-1)) if keys.shape[0] else keys
    pairs = keys[starts]
    crow = np.append(starts, keys.shape[0])
    columns = (allowed % size)[order]
    pair_row, pair_col = pairs // stride, pairs % stride
    row_counts = np.bincount(pair_row, minlength=sum(heights))
    row_starts = np.concatenate([[0], np.cumsum(heights)])
    pair_starts = np.searchsorted(pair_row, row_starts)
    entry_starts = crow[pair_starts]

    def tensor(values: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(values)).to(device)

    result = []
    for k in range(count):
        e0, e1, n0, n1 = (int(pair_starts[k]), int(pair_starts[k + 1]), int(entry_starts[k]),
                          int(entry_starts[k + 1]))
        entries = (e1 - e0) * size
        if entries <= DENSE_TRANSITIONS_LIMIT and n1 - n0 >= DENSE_TRANSITIONS_FILL * entries:
            # dense products beat sparse ones on well-filled matrices
            dense = np.zeros((e1 - e0, size))
            dense[np.repeat(np.arange(e1 - e0), np.diff(crow[e0:e1 + 1])), columns[n0:n1]] = 1.0
            matrix = tensor(dense)
        else:
            with warnings.catch_warnings():  # "sparse CSR support is in beta"
                warnings.simplefilter("ignore", UserWarning)
                matrix = torch.sparse_csr_tensor(
                    tensor(crow[e0:e1 + 1] - n0), tensor(columns[n0:n1]),
                    torch.ones(n1 - n0, dtype=torch.float64, device=device), (e1 - e0, size),
                    check_invariants=False)
        h0, h1 = int(row_starts[k]), int(row_starts[k + 1])
        result.append(Transitions(tensor(local[h0:h1]), matrix, tensor(pair_row[e0:e1] - h0),
                                  tensor(pair_col[e0:e1]), tensor(row_counts[h0:h1]), widths[k],
                                  classes))
    return result


def _successor_lists(host_table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets (S + 1,), targets)``: the sorted distinct states every state moves to, as CSR."""
    ordered = np.sort(host_table, axis=1)
    keep = ordered != REJECT
    keep[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    offsets = np.zeros(host_table.shape[0] + 1, dtype=np.int64)
    np.cumsum(keep.sum(1), out=offsets[1:])
    return offsets, ordered[keep]


def _reachable(offsets: np.ndarray, targets: np.ndarray, start: int, steps: int
               ) -> list[np.ndarray]:
    """The sorted states reachable from ``start`` after ``0 .. steps`` allowed moves (breadth
    first over the successor lists of :func:`_successor_lists`)."""
    frontier = np.array([start], dtype=np.int64)
    result = [frontier]
    for _ in range(steps):
        starts, ends = offsets[frontier], offsets[frontier + 1]
        lengths = ends - starts
        first = np.cumsum(lengths) - lengths
        picks = np.arange(int(lengths.sum())) - np.repeat(first - starts, lengths)
        frontier = np.unique(targets[picks])
        result.append(frontier)
    return result


def build_lifting(automaton: Automaton, num_variables: int, first: int, device: torch.device,
                  index: TableIndex | None = None) -> Lifting:
    """The :class:`Lifting` of ``automaton`` reading the variables ``first .. n-1``.

    ``index``: the :class:`TableIndex` of its table (shared between start states); None: a
    fresh one. The state sets, classes and moves are small: they are found on the host.
    """
    n = num_variables
    index = TableIndex.build(automaton, device) if index is None else index
    reach = _reachable(index.offsets, index.targets, automaton.start, max(0, n - first))
    sets = [reach[max(0, v - first)] for v in range(n + 1)]
    states = tuple(torch.from_numpy(s).to(device) for s in sets)
    # after the last variable only the total over exit states counts: one merged state
    widths = (*(s.shape[0] for s in sets[:n]), 1)
    classes, num_classes = index.classes, index.num_classes
    moves: list[Transitions | None] = [None] * n
    if first < n:
        read = np.unique(np.concatenate(sets[first:n]))
        rows = index.host_table[read]  # (|read|, G)
        local, count = host_column_classes(rows, automaton.num_states)
        if count < num_classes:  # this start's classes coarsen the table's
            rows = rows[:, np.unique(local, return_index=True)[1]]
            host = local if index.host_classes is None else local[index.host_classes]
            classes, num_classes = torch.from_numpy(host).to(device), count
        # variables with the same state sets before and after share one Transitions (their
        # inputs' matrices then come from one sparse product)
        distinct = [v for v in range(first, n) if v == first or v == n - 1 or not (
            np.array_equal(sets[v], sets[v - 1]) and np.array_equal(sets[v + 1], sets[v]))]
        built = _all_transitions(rows, automaton.num_states,
                                 [np.searchsorted(read, sets[v]) for v in distinct],
                                 [sets[v + 1] for v in distinct], [v == n - 1 for v in distinct],
                                 classes, device)
        for v, found in zip(distinct, built, strict=True):
            moves[v] = found
        for v in range(first, n):
            moves[v] = moves[v] if moves[v] is not None else moves[v - 1]
    return Lifting(states, widths, tuple(moves), classes, num_classes, index)


class LiftingCache:
    """Liftings per (automaton table, start state, first read variable), least recently used
    dropped past :data:`LIFTING_CACHE_SIZE`, and the :class:`TableIndex` of the last
    :data:`TABLE_CACHE_SIZE` tables (shared between their start states).

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
        #: per table (by identity): the table and its index
        self._indices: OrderedDict[int, tuple[Tensor, TableIndex]] = OrderedDict()

    def _check(self, automaton: Automaton) -> None:
        if not isinstance(automaton, Automaton):
            raise InvalidInputError(f"automaton must be a circuits.automata.Automaton, got "
                                    f"{type(automaton).__name__}")
        if automaton.num_categories != self.num_categories:
            raise InvalidInputError(
                f"the automaton reads {automaton.num_categories} categories but the circuit's "
                f"variables have {self.num_categories}")

    def index(self, automaton: Automaton) -> TableIndex:
        """The (cached) :class:`TableIndex` of ``automaton``'s table."""
        self._check(automaton)
        table = automaton.next_state
        hit = self._indices.get(id(table))
        if hit is None or hit[0] is not table:
            hit = self._indices[id(table)] = (table, TableIndex.build(automaton, self.device))
        self._indices.move_to_end(id(table))
        while len(self._indices) > TABLE_CACHE_SIZE:
            self._indices.popitem(last=False)
        return hit[1]

    def get(self, automaton: Automaton, consume_from: int) -> Lifting:
        """The (cached) lifting of ``automaton`` reading the variables ``consume_from .. n-1``.

        Raises:
            InvalidInputError: not an :class:`Automaton`, another number of categories than the
                circuit's, or ``consume_from`` not an int >= 0.
        """
        self._check(automaton)
        if isinstance(consume_from, bool) or not isinstance(consume_from, int) or consume_from < 0:
            raise InvalidInputError(f"consume_from must be an int >= 0, got {consume_from!r}")
        first = min(consume_from, self.num_variables)
        table = automaton.next_state
        key = (id(table), automaton.start, first)
        hit = self._entries.get(key)
        if hit is not None and hit[0] is table:
            self._entries.move_to_end(key)
            return hit[1]
        lifting = build_lifting(automaton, self.num_variables, first, self.device,
                                self.index(automaton))
        self._entries[key] = (table, lifting)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return lifting


__all__ = ["LIFTING_CACHE_SIZE", "Lifting", "LiftingCache", "TableIndex", "Transitions",
           "build_lifting", "category_classes", "column_classes", "sparse_column_classes"]
