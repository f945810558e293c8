"""The decoders' checks of what they are given: prompts, draft vocabularies, head outputs.

Each raises one :class:`~circuits_llm.decoding.warping.DecoderError` that says what was wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from circuits.compiled import CompiledCircuit
from circuits.compiled.circuit import LogParameters
from circuits.errors import InvalidInputError
from circuits_llm.decoding.warping import DecoderError
from circuits_llm.protocols import DraftHead

__all__ = ["check_draft_tokens", "check_prompt", "head_parameters"]


def check_prompt(input_ids: Tensor | Sequence[int], vocab: int) -> list[int]:
    """``input_ids`` ((L,) or (1, L) integer tensor, or ints) -> the prompt as a list of ids in
    ``0 .. vocab - 1`` (L >= 1)."""
    if isinstance(input_ids, Tensor):
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise DecoderError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise DecoderError(f"input_ids must have shape (L,) or (1, L) (batch size 1), "
                               f"got {tuple(input_ids.shape)}")
        tokens = [int(t) for t in input_ids.tolist()]
    else:
        tokens = list(input_ids) if isinstance(input_ids, Sequence) else [input_ids]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise DecoderError(f"input_ids must hold integer token ids, got {input_ids!r}")
    if not tokens:
        raise DecoderError("the prompt is empty: give at least one token id")
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise DecoderError(f"prompt token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
    return tokens


def head_parameters(circuit: CompiledCircuit, params: object) -> LogParameters:
    """The head's output for one round, checked and normalised once for the draft and ``q``.

    The value check (:mod:`circuits.compiled.validity`) costs one host synchronisation per round;
    a round synchronises anyway (its draft goes to the host), and this turns NaN/inf head outputs
    into an error instead of garbage drafts.
    """
    try:
        return circuit.log_parameters(params)  # type: ignore[arg-type]
    except InvalidInputError as error:
        raise DecoderError(f"the draft head's output for this round is unusable: {error}") from error


def check_draft_tokens(head: DraftHead) -> int:
    """The size of the head's draft vocabulary: ``head.draft_tokens`` (K,) distinct model ids
    when it compresses the vocabulary, else the whole vocabulary."""
    tokens = getattr(head, "draft_tokens", None)
    if tokens is None:
        return head.vocab_size
    if not isinstance(tokens, Tensor) or tokens.dim() != 1 or tokens.is_floating_point() \
            or tokens.numel() == 0:
        raise DecoderError(f"head.draft_tokens must be a non-empty (K,) integer tensor of model "
                           f"token ids, got {tokens!r}")
    ids = tokens.tolist()
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= head.vocab_size:
        raise DecoderError(f"head.draft_tokens must hold distinct ids in 0..{head.vocab_size - 1}")
    return len(ids)
