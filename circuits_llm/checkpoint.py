"""Atomic, validated checkpoints for long CPU jobs (pretraining, head training).

A checkpoint is a ``torch.save``-d dict with a ``kind`` (what wrote it) and a ``format`` version.
Writes go to a temporary file in the same directory followed by ``os.replace``, so an
interrupted write never leaves a half-written checkpoint in place of a good one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or was written by a different job or configuration."""


def save_checkpoint(path: str | Path, kind: str, state: dict[str, Any]) -> None:
    """Atomically write ``state`` (plus ``kind`` and the format version) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"kind": kind, "format": FORMAT_VERSION, **state}
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save(payload, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | Path, kind: str) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` for the same ``kind``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # any unpickling failure means the file is unusable
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({error}); delete it "
                              "to start over") from error
    if not isinstance(payload, dict) or payload.get("kind") != kind:
        found = payload.get("kind") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"checkpoint {path} was written by {found!r}, expected {kind!r}")
    if payload.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {payload.get('format')}, this code "
                              f"reads format {FORMAT_VERSION}")
    return payload
