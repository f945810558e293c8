"""How many drafts a speculative round verifies: a fixed number, or as many as the head trusts.

A round drafts the whole window ``d_1..d_{n-1}`` from the head's circuit (one joint draw) and then
verifies only its first ``L`` drafts: the backbone runs the block ``[c, d_1..d_L]`` (``L + 1``
tokens), the accept program tests ``d_1..d_L``, and when all ``L`` are accepted the bonus token is
drawn from ``p_{L+1}``, the target's conditional right after ``d_L``. The drafts after ``d_L`` are
discarded. A :class:`DraftLength` rule chooses ``L`` inside the draft program (a () long tensor;
fixed shapes, no host synchronisation there): :meth:`DraftLength.fixed` (the default: ``L = n-1``,
or a fixed shorter length) or :meth:`DraftLength.confident` (stop where the head's own estimate
of reaching and passing the next position falls below a threshold).

**Why the output law stays exactly the LM's.** The rule reads only draft-side quantities (the
head's conditionals ``q``, the drafts), never the target ``p``, and more precisely it decides
whether position ``k`` is verified from the drafts *before* it: the event ``{L >= k}`` is a
function of ``(e_t, c, d_1..d_{k-1})`` (``L`` is a stopping time of the draft sequence). The
confidence rule qualifies: its estimate for position ``k`` uses ``q_j(d_j)`` for ``j < k`` and the
whole vector ``q_k = q(X_k | c, d_{<k})`` (its maximum), itself a function of ``d_{<k}``, but never
the value ``q_k(d_k)``. Now reason lazily, as in ``docs/decoder-exactness.md`` §3: drawing the
window jointly equals drawing ``d_k ~ q_k`` just before position ``k`` (chain rule). When position
``k`` is reached (all earlier verified drafts accepted, prefix ``x_{<=t}, c, d_{<k}``), whether it
is verified is already decided by ``d_{<k}``. If ``L >= k``, then conditionally on everything so
far (including the event ``L >= k``) ``d_k`` is still a draw of ``q_k``, because that event does
not depend on ``d_k``; the accept test and the residual use that same ``q_k`` and the target's
``p_k``, so by the one-position lemma the emitted token has law ``p_k``. If ``L = k - 1``, the
bonus token is drawn from ``p_k`` itself. Either way the token emitted at that output index has
the target's conditional law given the past, and by the chain rule so does the whole output.
Greedy decoding needs nothing: any draft and any length give the argmax tokens.

What would break it: a rule that reads the target ``p`` (e.g. verify only drafts the target
likes), and, less obviously, a rule that uses ``q_k(d_k)`` to decide whether ``d_k`` is verified
(e.g. "stop before ``k`` when ``prod_{j<=k} q_j(d_j)`` is below the threshold"): then, given
``L >= k``, ``d_k`` is biased towards the tokens the head likes and is no longer a draw of the
``q_k`` that the accept test and the residual assume. The exact-law tests
(``tests/test_dynamic_draft.py``) measure both as biased (negative controls). Randomness the top-down
draw consumed is off limits for the same reason (it determines ``d_k`` jointly with the later
drafts).

Cost: a fixed rule's ``L`` is known on the host; a confident rule's ``L`` is read on the host after
the draft program (one small extra synchronisation per round), since the verify block's length
must be known to launch the backbone. A compiled backbone gets a compiled forward for every block
length ``L + 1`` the rule can choose (:meth:`DraftLength.lengths`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from circuits_llm.decoding.warping import DecoderError

__all__ = ["Confidence", "DraftLength", "DraftLengthKind"]


class DraftLengthKind(Enum):
    """The family of a :class:`DraftLength` rule.

    ``FIXED``: every round verifies the same number of drafts. ``CONFIDENT``: a round stops
    before the first position whose confidence estimate (:class:`Confidence`) is below a
    threshold.
    """

    FIXED = "fixed"
    CONFIDENT = "confident"


class Confidence(Enum):
    """The head's estimate ``s_k`` that drafts ``1..k`` are all accepted, from draft-side
    quantities known *before* ``d_k`` is drafted (what keeps the law exact; module docstring).

    ``DRAFTED``: ``s_k = q_1(d_1) ... q_{k-1}(d_{k-1}) * max_v q_k(v)``: the head's probability of
    the drafts made so far, times the best it can do at position ``k``.
    ``PEAK``: ``s_k = max_v q_1(v) ... max_v q_k(v)``: the product of the head's peak conditionals.

    Both are non-increasing in ``k``. Here ``q_k = q(X_k | X_0 = c, d_{<k})``, the circuit's exact
    conditional over the draft vocabulary (all zero when the evidence ``X_0 = c`` is impossible).
    """

    DRAFTED = "drafted"
    PEAK = "peak"


@dataclass(frozen=True)
class DraftLength:
    """How many of the window's ``n - 1`` drafts a round verifies (see the module docstring).

    Build one with :meth:`fixed` or :meth:`confident`.

    Attributes:
        kind: :class:`DraftLengthKind`.
        length: ``FIXED``: drafts per round (``None``: ``n - 1``, the whole window).
        threshold: ``CONFIDENT``: verify position ``k`` while ``s_k >= threshold`` (in ``[0, 1]``;
            ``0`` verifies every draft).
        confidence: ``CONFIDENT``: the estimate ``s_k`` (:class:`Confidence`).
        minimum: ``CONFIDENT``: always verify at least this many drafts (``0`` allows rounds that
            verify nothing: an autoregressive step after the head's forward).
    """

    kind: DraftLengthKind = DraftLengthKind.FIXED
    length: int | None = None
    threshold: float = 0.0
    confidence: Confidence = Confidence.DRAFTED
    minimum: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.kind, DraftLengthKind):
            raise DecoderError(f"kind must be a DraftLengthKind, got {self.kind!r}")
        if self.length is not None and (isinstance(self.length, bool)
                                        or not isinstance(self.length, int) or self.length < 0):
            raise DecoderError(f"length must be None or an int >= 0, got {self.length!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float) \
                or not 0.0 <= self.threshold <= 1.0 or math.isnan(self.threshold):
            raise DecoderError(f"threshold must be a number in [0, 1], got {self.threshold!r}")
        if not isinstance(self.confidence, Confidence):
            raise DecoderError(f"confidence must be a Confidence, got {self.confidence!r}")
        if isinstance(self.minimum, bool) or not isinstance(self.minimum, int) or self.minimum < 0:
            raise DecoderError(f"minimum must be an int >= 0, got {self.minimum!r}")

    @classmethod
    def fixed(cls, length: int | None = None) -> DraftLength:
        """Verify ``length`` drafts every round (``None``: the whole window, ``n - 1``)."""
        return cls(DraftLengthKind.FIXED, length=length)

    @classmethod
    def confident(cls, threshold: float, confidence: Confidence = Confidence.DRAFTED,
                  minimum: int = 1) -> DraftLength:
        """Verify drafts ``1..L`` where ``L`` is the last ``k`` with ``s_k >= threshold`` (at least
        ``minimum``); ``s_k`` is the head's estimate ``confidence`` (:class:`Confidence`)."""
        return cls(DraftLengthKind.CONFIDENT, threshold=float(threshold), confidence=confidence,
                   minimum=minimum)

    # ------------------------------------------------------------------ the host's view
    def check(self, window: int) -> None:
        """Refuse a rule that cannot run with a head of ``window`` variables (``window - 1``
        drafts).

        Raises:
            DecoderError: a fixed length or a minimum above ``window - 1``.
        """
        drafts = window - 1
        if self.kind is DraftLengthKind.FIXED and self.length is not None and self.length > drafts:
            raise DecoderError(f"DraftLength.fixed({self.length}) asks for more drafts than the "
                               f"head's window of {window} makes ({drafts})")
        if self.kind is DraftLengthKind.CONFIDENT and self.minimum > drafts:
            raise DecoderError(f"DraftLength.confident(minimum={self.minimum}) asks for more drafts "
                               f"than the head's window of {window} makes ({drafts})")

    def static_length(self, window: int) -> int | None:
        """The number of drafts every round verifies when it does not depend on the round
        (``FIXED``), else ``None`` (read from the draft program's output)."""
        if self.kind is DraftLengthKind.FIXED:
            return window - 1 if self.length is None else self.length
        return None

    def lengths(self, window: int) -> tuple[int, ...]:
        """Every number of verified drafts the rule can choose with a window of ``window``: the
        verify blocks have these lengths plus one (a compiled backbone compiles each)."""
        fixed = self.static_length(window)
        return (fixed,) if fixed is not None else tuple(range(self.minimum, window))

    # ------------------------------------------------------------------ the device's view
    def estimates(self, q: Tensor, drafts: Tensor) -> Tensor:
        """The confidence ``s_k`` of every position (see :class:`Confidence`).

        Args:
            q: (n-1, K) float64, the head's conditionals ``q(X_k | c, d_{<k})`` over the draft
                vocabulary (rows of zeros where the evidence is impossible).
            drafts: (n-1,) long, the drafts as draft-vocabulary indices.

        Returns:
            (n-1,) float64, non-increasing; entry ``k - 1`` reads ``q_j(d_j)`` only for ``j < k``.
        """
        best = q.amax(-1)
        if self.confidence is Confidence.PEAK:
            return torch.cumprod(best, 0)
        drafted = q.gather(1, drafts[:, None])[:, 0]
        before = torch.cat([drafted.new_ones(1), torch.cumprod(drafted, 0)[:-1]])
        return before * best

    def decide(self, q: Tensor | None, drafts: Tensor) -> Tensor:
        """The number of drafts to verify, ``L`` in ``0..n-1``, as a () long tensor (fixed shapes,
        no host read: traced inside the draft program).

        Args:
            q: (n-1, K) float64 conditionals (see :meth:`estimates`); unused (may be None) by a
                ``FIXED`` rule.
            drafts: (n-1,) long draft-vocabulary indices.
        """
        fixed = self.static_length(drafts.shape[0] + 1)
        if fixed is not None:
            return torch.full((), fixed, dtype=torch.long, device=drafts.device)
        if q is None:
            raise DecoderError("a confident draft-length rule needs the head's conditionals q")
        passed = (self.estimates(q, drafts) >= self.threshold).long()
        return torch.cumprod(passed, 0).sum().clamp(min=self.minimum)

    @property
    def needs_conditionals(self) -> bool:
        """Whether :meth:`decide` reads ``q`` (greedy rounds then compute it for the rule)."""
        return self.kind is DraftLengthKind.CONFIDENT

    def describe(self) -> str:
        """A short label, e.g. ``"fixed"``, ``"fixed 2"``, ``"confident drafted >= 0.3"``."""
        if self.kind is DraftLengthKind.FIXED:
            return "fixed" if self.length is None else f"fixed {self.length}"
        return f"confident {self.confidence.value} >= {self.threshold:g}, min {self.minimum}"
