"""Decoder-comparison reports: the JSON record, and the one import for the report's parts.

A comparison (``circuits-llm demo | bench``, ``benchmarks/study.py``) runs several decoders on the
same prompts and reports, per (decoder, mode), the MTPC paper's metrics. The report has four parts,
one module each:

* :mod:`circuits_llm.app.rows`: :class:`DecoderRow` (a pooled
  :class:`~circuits_llm.decoding.metrics.DecodeSummary` with speed-ups, :func:`with_speedups`), its
  JSON form and check, :class:`DecodeMode`, :class:`TokenUnit` and the text table
  (:func:`format_table`);
* :mod:`circuits_llm.app.round_analysis`: what the rows imply about the round
  (:func:`analyse`, :class:`RoundAnalysis`) and the targets of the real-model issue
  (:func:`check_targets`, :data:`TARGETS`);
* :mod:`circuits_llm.app.tradeoff_plot`: accepted length against latency per round with dotted
  iso-throughput lines (:func:`write_tradeoff_plot`), like the paper's Figure 1;
* this module: the JSON record (``results.json``): its schema (:func:`check_report`), plain JSON
  data from anything a record holds (:func:`jsonable`), and writing and reading it.

The names of all four are importable from here (``from circuits_llm.app import report``), which
is how the main job (:mod:`circuits_llm.app.demo`) reaches them: a test replaces
``report.write_tradeoff_plot`` to make the plot fail. Every file is written atomically by
:func:`circuits.files.atomic_write` (a temporary file in the same directory, ``fsync``, then
``os.replace``): a crash leaves the previous file or none.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from circuits.files import atomic_write_json
from circuits_llm.app.round_analysis import (
    BLOCK_TARGETS,
    TARGETS,
    Bound,
    RoundAnalysis,
    Target,
    analyse,
    check_targets,
    format_analysis,
)
from circuits_llm.app.rows import (
    BASELINE,
    INDEPENDENT,
    DecodeMode,
    DecoderRow,
    ReportError,
    TokenUnit,
    check_fields,
    check_row,
    format_table,
    with_speedups,
)
from circuits_llm.app.tradeoff_plot import iso_levels, write_tradeoff_plot

__all__ = [
    "BASELINE", "BLOCK_TARGETS", "INDEPENDENT", "REPORT_KIND", "SCHEMA_VERSION", "TARGETS",
    "Bound", "DecodeMode",
    "DecoderRow", "ReportError", "RoundAnalysis", "Target", "TokenUnit", "analyse", "check_report",
    "check_row", "check_targets", "format_analysis", "format_table", "iso_levels", "jsonable",
    "load_report", "with_speedups", "write_json", "write_tradeoff_plot",
]

#: Bumped whenever the meaning of a report's JSON fields changes (2: ``unit``, ``analysis`` and
#: ``targets`` added).
SCHEMA_VERSION = 2
REPORT_KIND = "circuits_llm.decoder_comparison"


_REPORT_TYPES: dict[str, tuple[type, ...]] = {
    "schema_version": (int,), "kind": (str,), "created": (str,), "command": (str,),
    "model": (dict,), "machine": (dict,), "config": (dict,), "heads": (dict,), "rows": (list,),
    "greedy_identical": (dict,), "sample": (dict,), "plot": (str,), "wall_s": (int, float),
    "unit": (str,), "analysis": (list,), "targets": (list,),
}


def check_report(report: Any) -> None:
    """Raise :class:`ReportError` unless ``report`` follows this module's JSON schema."""
    check_fields(report, _REPORT_TYPES, "report")
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
