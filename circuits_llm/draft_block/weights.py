"""How a drafter holds the draft block's weights: as trained, or in int8.

A recursive step of the shipped SmolLM2 block reads 36 MB of float32 weights on a CPU: 17 MB of
the block's projections and 19 MB of LM-head rows. Those reads are most of the draft side of a
round (docs/results.md, section 13). Holding the projections (the fusion, and every layer's
attention and MLP linears) as int8 codes with a float scale per row
(:class:`~circuits_llm.runtime.int8_linear.Int8Linear`), and the LM-head rows the same way with
the largest logits recomputed exactly (:class:`Int8Readout`), reads about a quarter of those bytes.

The decoder stays exact either way: every draft carries the law ``q`` it was drawn from, computed
by the weights the drafter holds, and the verifier's ``min(1, p/q)`` test and residual make the
output the target's law for any ``q``. Only acceptance can move, and it is measured
(``python -m benchmarks.expected_acceptance --block DIR --int8``; docs/results.md).

:class:`DraftWeights` is the choice; :func:`drafting_block` applies it to a block and returns the
block a drafter runs (the trained block itself, or an int8 copy sharing the target's parts).
"""

from __future__ import annotations

import copy
from enum import Enum

import torch
from torch import Tensor, nn

from circuits_llm.draft_block.block import DraftBlock, DraftBlockError
from circuits_llm.runtime.int8_linear import Int8Linear, packed_kernel_runs

__all__ = ["EXACT_TOP", "DraftWeights", "Int8Readout", "drafting_block", "int8_block"]

#: how many of the int8 readout's largest logits are recomputed from the rows as trained
EXACT_TOP = 16


class DraftWeights(Enum):
    """How a drafter holds the block's projections and LM-head rows.

    ``AUTO`` (the default): ``INT8`` where the packed int8 kernel runs (a CPU block of float32 or
    bfloat16 weights whose projections' input widths are multiples of 16), else ``AS_TRAINED``.
    A float64 block stays as trained: float64 exists to check exactness to 1e-10.
    ``AS_TRAINED``: the block's own weights. ``INT8``: int8 codes with a scale per output row, on
    any device (off a CPU the product runs on the dequantised weight, which saves memory, not
    time).
    """

    AUTO = "auto"
    AS_TRAINED = "as-trained"
    INT8 = "int8"

    def resolve(self, block: DraftBlock) -> DraftWeights:
        """``AS_TRAINED`` or ``INT8``: what ``AUTO`` means for ``block``; the others as they
        are."""
        if self is not DraftWeights.AUTO:
            return self
        attention = block.layers[0].self_attn
        widths = {block.hidden_size, block.config.intermediate_size,  # every projection's input
                  block.config.num_attention_heads * attention.head_dim}
        if block.fused_layers:
            widths.add(len(block.fused_layers) * block.hidden_size)
        packed = block.dtype in (torch.float32, torch.bfloat16) and all(
            packed_kernel_runs(width, block.device) for width in widths)
        return DraftWeights.INT8 if packed else DraftWeights.AS_TRAINED


class Int8Readout(nn.Module):
    """The LM head's rows over the draft vocabulary held in int8, with the largest logits
    recomputed from the rows as trained.

    The packed kernel returns bfloat16, whose rounding (0.06 at a logit of 16) would flip the
    argmax between near-ties and cost greedy acceptance (measured: 2.233 -> 2.194 tokens a round
    with a plain int8 readout). So the ``exact_top`` largest int8 logits of each row are replaced
    by exact products with the trained rows: the argmax is the trained readout's whenever it is
    among them, and the rest of the law moves by the rounding of small probabilities.

    Args:
        weight: (K, d) the trained rows (held by reference: the block's gathered readout).
        bias: (K,) or ``None``.
        exact_top: how many logits per row are recomputed (at most ``K``).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, exact_top: int = EXACT_TOP) -> None:
        super().__init__()
        self.codes = Int8Linear.from_weight(weight, bias)
        self.__dict__["_rows"] = weight  # shared with the trained block, not a buffer
        self.__dict__["_bias"] = bias
        self.exact_top = min(exact_top, weight.shape[0])

    def forward(self, normed: Tensor) -> Tensor:
        """``normed`` (..., d) the final norm's output -> (..., K) logits in the rows' dtype."""
        rows: Tensor = self.__dict__["_rows"]
        bias: Tensor | None = self.__dict__["_bias"]
        normed = normed.to(rows.dtype)
        approximate = self.codes(normed)
        top = approximate.topk(self.exact_top, -1).indices  # (..., m)
        exact = (rows[top] @ normed[..., None]).squeeze(-1)  # (..., m)
        if bias is not None:
            exact = exact + bias[top]
        return approximate.scatter(-1, top, exact)


def int8_block(block: DraftBlock) -> DraftBlock:
    """A copy of ``block`` whose ``nn.Linear`` projections (the fusion, every layer's attention and
    MLP) are :class:`~circuits_llm.runtime.int8_linear.Int8Linear` and whose readout is an
    :class:`Int8Readout`; its norms, rotary angles and draft vocabulary are copied, and the
    target's parts (embedding, final norm, LM head) are shared, not copied. The copy is for
    drafting: it has no trainable projections. A block already held in int8 is returned as it
    is."""
    if not isinstance(block, DraftBlock):
        raise DraftBlockError(f"int8_block quantises a DraftBlock, got {type(block).__name__}")
    if not any(isinstance(module, nn.Linear) for module in block.modules()):
        return block  # already held in int8
    weight, bias = block.readout()  # the trained rows, gathered once and kept by the block
    shared = {id(block.target): block.target}  # deepcopy's memo: these are not copied
    kept = block.__dict__.get("_readout")
    if kept is not None:
        shared[id(kept)] = kept
    clone = copy.deepcopy(block, shared)
    clone.__dict__.pop("_readout", None)  # the copy reads out through its Int8Readout
    for module in list(clone.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear.from_linear(child))
    clone.requires_grad_(False)
    clone.__dict__["readout_override"] = Int8Readout(weight, bias)  # not a submodule: never saved
    return clone


def drafting_block(block: DraftBlock, weights: DraftWeights) -> DraftBlock:
    """The block a drafter runs for ``weights``: ``block`` itself when it resolves to
    ``AS_TRAINED``, else :func:`int8_block` of it."""
    if not isinstance(weights, DraftWeights):
        raise DraftBlockError(f"weights must be a DraftWeights, got {weights!r}")
    if weights.resolve(block) is DraftWeights.INT8:
        return int8_block(block)
    return block
