"""The trained-head cache of ``demo``, ``bench``, ``generate`` and the study: find a head, or
train it into the cache first.

An entry is a :func:`circuits_llm.training.train_head` run directory,
``<cache>/<model fingerprint[:16]>/<arch>-n<window>-r<rank>-<config hash>``, keyed by the
model's :func:`~circuits_llm.models.model_fingerprint` (config and every weight) and the head's
whole training configuration, so a second run with the same model and settings trains nothing.
The entry is complete once its marker :data:`HEAD_MARKER` (the training record, JSON) is written,
which happens last.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from circuits_llm.models import LoadedModel
from circuits_llm.report import jsonable, write_json

#: The file whose presence marks a complete cache entry (the training record).
HEAD_MARKER = "demo_head.json"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/circuits_llm/heads`` (``~/.cache`` when the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "circuits_llm" / "heads"


def head_dir(cache: Path, fingerprint: str, training: Any) -> Path:
    """The cache entry of a head: ``cache/<model>/<arch>-n<window>-r<rank>-<config hash>``."""
    record = jsonable(training)
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:12]
    name = f"{record['architecture']}-n{record['window']}-r{record['rank']}-{key}"
    return cache / fingerprint[:16] / name


@dataclass
class ReadyHead:
    """A trained head with the backbone it was trained with, and its cache record."""

    name: str
    head: Any
    backbone: Any
    record: dict[str, Any]


def obtain_head(loaded: LoadedModel, training: Any, cache: Path, max_seconds: float,
                retrain: bool = False, progress: bool = True) -> ReadyHead:
    """Load a head from the cache, or train it into the cache first (then write its marker).

    ``training`` is a :class:`~circuits_llm.training.HeadTrainingConfig`; ``max_seconds`` bounds
    the training, ``retrain`` ignores a cached entry.
    """
    from circuits_llm.training import load_trained_head, train_head
    run_dir = head_dir(cache, loaded.fingerprint, training)
    marker = run_dir / HEAD_MARKER
    name = str(jsonable(training)["architecture"])
    cached = marker.is_file() and not retrain
    if not cached:
        run_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        result = train_head(loaded.model, training, run_dir, max_seconds=max_seconds,
                            progress=progress)
        record = {"architecture": name, "model_fingerprint": loaded.fingerprint,
                  "training_config": jsonable(training), "train_wall_s": time.perf_counter() - start,
                  "steps": result.step, "finished": result.finished,
                  "tokens_seen": result.tokens_seen,
                  "validation_bits_before": result.initial_validation.mean_bits,
                  "validation_bits_after": result.validation.mean_bits,
                  "validation_bits_by_position": list(result.validation.bits),
                  "max_seconds": max_seconds}
        write_json(record, marker)
    record = json.loads(marker.read_text())
    head, backbone = load_trained_head(run_dir, loaded.model)
    record.update(cached=cached, run_dir=str(run_dir), parameters=int(head.num_parameters()))
    return ReadyHead(name, head.eval(), backbone, record)


def find_cached_head(cache: Path, fingerprint: str, architecture: str,
                     preferred: list[Any]) -> Path | None:
    """A cached head of ``architecture`` for this model: a ``preferred`` config's, else the newest."""
    for training in preferred:
        run_dir = head_dir(cache, fingerprint, training)
        if (run_dir / HEAD_MARKER).is_file():
            return run_dir
    found = sorted((cache / fingerprint[:16]).glob(f"{architecture}-*/{HEAD_MARKER}"),
                   key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None
