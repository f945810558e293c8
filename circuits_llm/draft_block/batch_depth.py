"""How deep a recursive draft block drafts in a batch: fewer drafts when more rows draft.

A round verifies every row's window in one backbone call. On a GPU that call stays memory-bound
for a batch's few hundred rows, but on a CPU it is compute-bound: verifying 8 rows x 6 tokens cost
200 ms against a batched autoregressive step of 173 ms (SmolLM2, the 2-core Intel Xeon of
docs/journal.md section 13), so a deep window costs a batch more than its later drafts buy. There,
2 drafts a round took batch 8 from 1.05x to 1.23x batched plain decoding greedy and from 0.85x to
1.19x at T = 1, while one prompt alone is fastest with 5.

:class:`BatchDepth` maps the number of rows drafting in a round to the recursion's depth that
round. The depth is fixed before the round's draws (by the batch's composition), so each row's
verified length stays a stopping time of its drafts and every row's law stays exactly the
target's (docs/decoder-exactness.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from circuits_llm.draft_block.block import DraftBlockError

__all__ = ["BatchDepth"]


@dataclass(frozen=True)
class BatchDepth:
    """The recursion's depth by the number of rows drafting in a round.

    Attributes:
        steps: ``(rows, drafts)`` pairs, rows increasing: from ``rows`` rows up, draft at most
            ``drafts`` a round (below the first, the drafter's full depth ``k``).

    Raises:
        DraftBlockError: pairs that are not positive integers with increasing rows.
    """

    steps: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        pairs = self.steps
        valid = isinstance(pairs, tuple) and bool(pairs) and all(
            isinstance(pair, tuple) and len(pair) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair)
            for pair in pairs)
        if not valid or any(a[0] >= b[0] for a, b in pairwise(pairs)):
            raise DraftBlockError(f"BatchDepth takes (rows, drafts) pairs of positive ints with "
                                  f"increasing rows, e.g. ((4, 2),), got {pairs!r}")

    def drafts(self, rows: int, most: int) -> int:
        """Drafts a round when ``rows`` rows draft, at most ``most`` (the drafter's ``k``)."""
        chosen = most
        for threshold, drafts in self.steps:
            if rows >= threshold:
                chosen = drafts
        return min(chosen, most)

    @classmethod
    def for_device(cls, device: torch.device) -> BatchDepth | None:
        """The depth measured fastest on ``device``'s kind: on a CPU 2 drafts from 4 rows up
        (journal section 13: at batch 4 the depth hardly matters, 1.16x with 2 against 1.13x with
        5; at batch 8 it does); ``None`` (the full depth) elsewhere, where it is not measured."""
        return cls(((4, 2),)) if device.type == "cpu" else None

    @classmethod
    def within(cls, rows: int, most: int = 7) -> BatchDepth:
        """The deepest round whose verify block, ``drafts + 1`` tokens for every row, takes no
        more calls of ``rows`` rows than a round of one draft (at least 1 draft): a row-invariant
        bfloat16 model on a CPU computes a call of up to ``rows`` rows at about the price of one
        token (:func:`~circuits_llm.backbone.row_invariant.priced_rows`). With 32 (the Intel Xeon
        of journal section 16): 5 drafts up to 5 rows, 3 at 8, 1 from 11, 2 again from 17 (two
        calls hold 3 tokens a row). With 16 (an AMD EPYC, journal section 18): 3 drafts at 4
        rows, 1 at 8.

        Raises:
            DraftBlockError: ``rows`` or ``most`` below 1.
        """
        if rows < 1 or most < 1:
            raise DraftBlockError(f"BatchDepth.within takes rows >= 1 and most >= 1, got {rows}, "
                                  f"{most}")
        steps: list[tuple[int, int]] = []
        for batch in range(1, rows + 2):  # past ``rows`` rows every round drafts 1
            calls = -(-2 * batch // rows)  # the calls of a round of one draft a row
            drafts = max(1, min(most, calls * rows // batch - 1))
            if not steps or drafts != steps[-1][1]:
                steps.append((batch, drafts))
        return cls(tuple(steps))

    def describe(self) -> str:
        """E.g. ``"2 drafts from 4 rows"``."""
        return ", ".join(f"{drafts} draft{'s' * (drafts > 1)} from {rows} rows"
                         for rows, drafts in self.steps)
