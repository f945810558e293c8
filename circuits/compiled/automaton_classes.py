"""Category classes of an automaton: the categories that move every state of a set alike.

The transition matrices of an automaton product only need each class's summed probability
(:mod:`~circuits.compiled.automaton_lifting`), so the classes are computed once per automaton
table (over all its states) and per start state (over the states it can reach). All functions
here are exact: hashed classes are checked against the columns and fall back to the packed
labels of :func:`category_classes` when two different columns collide.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from circuits.automata import REJECT

#: labels are packed into int64 keys while below this bound (:func:`category_classes`)
_PACK_LIMIT = 1 << 62
#: the hash weights lie in ``1 .. _HASH_WEIGHT - 1`` (a fixed seed): with ``U`` rows of states
#: below ``S``, hashes stay exact int64 sums while ``U (S + 2) < 2 _HASH_WEIGHT``
_HASH_WEIGHT = 1 << 31
_HASH_SEED = 0x5EED


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


def column_classes(rows: Tensor, num_states: int) -> tuple[Tensor, int]:
    """:func:`category_classes` by one hash of every column, verified.

    Each column ``x`` gets ``h(x) = sum_a w_a (rows[a, x] + 2)`` with fixed random weights
    ``w_a < 2^31`` (exact int64 arithmetic while ``U (S + 1) < 2^32``); equal columns have equal
    hashes, and the classes of the hashes are checked against the columns (every column equal to
    its class's first): a collision of two different columns, or too many rows to hash without
    overflow, falls back to the packed labels of :func:`category_classes`. Either way the result
    is exact; the numbering of the classes may differ between the two.

    Returns:
        ``(classes (K,) long, C)``.
    """
    count, size = rows.shape
    if size == 0 or count == 0 or count * (num_states + 2) >= _HASH_WEIGHT * 2:
        return category_classes(rows, num_states) if size else (rows.new_zeros(0), 0)
    weights = _hash_weights(count, rows.device)
    hashes = ((rows + 2) * weights[:, None]).sum(0)
    _, classes = torch.unique(hashes, return_inverse=True)
    found = int(classes.max()) + 1
    first = representatives(classes, found)
    if bool((rows == rows.index_select(1, first.index_select(0, classes))).all()):
        return classes, found
    return category_classes(rows, num_states)


def sparse_column_classes(rows: Tensor, num_states: int) -> tuple[Tensor, int]:
    """:func:`column_classes` of a table that is mostly :data:`~circuits.automata.REJECT` (an
    automaton over a vocabulary): the hash and the check only visit the allowed entries.

    ``h(x) = sum_{a allowed x} w_a (rows[a, x] + 1)`` (exact int64 while ``U (S + 1) < 2^32``);
    the check: every column has as many allowed entries as its class's first, and each of them
    agrees with it. Falls back to :func:`column_classes` where the hash cannot be exact or two
    different columns collide; exact either way.
    """
    count, size = rows.shape
    if size == 0 or count == 0 or count * (num_states + 2) >= _HASH_WEIGHT * 2:
        return column_classes(rows, num_states)
    states, columns = (rows != REJECT).nonzero(as_tuple=True)  # by state, then column
    after = rows[states, columns]
    weights = _hash_weights(count, rows.device)
    hashes = rows.new_zeros(size).index_add_(0, columns, weights[states] * (after + 1))
    _, classes = torch.unique(hashes, return_inverse=True)
    found = int(classes.max()) + 1
    first = representatives(classes, found).index_select(0, classes)  # (K,) each's first
    entries = torch.bincount(columns, minlength=size)
    if bool((entries == entries[first]).all()) and \
            bool((rows[states, first[columns]] == after).all()):
        return classes, found
    return column_classes(rows, num_states)


def host_column_classes(rows: np.ndarray, num_states: int) -> tuple[np.ndarray, int]:
    """:func:`column_classes` of a host array (small blocks: no tensor overhead).

    Returns:
        ``(classes (K,) int64, C)``.
    """
    count, size = rows.shape
    if size == 0:
        return np.zeros(0, dtype=np.int64), 0
    if count == 0:
        return np.zeros(size, dtype=np.int64), 1
    if count * (num_states + 2) < _HASH_WEIGHT * 2:
        weights = _hash_weights(count, torch.device("cpu")).numpy()
        hashes = weights @ (rows + 2)
        _, first, classes = np.unique(hashes, return_index=True, return_inverse=True)
        classes = classes.reshape(-1)
        if (rows == rows[:, first[classes]]).all():
            return classes, int(first.shape[0])
    found, count = category_classes(torch.from_numpy(rows), num_states)
    return found.numpy(), count


_WEIGHTS: dict[tuple[str, int], Tensor] = {}


def _hash_weights(count: int, device: torch.device) -> Tensor:
    """The first ``count`` of a fixed sequence of random weights in ``1 .. _HASH_WEIGHT - 1``
    (drawn once per device, longer when a longer one is asked for)."""
    key = (str(device), _HASH_WEIGHT)
    weights = _WEIGHTS.get(key)
    if weights is None or weights.shape[0] < count:
        generator = torch.Generator().manual_seed(_HASH_SEED)
        size = max(count, 2 * (0 if weights is None else weights.shape[0]), 1024)
        weights = _WEIGHTS[key] = torch.randint(1, _HASH_WEIGHT, (size,),
                                                generator=generator).to(device)
    return weights[:count]


def representatives(classes: Tensor, count: int) -> Tensor:
    """(C,) long: the first category of every class."""
    return torch.full((count,), classes.shape[0], dtype=torch.long, device=classes.device
                      ).scatter_reduce_(0, classes, torch.arange(classes.shape[0],
                                                                 device=classes.device), "amin")


__all__ = ["category_classes", "column_classes", "host_column_classes", "representatives",
           "sparse_column_classes"]
