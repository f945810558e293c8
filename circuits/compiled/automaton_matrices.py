"""The lifted matrices of an automaton product, bottom-up (:mod:`circuits.compiled.automaton_product`).

Every layer ``u`` over ``[i, j)`` gets ``M_u (units, |R_i|, |R_j|)``: ``M_u[a, b]`` is the mass of
its assignments on which the DFA goes from ``a`` (before ``i``) to ``b`` (after ``j - 1``). An input
of an unobserved read variable is a :class:`LiftedInput`: its values at the state pairs its
transitions connect, ``T (E, C) @ P (C, units)`` with the 0/1 pair-by-class matrix and the class
sums ``P`` of its probabilities (:class:`~circuits.compiled.automaton_lifting.Transitions`); it is
applied to vectors as a sparse matrix and made dense only where a caller needs the matrix. A sum is
``W @ M``; a product multiplies its children's matrices in interval order.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from circuits.compiled.automaton_lifting import Lifting, Transitions
from circuits.compiled.automaton_structure import ProductStructure
from circuits.compiled.folding import FoldKind
from circuits.compiled.layers import SoftmaxParts
from circuits.compiled.prepared import LogParameters, ParamsLike
from circuits.errors import InvalidInputError


@dataclass(frozen=True)
class Linear:
    """One parameter set in linear space, float64.

    Attributes:
        layers: per layer: an input's ``(units, K)`` probabilities, a sum's ``(units, inputs)``
            weights, or None (a product).
        folds: per input fold: its ``(F * units, K)`` probabilities (slot ``s`` is the rows
            ``s * units .. (s + 1) * units - 1``); ``layers`` holds views of these.
    """

    layers: list[Tensor | None]
    folds: dict[int, Tensor]

    def __getitem__(self, i: int) -> Tensor | None:
        return self.layers[i]


def linear_parameters(structure: ProductStructure, params: ParamsLike | None) -> Linear:
    """The :class:`Linear` parameters: one float64 copy and ``exp`` per fold, in the fold's own
    (contiguous) layout.

    Args:
        params: one parameter set: :class:`LogParameters` (batch 1 or the module's own), a raw
            external mapping with batch 1, or None (the module's own).
    """
    prepared = params if isinstance(params, LogParameters) else \
        structure.circuit.resolve_params(params, None)
    if prepared.batch not in (None, 1):
        raise InvalidInputError(f"an automaton product takes one parameter set, got "
                                f"{prepared.batch}")
    tables: dict[int, Tensor] = {}
    folds: dict[int, Tensor] = {}
    layers: list[Tensor | None] = []
    for node in structure.nodes:
        if node.fold_id < 0:
            layers.append(None)
            continue
        if node.fold_id not in tables:
            value = prepared.values[node.fold_id]
            if isinstance(value, SoftmaxParts):
                value = value.log_probs()
            if value.dim() == 4:
                value = value[0]
            # exponentiated in place: a second allocation costs more than the exp
            table = value.detach().to(torch.float64, copy=True).exp_()
            if node.kind is FoldKind.INPUT:  # (F, units, K)
                folds[node.fold_id] = table.view(-1, table.shape[-1])
            tables[node.fold_id] = table
        layers.append(tables[node.fold_id][node.slot])
    return Linear(layers, folds)


def _csr(crow: Tensor, cols: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, cols, values, shape, check_invariants=False)


@dataclass(frozen=True)
class LiftedInput:
    """The lifted matrices ``M (units, |R_a|, |R_b|)`` of one input layer of a read variable,
    kept as their values at the pairs its transitions connect.

    Attributes:
        moves: the variable's transitions (the pairs, as CSR indices).
        values: (units, E) float64: ``M[u, pair_row[e], pair_col[e]]``.
    """

    moves: Transitions
    values: Tensor
    blocks: dict[int, tuple[Tensor, Tensor, Tensor]] = field(default_factory=dict, repr=False)

    @property
    def units(self) -> int:
        return int(self.values.shape[0])

    def block_indices(self, count: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(crow, stacked_cols, diagonal_cols)`` of ``count`` copies of the pairs: the CSR row
        pointers of ``count |R_a|`` rows, and the columns stacked (``b``: a ``(count |R_a|,
        |R_b|)`` matrix) or block-diagonal (``u |R_b| + b`` in copy ``u``: ``(count |R_a|, count
        |R_b|)``); kept for the draw (not with the transitions, which a cache may hold long)."""
        found = self.blocks.get(count)
        if found is None:
            moves = self.moves
            device = moves.pair_col.device
            crow = torch.zeros(count * moves.width_before + 1, dtype=torch.long, device=device)
            torch.cumsum(moves.row_counts.repeat(count), 0, out=crow[1:])
            stacked = moves.pair_col.repeat(count)
            offsets = torch.arange(count, device=device) * moves.width_after
            diagonal = (moves.pair_col[None] + offsets[:, None]).reshape(-1)
            found = self.blocks[count] = (crow, stacked, diagonal)
        return found

    def apply_shared(self, right: Tensor) -> Tensor:
        """``M[u] @ right`` for every unit: ``right (|R_b|, k)`` -> ``(units, |R_a|, k)``."""
        moves, units = self.moves, self.units
        crow, stacked, _ = self.block_indices(units)
        matrix = _csr(crow, stacked, self.values.reshape(-1),
                      (units * moves.width_before, moves.width_after))
        return (matrix @ right).view(units, moves.width_before, right.shape[1])

    def apply_mapped(self, right: Tensor, index: Tensor | None) -> Tensor:
        """``M[index[j]] @ right[j]`` for every block ``j``: ``right (U, |R_b|, k)`` -> ``(U,
        |R_a|, k)`` (``index`` None: block ``j`` is unit ``j``)."""
        moves = self.moves
        blocks, k = right.shape[0], right.shape[2]
        crow, _, diagonal = self.block_indices(blocks)
        values = self.values if index is None else self.values.index_select(0, index)
        matrix = _csr(crow, diagonal, values.reshape(-1),
                      (blocks * moves.width_before, blocks * moves.width_after))
        return (matrix @ right.reshape(-1, k)).view(blocks, moves.width_before, k)

    def dense(self) -> Tensor:
        """``M`` as a dense ``(units, |R_a|, |R_b|)`` tensor."""
        moves = self.moves
        flat = moves.pair_row * moves.width_after + moves.pair_col
        out = self.values.new_zeros(self.units, moves.width_before * moves.width_after)
        out.index_copy_(1, flat, self.values)
        return out.view(self.units, moves.width_before, moves.width_after)


def lifted_inputs(structure: ProductStructure, ids: list[int], linear: Linear,
                  lifting: Lifting) -> dict[int, LiftedInput]:
    """The :class:`LiftedInput` of the input layers ``ids`` (unobserved read variables): one
    sparse product ``T @ P`` per run of a fold's consecutive slots that share transitions."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and _extends(structure, lifting, runs[-1][-1], i):
            runs[-1].append(i)
        else:
            runs.append([i])
    # per input fold: the class sums (C, rows) of the rows from its first needed slot's on
    spans: dict[int, tuple[int, int]] = {}
    for run in runs:
        node = structure.nodes[run[0]]
        lo, hi = spans.get(node.fold_id, (node.slot, node.slot + len(run)))
        spans[node.fold_id] = (min(lo, node.slot), max(hi, node.slot + len(run)))
    sums: dict[int, tuple[int, Tensor]] = {}
    result: dict[int, LiftedInput] = {}
    for run in runs:
        first = structure.nodes[run[0]]
        units = first.units
        moves = lifting.moves[first.lo]
        assert moves is not None
        if first.fold_id not in sums:
            lo, hi = spans[first.fold_id]
            sums[first.fold_id] = (lo * units, lifting.class_sums(
                linear.folds[first.fold_id][lo * units:hi * units]))
        offset, table = sums[first.fold_id]
        block = table[:, first.slot * units - offset:(first.slot + len(run)) * units - offset]
        values = (moves.matrix @ block).T.contiguous()  # (len(run) * units, E)
        for k, i in enumerate(run):
            result[i] = LiftedInput(moves, values[k * units:(k + 1) * units])
    return result


def input_matrices(structure: ProductStructure, ids: list[int], linear: Linear, lifting: Lifting,
                   values: Tensor, observed: Tensor) -> dict[int, Tensor]:
    """Dense ``M (units, |R_v|, |R_{v+1}|)`` of the input layers ``ids``.

    A variable that is not read gives the identity times ``sum_x p_u(x)`` (``p_u(x)`` when
    observed); an observed read one ``p_u(x)`` at its moves; an unobserved read one its
    :class:`LiftedInput` made dense.
    """
    result: dict[int, Tensor] = {}
    unobserved: list[int] = []
    for i in ids:
        node, probs = structure.nodes[i], linear[i]
        assert probs is not None
        v, moves = node.lo, lifting.moves[node.lo]
        if moves is None or bool(observed[v]):
            result[i] = observed_matrix(probs, lifting, v, int(values[v]) if bool(observed[v])
                                        else None)
        else:
            unobserved.append(i)
    for i, lifted in lifted_inputs(structure, unobserved, linear, lifting).items():
        result[i] = lifted.dense()
    return result


def observed_matrix(probs: Tensor, lifting: Lifting, v: int, x: int | None) -> Tensor:
    """``M (units, |R_v|, |R_{v+1}|)`` of an input ``probs (units, K)`` of variable ``v``
    observed at ``x``, or of a variable that is not read (``x`` None: unobserved)."""
    moves = lifting.moves[v]
    if moves is None:  # not read: the identity
        scale = probs.sum(1) if x is None else probs[:, x]
        eye = torch.eye(lifting.width(v), dtype=torch.float64, device=probs.device)
        return scale[:, None, None] * eye
    assert x is not None
    hits = moves.next_column(x)[:, None] == torch.arange(lifting.width(v + 1),
                                                         device=probs.device)
    return probs[:, x][:, None, None] * hits


def _extends(structure: ProductStructure, lifting: Lifting, last: int, i: int) -> bool:
    """Whether input ``i`` continues a run ending with ``last``: the same fold, the next slot and
    the same transitions (their class sums are adjacent columns: one sparse product)."""
    a, b = structure.nodes[last], structure.nodes[i]
    return a.fold_id == b.fold_id and b.slot == a.slot + 1 and \
        lifting.moves[a.lo] is lifting.moves[b.lo]


def combine(structure: ProductStructure, i: int, mats: dict[int, Tensor], linear: Linear) -> Tensor:
    """A sum or product layer's matrices from its children's."""
    node = structure.nodes[i]
    if node.kind is FoldKind.SUM:
        weights = linear[i]
        assert weights is not None
        joined = mats[node.children[0]] if len(node.children) == 1 else \
            torch.cat([mats[c] for c in node.children], 0)
        return (weights @ joined.flatten(1)).view(node.units, *joined.shape[1:])
    result = structure.gathered(node, 0, mats)
    for t in range(1, len(node.children)):
        result = torch.bmm(result, structure.gathered(node, t, mats))
    return result


def lifted_matrices(structure: ProductStructure, ids: list[int], linear: Linear, lifting: Lifting,
                    values: Tensor, observed: Tensor) -> dict[int, Tensor]:
    """The dense lifted matrices of layers ``ids`` (a set closed under children, children
    first)."""
    inputs = [i for i in ids if structure.nodes[i].kind is FoldKind.INPUT]
    mats = input_matrices(structure, inputs, linear, lifting, values, observed)
    for i in ids:
        if structure.nodes[i].kind is not FoldKind.INPUT:
            mats[i] = combine(structure, i, mats, linear)
    return mats


__all__ = [
    "LiftedInput",
    "Linear",
    "combine",
    "input_matrices",
    "lifted_inputs",
    "lifted_matrices",
    "linear_parameters",
    "observed_matrix",
]
