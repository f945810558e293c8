"""One recursive draft of a draft block: the law it is drawn from and the draw itself, for one
sequence (:class:`~circuits_llm.draft_block.drafter.BlockRoundProgram`) or every row of a batch
(:class:`~circuits_llm.draft_block.batch.RaggedBlockRows`). A sampled draft is an inverse-CDF
draw from exactly the law handed to the accept test; a greedy draft is the argmax."""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_llm.decoding.acceptance import draw_from_row, draw_from_row_on_host
from circuits_llm.decoding.warping import SamplingConfig, warp_logits
from circuits_llm.draft_block.block import DraftBlockError

__all__ = ["draft_law", "draw_step"]


def draft_law(logits: Tensor, config: SamplingConfig) -> Tensor:
    """The law a recursive draft is drawn from, given the block's ``logits`` (..., K) over the
    draft vocabulary (``-inf`` where a constraint forbids): (..., K) float64, the warped softmax
    when sampling, the plain softmax when greedy (what a draft-length rule reads; the greedy
    draft is its argmax)."""
    if config.greedy:
        return torch.softmax(logits.double(), -1)
    return torch.softmax(warp_logits(logits, config).double(), -1)


def draw_step(logits: Tensor, config: SamplingConfig, uniforms: Tensor | None,
              draft_tokens: Tensor | None, *, with_law: bool = False,
              given: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """One recursive step's draft for each row (``...``: () for one sequence, (B,) for a batch),
    the step of :class:`BlockRoundProgram` and of the batch's ``RaggedBlockRows``.

    Args:
        logits: (..., K) the block's logits over the draft vocabulary.
        config: the sampling configuration (greedy when ``temperature == 0``).
        uniforms: (...) float64, each row's uniform for an inverse-CDF draw from its law
            (:func:`draft_law`), or ``None`` when greedy (each row's argmax).
        draft_tokens: (K,) the model ids of the draft vocabulary, or ``None`` (``K = V``).
        with_law: return the law even when greedy (a draft-length rule reads it).
        given: (...) long, indices decided elsewhere (the context copy's proposal, fed to the
            block as drafts): no draw, only the law and the token mapping.

    Returns:
        ``(index, token, law)``: (...) long indices into the draft vocabulary, (...) long model
        ids, and (..., K) float64 the law each was drawn from (``None`` when greedy and not
        ``with_law``).
    """
    if given is None and (uniforms is None) != config.greedy:
        raise DraftBlockError("a recursive draft takes uniforms exactly when sampling")
    law = draft_law(logits, config) if with_law or uniforms is not None else None
    if given is not None:
        index = given
    elif uniforms is None:
        index = logits.argmax(-1)
    else:
        assert law is not None
        rows, draws = law.reshape(-1, law.shape[-1]), uniforms.reshape(-1)
        if law.device.type == "cpu":  # the same tokens, without a maximum at every draw
            index = torch.tensor([draw_from_row_on_host(rows[i], float(draws[i]))
                                  for i in range(len(draws))])
        else:
            index = torch.stack([draw_from_row(rows[i], draws[i]) for i in range(len(draws))])
        index = index.reshape(uniforms.shape)
    token = index if draft_tokens is None else draft_tokens.to(index.device)[index]
    return index, token, law
