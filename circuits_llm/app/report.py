"""Decoder-comparison reports: rows, the text table, the JSON record and the trade-off plot.

A comparison runs several decoders (autoregressive, speculative with an FF head, with a BTree
head, ...) on the same prompts in the same process and pools each decoder's rounds with
:func:`circuits_llm.decoding.metrics.aggregate`. One :class:`DecoderRow` per (decoder, mode) holds the
MTPC paper's metrics (Section 4.2): mean latency per round ``mu_lat``, mean accepted length
(tokens per round, ``mu_acc``), per-position acceptance, throughput ``mu_acc / mu_lat`` and the
wall-time speed-ups over the autoregressive baseline and the FF (independence) head.

Throughput is in tokens per second of the model's own tokenizer (:class:`TokenUnit`): bytes for
the byte-level models, subword tokens for a model such as SmolLM2.

:func:`analyse` adds what the rows imply about the round (:class:`RoundAnalysis`: the head side of
a round against its verify forward, the ideal speed-up at the measured acceptance, and how much of
it was realised), and :func:`check_targets` compares them with the targets of the real-model
issue (:data:`TARGETS`).

:func:`write_tradeoff_plot` draws accepted length against latency per round with dotted
iso-throughput lines, like the paper's Figure 1. Every file is written atomically by
:func:`circuits.files.atomic_write` (a temporary file in the same directory, ``fsync``, then
``os.replace``): a crash leaves the previous file or none.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from circuits.files import atomic_write, atomic_write_json
from circuits_llm.decoding.metrics import DecodeSummary

#: Bumped whenever the meaning of a report's JSON fields changes (2: ``unit``, ``analysis`` and
#: ``targets`` added).
SCHEMA_VERSION = 2
REPORT_KIND = "circuits_llm.decoder_comparison"
BASELINE = "autoregressive"
INDEPENDENT = "ff"


class ReportError(ValueError):
    """A report or one of its rows is malformed (the message names the field)."""


class TokenUnit(Enum):
    """What a token is for throughput: a byte (byte-level models) or a subword token."""

    BYTES = "bytes"
    TOKENS = "tok"

    @property
    def per_second(self) -> str:
        """The column label: ``bytes/s`` or ``tok/s``."""
        return f"{self.value}/s"


class DecodeMode(Enum):
    """How tokens are chosen: argmax (temperature 0) or sampling (temperature > 0)."""

    GREEDY = "greedy"
    SAMPLING = "sampling"


@dataclass(frozen=True)
class DecoderRow:
    """The pooled metrics of one decoder in one mode over all prompts of a comparison.

    Attributes:
        decoder: ``"autoregressive"`` or a head name (``"ff"``, ``"btree"``, ...).
        mode: greedy or sampling.
        prompts: number of prompts decoded.
        new_tokens: tokens generated in total.
        rounds: decoding rounds (backbone calls after the prefills) in total.
        mean_latency_s: ``mu_lat``, seconds per round.
        tokens_per_round: ``mu_acc``, the mean accepted length (tokens emitted per round).
        tokens_per_call: tokens per backbone call, prefill calls included.
        acceptance_rate: accepted drafts / drafted tokens (0 for autoregressive decoding).
        acceptance_by_position: fraction of rounds whose ``k``-th draft was accepted, ``k >= 1``.
        throughput: tokens (bytes) per decoding second, ``mu_acc / mu_lat``.
        mean_split_s: mean seconds per round of each phase (head, draft, conditionals, verify,
            accept).
        speedup_vs_ar: throughput over the autoregressive row of the same mode (None if absent).
        speedup_vs_ff: throughput over the FF row of the same mode (None if absent).
    """

    decoder: str
    mode: DecodeMode
    prompts: int
    new_tokens: int
    rounds: int
    mean_latency_s: float
    tokens_per_round: float
    tokens_per_call: float
    acceptance_rate: float
    acceptance_by_position: tuple[float, ...]
    throughput: float
    mean_split_s: dict[str, float] = field(default_factory=dict)
    speedup_vs_ar: float | None = None
    speedup_vs_ff: float | None = None

    @classmethod
    def from_summary(cls, decoder: str, mode: DecodeMode, prompts: int,
                     summary: DecodeSummary) -> DecoderRow:
        """A row from a pooled :class:`~circuits_llm.decoding.metrics.DecodeSummary` (no speed-ups yet)."""
        return cls(decoder=decoder, mode=mode, prompts=prompts, new_tokens=summary.new_tokens,
                   rounds=summary.rounds, mean_latency_s=summary.mean_latency_s,
                   tokens_per_round=summary.tokens_per_round,
                   tokens_per_call=summary.tokens_per_call,
                   acceptance_rate=summary.acceptance_rate,
                   acceptance_by_position=tuple(summary.acceptance_by_position),
                   throughput=summary.throughput, mean_split_s=dict(summary.mean_split_s))

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the mode as its value, positions as a list)."""
        record = asdict(self)
        record["mode"] = self.mode.value
        record["acceptance_by_position"] = list(self.acceptance_by_position)
        return record

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> DecoderRow:
        """Inverse of :meth:`to_json`; raises :class:`ReportError` on a malformed record."""
        check_row(record)
        values = dict(record)
        values["mode"] = DecodeMode(values["mode"])
        values["acceptance_by_position"] = tuple(values["acceptance_by_position"])
        return cls(**values)


def with_speedups(rows: Iterable[DecoderRow]) -> list[DecoderRow]:
    """Fill ``speedup_vs_ar`` / ``speedup_vs_ff`` from the rows of the same mode."""
    rows = list(rows)
    by_key = {(row.decoder, row.mode): row for row in rows}

    def ratio(row: DecoderRow, baseline: str) -> float | None:
        base = by_key.get((baseline, row.mode))
        if base is None or base.throughput <= 0:
            return None
        return row.throughput / base.throughput

    return [replace(row, speedup_vs_ar=ratio(row, BASELINE), speedup_vs_ff=ratio(row, INDEPENDENT))
            for row in rows]


# ---------------------------------------------------------------------------- JSON schema
_ROW_TYPES: dict[str, tuple[type, ...]] = {
    "decoder": (str,), "mode": (str,), "prompts": (int,), "new_tokens": (int,), "rounds": (int,),
    "mean_latency_s": (int, float), "tokens_per_round": (int, float),
    "tokens_per_call": (int, float), "acceptance_rate": (int, float),
    "acceptance_by_position": (list, tuple), "throughput": (int, float), "mean_split_s": (dict,),
    "speedup_vs_ar": (int, float, type(None)), "speedup_vs_ff": (int, float, type(None)),
}
_REPORT_TYPES: dict[str, tuple[type, ...]] = {
    "schema_version": (int,), "kind": (str,), "created": (str,), "command": (str,),
    "model": (dict,), "machine": (dict,), "config": (dict,), "heads": (dict,), "rows": (list,),
    "greedy_identical": (dict,), "sample": (dict,), "plot": (str,), "wall_s": (int, float),
    "unit": (str,), "analysis": (list,), "targets": (list,),
}


def _check_fields(record: Any, types: Mapping[str, tuple[type, ...]], what: str) -> None:
    if not isinstance(record, Mapping):
        raise ReportError(f"{what} must be a JSON object, got {type(record).__name__}")
    missing = sorted(set(types) - set(record))
    unknown = sorted(set(record) - set(types))
    if missing or unknown:
        raise ReportError(f"{what}: missing keys {missing}, unknown keys {unknown}")
    for key, allowed in types.items():
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, allowed):
            names = "/".join(t.__name__ for t in allowed)
            raise ReportError(f"{what}: {key} must be {names}, got {value!r}")


def check_row(record: Any) -> None:
    """Raise :class:`ReportError` unless ``record`` is a valid JSON row."""
    _check_fields(record, _ROW_TYPES, "row")
    if record["mode"] not in {m.value for m in DecodeMode}:
        raise ReportError(f"row: mode must be one of {[m.value for m in DecodeMode]}, "
                          f"got {record['mode']!r}")
    rates = [record["acceptance_rate"], *record["acceptance_by_position"]]
    if not all(isinstance(r, (int, float)) and 0 <= r <= 1 for r in rates):
        raise ReportError(f"row {record['decoder']}/{record['mode']}: acceptance rates must lie "
                          f"in [0, 1], got {rates}")


def check_report(report: Any) -> None:
    """Raise :class:`ReportError` unless ``report`` follows this module's JSON schema."""
    _check_fields(report, _REPORT_TYPES, "report")
    if report["schema_version"] != SCHEMA_VERSION or report["kind"] != REPORT_KIND:
        raise ReportError(f"report: expected kind {REPORT_KIND!r} version {SCHEMA_VERSION}, got "
                          f"{report['kind']!r} version {report['schema_version']!r}")
    for row in report["rows"]:
        check_row(row)
    if report["unit"] not in {u.value for u in TokenUnit}:
        raise ReportError(f"report: unit must be one of {[u.value for u in TokenUnit]}, got "
                          f"{report['unit']!r}")
    identical = report["greedy_identical"]
    if not isinstance(identical.get("all"), bool) or not isinstance(identical.get("prompts"), int):
        raise ReportError("report: greedy_identical needs a bool 'all' and an int 'prompts'")


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data: dataclasses as dicts, enums as their values, paths as strings,
    NaN and infinities as None (JSON has neither), anything else unknown as its ``repr``."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def write_json(report: Mapping[str, Any], path: Path) -> Path:
    """Write ``report`` as indented JSON with sorted keys, atomically."""
    return atomic_write_json(path, report, sort_keys=True)


def load_report(path: Path) -> dict[str, Any]:
    """Read and check a report written by :func:`write_json`."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ReportError(f"cannot read a report from {path}: {error}") from None
    check_report(report)
    return report


# ---------------------------------------------------------------------------- the table
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: Iterable[DecoderRow], unit: TokenUnit = TokenUnit.BYTES) -> str:
    """The comparison as fixed-width text: one line per (mode, decoder), then per-position rates."""
    rows = sorted(rows, key=lambda r: (r.mode.value, r.decoder != BASELINE, r.decoder))
    header = (f"{'mode':<9}{'decoder':<15}{'lat/round':>10}{'acc.len':>9}{'tok/call':>9}"
              f"{'accept':>8}{unit.per_second:>9}{'x AR':>7}{'x FF':>7}")
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.mode.value:<9}{row.decoder:<15}{row.mean_latency_s * 1e3:>8.2f}ms"
            f"{row.tokens_per_round:>9.2f}{row.tokens_per_call:>9.2f}"
            f"{row.acceptance_rate:>8.1%}{row.throughput:>9.1f}"
            f"{_fmt(row.speedup_vs_ar, '.2f'):>7}{_fmt(row.speedup_vs_ff, '.2f'):>7}")
    speculative = [row for row in rows if row.acceptance_by_position]
    if speculative:
        lines += ["", "per-position acceptance (% of rounds whose k-th draft was accepted)"]
        depth = max(len(row.acceptance_by_position) for row in speculative)
        lines.append(f"{'mode':<9}{'decoder':<15}" + "".join(f"{k:>5}" for k in range(1, depth + 1)))
        for row in speculative:
            rates = "".join(f"{100 * rate:>5.0f}" for rate in row.acceptance_by_position)
            lines.append(f"{row.mode.value:<9}{row.decoder:<15}{rates}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the round, analysed
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
                     f"{_fmt(item.realised_over_ideal, '.2f'):>16}")
    lines += ["", "targets (real-model issue)"]
    for target in targets:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[target["met"]]
        value = _fmt(target["value"], ".3f")
        lines.append(f"  {target['name']:<34}{value:>8}  (target {target['target']}): {verdict}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the plot
_COLORS = {BASELINE: "#555555", INDEPENDENT: "#1f77b4", "btree": "#d62728"}
_PALETTE = ("#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2")
_MARKERS = {DecodeMode.GREEDY: "o", DecodeMode.SAMPLING: "^"}


def iso_levels(throughputs: Iterable[float], count: int = 6) -> list[float]:
    """Round throughput levels (1-2-5 series) spanning ``throughputs``, for iso-throughput lines."""
    values = [t for t in throughputs if t > 0 and math.isfinite(t)]
    if not values:
        return []
    low, high = min(values) / 2, max(values) * 2
    levels: list[float] = []
    for exponent in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1):
        levels += [m * 10.0 ** exponent for m in (1, 2, 5) if low <= m * 10.0 ** exponent <= high]
    while len(levels) > count:
        levels = levels[::2]
    return levels


def _draw_iso_lines(ax: Any, levels: list[float], x_max: float, y_max: float,
                    unit: TokenUnit = TokenUnit.BYTES) -> None:
    for level in levels:
        slope = level / 1e3  # tokens per round per ms of latency
        x_end = min(x_max, y_max / slope)
        ax.plot([0, x_end], [0, slope * x_end], ls=":", color="0.55", lw=1.0, zorder=1)
        ax.annotate(f"{level:g} {unit.per_second}", (x_end, slope * x_end), xytext=(-3, -3),
                    textcoords="offset points", ha="right", va="top", fontsize=7.5, color="0.4",
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})


def write_tradeoff_plot(rows: Iterable[DecoderRow], path: Path, title: str,
                        unit: TokenUnit = TokenUnit.BYTES) -> Path:
    """Accepted length (tokens per round) against latency per round, with iso-throughput lines.

    One panel per decoding mode; every point is one decoder. A dotted line ``y = T * x`` joins
    all designs with throughput ``T`` tokens (``unit``) per second, so points further up-left are
    faster (the MTPC paper's Figure 1). The PNG is written atomically.
    """
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = [row for row in rows if row.rounds > 0]
    if not rows:
        raise ReportError("nothing to plot: no row has any decoding round")
    modes = [mode for mode in DecodeMode if any(row.mode is mode for row in rows)]
    x_max = max(row.mean_latency_s * 1e3 for row in rows) * 1.35
    y_max = max(row.tokens_per_round for row in rows) * 1.25
    levels = iso_levels(row.throughput for row in rows)
    decoders = list(dict.fromkeys(row.decoder for row in rows))
    extra = iter(_PALETTE)
    colors = {name: _COLORS.get(name) or next(extra, "black") for name in decoders}
    fig, axes = plt.subplots(1, len(modes), figsize=(5.2 * len(modes), 4.6), dpi=120,
                             sharex=True, sharey=True, squeeze=False)
    try:
        for ax, mode in zip(axes[0], modes, strict=True):
            _draw_iso_lines(ax, levels, x_max, y_max, unit)
            points = sorted((row for row in rows if row.mode is mode),
                            key=lambda r: r.mean_latency_s)
            for index, row in enumerate(points):
                xy = (row.mean_latency_s * 1e3, row.tokens_per_round)
                ax.scatter(*xy, s=80, zorder=3, color=colors[row.decoder], marker=_MARKERS[mode],
                           edgecolors="black", linewidths=0.6, label=row.decoder)
                above = index % 2 == 0
                ax.annotate(f"{row.decoder}\n{row.throughput:.0f} {unit.per_second}", xy,
                            xytext=(7, 5 if above else -5), textcoords="offset points",
                            va="bottom" if above else "top", fontsize=8, zorder=4)
            ax.set_xlim(0, x_max)
            ax.set_ylim(0, y_max)
            ax.set_title(f"{mode.value}", fontsize=10)
            ax.set_xlabel("mean latency per round (ms)")
            ax.grid(alpha=0.25)
        axes[0][0].set_ylabel("mean accepted length (tokens per round)")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8.5,
                   frameon=False)
        fig.suptitle(f"{title}\n(dotted: iso-throughput; up-left is faster)", fontsize=9.5)
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        return atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)
