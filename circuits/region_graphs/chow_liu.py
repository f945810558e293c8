"""Chow-Liu trees (Chow & Liu, 1968) learned from data, and the region graphs they induce.

:func:`chow_liu_tree` weighs every pair of variables by their empirical mutual information
(counts smoothed with a tiny pseudo-count so that empty cells have finite logs) and keeps a
maximum spanning tree: the tree-shaped distribution closest in KL divergence to the data.
:func:`chow_liu` roots it at variable 0 and turns it into a region graph with one region per
subtree, so that circuits built from it (:func:`circuits.region_graphs.build_circuit`) follow
the learned dependency tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import networkx as nx
import numpy as np
import torch

from circuits.errors import RegionGraphError
from circuits.region_graphs.constructors import GraphBuilder, check_positive_int
from circuits.region_graphs.graph import RegionGraph

#: Added to every cell of each pairwise count table before normalising.
PSEUDO_COUNT = 1e-3
#: Edge attribute of :func:`chow_liu_tree` holding the mutual information (nats).
WEIGHT_KEY = "weight"


def _as_data(data: Any) -> np.ndarray:
    """``data`` as an (N, n) int64 array of values >= 0, or a RegionGraphError."""
    if isinstance(data, torch.Tensor):
        if data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
            raise RegionGraphError(f"data must hold integer categories, got a {data.dtype} tensor")
        array = data.detach().cpu().numpy()
    elif isinstance(data, np.ndarray):
        array = data
    else:
        raise RegionGraphError(
            f"data must be a numpy array or torch tensor of shape (N, n), got {type(data).__name__}")
    if not np.issubdtype(array.dtype, np.integer):
        raise RegionGraphError(f"data must hold integer categories, got dtype {array.dtype}")
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
        raise RegionGraphError(
            f"data must have shape (N, n) with N >= 1 samples and n >= 1 variables, got "
            f"{tuple(array.shape)}")
    if (array < 0).any():
        raise RegionGraphError("data holds negative values; categories are 0 .. K-1")
    return array.astype(np.int64, copy=False)


def _categories(array: np.ndarray, num_categories: int | Sequence[int] | None) -> list[int]:
    """The number of categories of each column, checked against the data."""
    n = array.shape[1]
    observed = [int(v) + 1 for v in array.max(axis=0)]
    if num_categories is None:
        return observed
    if isinstance(num_categories, Sequence) and not isinstance(num_categories, str):
        if len(num_categories) != n:
            raise RegionGraphError(
                f"num_categories lists {len(num_categories)} sizes but data has {n} variables")
        sizes = [check_positive_int(f"num_categories[{i}]", k) for i, k in enumerate(num_categories)]
    else:
        sizes = [check_positive_int("num_categories", num_categories)] * n
    for variable, (size, needed) in enumerate(zip(sizes, observed, strict=True)):
        if needed > size:
            raise RegionGraphError(
                f"variable {variable} takes value {needed - 1} but num_categories allows 0 .. "
                f"{size - 1}; raise num_categories or fix the data")
    return sizes


def mutual_information(data: Any, num_categories: int | Sequence[int] | None = None) -> np.ndarray:
    """The (n, n) symmetric matrix of pairwise empirical mutual informations (nats, zero diagonal)."""
    array = _as_data(data)
    sizes = _categories(array, num_categories)
    n = array.shape[1]
    info = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            codes = array[:, i] * sizes[j] + array[:, j]
            joint = np.bincount(codes, minlength=sizes[i] * sizes[j]).astype(np.float64)
            joint = (joint + PSEUDO_COUNT).reshape(sizes[i], sizes[j])
            joint /= joint.sum()
            outer = joint.sum(axis=1, keepdims=True) * joint.sum(axis=0, keepdims=True)
            info[i, j] = info[j, i] = float((joint * np.log(joint / outer)).sum())
    return info


def chow_liu_tree(data: Any, num_categories: int | Sequence[int] | None = None) -> nx.Graph:
    """The Chow-Liu tree of ``data`` (N, n): an undirected :class:`networkx.Graph` over nodes
    ``0 .. n-1`` whose edges carry their mutual information as ``weight``.

    Args:
        data: integer numpy array or torch tensor of shape (N, n), values ``0 .. K-1``.
        num_categories: categories per variable (an int for all, or one per column); default:
            ``1 + max`` of each column.
    """
    info = mutual_information(data, num_categories)
    n = info.shape[0]
    complete = nx.Graph()
    complete.add_nodes_from(range(n))
    for i in range(n):
        for j in range(i + 1, n):
            complete.add_edge(i, j, **{WEIGHT_KEY: float(info[i, j])})
    tree = nx.maximum_spanning_tree(complete, weight=WEIGHT_KEY, algorithm="kruskal")
    result = nx.Graph()
    result.add_nodes_from(range(n))
    for u, v in sorted(tuple(sorted(edge)) for edge in tree.edges()):
        result.add_edge(u, v, **{WEIGHT_KEY: float(info[u, v])})
    return result


def chow_liu(data: Any, num_categories: int | Sequence[int] | None = None) -> RegionGraph:
    """The region graph of the Chow-Liu tree of ``data``, rooted at variable 0.

    Each variable ``v`` gets a singleton region ``{v}``; each variable with children in the
    rooted tree also gets the region of its subtree, with one partition into ``{v}`` followed by
    the subtree regions of its children (in increasing variable order). The root region is the
    subtree of variable 0. Arguments are those of :func:`chow_liu_tree`.
    """
    tree = chow_liu_tree(data, num_categories)
    rooted = nx.bfs_tree(tree, 0, sort_neighbors=sorted)
    preorder = list(nx.dfs_preorder_nodes(rooted, 0, sort_neighbors=sorted))
    children = {v: sorted(rooted.successors(v)) for v in preorder}
    scopes: dict[int, frozenset[int]] = {}
    for v in reversed(preorder):  # children before parents, no recursion on deep chains
        scopes[v] = frozenset({v}).union(*(scopes[c] for c in children[v]))
    builder = GraphBuilder()
    region = {v: builder.region(scopes[v]) for v in preorder}
    for v in preorder:
        if children[v]:
            parts = [builder.region((v,))] + [region[c] for c in children[v]]
            builder.partition(region[v], parts)
    return builder.build()

__all__ = ["PSEUDO_COUNT", "WEIGHT_KEY", "chow_liu", "chow_liu_tree", "mutual_information"]
