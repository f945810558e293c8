"""What the speculative decoder asks of a :class:`~circuits_llm.protocols.ContextDrafter` (a
drafter with state of its own, such as a draft block's
:class:`~circuits_llm.draft_block.BlockDrafter`), kept out of the decode loop.

The loop (:mod:`circuits_llm.decoding.decoder`) treats a circuit head and a context drafter
alike once it holds a round program; the drafter alone needs checking against the decoder's
options, its program built with the options it declares it takes, its state begun with the
prefill's pairs and, after every round, told the kept positions' pairs. Each is one function
here, shared by the single-prompt decoder and the batch (:mod:`circuits_llm.decoding.batch`,
whose rows' draft-block states take the same pairs), so the contract the protocol's docstring
states is read in one place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from circuits_llm.decoding.acceptance import Transition
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.warping import DecoderError, SamplingConfig
from circuits_llm.protocols import ContextDrafter
from circuits_llm.runtime.compiling import Compiler

__all__ = [
    "check_drafter", "drafter_device", "drafter_program", "kept_pairs",
    "prefill_pairs",
]


def _takes_options(drafter: ContextDrafter) -> bool:
    """Whether ``drafter`` declares which copy and length rule it takes (``decoding_problem``)."""
    return callable(getattr(drafter, "decoding_problem", None))


def check_drafter(drafter: ContextDrafter, lookup: ContextLookup | None,
                  rule: DraftLength) -> None:
    """A context drafter drafts ``window - 1 >= 1`` tokens, with the copy and length rule its
    ``decoding_problem(lookup, rule)`` accepts (a drafter without one: neither).

    Raises:
        DecoderError: the window is too small, or the drafter refuses ``lookup`` or ``rule``
            (the message is the drafter's own reason).
    """
    if drafter.window < 2:
        raise DecoderError(f"the drafter's window must be >= 2 (the known next token and at "
                           f"least one draft), got {drafter.window}")
    if _takes_options(drafter):
        problem = drafter.decoding_problem(lookup, rule)  # type: ignore[attr-defined]
    elif lookup is not None or rule != DraftLength.fixed():
        problem = "it takes neither lookup nor a draft_length rule (it has no decoding_problem)"
    else:
        problem = None
    if problem is not None:
        raise DecoderError(f"{type(drafter).__name__}: {problem}")


def drafter_program(drafter: ContextDrafter, config: SamplingConfig, *, compile: bool,
                    compiler: Compiler | None, draft_length: DraftLength,
                    lookup: ContextLookup | None) -> Any:
    """The drafter's round program for ``config``: ``round_program(config, compile=,
    compiler=)``, with ``draft_length=`` and ``lookup=`` too when the drafter has a
    ``decoding_problem`` (which :func:`check_drafter` has asked about them). Typed ``Any``: the
    program's class is the drafter's own (an ``AcceptProgram`` with ``draw_uniforms``, ``draft``
    and ``verified``)."""
    options = {"draft_length": draft_length, "lookup": lookup} if _takes_options(drafter) else {}
    return drafter.round_program(config, compile=compile, compiler=compiler, **options)


def drafter_device(drafter: ContextDrafter) -> torch.device:
    """Where the drafter's drafts live: its ``device`` when it has one, else the CPU."""
    device = getattr(drafter, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def prefill_pairs(prompt: list[int], features: Tensor | None, hidden_size: int,
                  device: torch.device) -> tuple[Tensor, Tensor]:
    """A sequence's first pairs, what ``ContextDrafter.begin`` takes: the feature after each
    prompt token but the last two (``features`` (1, len(prompt) - 1, d), the prefill's draft
    hidden states, without its last position) with the token that follows it -> (1, m, d) and
    (m,) long; ``features`` ``None`` (a one-token prompt, no prefill): no pairs."""
    hidden = torch.zeros(1, 0, hidden_size, device=device) if features is None \
        else features[:, :-1]
    return hidden, torch.tensor(prompt[1:-1], dtype=torch.long)


def kept_pairs(features: Tensor, move: Transition) -> tuple[Tensor, Tensor]:
    """A round's pairs, what ``ContextDrafter.follow`` takes: the verify forward's features of
    the kept positions but the last (``features`` (1, n, d), the first ``move.keep - 1``) with
    the emitted token after each -> (1, m, d) and (m,) long."""
    kept = move.keep - 1
    return features[:, :kept], torch.tensor(move.emitted[:kept], dtype=torch.long)
