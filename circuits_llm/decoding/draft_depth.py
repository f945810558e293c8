"""How many drafts a round verifies, chosen before the round from how earlier rounds fared.

A round that verifies ``L`` drafts costs a backbone call over ``L + 1`` tokens plus the drafting,
and returns ``1 + (the accepted drafts)`` tokens. On a CPU the call's cost is far from flat: on
the 2-core Intel Xeon of docs/journal.md (SmolLM2, packed verify weights) one token costs a plain
step, 2-4 tokens 1.40 steps, 6 tokens 1.51 and 8 tokens 1.61. So a round pays only where its
drafts are accepted often enough, and the best depth moves with the text: deep where the model
repeats its context (greedy code), shallow where the drafter is unsure (sampling, chat), none at
all (a plain step) where drafts are rarely accepted.

:class:`AdaptiveDepth` keeps, per decode, a running estimate of each position's acceptance given
the drafts before it were accepted (:class:`DepthTracker`) and picks the depth that maximises
expected tokens per unit of cost (:class:`RoundCosts`). Rounds whose copy of the context proposes
a continuation are tracked apart from the others: greedy rounds that copy are accepted far more
often.

**Why the output law stays exactly the model's.** Round ``r``'s depth is a function of rounds
``< r`` (their drafts, the verifier's laws and what was accepted) and of the round's copy
component, itself a function of the text so far. It is fixed before any of round ``r``'s draws,
so the number of drafts verified is a stopping time of the round's drafts, the case of
docs/decoder-exactness.md (section 3). A depth of 0 is a plain step: the verifier draws the
token from ``p_1``. The drafter still drafts one token then (a probe, about 3% of a step with a
draft block), so the tracker keeps learning while the decoder does not speculate.

**Reproducibility.** The depth never reads a clock: with the same :class:`RoundCosts` a seed
gives the same tokens on every machine. Costs measured on the machine
(:meth:`RoundCosts.measure`) make the depths, and so the sampled stream of a seed, depend on the
measurement; the output's law does not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_llm.decoding.warping import DecoderError, SamplingConfig, warp_logits

__all__ = ["AdaptiveDepth", "DepthTracker", "RoundCosts", "observed_acceptance"]


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class RoundCosts:
    """What a round costs, in plain decoding steps (one token through the backbone = 1).

    Attributes:
        verify: ``verify[w - 1]``: a backbone call over ``w`` tokens (``w = 1, 2, ...``); beyond
            the table the last two entries' slope continues.
        draft_step: one draft step (a draft block's call, readout and draw); a round that drafts
            ``d >= 1`` tokens pays ``d`` of them, a plain step one (the probe).
        draft_fixed: what every round's drafting pays whatever its depth (a circuit head's one
            pass over its window; 0 for a recursive draft block).
    """

    verify: tuple[float, ...]
    draft_step: float
    draft_fixed: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.verify, tuple) or not self.verify \
                or not all(_positive(v) for v in self.verify):
            raise DecoderError(f"RoundCosts.verify must be a non-empty tuple of positive costs "
                               f"(in plain steps, e.g. (1.0, 1.4, 1.4)), got {self.verify!r}")
        for name in ("draft_step", "draft_fixed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (_positive(value) or value == 0):
                raise DecoderError(f"RoundCosts.{name} must be a cost >= 0 in plain steps, got "
                                   f"{value!r}")

    def block(self, tokens: int) -> float:
        """The cost of a backbone call over ``tokens >= 1`` tokens."""
        table = self.verify
        if tokens <= len(table):
            return table[tokens - 1]
        slope = table[-1] - table[-2] if len(table) >= 2 else 0.0
        return table[-1] + max(slope, 0.0) * (tokens - len(table))

    def round(self, depth: int) -> float:
        """The cost of a round that verifies ``depth`` drafts (``0``: a plain step and a probe)."""
        return self.block(depth + 1) + self.draft_fixed + max(depth, 1) * self.draft_step

    @classmethod
    def for_device(cls, device: torch.device) -> RoundCosts:
        """The costs measured on this project's CPU (docs/journal.md section 15: SmolLM2,
        packed verify weights, the int8 draft block), or on any other device a flat verify (a
        GPU's verify of a few tokens costs about one step) with a draft step of a tenth of one
        (not measured there)."""
        if device.type == "cpu":
            return cls((0.95, 1.30, 1.32, 1.34, 1.40, 1.42, 1.50, 1.51), 0.025, 0.05)
        return cls((1.0, 1.02, 1.04, 1.06, 1.08, 1.10, 1.12, 1.14), 0.1)

    @classmethod
    def measure(cls, extend: Callable[[int], None], draft_step: Callable[[], None],
                widths: int, repeats: int = 7) -> RoundCosts:
        """Costs timed on this machine: ``extend(w)`` runs (and undoes) a backbone call over
        ``w`` tokens, ``draft_step()`` one draft step; medians of ``repeats`` interleaved
        rounds, each relative to the one-token call.

        Raises:
            DecoderError: ``widths`` or ``repeats`` below 1.
        """
        if not isinstance(widths, int) or widths < 1 or not isinstance(repeats, int) \
                or repeats < 1:
            raise DecoderError(f"RoundCosts.measure takes widths >= 1 and repeats >= 1, got "
                               f"{widths!r} and {repeats!r}")
        times: list[list[float]] = [[] for _ in range(widths + 1)]
        for _ in range(repeats):
            for w in range(1, widths + 1):
                start = time.perf_counter()
                extend(w)
                times[w - 1].append(time.perf_counter() - start)
            start = time.perf_counter()
            draft_step()
            times[widths].append(time.perf_counter() - start)
        medians = [sorted(t)[len(t) // 2] for t in times]
        step = medians[0]
        return cls(tuple(m / step for m in medians[:widths]), medians[widths] / step)


@dataclass(frozen=True)
class AdaptiveDepth:
    """Choose each round's depth from the acceptance of earlier rounds (module docstring).

    Attributes:
        costs: what rounds cost on the machine (:class:`RoundCosts`; :meth:`for_device`).
        memory: how many recent rounds the estimates follow (each round's observations weigh
            ``1 - 1 / memory`` of the round before's).
        prior: the acceptance assumed at a position before it is observed; a deeper position
            starts from the estimate of the one before it.
        prior_weight: how many rounds of observations the prior is worth.
    """

    costs: RoundCosts
    memory: float = 8.0
    prior: float = 0.5
    prior_weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.costs, RoundCosts):
            raise DecoderError(f"AdaptiveDepth.costs must be a RoundCosts, got {self.costs!r}")
        if not _positive(self.memory) or self.memory < 1:
            raise DecoderError(f"AdaptiveDepth.memory must be a number of rounds >= 1, got "
                               f"{self.memory!r}")
        if isinstance(self.prior, bool) or not isinstance(self.prior, int | float) \
                or not 0.0 <= self.prior <= 1.0:
            raise DecoderError(f"AdaptiveDepth.prior must be an acceptance in [0, 1], got "
                               f"{self.prior!r}")
        if not _positive(self.prior_weight):
            raise DecoderError(f"AdaptiveDepth.prior_weight must be > 0 rounds, got "
                               f"{self.prior_weight!r}")

    @classmethod
    def for_device(cls, device: torch.device) -> AdaptiveDepth:
        """The rule with :meth:`RoundCosts.for_device`'s costs."""
        return cls(RoundCosts.for_device(device))

    def start(self, most: int) -> DepthTracker:
        """A fresh tracker for one decode whose drafter drafts at most ``most`` tokens a round."""
        return DepthTracker(self, most)

    def describe(self) -> str:
        """E.g. ``"adaptive depth (memory 8 rounds)"``."""
        return f"adaptive depth (memory {self.memory:g} rounds)"


class DepthTracker:
    """One decode's acceptance estimates and depth choices (:class:`AdaptiveDepth`).

    Two sets of estimates, for rounds whose copy of the context proposes tokens and for the
    others. Position ``j``'s estimate is ``(A_j + w * e_{j-1}) / (N_j + w)``: ``A_j`` the decayed
    sum of observed acceptances at ``j``, ``N_j`` the decayed count, ``w`` the prior's weight and
    ``e_{j-1}`` the estimate one position up (``e_0``: the prior).

    Args:
        rule: the :class:`AdaptiveDepth`.
        most: the drafter's drafts a round, the deepest choice.
    """

    def __init__(self, rule: AdaptiveDepth, most: int) -> None:
        if isinstance(most, bool) or not isinstance(most, int) or most < 1:
            raise DecoderError(f"a depth tracker needs most >= 1 drafts a round, got {most!r}")
        self.rule = rule
        self.most = most
        self._sums = {copying: [0.0] * most for copying in (False, True)}
        self._counts = {copying: [0.0] * most for copying in (False, True)}
        self.depths: list[int] = []

    def estimates(self, copying: bool) -> list[float]:
        """Position ``j``'s estimated acceptance given every draft before it was accepted,
        ``j = 1..most``."""
        out, above = [], self.rule.prior
        weight = self.rule.prior_weight
        for total, count in zip(self._sums[copying], self._counts[copying], strict=True):
            above = (total + weight * above) / (count + weight)
            out.append(above)
        return out

    def expected_tokens(self, copying: bool) -> list[float]:
        """Expected tokens of a round verifying ``d = 0..most`` drafts."""
        tokens, reach = [1.0], 1.0
        for beta in self.estimates(copying):
            reach *= beta
            tokens.append(tokens[-1] + reach)
        return tokens

    def choose(self, copying: bool) -> int:
        """This round's depth: the ``d`` in ``0..most`` with the most expected tokens per cost
        (the shallower on a tie); recorded in :attr:`depths`."""
        costs = self.rule.costs
        values = [t / costs.round(d) for d, t in enumerate(self.expected_tokens(copying))]
        depth = max(range(len(values)), key=lambda d: (values[d], -d))
        self.depths.append(depth)
        return depth

    def observe(self, copying: bool, acceptance: Sequence[float]) -> None:
        """A finished round: ``acceptance[j - 1]`` is position ``j``'s acceptance (or its
        expectation) given the drafts before it were accepted, for the positions it observed
        (the first ``len(acceptance)``)."""
        if len(acceptance) > self.most:
            raise DecoderError(f"a round observed {len(acceptance)} positions but drafts at most "
                               f"{self.most}")
        keep = 1.0 - 1.0 / self.rule.memory
        sums, counts = self._sums[copying], self._counts[copying]
        for j in range(self.most):
            sums[j] *= keep
            counts[j] *= keep
        for j, value in enumerate(acceptance):
            sums[j] += float(value)
            counts[j] += 1.0


def observed_acceptance(logits: Tensor, config: SamplingConfig, drafts: Tensor,
                        q: Tensor | None, draft_tokens: Tensor | None, verified: int,
                        accepted: int) -> list[float]:
    """What one round says about each position's acceptance, for :meth:`DepthTracker.observe`.

    Positions ``1..min(verified, accepted + 1)`` had every draft before them accepted (position
    1 also when nothing was verified: the probe). Greedy, or without usable conditionals: 1 for
    an accepted draft, 0 for the first rejected (the probe's: whether ``d_1`` is the argmax of
    ``p_1``). Sampling: ``sum_x min(p_j(x), q_j(x))``, the exact probability that ``d_j`` is
    accepted given the drafts before it, a lower-variance observation than the coin's.

    Args:
        logits: (>= m, V) the verifier's logits for ``[c, d_1, ...]``.
        config: the sampling configuration.
        drafts: (n-1,) model ids of the drafts.
        q: (n-1, K) float64, the laws the drafts were drawn from over the draft vocabulary, or
            ``None``.
        draft_tokens: (K,) the draft vocabulary's model ids (``None``: ``K = V``).
        verified: ``L``, the drafts verified.
        accepted: how many of them were accepted.
    """
    positions = min(max(verified, 1), accepted + 1, drafts.shape[0])
    if config.greedy or q is None or (q.shape[-1] != (logits.shape[-1] if draft_tokens is None
                                                       else draft_tokens.numel())):
        if verified == 0:  # the probe: would d_1 have been accepted?
            best = int(logits[0].argmax())
            return [float(int(drafts[0]) == best)] if config.greedy else []
        return [1.0 if j < accepted else 0.0 for j in range(positions)]
    with torch.no_grad():
        p = torch.softmax(warp_logits(logits[:positions], config).double(), -1)
        if draft_tokens is not None:
            p = p[:, draft_tokens.to(p.device)]
        overlap = torch.minimum(p, q[:positions].to(p.device)).sum(-1)
    return [float(v) for v in overlap.clamp(0.0, 1.0).tolist()]
