"""What a comparison's rows say about the speculative round, held against the project's targets.

:func:`analyse` gives each speculative row a :class:`RoundAnalysis` against the autoregressive row
of its mode: the head side of a round against its verify forward, what a verify forward costs
against one autoregressive step, the ideal speed-up at the measured acceptance, and how much of it
was realised. :func:`check_targets` holds those numbers and the rows' speed-ups against the
targets of the real-model issue (:data:`TARGETS`), and :func:`format_analysis` prints both.

Kept apart from the rows (:mod:`circuits_llm.app.rows`) because it is an interpretation of them:
the rows are measurements, this is what the project expects of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from circuits_llm.app.rows import BASELINE, DecodeMode, DecoderRow, format_optional


@dataclass(frozen=True)
class RoundAnalysis:
    """What one speculative row says about its round, against the autoregressive row of its mode.

    With ``t_round`` = :attr:`DecoderRow.mean_latency_s`, ``t_verify`` its verify part
    (``mean_split_s["verify_s"]``), ``t_AR`` the autoregressive row's latency per round (one
    token) and ``mu_acc`` = :attr:`DecoderRow.tokens_per_round`:

    Attributes:
        decoder, mode: the row analysed.
        head_over_verify: ``(t_round - t_verify) / t_verify``: everything a round does besides
            the verify forward (parameterise, draft, conditionals, accept) per verify forward.
        verify_over_ar: ``t_verify / t_AR``: what verifying ``n`` tokens costs against one AR step
            (1 on a device where the forward is memory-bound; more on a CPU).
        ideal_speedup: ``mu_acc * t_AR / t_verify``: the speed-up over autoregressive decoding at
            the measured acceptance if the head side of the round cost nothing.
        realised_over_ideal: the measured speed-up over AR divided by :attr:`ideal_speedup`
            (``= t_verify / t_round`` up to the AR row's own tokens per round, which is 1).
    """

    decoder: str
    mode: DecodeMode
    head_over_verify: float
    verify_over_ar: float
    ideal_speedup: float
    realised_over_ideal: float | None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "mode": self.mode.value}


def analyse(rows: Iterable[DecoderRow]) -> list[RoundAnalysis]:
    """One :class:`RoundAnalysis` per speculative row that has an autoregressive row of its mode
    and a measured verify time (rows without either are left out)."""
    rows = list(rows)
    baseline = {row.mode: row for row in rows if row.decoder == BASELINE}
    out = []
    for row in rows:
        base = baseline.get(row.mode)
        verify = row.mean_split_s.get("verify_s", 0.0)
        if row.decoder == BASELINE or base is None or verify <= 0 or row.rounds == 0 \
                or base.mean_latency_s <= 0:
            continue
        ar_step = base.mean_latency_s / max(base.tokens_per_round, 1e-12)
        ideal = row.tokens_per_round * ar_step / verify
        realised = None if row.speedup_vs_ar is None else row.speedup_vs_ar / ideal
        out.append(RoundAnalysis(row.decoder, row.mode, (row.mean_latency_s - verify) / verify,
                                 verify / ar_step, ideal, realised))
    return out


class Bound(Enum):
    """How a measured value is held against its target."""

    AT_MOST = "<="
    AT_LEAST = ">="


@dataclass(frozen=True)
class Target:
    """One target of the real-model issue (:data:`TARGETS`): a metric of one decoder and mode."""

    name: str
    decoder: str
    mode: DecodeMode
    metric: str
    comparison: Bound
    threshold: float

    def value(self, rows: Iterable[DecoderRow], analysis: Iterable[RoundAnalysis]) -> float | None:
        """The measured value (None when the run has no such row or metric)."""
        for item in (*rows, *analysis):
            if item.decoder == self.decoder and item.mode is self.mode:
                found = getattr(item, self.metric, None)
                if found is not None:
                    return float(found)
        return None


#: The targets of the real-model issue (benchmarks on the real model, ratios from one run):
#: BTree head round <= 15% of a verify forward; BTree >= 2x AR greedy and >= 1.5x AR sampling;
#: BTree >= 1.17x FF (the MTPC paper's ratio); realised / ideal speed-up >= 0.85.
TARGETS: tuple[Target, ...] = (
    *(Target(f"btree head round / verify ({m.value})", "btree", m, "head_over_verify",
             Bound.AT_MOST, 0.15) for m in DecodeMode),
    Target("btree x AR (greedy)", "btree", DecodeMode.GREEDY, "speedup_vs_ar",
           Bound.AT_LEAST, 2.0),
    Target("btree x AR (sampling)", "btree", DecodeMode.SAMPLING, "speedup_vs_ar",
           Bound.AT_LEAST, 1.5),
    *(Target(f"btree x FF ({m.value})", "btree", m, "speedup_vs_ff", Bound.AT_LEAST, 1.17)
      for m in DecodeMode),
    *(Target(f"btree realised / ideal ({m.value})", "btree", m, "realised_over_ideal",
             Bound.AT_LEAST, 0.85) for m in DecodeMode),
)
#: The draft-block issue's (44) targets of its rows, ``block`` (recursive) and ``btree-block`` (a
#: BTree head on the block): ``make demo`` >= 2.5x AR greedy and >= 1.3x AR sampling; >= 4.0
#: tokens per round greedy and >= 2.0 at T = 1 (not measured in a run without those rows).
BLOCK_TARGETS: tuple[Target, ...] = tuple(
    target for name in ("block", "btree-block") for target in (
        Target(f"{name} x AR (greedy)", name, DecodeMode.GREEDY, "speedup_vs_ar",
               Bound.AT_LEAST, 2.5),
        Target(f"{name} x AR (sampling)", name, DecodeMode.SAMPLING, "speedup_vs_ar",
               Bound.AT_LEAST, 1.3),
        Target(f"{name} tok/round (greedy)", name, DecodeMode.GREEDY, "tokens_per_round",
               Bound.AT_LEAST, 4.0),
        Target(f"{name} tok/round (sampling)", name, DecodeMode.SAMPLING, "tokens_per_round",
               Bound.AT_LEAST, 2.0)))
TARGETS = TARGETS + BLOCK_TARGETS


def check_targets(rows: Iterable[DecoderRow], analysis: Iterable[RoundAnalysis],
                  targets: Iterable[Target] = TARGETS) -> list[dict[str, Any]]:
    """Each target with its measured value and whether it is met (None: not measured)."""
    rows, analysis = list(rows), list(analysis)
    out = []
    for target in targets:
        value = target.value(rows, analysis)
        met = None if value is None else (value <= target.threshold
                                          if target.comparison is Bound.AT_MOST
                                          else value >= target.threshold)
        out.append({"name": target.name, "value": value, "target":
                    f"{target.comparison.value} {target.threshold:g}", "met": met})
    return out


def format_analysis(analysis: Iterable[RoundAnalysis], targets: Iterable[Mapping[str, Any]]) -> str:
    """The round analysis and the targets as fixed-width text."""
    lines = [f"{'mode':<9}{'decoder':<15}{'head/verify':>12}{'verify/AR':>11}{'ideal xAR':>11}"
             f"{'realised/ideal':>16}"]
    for item in sorted(analysis, key=lambda a: (a.mode.value, a.decoder)):
        lines.append(f"{item.mode.value:<9}{item.decoder:<15}{item.head_over_verify:>12.1%}"
                     f"{item.verify_over_ar:>11.2f}{item.ideal_speedup:>11.2f}"
                     f"{format_optional(item.realised_over_ideal, '.2f'):>16}")
    lines += ["", "targets (real-model issue)"]
    for target in targets:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[target["met"]]
        value = format_optional(target["value"], ".3f")
        lines.append(f"  {target['name']:<34}{value:>8}  (target {target['target']}): {verdict}")
    return "\n".join(lines)
