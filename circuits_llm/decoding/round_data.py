"""What a speculative round's programs exchange (:mod:`circuits_llm.decoding.round`).

:class:`DraftResult` is what the draft program hands to the backbone and to the accept program;
:class:`RoundOutcome` the host's view of the round, read in one transfer; :class:`UniformTape` the
round's pre-drawn uniforms, which the top-down pass reads in a fixed order so that eager and
compiled programs draw the same tokens. Kept apart from the programs so that a drafter outside
them (:class:`~circuits_llm.decoding.constrained.ProductDrafter`) returns the same values without
importing the programs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits.kernels import GumbelChooser

__all__ = ["DraftResult", "RoundOutcome", "UniformTape"]


class UniformTape(GumbelChooser):
    """A Gumbel-max chooser that reads its float64 uniforms from a pre-drawn tape.

    The top-down pass asks for uniforms of static shapes in a fixed order, so a tape read at
    Python-int offsets gives the same draws eagerly and under ``torch.compile``, where no
    ``torch.Generator`` may be used. With ``tape=None`` it hands out zeros and only counts how
    many uniforms a pass needs (:attr:`used`): how long the tape must be.
    """

    def __init__(self, tape: Tensor | None) -> None:
        super().__init__(None)
        self.tape = tape
        self.used = 0

    def uniforms(self, shape: tuple[int, ...], device: torch.device) -> Tensor:
        count = math.prod(shape)
        start, self.used = self.used, self.used + count
        if self.tape is None:
            return torch.zeros(shape, dtype=torch.float64, device=device)
        return self.tape[start:start + count].view(shape)


@dataclass(frozen=True)
class DraftResult:
    """What the draft program hands to the backbone and to the accept program.

    The draft program returns ``block``, ``q``, the two flags as one (2,) tensor and ``length``;
    ``tokens``, ``head_ok`` and ``possible`` are views of them (:meth:`RoundProgram._result
    <circuits_llm.decoding.round.RoundProgram._result>`).

    Attributes:
        tokens: (n-1,) long, the drafted tokens as model-vocabulary ids (``block[0, 1:]``).
        block: (1, n) long, ``[c, d_1..d_{n-1}]``: the backbone's verify input.
        q: (n-1, K) float64, the draft's conditionals over the draft vocabulary (all zero when
            the evidence ``X_0 = c`` is impossible); None when greedy (a point mass on the draft).
        head_ok: () bool, the raw head outputs are usable: no NaN, no ``+inf``, and every row
            (a softmax's last dimension) has an entry above ``-inf``.
        possible: () bool, the evidence ``X_0 = c`` has probability above zero under the draft.
        length: () long, ``L``: how many drafts the round verifies (0..n-1; the
            :class:`~circuits_llm.decoding.draft_length.DraftLength` rule); ``None``: ``n - 1``.
            The verify block is ``block[:, :L + 1]``.
        extra: (n-1,) long model ids of ``q``'s extra column, or None (``q`` has only the draft
            vocabulary's ``K``): a proposal's tokens, which may lie outside the draft vocabulary
            (:class:`~circuits_llm.decoding.constrained.ProductDrafter`; see
            :func:`~circuits_llm.decoding.acceptance.round_decisions`).
    """

    tokens: Tensor
    block: Tensor
    q: Tensor | None
    head_ok: Tensor
    possible: Tensor
    length: Tensor | None = None
    extra: Tensor | None = None


@dataclass(frozen=True)
class RoundOutcome:
    """The host's view of a round, read in one transfer.

    Attributes:
        draft: the verified drafts (model ids): the first ``L`` of the window.
        accepted: how many of them were accepted.
        token: the emitted correction or bonus token.
        head_ok: the head's output was usable (see :class:`DraftResult`).
        verifier_ok: every verifier row had a finite maximum (after warping).
        possible: the draft gave ``X_0 = c`` positive probability; otherwise every draft was
            rejected and the token came from ``p_1``: an autoregressive step in all but cost.
    """

    draft: tuple[int, ...]
    accepted: int
    token: int
    head_ok: bool
    verifier_ok: bool
    possible: bool
