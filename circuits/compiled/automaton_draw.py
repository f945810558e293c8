"""The sequential draw of an automaton product (:meth:`AutomatonProduct.draw
<circuits.compiled.automaton_product.AutomatonProduct.draw>`).

Variables ``m .. n-1`` are drawn one after the other, each from its exact conditional given the
earlier ones. The states before a drawn variable are known, so every top-down quantity is one row
of a lifted matrix: ``rows[i] (units, |R_hi|)`` is ``dZ/dM_i`` at layer ``i``'s (known) entry
state. Entering child ``t`` of a product ``P`` needs ``M_{c_{t+1}} ... M_{c_last} @ rows[P]`` per
unit (its right siblings applied to the row), times the values of its left siblings (plain circuit
values: their variables are drawn).

Right siblings are never multiplied out into matrices unless that is cheaper
(:class:`RightContext`): a product of lifted matrices ``(|R|, |R|) @ (|R|, |R|)`` costs ``|R|^3``
per unit, and a JSON string reaches a few hundred states within a window, while applying the
same factors right to left to a block of vectors costs ``|R|^2`` per vector. A sum applied to one
vector per unit, ``M_sum[u] @ y[u] = sum_w W[u, w] M_w @ y[u]``, becomes its inputs applied to all
the vectors at once (a shared block of ``units x k`` columns), contracted with ``W`` afterwards;
where that block would grow too wide (a sum below a sum), the estimated flops pick materialising
the sum's matrix instead. Inputs stay sparse
(:class:`~circuits.compiled.automaton_matrices.LiftedInput`). Every choice computes the same exact
products; only their order differs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from circuits.automata import REJECT
from circuits.compiled.automaton_lifting import Lifting
from circuits.compiled.automaton_matrices import (
    LiftedInput,
    Linear,
    lifted_inputs,
    observed_matrix,
)
from circuits.compiled.automaton_structure import ProductStructure
from circuits.compiled.folding import FoldKind


def _compose(unit_map: Tensor | None, index: Tensor | None) -> Tensor | None:
    """The child units of blocks that stand for parent units ``index`` (None: the identity)."""
    if unit_map is None:
        return index
    return unit_map if index is None else unit_map.index_select(0, index)


def _dense_apply(matrix: Tensor, right: Tensor, index: Tensor | None, shared: bool) -> Tensor:
    """``matrix (units, R_lo, R_hi)`` applied to ``right`` (see :meth:`RightContext.apply`)."""
    units, lo, hi = matrix.shape
    if shared:
        return (matrix.reshape(units * lo, hi) @ right).view(units, lo, right.shape[1])
    return torch.bmm(matrix if index is None else matrix.index_select(0, index), right)


class RightContext:
    """The lifted matrices of the layers right of the drawn variable, applied lazily.

    Args:
        structure: the circuit's interval structure.
        linear: the parameter set in linear space.
        lifting: the automaton's side.
        inputs: the sparse lifted inputs of the unobserved read variables right of the draw.
        dense: dense matrices known up front (inputs of variables that are not read).
    """

    def __init__(self, structure: ProductStructure, linear: Linear, lifting: Lifting,
                 inputs: dict[int, LiftedInput], dense: dict[int, Tensor]) -> None:
        self.structure = structure
        self.linear = linear
        self.lifting = lifting
        self.inputs = inputs
        self.mats = dense
        self._costs: dict[tuple[int, int, int, bool], float] = {}

    def _widths(self, i: int) -> tuple[int, int]:
        node = self.structure.nodes[i]
        return self.lifting.width(node.lo), self.lifting.width(node.hi)

    # ------------------------------------------------------------------ application
    def apply(self, i: int, right: Tensor, index: Tensor | None = None, *,
              shared: bool = False) -> Tensor:
        """Layer ``i``'s matrices applied to a block of vectors.

        ``shared``: ``right (R_hi, k)``, the same for every unit; returns ``(units, R_lo, k)``.
        Otherwise ``right (U, R_hi, k)`` and block ``j`` meets unit ``index[j]`` (None: unit
        ``j``); returns ``(U, R_lo, k)``.
        """
        matrix = self.mats.get(i)
        if matrix is not None:
            return _dense_apply(matrix, right, index, shared)
        node = self.structure.nodes[i]
        if node.kind is FoldKind.INPUT:
            lifted = self.inputs[i]
            return lifted.apply_shared(right) if shared else lifted.apply_mapped(right, index)
        if node.kind is FoldKind.SUM:
            return self._apply_sum(i, right, index, shared)
        children, maps = node.children, node.unit_maps
        last = len(children) - 1
        if shared:
            out = self.apply(children[last], right, shared=True)
            if maps[last] is not None:
                out = out.index_select(0, maps[last])
            index, last = None, last - 1
        else:
            out = right
        for t in range(last, -1, -1):
            out = self.apply(children[t], out, _compose(maps[t], index))
        return out

    def _apply_sum(self, i: int, right: Tensor, index: Tensor | None, shared: bool) -> Tensor:
        node = self.structure.nodes[i]
        weights = self.linear[i]
        assert weights is not None
        lo, hi = self._widths(i)
        inner = sum(self.structure.nodes[c].units for c in node.children)
        if shared:
            k = right.shape[1]
            joined = self._joined(node.children, right)
            return (weights @ joined.view(inner, -1)).view(node.units, lo, k)
        blocks, k = right.shape[0], right.shape[2]
        if self._push_cost(i, k, blocks) > self._mat_cost(i) + blocks * lo * hi * k:
            return _dense_apply(self.materialize(i), right, index, False)
        # every input applied to all blocks' vectors at once, then block j takes its unit's mix
        flat = right.permute(1, 0, 2).reshape(hi, blocks * k)
        joined = self._joined(node.children, flat).view(inner, lo, blocks, k)
        mix = weights if index is None else weights.index_select(0, index)  # (U, inner)
        per_block = joined.permute(2, 1, 3, 0).reshape(blocks, lo * k, inner)
        return torch.bmm(per_block, mix[:, :, None]).view(blocks, lo, k)

    def _joined(self, children: tuple[int, ...], right: Tensor) -> Tensor:
        parts = [self.apply(c, right, shared=True) for c in children]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    def materialize(self, i: int) -> Tensor:
        """Layer ``i``'s dense matrices ``(units, R_lo, R_hi)`` (kept)."""
        matrix = self.mats.get(i)
        if matrix is not None:
            return matrix
        node = self.structure.nodes[i]
        if node.kind is FoldKind.INPUT:
            matrix = self.inputs[i].dense()
        elif node.kind is FoldKind.SUM:
            weights = self.linear[i]
            assert weights is not None
            parts = [self.materialize(c) for c in node.children]
            joined = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
            matrix = (weights @ joined.flatten(1)).view(node.units, *joined.shape[1:])
        else:  # right to left: the last child's matrices, then each factor applied to them
            last = len(node.children) - 1
            matrix = self.materialize(node.children[last])
            if node.unit_maps[last] is not None:
                matrix = matrix.index_select(0, node.unit_maps[last])
            for t in range(last - 1, -1, -1):
                matrix = self.apply(node.children[t], matrix, node.unit_maps[t])
        self.mats[i] = matrix
        self._costs.clear()
        return matrix

    # ------------------------------------------------------------------ flop estimates
    def _apply_cost(self, i: int, k: int, blocks: int, shared: bool) -> float:
        """Estimated multiply-adds of :meth:`apply` (``blocks``: U, ignored when shared)."""
        key = (i, k, blocks, shared)
        found = self._costs.get(key)
        if found is not None:
            return found
        node = self.structure.nodes[i]
        lo, hi = self._widths(i)
        rows = node.units if shared else blocks
        if i in self.mats:
            cost = float(rows * lo * hi * k)
        elif node.kind is FoldKind.INPUT:
            cost = float(rows * self.inputs[i].moves.pair_col.shape[0] * k)
        elif node.kind is FoldKind.SUM:
            inner = sum(self.structure.nodes[c].units for c in node.children)
            if shared:
                cost = sum(self._apply_cost(c, k, 0, True) for c in node.children) + \
                    node.units * inner * lo * k
            else:
                cost = min(self._push_cost(i, k, blocks), self._mat_cost(i) + blocks * lo * hi * k)
        else:
            children = node.children
            if shared:
                cost = self._apply_cost(children[-1], k, 0, True) + sum(
                    self._apply_cost(c, k, node.units, False) for c in children[:-1])
            else:
                cost = sum(self._apply_cost(c, k, blocks, False) for c in children)
        self._costs[key] = cost
        return cost

    def _push_cost(self, i: int, k: int, blocks: int) -> float:
        """A sum applied block by block through its inputs (a shared block of U k columns)."""
        node = self.structure.nodes[i]
        lo, _ = self._widths(i)
        inner = sum(self.structure.nodes[c].units for c in node.children)
        return sum(self._apply_cost(c, blocks * k, 0, True) for c in node.children) + \
            blocks * inner * lo * k

    def _mat_cost(self, i: int) -> float:
        """Estimated multiply-adds of :meth:`materialize`."""
        if i in self.mats:
            return 0.0
        key = (i, -1, -1, False)
        found = self._costs.get(key)
        if found is not None:
            return found
        node = self.structure.nodes[i]
        lo, hi = self._widths(i)
        if node.kind is FoldKind.INPUT:
            cost = float(node.units * lo * hi)
        elif node.kind is FoldKind.SUM:
            inner = sum(self.structure.nodes[c].units for c in node.children)
            cost = sum(self._mat_cost(c) for c in node.children) + node.units * inner * lo * hi
        else:
            cost = self._mat_cost(node.children[-1]) + sum(
                self._apply_cost(c, hi, node.units, False) for c in node.children[:-1])
        self._costs[key] = cost
        return cost


class SequentialDraw:
    """One draw of variables ``m .. n-1`` (see the module docstring); :meth:`run` does it.

    Args:
        structure, linear, lifting: the circuit's structure, one parameter set in linear space
            and the automaton's side.
        prefix: the values of variables ``0 .. m-1``.
    """

    def __init__(self, structure: ProductStructure, linear: Linear, lifting: Lifting,
                 prefix: list[int]) -> None:
        self.structure = structure
        self.linear = linear
        self.lifting = lifting
        self.drawn = list(prefix)
        self.m = len(prefix)
        #: the circuit values (units,) of the layers whose variables are all drawn
        self.done: dict[int, Tensor] = {}
        #: the top-down rows (units, |R_hi|) of the layers entered so far
        self.rows: dict[int, Tensor] = {}
        #: per product: its right siblings applied to its row, by first child (units, R, 1)
        self.chains: dict[tuple[int, int], Tensor] = {}
        self.state = 0  # the local index of the state before the next variable
        self.context: RightContext | None = None

    def run(self, conditionals: Tensor, pick: Callable[[Tensor, int], int | None]) -> int:
        """Draw into ``self.drawn``; row ``k`` of ``conditionals (n - m, K)`` gets the ``k``-th
        drawn variable's conditional, ``pick(conditional, k)`` chooses its value (None: stop
        there). Returns how many were drawn before a conditional with no mass, a stop (or a
        prefix the automaton rejects)."""
        structure, lifting, m = self.structure, self.lifting, self.m
        for v in range(m):
            if not self._advance(v, self.drawn[v]):
                return 0
            self._complete(v, self.drawn[v])
        self.context = self._context()
        self.rows[structure.root] = torch.ones(
            1, lifting.width(structure.num_variables), dtype=torch.float64,
            device=conditionals.device)
        length = 0
        for v in range(m, structure.num_variables):
            score = self._score(v)
            total = float(score.sum())
            if not total > 0:
                break
            conditional = torch.div(score, total, out=conditionals[v - m])
            x = pick(conditional, v - m)
            if x is None:
                break
            self.drawn.append(x)
            self._advance(v, x)
            self._complete(v, x)
            length += 1
        return length

    def _context(self) -> RightContext:
        """The right context of the layers after the first drawn variable."""
        structure, lifting = self.structure, self.lifting
        read: list[int] = []
        dense: dict[int, Tensor] = {}
        for i, node in enumerate(structure.nodes):
            if node.kind is not FoldKind.INPUT or node.lo <= self.m:
                continue
            if lifting.moves[node.lo] is None:
                probs = self.linear[i]
                assert probs is not None
                dense[i] = observed_matrix(probs, lifting, node.lo, None)
            else:
                read.append(i)
        inputs = lifted_inputs(structure, read, self.linear, lifting)
        return RightContext(structure, self.linear, lifting, inputs, dense)

    def _advance(self, v: int, x: int) -> bool:
        """Move the state over variable ``v = x``; False when the automaton rejects it."""
        moves = self.lifting.moves[v]
        if moves is None:
            return True
        after = moves.next_category(self.state, x)
        if after == self.lifting.width(v + 1):
            self.state = REJECT
            return False
        self.state = after
        return True

    def _complete(self, v: int, x: int) -> None:
        """The circuit values of the layers whose interval ends at variable ``v = x``."""
        structure, done = self.structure, self.done
        for i in structure.ending[v]:
            node, param = structure.nodes[i], self.linear[i]
            if node.kind is FoldKind.INPUT:
                assert param is not None
                done[i] = param[:, x]
            elif node.kind is FoldKind.SUM:
                assert param is not None
                done[i] = param @ (done[node.children[0]] if len(node.children) == 1
                                   else torch.cat([done[c] for c in node.children]))
            else:
                value = structure.gathered(node, 0, done)
                for t in range(1, len(node.children)):
                    value = value * structure.gathered(node, t, done)
                done[i] = value

    def _chain(self, i: int, s: int) -> Tensor:
        """``M_{c_s} ... M_{c_last} @ rows[i]`` per unit of product ``i``: (units, R, 1)."""
        node = self.structure.nodes[i]
        if s == len(node.children):
            return self.rows[i][:, :, None]
        key = (i, s)
        found = self.chains.get(key)
        if found is None:
            assert self.context is not None
            found = self.chains[key] = self.context.apply(
                node.children[s], self._chain(i, s + 1), node.unit_maps[s])
        return found

    def _score(self, v: int) -> Tensor:
        """``q(x_{<v}, x_v = x)`` (right of ``v`` summed out) for every ``x``: (K,).

        Top-down along the layers containing ``v``; ``rows`` keeps the rows of earlier steps
        (a layer's row depends only on the values before it and the layers right of it), and a
        step computes those of the layers it enters (``pending`` collects the contributions of
        their parents).
        """
        structure, rows = self.structure, self.rows
        pending: dict[int, Tensor] = {}
        score: Tensor | None = None
        for i in structure.containing[v]:
            row = rows.get(i)
            if row is None:
                row = pending.pop(i, None)
                if row is None:
                    continue
                rows[i] = row
            node, param = structure.nodes[i], self.linear[i]
            if node.kind is FoldKind.INPUT:
                assert param is not None
                part = self._input_score(v, row, param)
                score = part if score is None else score + part
            elif node.kind is FoldKind.SUM:
                assert param is not None
                for child, offset in zip(node.children, node.offsets, strict=True):
                    if child not in rows:
                        width = structure.nodes[child].units
                        _add(pending, child, param[:, offset:offset + width].T @ row)
            else:
                t = structure.path_child[(i, v)]
                if node.children[t] in rows:
                    continue
                row = self._chain(i, t + 1)[:, :, 0]
                for left in range(t):
                    row = row * structure.gathered(node, left, self.done)[:, None]
                _add(pending, node.children[t], structure.to_child(node, t, row))
        if score is None:
            return torch.zeros(structure.num_categories, dtype=torch.float64,
                               device=rows[structure.root].device)
        return score

    def _input_score(self, v: int, row: Tensor, probs: Tensor) -> Tensor:
        """``sum_u p_u(x) row[u, next(state, x)]`` for every ``x``: ``row (units, |R_{v+1}|)``,
        ``probs (units, K)``."""
        moves = self.lifting.moves[v]
        if moves is None:
            return row[:, self.state] @ probs
        padded = torch.cat([row, row.new_zeros(row.shape[0], 1)], 1)
        gathered = padded.index_select(1, moves.class_next[self.state])  # (units, C)
        allowed = self.lifting.allowed_categories(v, self.state)
        if allowed is None:  # most categories: every one
            if moves.classes is not None:
                gathered = gathered.index_select(1, moves.classes)  # (units, K)
            return gathered.mul_(probs).sum(0)
        # few categories: the others score 0 (their moves reach the zero padding)
        classes = allowed if moves.classes is None else moves.classes.index_select(0, allowed)
        part = gathered.index_select(1, classes).mul_(probs.index_select(1, allowed)).sum(0)
        return part.new_zeros(probs.shape[1]).index_copy_(0, allowed, part)


def _add(into: dict[int, Tensor], key: int, value: Tensor) -> None:
    into[key] = into[key] + value if key in into else value


__all__ = ["RightContext", "SequentialDraw"]
