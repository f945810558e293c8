"""The numerics a decode runs the model in, chosen once before any backbone wraps the model:
what ``demo``, ``bench``, ``generate`` and the benchmarks run.

* :class:`Precision`: float32 (the weights as loaded, laid out and packed for verify blocks by
  :func:`pack_for_verify_blocks`), or bfloat16 made row-invariant
  (:func:`~circuits_llm.backbone.row_invariant.make_row_invariant`: a verify block's logits equal
  the same positions decoded one by one, bit for bit), which on a CPU with AVX512-BF16 / AMX makes
  a verify of 6-16 positions cost about 1.1 single-position forwards (journal §16). ``auto`` is
  bfloat16 where torch's CPU kernels compute it natively, float32 elsewhere.
* :func:`decode_model`: the model the decoders run, in that precision. A bfloat16 decode runs a
  copy, so that the drafters, which share the target's embedding, final norm and LM head, keep
  reading them as they were trained.
"""

from __future__ import annotations

import copy
from enum import Enum
from typing import Any

import torch

__all__ = ["CPU_GREEDY_EXIT", "CPU_SAMPLED_EXIT", "FLAT_VERIFY_GREEDY_STEPS", "Precision",
           "decode_model", "pack_for_verify_blocks", "recursive_depths"]


class Precision(Enum):
    """The precision the decoders run the model in (``--precision``)."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    def resolve(self, device: torch.device, compile: bool = False) -> Precision:
        """A concrete precision: ``AUTO`` is bfloat16 on a CPU whose oneDNN kernels compute
        bfloat16 natively (AVX512-BF16 or AMX) and an eager backbone, float32 otherwise (a GPU
        keeps the model as loaded: its verify blocks are cheap already).

        Raises:
            ValueError: bfloat16 asked for with ``compile``: the row-invariant kernels are probed
                eager, and compiled code chooses its own.
        """
        if self is Precision.BFLOAT16 and compile:
            raise ValueError("--precision bfloat16 runs row-invariant eager kernels, and --compile "
                             "would replace them with compiled ones: leave --compile out, or "
                             "give --precision float32")
        if self is not Precision.AUTO:
            return self
        if compile:
            return Precision.FLOAT32
        from circuits_llm.runtime.int8_linear import native_bfloat16
        return Precision.BFLOAT16 if native_bfloat16(device) else Precision.FLOAT32


#: a recursive block's drafts in a greedy round where a verify block of up to 32 tokens costs one
#: token (bfloat16 here): the copy's drafts cost no readout, and runs of them are accepted where
#: the text repeats (journal section 17: 9 drafts 3.10x plain decoding greedy, 5 drafts 2.84x)
FLAT_VERIFY_GREEDY_STEPS = 9
#: a recursive block's most drafts in a sampled round there: each sampled draft pays a readout
#: and a draw, and the shipped block's 5th is accepted in 3% of rounds at T = 1 (journal section
#: 18, AMD EPYC, 6 prompts x 128 tokens x 2 seeds: 3 / 4 / 5 drafts 1.52x / 1.51x / 1.43x plain
#: decoding at 1.81 / 1.90 / 1.91 tokens a round)
FLAT_VERIFY_SAMPLED_STEPS = 4
#: on a CPU, a shipped recursive block's greedy round stops drafting after a draft to which the
#: block gives its argmax less than this probability (``BlockDrafter(greedy_exit=)``; journal
#: sections 20-21, AMD EPYC, chat prompts: bfloat16 at 9 drafts 1.17x -> 1.33x plain decoding,
#: float32 at 5 drafts 1.04-1.06x -> 1.15x; code within the noise)
CPU_GREEDY_EXIT = 0.3
#: and its sampled round after a draft the block gives its argmax less than this
#: (``BlockDrafter(sampled_exit=)``, exact; journal section 21, AMD EPYC, T = 1, 12 code and 8
#: chat prompts: bfloat16 1.63x -> 1.70x and 1.28x -> 1.33x plain decoding, draft side 18.4% ->
#: 13.9% of a verify; float32 1.22x -> 1.35x and 1.02x -> 1.14x)
CPU_SAMPLED_EXIT = 0.3


def recursive_depths(precision: Precision, shipped_steps: int) -> tuple[int, int | None]:
    """A recursive block's drafts a round and its cap for sampled rounds
    (:class:`~circuits_llm.draft_block.BlockDrafter`'s ``steps`` and ``sampled_steps``) when the
    decoders run in the resolved ``precision``: in bfloat16 :data:`FLAT_VERIFY_GREEDY_STEPS`
    greedy (or the shipped depth, if deeper) and the shipped depth sampled, at most
    :data:`FLAT_VERIFY_SAMPLED_STEPS`; in float32, where a verify block's cost grows with its
    tokens, the shipped depth for both."""
    if precision is Precision.BFLOAT16 and shipped_steps < FLAT_VERIFY_GREEDY_STEPS:
        return FLAT_VERIFY_GREEDY_STEPS, min(shipped_steps, FLAT_VERIFY_SAMPLED_STEPS)
    return shipped_steps, None


def decode_model(model: Any, precision: Precision, window: int, device: torch.device
                 ) -> tuple[Any, str]:
    """The model every decoder of a run wraps, and a line saying what was done.

    float32: ``model`` itself, its linear weights laid out and packed for verify blocks of up to
    ``window`` tokens on a CPU (:func:`pack_for_verify_blocks`). bfloat16: a row-invariant
    bfloat16 copy (:func:`~circuits_llm.backbone.row_invariant.make_row_invariant`); ``model``
    stays as it was, for the drafters that share its parts. ``AUTO`` is resolved first."""
    from circuits_llm.backbone.row_invariant import make_row_invariant
    chosen = precision.resolve(device)
    if chosen is Precision.FLOAT32:
        return model, pack_for_verify_blocks(model, window, device)
    copied = copy.deepcopy(model)
    done = make_row_invariant(copied, torch.bfloat16)
    return copied, f"model: {done.describe()}"


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
