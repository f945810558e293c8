"""The lifted matrices of an automaton product, bottom-up (:mod:`circuits.compiled.automaton_product`).

Every layer ``u`` over ``[i, j)`` gets ``M_u (units, |R_i|, |R_j|)``: ``M_u[a, b]`` is the mass of
its assignments on which the DFA goes from ``a`` (before ``i``) to ``b`` (after ``j - 1``). An input
of an unobserved read variable is ``T (|R_i| |R_{i+1}|, C) @ P (C, units)`` with the sparse 0/1
transitions over the category classes and the class sums ``P`` of its probabilities
(:class:`~circuits.compiled.automaton_lifting.Lifting`); a sum is ``W @ M``; a product multiplies
its children's matrices in interval order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from circuits.compiled.automaton_lifting import Lifting
from circuits.compiled.automaton_structure import ProductStructure
from circuits.compiled.folding import FoldKind
from circuits.compiled.layers import SoftmaxParts
from circuits.compiled.prepared import LogParameters, ParamsLike
from circuits.errors import InvalidInputError


@dataclass(frozen=True)
class Linear:
    """One parameter set in linear space, float64.

    Attributes:
        layers: per layer: an input's ``(K, units)`` probabilities (transposed: a category's
            units are contiguous), a sum's ``(units, inputs)`` weights, or None (a product).
        folds: per input fold: its ``(K, F * units)`` probabilities (slot ``s`` is the columns
            ``s * units .. (s + 1) * units - 1``); ``layers`` holds views of these.
    """

    layers: list[Tensor | None]
    folds: dict[int, Tensor]

    def __getitem__(self, i: int) -> Tensor | None:
        return self.layers[i]


def linear_parameters(structure: ProductStructure, params: ParamsLike | None) -> Linear:
    """The :class:`Linear` parameters: one ``exp`` per fold.

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
            value = value.detach()
            if node.kind is FoldKind.INPUT:  # (F, units, K) -> (K, F, units), one copy
                table = torch.empty((value.shape[2], value.shape[0], value.shape[1]),
                                    dtype=torch.float64, device=value.device)
                table.copy_(value.permute(2, 0, 1))
                folds[node.fold_id] = table.view(table.shape[0], -1)
            else:
                table = value.to(torch.float64, copy=True)
            # exponentiated in place: a second allocation costs more than the exp
            tables[node.fold_id] = table.exp_()
        table = tables[node.fold_id]
        layers.append(table[:, node.slot] if node.kind is FoldKind.INPUT else table[node.slot])
    return Linear(layers, folds)


def input_matrices(structure: ProductStructure, ids: list[int], linear: Linear, lifting: Lifting,
                   values: Tensor, observed: Tensor) -> dict[int, Tensor]:
    """``M (units, |R_v|, |R_{v+1}|)`` of the input layers ``ids``.

    A variable that is not read gives the identity times ``sum_x p_u(x)`` (``p_u(x)`` when
    observed); an observed read one ``p_u(x)`` at its moves; an unobserved read one the sparse
    product ``T @ P`` of its transitions with its class sums, taken for whole folds at once.
    """
    result: dict[int, Tensor] = {}
    runs: list[list[int]] = []  # unobserved read inputs, in runs of one fold, moves, next slots
    for i in ids:
        node, probs = structure.nodes[i], linear[i]
        assert probs is not None
        v, moves = node.lo, lifting.moves[node.lo]
        if moves is None:  # not read: the identity
            scale = probs[int(values[v])] if bool(observed[v]) else probs.sum(0)
            eye = torch.eye(lifting.width(v), dtype=torch.float64, device=probs.device)
            result[i] = scale[:, None, None] * eye
        elif bool(observed[v]):
            x = int(values[v])
            hits = moves.local_next[:, x, None] == torch.arange(
                lifting.width(v + 1), device=probs.device)
            result[i] = probs[x][:, None, None] * hits
        elif runs and _extends(structure, lifting, runs[-1][-1], i):
            runs[-1].append(i)
        else:
            runs.append([i])
    sums: dict[int, Tensor] = {}  # per input fold: (C, F * units) class sums
    for run in runs:
        first, units = structure.nodes[run[0]], structure.nodes[run[0]].units
        moves = lifting.moves[first.lo]
        assert moves is not None
        if first.fold_id not in sums:
            sums[first.fold_id] = lifting.class_sums(linear.folds[first.fold_id])
        block = sums[first.fold_id][:, first.slot * units:(first.slot + len(run)) * units]
        # (len(run) * units, |R_v| |R_{v+1}|), contiguous for the batched products above it
        product = (moves.matrix @ block).T.contiguous()
        for k, i in enumerate(run):
            node = structure.nodes[i]
            result[i] = product[k * units:(k + 1) * units].reshape(
                units, lifting.width(node.lo), lifting.width(node.hi))
    return result


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
    """The lifted matrices of layers ``ids`` (a set closed under children, children first)."""
    inputs = [i for i in ids if structure.nodes[i].kind is FoldKind.INPUT]
    mats = input_matrices(structure, inputs, linear, lifting, values, observed)
    for i in ids:
        if structure.nodes[i].kind is not FoldKind.INPUT:
            mats[i] = combine(structure, i, mats, linear)
    return mats


__all__ = ["Linear", "combine", "input_matrices", "lifted_matrices", "linear_parameters"]
