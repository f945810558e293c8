"""Speed bounds from a head's exact first-draft acceptance: how fast, against plain decoding, could
sampled rounds with this head on this machine go, whatever rule chooses the draft length?

From ``alpha1`` at every position (the probability that the round's first draft is accepted,
:mod:`benchmarks.acceptance_measures`) and the machine's costs (a verify block of 2 tokens and the
head's draft program, measured by :func:`measure_costs` in plain decoding steps, the model's linear
weights packed as ``make demo`` packs them) :func:`speed_bounds` gives the speed against plain
decoding of rounds that verify at most the first draft: every round; the best
``DraftLength.confident(tau, minimum=0)`` (the head's peak ``max q_1`` decides; a round below
``tau`` is a plain step after the head's program); and an oracle that verifies exactly the
positions whose ``alpha1`` is high enough and skips the head elsewhere. The oracle reads the
target, so no exact rule can do better (rules that verify the second draft too gain at most
``alpha1 * beta2`` more tokens for a third row): it says whether *any* choice of draft length can
reach a speed target with this head on this machine. The bounds need timed costs: heads only
(T = 1), not draft blocks.

Why a module of its own: the bounds read only ``alpha1`` and the peak per position
(:class:`FirstDraftAcceptance`), not how they were measured, and timing a round's pieces is a job
apart from measuring acceptance. :func:`benchmarks.acceptance_measures.measure_head` adds the
bounds to its record when given :class:`RoundCosts`; this module imports nothing from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from circuits_llm.decoding.round import RoundProgram
from circuits_llm.protocols import Backbone
from circuits_llm.runtime.timing import interleaved


class FirstDraftAcceptance(Protocol):
    """What :func:`speed_bounds` reads of a drafter's measures at ``P`` positions
    (:class:`benchmarks.acceptance_measures.Acceptance` is one)."""

    @property
    def alpha1(self) -> Tensor:
        """(P,) float64, the probability that the round's first draft is accepted."""
        ...

    @property
    def peak(self) -> Tensor:
        """(P,) float64, ``max_x q(X_1 = x | X_0 = c)``, what ``DraftLength.confident`` reads."""
        ...


@dataclass(frozen=True)
class RoundCosts:
    """What the pieces of a sampled round cost, in plain decoding steps (one token's forward).

    Attributes:
        verify: a backbone forward of a block of 2 tokens (the verified token and one draft).
        head: the head's draft program (draw and conditionals of the window).
    """

    verify: float
    head: float

    def __post_init__(self) -> None:
        if not (self.verify > 0 and self.head >= 0):
            raise ValueError(f"costs must be verify > 0 and head >= 0 plain steps, got {self}")


def _best_cut(alpha1: Tensor, score: Tensor, verify: float, skip: float) -> tuple[float, float]:
    """Verify the rounds whose ``score`` is at least a threshold, take a plain step (``skip``
    steps) at the others: the best speed over thresholds, and that threshold (``inf``: verify
    nothing). Rounds are cut only between distinct scores, as a threshold would cut them."""
    count = alpha1.numel()
    order = score.argsort(descending=True, stable=True)
    ranked = score[order]
    cuttable = torch.cat([torch.ones(1, dtype=torch.bool), ranked[1:] < ranked[:-1],
                          torch.ones(1, dtype=torch.bool)])
    k = torch.arange(count + 1, dtype=torch.float64)  # rounds verified
    gained = torch.cat([alpha1.new_zeros(1), torch.cumsum(alpha1[order], 0)])
    speed = (count + gained) / (k * verify + (count - k) * skip)
    best = int(torch.where(cuttable, speed, torch.full_like(speed, -1.0)).argmax())
    return float(speed[best]), float(ranked[best - 1]) if best > 0 else float("inf")


def speed_bounds(acceptance: FirstDraftAcceptance, costs: RoundCosts) -> dict[str, float]:
    """Speed against plain decoding (tokens per plain step) of sampled rounds that verify at most
    the first draft, at T = 1 (module docstring).

    A round that verifies its first draft emits ``1 + alpha1`` tokens on average for
    ``costs.verify + costs.head`` steps; one that verifies nothing emits 1 token for 1 step, plus
    ``costs.head`` when the head ran to decide. Returns ``always`` (every round verifies),
    ``confident`` and ``confident_threshold`` (the best ``DraftLength.confident(tau, minimum=0)``:
    the head's peak ``max q_1`` decides), and ``oracle`` with ``oracle_verified`` (the share of
    rounds it verifies: those with the highest ``alpha1``, best cut, no head elsewhere; it reads the
    target, so it bounds every exact rule from above).
    """
    alpha1 = acceptance.alpha1
    count = alpha1.numel()
    if count == 0:
        raise ValueError("speed_bounds needs at least one position")
    verify = costs.verify + costs.head
    confident, threshold = _best_cut(alpha1, acceptance.peak, verify, 1.0 + costs.head)
    oracle, cut = _best_cut(alpha1, alpha1, verify, 1.0)
    return {"always": float((1 + alpha1).sum()) / (count * verify), "confident": confident,
            "confident_threshold": threshold, "oracle": oracle,
            "oracle_verified": float((alpha1 >= cut).double().mean())}


def measure_costs(backbone: Backbone, program: RoundProgram, text: Tensor, rounds: int = 12
                  ) -> RoundCosts:
    """:class:`RoundCosts` on this machine: after ``text`` (T,) model ids as context, a backbone
    forward of 1 token against one of 2 tokens (each cropped back) and ``program``'s draft
    program, interleaved (medians)."""
    with torch.no_grad():
        backbone.reset()
        step = backbone.extend(text[None, :-2])
    length = backbone.length
    hidden = step.draft_hidden[0, -1:].clone()
    c = text[-2:-1].clone()

    def forward(tokens: Tensor) -> None:
        backbone.extend(tokens[None])
        backbone.crop(length)

    generator = torch.Generator().manual_seed(0)
    uniforms = None if program.config.greedy else program.draw_uniforms(generator)
    timings = interleaved({"step": lambda: forward(text[-2:-1]), "verify": lambda: forward(text[-2:]),
                           "head": lambda: program.draft(hidden, c, uniforms)},
                          rounds=rounds, max_calls=1)
    step_s = timings["step"].median
    return RoundCosts(verify=timings["verify"].median / step_s, head=timings["head"].median / step_s)
