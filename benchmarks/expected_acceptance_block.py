"""Expected acceptance of a draft block's drafts (issue 44) at T = 1 and greedy, on fixed held-out
text: the recursive block (FastMTP, :class:`~circuits_llm.draft_block.BlockDrafter`) and a circuit
head on the block (:class:`~circuits_llm.draft_block.BlockCircuitDrafter`).

``python -m benchmarks.expected_acceptance --block DIR [--head HEAD_DIR]`` runs these; the
measures (``alpha1``, ``beta2``, ``beta3``, their greedy forms) and the teacher forcing are those
of :mod:`benchmarks.acceptance_measures`, which measures the heads on the backbone.

Teacher-forced the same way as a head: the block's KV cache holds the text's verified pairs
``(h_j, x_{j+1})``, ``j < t``; step 1 reads ``(h_t, x_{t+1} = c)`` and its output ``o_1`` gives
``q_1`` (the block's LM-head readout over its draft vocabulary, softmax at T = 1, argmax greedy);
the recursive step 2 reads ``(o_1, x_{t+2})`` at the next position, step 3 ``(o_2, x_{t+3})``. All
of it is one causal block pass over each text for step 1 and one masked pass per further step
(:func:`~circuits_llm.draft_block.training.depth_outputs`, the training's "training-time test"
passes, equal to the drafter's step-by-step calls). The block reads any verified token, so no
position is skipped. A circuit head on the block reads ``o_1`` where a head reads the backbone's
hidden state; everything else is the heads' measure. No speed bounds here: they need the timed
costs of a head's draft program, which these measures do not time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.acceptance_measures import (
    Acceptance,
    FeatureMap,
    Position,
    collect_positions,
    measure_head,
)
from circuits.errors import CircuitError
from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.draft_block.block import DraftBlock, DraftBlockError
from circuits_llm.draft_block.training import depth_outputs
from circuits_llm.protocols import Backbone
from circuits_llm.runtime.checkpoint import CheckpointError
from circuits_llm.training.config import TrainingConfigError

#: what :func:`load_block_drafters` raises on a bad ``--block`` or ``--head`` directory (the CLI
#: turns each into one usage error)
BLOCK_LOAD_ERRORS = (TrainingConfigError, CheckpointError, CircuitError, DraftBlockError,
                     ValueError)


@torch.no_grad()
def block_depths(block: DraftBlock, hidden: Tensor, ids: Tensor, depths: int) -> list[Tensor]:
    """The block's outputs at recursive steps ``1..depths`` over one text, teacher-forced:
    ``hidden`` (T, d) the features ``h_j``, ``ids`` (T,) the text -> ``depths`` tensors (T-1, d),
    step ``a``'s row ``t + a - 1`` being the round after ``c = x_{t+1}`` at its step ``a`` (step
    1 reads ``(h_t, x_{t+1})``, step ``a >= 2`` reads step ``a - 1``'s output with
    ``x_{t+a}``)."""
    dtype, device = block.dtype, block.device
    passes = depth_outputs(block, hidden[None, :-1].to(device, dtype), ids[None, 1:].to(device),
                           depths)
    return [output[0] for output in passes]


def block_features(block: DraftBlock) -> FeatureMap:
    """The :data:`~benchmarks.acceptance_measures.FeatureMap` of a circuit head on ``block``: the
    backbone's features ``(T, d)`` and the text ``(T,)`` -> the block's step-1 outputs ``o_1``
    ``(T - 1, d)``, row ``t`` the one a round after ``c = x_{t+1}`` hands the head."""
    return lambda hidden, ids: block_depths(block, hidden, ids, 1)[0]


def collect_block_positions(backbone: Backbone, texts: Sequence[Tensor], program: RoundProgram,
                            block: DraftBlock) -> tuple[list[Position], int]:
    """:func:`~benchmarks.acceptance_measures.collect_positions` for ``program``'s head on
    ``block``'s outputs: each position's ``hidden`` is ``o_1`` (1, d)."""
    return collect_positions(backbone, texts, program, block_features(block))


def block_measures(block: DraftBlock, backbone: Backbone, texts: Sequence[Tensor], *,
                   first: int = 0) -> tuple[Acceptance, Acceptance]:
    """:class:`~benchmarks.acceptance_measures.Acceptance` of the recursive block at every
    position ``t = first..T-4`` of ``texts`` (module docstring), at T = 1 and greedy, from one
    prefill and the passes of :func:`block_depths` (steps ``1..min(3, k)``) per text."""
    depths = min(3, block.steps)
    tokens = None if block.draft_tokens is None else block.draft_tokens.cpu()
    inside = torch.ones(block.vocab_size, dtype=torch.bool)
    if tokens is not None:
        inside = torch.zeros_like(inside)
        inside[tokens] = True
    # per mode (T = 1, greedy): alpha1, beta2, beta3, peak, one tensor per text each
    columns: list[list[list[Tensor]]] = [[[], [], [], []], [[], [], [], []]]
    for ids in texts:
        count = max(ids.shape[0] - 3 - first, 0)  # the rows t = first..T-4
        with torch.no_grad():
            backbone.reset()
            step = backbone.extend(ids[None])
            outputs = block_depths(block, step.draft_hidden[0], ids, depths)
            logits = step.verifier_logits[0]
        nan = torch.full((count,), float("nan"), dtype=torch.float64)
        values = [[nan, nan, nan, nan], [nan, nan, nan, nan]]
        known = torch.ones(count, dtype=torch.bool)
        for a, output in enumerate(outputs, 1):  # row t + a - 1: the law of x_{t+a+1}
            rows = slice(first + a - 1, first + a - 1 + count)
            with torch.no_grad():
                drafted = block.logits(output[rows]).double().cpu()
            target = logits[first + a:first + a + count].double().cpu()
            if a >= 2:  # the drafts before are the text's x_{t+2}..x_{t+a}
                known &= inside[ids[first + a:first + a + count].cpu()]
            q, p = torch.softmax(drafted, -1), torch.softmax(target, -1)
            accept = torch.minimum(p if tokens is None else p[:, tokens], q).sum(-1)
            chosen = drafted.argmax(-1)
            chosen = chosen if tokens is None else tokens[chosen]
            hit = (chosen == target.argmax(-1)).double()
            values[0][a - 1] = torch.where(known, accept, nan)
            values[1][a - 1] = torch.where(known, hit, nan)
            if a == 1:
                values[0][3] = q.max(-1).values
        for mode in range(2):
            for column, value in zip(columns[mode], values[mode], strict=True):
                column.append(value)
    empty = torch.zeros(0, dtype=torch.float64)
    alpha1, beta2, beta3, peak = (torch.cat(c) if c else empty for c in columns[0])
    hits = [torch.cat(c) if c else empty for c in columns[1]]
    return Acceptance(alpha1, beta2, peak, beta3), Acceptance(hits[0], hits[1], hits[3], hits[2])


def block_acceptance(block: DraftBlock, backbone: Backbone, texts: Sequence[Tensor], *,
                     greedy: bool = False) -> Acceptance:
    """:func:`block_measures`' T = 1 or ``greedy``
    :class:`~benchmarks.acceptance_measures.Acceptance` (``peak`` NaN when greedy)."""
    return block_measures(block, backbone, texts)[1 if greedy else 0]


def measure_block(block: DraftBlock, backbone: Backbone, texts: Sequence[Tensor], *,
                  greedy: bool = False, first: int = 0) -> dict[str, Any]:
    """:func:`block_acceptance` of the recursive block at T = 1 (and ``greedy``) from row
    ``first`` of each text on, as :func:`~benchmarks.acceptance_measures.measure_head` records a
    head's."""
    sampled, argmax = block_measures(block, backbone, texts, first=first)
    record: dict[str, Any] = {"skipped_outside_vocabulary": 0,
                              "by_temperature": {"1": sampled.summary()}}
    if greedy:
        record["greedy"] = argmax.summary()
    return record


def measure_head_on_block(head: Any, block: DraftBlock, backbone: Backbone,
                          texts: Sequence[Tensor], temperatures: Sequence[float], *,
                          greedy: bool = False, first: int = 0) -> dict[str, Any]:
    """:func:`~benchmarks.acceptance_measures.measure_head` of a circuit ``head`` reading
    ``block``'s outputs ``o_1`` from row ``first`` of each text on (no costs, so no speed
    bounds)."""
    return measure_head(head, backbone, texts, temperatures, features=block_features(block),
                        greedy=greedy, first=first)


def load_block_head(path: Path, block: DraftBlock, model: Any) -> Any:
    """The circuit head at ``path`` (a ``save_head`` directory, or a ``train-head --on-block``
    run, which must have trained on ``block``), checked to read ``block``'s outputs."""
    from circuits_llm.draft_block.circuit_drafter import check_block_head
    from circuits_llm.heads import load_head
    from circuits_llm.training.block_head_trainer import block_sha256, load_trained_block_head
    from circuits_llm.training.results import RECORD_FILE
    if (path / RECORD_FILE).is_file():
        trained_on, head = load_trained_block_head(path, model, block_dir=None)
        if block_sha256(trained_on) != block_sha256(block):
            raise DraftBlockError(f"the head in {path} was trained on another draft block than "
                                  "--block's; give --block the block it was trained on")
    else:
        head = load_head(path, block.hidden_size, block.vocab_size, device=block.device)
    check_block_head(block, head)
    return head.eval()


def load_block_drafters(block_dir: Path, head_dir: Path | None, model: Any
                        ) -> tuple[DraftBlock, Any | None]:
    """The CLI's ``--block DIR`` (a ``save_draft_block`` directory or a ``train-head
    --draft-block`` run) for ``model``, and with ``head_dir`` the circuit head on it
    (:func:`load_block_head`; else None). Raises one of :data:`BLOCK_LOAD_ERRORS`."""
    from circuits_llm.training.block_head_trainer import load_block
    block = load_block(block_dir, model)
    return block, None if head_dir is None else load_block_head(head_dir, block, model)


def measure_block_drafters(block: DraftBlock, head: Any | None, model: Any,
                           texts: Sequence[Tensor], temperatures: Sequence[float], *,
                           greedy: bool = False, int8: bool = False, first: int = 0,
                           log: Callable[[str], None] = lambda line: None
                           ) -> dict[str, dict[str, Any]]:
    """The CLI's rows for the draft block on ``model`` (the HF causal LM): ``"recursive block"``
    (:func:`measure_block`) and, with ``head``, ``"<architecture> on block"``
    (:func:`measure_head_on_block` at each of ``temperatures``), logging each when done; with
    ``int8`` the same rows again for the block's int8 copy (what a drafter on a CPU holds by
    default, :func:`~circuits_llm.draft_block.weights.int8_block`), named ``"..., int8"``; each
    from row ``first`` of every text on."""
    from circuits_llm.draft_block.weights import int8_block
    backbone = HFBackbone(model, feature_layers=block.fused_layers)
    rows: dict[str, dict[str, Any]] = {}
    for suffix, held in (("", block), *((", int8", int8_block(block)),) * int8):
        rows[f"recursive block{suffix}"] = measure_block(held, backbone, texts, greedy=greedy,
                                                         first=first)
        log(f"recursive block{suffix}: done")
        if head is not None:
            name = f"{getattr(head, 'architecture', None) or 'head'} on block{suffix}"
            rows[name] = measure_head_on_block(head, held, backbone, texts, temperatures,
                                               greedy=greedy, first=first)
            log(f"{name}: done")
    return rows
