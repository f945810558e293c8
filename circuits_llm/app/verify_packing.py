"""The model's linear weights laid out and packed for verify blocks on a CPU, once, before any
backbone wraps the model: what ``demo``, ``bench``, ``generate`` with a head and the benchmarks
run (:func:`pack_for_verify_blocks`; re-exported by :mod:`circuits_llm.app.demo`)."""

from __future__ import annotations

import torch

__all__ = ["pack_for_verify_blocks"]


def pack_for_verify_blocks(model: torch.nn.Module, window: int, device: torch.device) -> str:
    """Store ``model``'s linear weights in the layout whose one-token step is fastest on this
    machine (:func:`~circuits_llm.backbone.weight_layout.tune_weight_layout`), then pack them for
    verify blocks of up to ``window`` tokens on a CPU (before any backbone wraps the model), with
    the backend and smallest block measured fastest in that layout
    (:func:`~circuits_llm.backbone.packed_linear.tune_linear_packing`); returns a line saying what
    was done. Every decoder on the model, the autoregressive baseline included, runs on both."""
    from circuits_llm.backbone.packed_linear import pack_linear_layers, tune_linear_packing
    from circuits_llm.backbone.weight_layout import tune_weight_layout
    # measured here (rather than inside pack_linear_layers) to log what was measured
    if device.type != "cpu":
        return f"linear layers: unchanged on {device.type} (weight packing is for the CPU)"
    layout = tune_weight_layout(model)
    stored = "" if layout is None else f"{layout.describe()}; "
    choice = tune_linear_packing(model, window)
    if choice is None:
        return f"linear layers: {stored}torch's default kernels (no packed GEMM in this torch, " \
               "or none faster than F.linear on this machine)"
    swapped = pack_linear_layers(model, rows=window, min_rows=choice.min_rows,
                                 backend=choice.backend)
    return f"linear layers: {stored}{swapped} packed with {choice.describe()}"
