"""The memory layout of a model's linear weights, chosen by measurement for one-token steps.

``nn.Linear`` keeps its weight ``W`` as ``(out, in)`` contiguous, and ``F.linear(x, W)`` computes
``x @ W.T``: a product whose right operand is transposed. On some CPUs the untransposed product is
faster for the one-row calls of a decode step: measured on SmolLM2-135M's 211 linear weights on a
2-core AMD EPYC (1 thread), a one-token forward took 119.0 ms with the weights stored column-major
against 130.2 ms as loaded, and a 2-token forward 161.6 against 186.5 ms (docs/journal.md, "The
open targets at a glance"). :class:`WeightLayout` names the two layouts; :func:`set_weight_layout`
stores every float32 CPU linear weight of a model in one of them (the same values and shape, the
same ``Parameter`` objects, so tied weights stay tied and no memory is added); and
:func:`tune_weight_layout` times one-row ``F.linear`` passes over the model's own weights in both
layouts, interleaved, and keeps the faster.

The outputs equal the row-major ones up to float32 rounding (the kernels sum in different orders),
as packed weights' outputs do (:mod:`~circuits_llm.backbone.packed_linear`). Relaying out changes a
weight's storage, so a :class:`~circuits_llm.backbone.packed_linear.PackedLinear` packs it again on
its next packed call; choose the layout before packing, since the packing tuner measures
``F.linear`` in the layout it finds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from circuits_llm.runtime.timing import interleaved

__all__ = ["LayoutChoice", "WeightLayout", "choose_layout", "set_weight_layout",
           "tune_weight_layout", "weight_layout"]

#: A layout must be at least this much faster than row-major to be chosen (the machine's noise
#: between interleaved passes is a few percent; row-major is what every other tool expects).
MIN_GAIN = 0.03


class WeightLayout(Enum):
    """How a linear weight ``W`` of shape ``(out, in)`` is stored."""

    #: torch's default: ``(out, in)`` contiguous, strides ``(in, 1)``
    ROW_MAJOR = "row-major"
    #: the same values stored as ``W.T`` contiguous, strides ``(1, out)``: ``F.linear`` then runs
    #: an untransposed product
    COLUMN_MAJOR = "column-major"

    def store(self, weight: Tensor) -> Tensor:
        """``weight`` (out, in) with the same values, stored in this layout (itself when it is)."""
        if self is WeightLayout.ROW_MAJOR:
            return weight.contiguous()
        return weight.t().contiguous().t()


def weight_layout(weight: Tensor) -> WeightLayout | None:
    """The layout ``weight`` (2-D) is stored in; ``None`` for any other strides.

    A weight with a dimension of size 1 is both; it is reported as row-major.
    """
    if weight.dim() != 2:
        return None
    if weight.is_contiguous():
        return WeightLayout.ROW_MAJOR
    if weight.t().is_contiguous():
        return WeightLayout.COLUMN_MAJOR
    return None


def _layout_targets(model: nn.Module) -> list[nn.Parameter]:
    """The distinct float32 CPU weights of ``model``'s ``nn.Linear`` layers (subclasses such as
    ``PackedLinear`` included), each once even when tied."""
    seen: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            weight = module.weight
            if weight.dtype == torch.float32 and weight.device.type == "cpu":
                seen.setdefault(id(weight), weight)
    return list(seen.values())


def set_weight_layout(model: nn.Module, layout: WeightLayout) -> int:
    """Store every float32 CPU ``nn.Linear`` weight of ``model`` in ``layout``, in place.

    The ``Parameter`` objects stay the same (their ``.data`` is replaced), so ties (an LM head
    sharing the input embedding) and optimiser references hold; values and shapes are unchanged.
    Returns how many distinct weights were visited.
    """
    if not isinstance(layout, WeightLayout):
        raise ValueError(f"layout must be a WeightLayout, got {layout!r}")
    weights = _layout_targets(model)
    with torch.no_grad():
        for weight in weights:
            if weight_layout(weight) is not layout:
                weight.data = layout.store(weight.data)
    return len(weights)


@dataclass(frozen=True)
class LayoutChoice:
    """What :func:`tune_weight_layout` measured and chose.

    Attributes:
        layout: the layout the weights were left in.
        milliseconds: one-row ``F.linear`` pass over every weight, per layout (best of the runs).
    """

    layout: WeightLayout
    milliseconds: dict[WeightLayout, float]

    def describe(self) -> str:
        """One line for logs: the choice and the measured pass times."""
        cells = ", ".join(f"{layout.value} {ms:.0f}" for layout, ms in self.milliseconds.items())
        return f"weights {self.layout.value} (ms per one-row pass over the linear weights: {cells})"


def choose_layout(milliseconds: dict[WeightLayout, float]) -> WeightLayout:
    """The layout :func:`tune_weight_layout` keeps: column-major only when its one-row pass is at
    least :data:`MIN_GAIN` faster than row-major's, else row-major (what other code expects)."""
    row = milliseconds[WeightLayout.ROW_MAJOR]
    column = milliseconds.get(WeightLayout.COLUMN_MAJOR)
    if column is not None and column <= (1.0 - MIN_GAIN) * row:
        return WeightLayout.COLUMN_MAJOR
    return WeightLayout.ROW_MAJOR


def tune_weight_layout(model: nn.Module, repeats: int = 3) -> LayoutChoice | None:
    """Time a one-row ``F.linear`` pass over ``model``'s float32 CPU linear weights in each layout,
    leave the weights in the faster one (:func:`choose_layout`) and return the choice; ``None``
    (nothing changed) when the model has no such weight.

    The layouts take turns in place (``repeats`` rounds, each relaying out every weight and timing
    one pass, best of two calls), so no second copy of the weights is held and a machine whose
    memory bandwidth drifts is measured in both layouts at nearly the same moments. About 2-4 s for
    SmolLM2-135M (relaying out 537 MB of weights six times).
    """
    weights = _layout_targets(model)
    if not weights:
        return None
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    inputs = {width: torch.randn(1, width) for width in {int(w.shape[1]) for w in weights}}

    def one_pass() -> None:
        for weight in weights:
            F.linear(inputs[int(weight.shape[1])], weight)

    best: dict[WeightLayout, float] = {}
    with torch.no_grad():
        for _ in range(repeats):
            for layout in WeightLayout:
                set_weight_layout(model, layout)
                timing = interleaved({layout.value: one_pass}, rounds=2, max_calls=1)
                ms = 1e3 * timing[layout.value].best
                best[layout] = min(ms, best.get(layout, float("inf")))
        chosen = choose_layout(best)
        set_weight_layout(model, chosen)
    return LayoutChoice(chosen, best)
