"""Verified, atomic checkpoints of a :func:`circuits.learn.fit` run.

A checkpoint file is::

    circuits.learn checkpoint\\n                                  (magic line)
    {"format": 1, "bytes": N, "sha256": ..., "epoch": E}\\n        (JSON header)
    <N bytes: the torch.save-d payload>

The SHA-256 of the payload is checked before it is unpickled (with ``weights_only=True``: tensors,
numbers, strings, lists and dicts only), so a truncated or altered file is a
:class:`CheckpointError` naming the file, never a silently different resume. Files are written
with :func:`circuits.files.atomic_write`: an interrupted write leaves the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

from circuits.errors import CircuitError
from circuits.files import atomic_write

MAGIC = b"circuits.learn checkpoint\n"
FORMAT_VERSION = 1
_MAX_HEADER = 1 << 16


class CheckpointError(CircuitError, RuntimeError):
    """A checkpoint is corrupt, unreadable, or belongs to a different run."""


def save_checkpoint(path: str | os.PathLike[str], payload: dict[str, Any], epoch: int) -> Path:
    """Write ``payload`` (torch-serialisable) to ``path`` atomically, with its SHA-256."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    header = {"format": FORMAT_VERSION, "bytes": len(data),
              "sha256": hashlib.sha256(data).hexdigest(), "epoch": epoch}
    blob = MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + data
    return atomic_write(path, lambda tmp: tmp.write_bytes(blob))


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and verify a checkpoint; returns its payload.

    Raises:
        CheckpointError: the file is not a checkpoint, is truncated, or fails its checksum.
    """
    path = Path(path)
    blob = path.read_bytes()

    def corrupt(problem: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path}: {problem}; delete it to start the run over")

    if not blob.startswith(MAGIC):
        raise corrupt("not a circuits.learn checkpoint (wrong first line)")
    end = blob.find(b"\n", len(MAGIC), len(MAGIC) + _MAX_HEADER)
    if end < 0:
        raise corrupt("its header is missing or truncated")
    try:
        header = json.loads(blob[len(MAGIC):end])
        size, digest, version = int(header["bytes"]), str(header["sha256"]), int(header["format"])
    except (ValueError, KeyError, TypeError) as error:
        raise corrupt(f"its header is unreadable ({error})") from None
    if version != FORMAT_VERSION:
        raise corrupt(f"format {version} is not the supported format {FORMAT_VERSION}")
    data = blob[end + 1:]
    if len(data) != size:
        raise corrupt(f"the payload has {len(data)} bytes, the header says {size}")
    if hashlib.sha256(data).hexdigest() != digest:
        raise corrupt("the SHA-256 of the payload does not match its header (the file changed)")
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # verified bytes that still fail: a writer bug, say so
        raise corrupt(f"the payload does not load ({type(error).__name__}: {error})") from None
    if not isinstance(payload, dict):
        raise corrupt("the payload is not a dictionary")
    return payload


__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]
