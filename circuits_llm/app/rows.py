"""The rows of a decoder comparison: one :class:`DecoderRow` per (decoder, mode), and their table.

A comparison runs several decoders (autoregressive, speculative with an FF head, with a BTree
head, ...) on the same prompts in the same process and pools each decoder's rounds with
:func:`circuits_llm.decoding.metrics.aggregate`. A row holds the MTPC paper's metrics (Section
4.2) of that pooled :class:`~circuits_llm.decoding.metrics.DecodeSummary`, exactly its
:meth:`~circuits_llm.decoding.metrics.DecodeSummary.reported` fields (mean latency per round
``mu_lat``, mean accepted length ``mu_acc``, per-position acceptance, throughput
``mu_acc / mu_lat``, ...), plus the wall-time speed-ups over the autoregressive baseline and the
FF (independence) head (:func:`with_speedups`).

Throughput is in tokens per second of the model's own tokenizer (:class:`TokenUnit`): bytes for
the byte-level models, subword tokens for a model such as SmolLM2.

Everything the other parts of the report (:mod:`circuits_llm.app.report`, the JSON record;
:mod:`circuits_llm.app.round_analysis`; :mod:`circuits_llm.app.tradeoff_plot`) read of a row is
here, with the row's own JSON form and its check (:func:`check_row`), so they import this module
and nothing of each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any

from circuits_llm.decoding.metrics import DecodeSummary

BASELINE = "autoregressive"
INDEPENDENT = "ff"


class DecodeMode(Enum):
    """How tokens are chosen: argmax (temperature 0) or sampling (temperature > 0)."""

    GREEDY = "greedy"
    SAMPLING = "sampling"


class TokenUnit(Enum):
    """What a token is for throughput: a byte (byte-level models) or a subword token."""

    BYTES = "bytes"
    TOKENS = "tok"

    @property
    def per_second(self) -> str:
        """The column label: ``bytes/s`` or ``tok/s``."""
        return f"{self.value}/s"


class ReportError(ValueError):
    """A report or one of its rows is malformed (the message names the field)."""


@dataclass(frozen=True)
class DecoderRow:
    """The pooled metrics of one decoder in one mode over all prompts of a comparison.

    Attributes:
        decoder: ``"autoregressive"`` or a head name (``"ff"``, ``"btree"``, ...).
        mode: greedy or sampling.
        prompts: number of prompts decoded.
        new_tokens, rounds, mean_latency_s, tokens_per_round, tokens_per_call, acceptance_rate,
            acceptance_by_position, throughput, mean_split_s: the pooled
            :class:`~circuits_llm.decoding.metrics.DecodeSummary`'s fields of the same names
            (:data:`~circuits_llm.decoding.metrics.REPORTED`): tokens generated and rounds in
            total, ``mu_lat`` (seconds per round), ``mu_acc`` (tokens per round), tokens per
            backbone call, accepted / drafted tokens (0 for autoregressive decoding), the fraction
            of rounds whose ``k``-th draft was accepted, tokens per decoding second
            (``mu_acc / mu_lat``) and the mean seconds per round of each phase.
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
        return cls(decoder=decoder, mode=mode, prompts=prompts, **summary.reported())

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


# ---------------------------------------------------------------------------- a row's JSON schema
_ROW_TYPES: dict[str, tuple[type, ...]] = {
    "decoder": (str,), "mode": (str,), "prompts": (int,), "new_tokens": (int,), "rounds": (int,),
    "mean_latency_s": (int, float), "tokens_per_round": (int, float),
    "tokens_per_call": (int, float), "acceptance_rate": (int, float),
    "acceptance_by_position": (list, tuple), "throughput": (int, float), "mean_split_s": (dict,),
    "speedup_vs_ar": (int, float, type(None)), "speedup_vs_ff": (int, float, type(None)),
}


def check_fields(record: Any, types: Mapping[str, tuple[type, ...]], what: str) -> None:
    """Raise :class:`ReportError` unless ``record`` is a JSON object with exactly the keys of
    ``types``, each of one of its types (a bool is never a number)."""
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
    check_fields(record, _ROW_TYPES, "row")
    if record["mode"] not in {m.value for m in DecodeMode}:
        raise ReportError(f"row: mode must be one of {[m.value for m in DecodeMode]}, "
                          f"got {record['mode']!r}")
    rates = [record["acceptance_rate"], *record["acceptance_by_position"]]
    if not all(isinstance(r, (int, float)) and 0 <= r <= 1 for r in rates):
        raise ReportError(f"row {record['decoder']}/{record['mode']}: acceptance rates must lie "
                          f"in [0, 1], got {rates}")


# ---------------------------------------------------------------------------- the table
def format_optional(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` for None (a speed-up without its baseline)."""
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
            f"{format_optional(row.speedup_vs_ar, '.2f'):>7}"
            f"{format_optional(row.speedup_vs_ff, '.2f'):>7}")
    speculative = [row for row in rows if row.acceptance_by_position]
    if speculative:
        lines += ["", "per-position acceptance (% of rounds whose k-th draft was accepted)"]
        depth = max(len(row.acceptance_by_position) for row in speculative)
        lines.append(f"{'mode':<9}{'decoder':<15}" + "".join(f"{k:>5}" for k in range(1, depth + 1)))
        for row in speculative:
            rates = "".join(f"{100 * rate:>5.0f}" for rate in row.acceptance_by_position)
            lines.append(f"{row.mode.value:<9}{row.decoder:<15}{rates}")
    return "\n".join(lines)
