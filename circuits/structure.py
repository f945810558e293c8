"""Structural properties of circuits, with explanations of what is wrong.

* **smooth**: every sum layer's inputs have the same scope.
* **decomposable**: every product layer's inputs have pairwise disjoint scopes.
* **structured-decomposable**: decomposable, and all product layers with the same scope split it
  into the same set of sub-scopes (the circuit follows one variable tree, a *vtree*).
* **compatible** (two circuits): both smooth and decomposable, and any two product layers, one
  from each circuit, with the same scope split it the same way. Compatible circuits can be
  multiplied in polynomial time (:func:`circuits.operations.multiply`).

Each ``is_*`` predicate has a ``*_violations`` twin returning human-readable reasons;
:func:`check` raises :class:`~circuits.errors.StructureError` naming the offending layer. It also
requires the variable ids to have no gap (:func:`variable_id_violations`).
"""

from __future__ import annotations

from circuits.errors import StructureError
from circuits.symbolic import Circuit, ProductLayer, Scope


def _fmt(scope: Scope) -> str:
    return "{" + ", ".join(map(str, sorted(scope))) + "}"


def smoothness_violations(circuit: Circuit) -> list[str]:
    """Reasons why ``circuit`` is not smooth (empty when it is)."""
    problems = []
    for layer in circuit.sum_layers:
        scopes = {i.scope for i in layer.inputs}
        if len(scopes) > 1:
            detail = ", ".join(f"{i.describe()} has scope {_fmt(i.scope)}" for i in layer.inputs)
            problems.append(
                f"{layer.describe()} is not smooth: its inputs have different scopes ({detail}). "
                "Every input of a sum must cover the same variables.")
    return problems


def decomposability_violations(circuit: Circuit) -> list[str]:
    """Reasons why ``circuit`` is not decomposable (empty when it is)."""
    problems = []
    for layer in circuit.product_layers:
        seen: dict[int, str] = {}
        for child in layer.inputs:
            for variable in child.scope:
                if variable in seen:
                    problems.append(
                        f"{layer.describe()} is not decomposable: variable {variable} is in the "
                        f"scope of both {seen[variable]} and {child.describe()}. The inputs of a "
                        "product must cover disjoint variables.")
                    break
                seen[variable] = child.describe()
    return problems


def variable_id_violations(circuit: Circuit) -> list[str]:
    """Reasons why the variable ids of ``circuit`` are not ``0 .. num_variables - 1`` without gaps.

    Data has one column per id up to the largest; an id that no input layer (integrated or not)
    uses would be a column that the circuit silently ignores, usually a numbering mistake.
    """
    used = {layer.variable for layer in circuit.input_layers}
    missing = sorted(set(range(circuit.num_variables)) - used)
    if not missing:
        return []
    return [f"variable ids {missing} are missing: the input layers use {_fmt(frozenset(used))}, "
            f"so data would have {circuit.num_variables} columns of which {len(missing)} no layer "
            f"reads. Number the variables 0..{len(used) - 1} without gaps (or add input layers "
            "for the missing ids)."]


def _splits(circuit: Circuit) -> dict[Scope, dict[frozenset[Scope], ProductLayer]]:
    """For every product scope, the distinct ways the circuit splits it (ignoring empty parts)."""
    table: dict[Scope, dict[frozenset[Scope], ProductLayer]] = {}
    for layer in circuit.product_layers:
        split = frozenset(i.scope for i in layer.inputs if i.scope)
        table.setdefault(layer.scope, {}).setdefault(split, layer)
    return table


def structured_decomposability_violations(circuit: Circuit) -> list[str]:
    """Reasons why ``circuit`` is not structured-decomposable (empty when it is)."""
    problems = decomposability_violations(circuit)
    for scope, splits in _splits(circuit).items():
        if len(splits) > 1:
            ways = "; ".join(
                f"{layer.describe()} splits it into " + " | ".join(_fmt(s) for s in sorted(
                    split, key=sorted)) for split, layer in splits.items())
            problems.append(
                f"scope {_fmt(scope)} is split in {len(splits)} different ways ({ways}); a "
                "structured-decomposable circuit splits each scope one way.")
    return problems


def compatibility_violations(first: Circuit, second: Circuit) -> list[str]:
    """Reasons why two circuits are not compatible (empty when they are)."""
    problems = [f"first circuit: {p}" for p in
                smoothness_violations(first) + decomposability_violations(first)]
    problems += [f"second circuit: {p}" for p in
                 smoothness_violations(second) + decomposability_violations(second)]
    if problems:
        return problems
    splits_a, splits_b = _splits(first), _splits(second)
    for scope in splits_a.keys() & splits_b.keys():
        for split_a, layer_a in splits_a[scope].items():
            for split_b, layer_b in splits_b[scope].items():
                if split_a != split_b:
                    problems.append(
                        f"scope {_fmt(scope)} is split as "
                        + " | ".join(_fmt(s) for s in sorted(split_a, key=sorted))
                        + f" by {layer_a.describe()} in the first circuit but as "
                        + " | ".join(_fmt(s) for s in sorted(split_b, key=sorted))
                        + f" by {layer_b.describe()} in the second.")
    return problems


def is_smooth(circuit: Circuit) -> bool:
    return not smoothness_violations(circuit)


def is_decomposable(circuit: Circuit) -> bool:
    return not decomposability_violations(circuit)


def is_structured_decomposable(circuit: Circuit) -> bool:
    return not structured_decomposability_violations(circuit)


def are_compatible(first: Circuit, second: Circuit) -> bool:
    return not compatibility_violations(first, second)


def check(circuit: Circuit) -> None:
    """Raise :class:`StructureError` unless ``circuit`` is smooth and decomposable and its
    variable ids have no gap.

    Smoothness and decomposability make every query of :mod:`circuits.compiled` exact; gap-free
    ids make every data column one of the circuit's variables.
    """
    problems = (variable_id_violations(circuit) + smoothness_violations(circuit)
                + decomposability_violations(circuit))
    if problems:
        raise StructureError("circuit is not valid for exact inference:\n- " + "\n- ".join(problems))


__all__ = [
    "are_compatible", "check", "compatibility_violations", "decomposability_violations",
    "is_decomposable", "is_smooth", "is_structured_decomposable", "smoothness_violations",
    "structured_decomposability_violations", "variable_id_violations",
]
