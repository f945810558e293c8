"""Chow-Liu trees (Chow & Liu, 1968) learned from data, and the region graphs they induce.

:func:`chow_liu_tree` weighs every pair of variables by their empirical mutual information
(counts smoothed with a tiny pseudo-count so that empty cells have finite logs) and keeps a
maximum spanning tree: the tree-shaped distribution closest in KL divergence to the data.
:func:`chow_liu` roots it (at variable 0 by default, or at a center of the tree: :func:`tree_center`)
and turns it into a region graph with one region per subtree, so that circuits built from it
(:func:`circuits.region_graphs.build_circuit`) follow the learned dependency tree; with the CP
pattern and equal input and sum widths that circuit is a hidden Chow-Liu tree
(:func:`circuits.templates.hclt`).

Mutual information is computed between categorical columns. Real-valued columns (Gaussian inputs)
are first binned into equal-frequency bins by :func:`discretize`, which also checks a table whose
columns mix discrete and real-valued variables.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
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
#: Bins per real-valued column in :func:`discretize` unless told otherwise.
DEFAULT_NUM_BINS = 16


def _table(data: Any) -> np.ndarray:
    """``data`` (a numpy array or torch tensor) as an (N, n) numpy array with N, n >= 1, or a
    RegionGraphError."""
    if isinstance(data, torch.Tensor):
        array = data.detach().cpu().numpy()
    elif isinstance(data, np.ndarray):
        array = data
    else:
        raise RegionGraphError(
            f"data must be a numpy array or torch tensor of shape (N, n), got {type(data).__name__}")
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
        raise RegionGraphError(
            f"data must have shape (N, n) with N >= 1 samples and n >= 1 variables, got "
            f"{tuple(array.shape)}")
    return array


def _as_data(data: Any) -> np.ndarray:
    """``data`` as an (N, n) int64 array of values >= 0, or a RegionGraphError."""
    if isinstance(data, torch.Tensor) and (data.is_floating_point() or data.is_complex()
                                           or data.dtype == torch.bool):
        raise RegionGraphError(f"data must hold integer categories, got a {data.dtype} tensor")
    array = _table(data)
    if not np.issubdtype(array.dtype, np.integer):
        raise RegionGraphError(
            f"data must hold integer categories, got dtype {array.dtype}; bin real values into "
            "categories first with circuits.region_graphs.chow_liu.discretize")
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


def tree_center(tree: nx.Graph) -> int:
    """The smallest variable among the centers of ``tree`` (the nodes whose farthest node is
    nearest): rooted there, the tree is as shallow as it can be, so circuits built from it have
    the fewest layers between input and output (pyjuice roots its HCLTs at a center too)."""
    if tree.number_of_nodes() == 0 or not nx.is_tree(tree):
        raise RegionGraphError("tree_center needs a non-empty tree (e.g. from chow_liu_tree)")
    return int(min(nx.center(tree)))


def chow_liu(data: Any, num_categories: int | Sequence[int] | None = None,
             root: int | None = 0) -> RegionGraph:
    """The region graph of the Chow-Liu tree of ``data``, rooted at variable ``root``.

    Each variable ``v`` gets a singleton region ``{v}``; each variable with children in the
    rooted tree also gets the region of its subtree, with one partition into ``{v}`` followed by
    the subtree regions of its children (in increasing variable order). The root region is the
    subtree of ``root``. ``data`` and ``num_categories`` are those of :func:`chow_liu_tree`.

    Args:
        root: the variable at the root (default 0); None roots the tree at its center
            (:func:`tree_center`), the shallowest choice.
    """
    tree = chow_liu_tree(data, num_categories)
    if root is None:
        root = tree_center(tree)
    elif isinstance(root, bool) or not isinstance(root, Integral) or not 0 <= root < len(tree):
        raise RegionGraphError(
            f"root must be a variable 0 .. {len(tree) - 1} of the data (or None for the tree's "
            f"center), got {root!r}")
    root = int(root)
    rooted = nx.bfs_tree(tree, root, sort_neighbors=sorted)
    preorder = list(nx.dfs_preorder_nodes(rooted, root, sort_neighbors=sorted))
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


def discretize(data: Any, supports: Sequence[int | None],
               num_bins: int = DEFAULT_NUM_BINS) -> tuple[np.ndarray, list[int]]:
    """``data`` (N, n) as categories for structure learning: ``(codes (N, n) int64, sizes)``.

    Column ``j`` is discrete when ``supports[j]`` is its number of values (its entries must be
    integers ``0 .. supports[j] - 1``, and are kept) and real-valued when ``supports[j]`` is None
    (its entries must be finite; they are binned into ``num_bins`` equal-frequency bins cut at the
    column's empirical quantiles, so a column with few distinct values gets fewer non-empty bins).
    ``sizes[j]`` is ``supports[j]``, or ``num_bins`` for a real column.
    """
    array = _table(data)
    if not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)):
        raise RegionGraphError(f"data must hold numbers, got dtype {array.dtype}")
    if len(supports) != array.shape[1]:
        raise RegionGraphError(
            f"{len(supports)} variables described but data has {array.shape[1]} columns")
    num_bins = check_positive_int("num_bins", num_bins)
    codes = np.empty(array.shape, dtype=np.int64)
    sizes: list[int] = []
    for j, support in enumerate(supports):
        column = array[:, j]
        if not np.isfinite(column).all():
            row = int(np.flatnonzero(~np.isfinite(column))[0])
            raise RegionGraphError(
                f"variable {j} has the non-finite value {column[row]} in row {row}; structure "
                "learning needs complete data")
        if support is None:
            cuts = np.quantile(column.astype(np.float64), np.linspace(0, 1, num_bins + 1)[1:-1])
            codes[:, j] = np.searchsorted(cuts, column, side="right")
            sizes.append(num_bins)
            continue
        size = check_positive_int(f"the number of values of variable {j}", support)
        bad = (column != np.round(column)) | (column < 0) | (column >= size)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise RegionGraphError(
                f"variable {j} takes the value {column[row]} in row {row}, but it is discrete with "
                f"values 0 .. {size - 1}")
        codes[:, j] = column.astype(np.int64)
        sizes.append(size)
    return codes, sizes


__all__ = ["DEFAULT_NUM_BINS", "PSEUDO_COUNT", "WEIGHT_KEY", "chow_liu", "chow_liu_tree", "discretize",
           "mutual_information", "tree_center"]
