"""Region graphs and the circuits built from them.

A region graph (:class:`RegionGraph`) says how the variables are recursively split; a
sum-product pattern (:class:`SumProductPattern`) says which layers realise each split;
:func:`build_circuit` combines the two into a smooth, decomposable :class:`~circuits.Circuit`::

    from circuits.region_graphs import SumProductPattern, build_circuit, quad_tree
    circuit = build_circuit(quad_tree(4, 4), SumProductPattern.CP, num_sum_units=8,
                            num_input_units=8, num_categories=256)

Constructors: :func:`fully_factorized`, :func:`linear` (HMM chain), :func:`balanced_binary_tree`
(the MTPC BTree), :func:`random_binary_tree` (RAT-SPN), :func:`quad_tree`,
:func:`poon_domingos` (images) and :func:`chow_liu` (learned from data). Any
:class:`networkx.DiGraph` with ``kind``/``scope`` node attributes is accepted by
:meth:`RegionGraph.from_networkx`.
"""

from circuits.region_graphs.build import SumProductPattern, build_circuit
from circuits.region_graphs.chow_liu import chow_liu, chow_liu_tree, mutual_information
from circuits.region_graphs.constructors import (
    balanced_binary_tree,
    fully_factorized,
    linear,
    poon_domingos,
    quad_tree,
    random_binary_tree,
)
from circuits.region_graphs.graph import KIND_KEY, SCOPE_KEY, NodeKind, RegionGraph, Scope

__all__ = [
    "KIND_KEY", "SCOPE_KEY", "NodeKind", "RegionGraph", "Scope", "SumProductPattern",
    "balanced_binary_tree", "build_circuit", "chow_liu", "chow_liu_tree", "fully_factorized",
    "linear", "mutual_information", "poon_domingos", "quad_tree", "random_binary_tree",
]
