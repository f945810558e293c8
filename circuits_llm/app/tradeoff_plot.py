"""The trade-off plot of a decoder comparison: accepted length against latency per round.

:func:`write_tradeoff_plot` draws one panel per decoding mode, one point per decoder, with dotted
iso-throughput lines (levels from :func:`iso_levels`), like the MTPC paper's Figure 1: points
further up-left are faster. matplotlib is imported only when a plot is drawn, so the rest of the
report needs none. The PNG is written atomically (:func:`circuits.files.atomic_write`: a
temporary file in the same directory, ``fsync``, then ``os.replace``): a crash leaves the previous
file or none.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from circuits.files import atomic_write
from circuits_llm.app.rows import BASELINE, INDEPENDENT, DecodeMode, DecoderRow, ReportError, TokenUnit

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
