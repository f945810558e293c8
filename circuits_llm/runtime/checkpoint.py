"""Verified, atomic checkpoints for long jobs (pretraining, head training).

A checkpoint file (format 2) is::

    circuits-llm checkpoint\\n                                   (magic line)
    {"bytes": N, "format": 2, "kind": ..., "sha256": ..., "summary": {...}}\\n   (JSON header)
    <N bytes: the torch.save-d payload dict, with its "kind" and "format">

The SHA-256 of the payload is checked before anything is unpickled, so a flipped, missing or
extra byte anywhere in the file is a :class:`CheckpointCorruptError` naming the file, never a
silently different resume. ``summary`` holds a few JSON scalars (e.g. the step) that can be read
without loading the payload, for messages about a file.

Writes go through :func:`circuits.files.atomic_write` (temporary file, ``fsync``,
``os.replace``): an interrupted or failed write (a full disk included) leaves the previous file in
place, and the failure is a one-line :class:`CheckpointWriteError`. With ``keep_previous`` the
file being replaced is first kept as ``<stem>.prev<suffix>`` (a hard link, or a copy), but only
if it verifies: a corrupt file never displaces a good previous one.

Format 1 files (a bare ``torch.save`` zip without a checksum) are refused unless the caller asks
for them explicitly (``allow_unverified``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from circuits.files import atomic_write

FORMAT_VERSION = 2
LEGACY_FORMAT_VERSION = 1
MAGIC = b"circuits-llm checkpoint\n"
_ZIP_MAGIC = b"PK\x03\x04"
_MAX_HEADER_BYTES = 1 << 16
_BLOCK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or was written by a different job or configuration."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file fails its integrity check (``problem`` says how, without advice)."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{problem}; delete it to start over")
        self.path = path
        self.problem = problem


class UnverifiableCheckpointError(CheckpointCorruptError):
    """A format 1 checkpoint: it has no checksum (load it only with ``allow_unverified``)."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint (or another run file) failed; the previous file is left intact."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What a verified checkpoint's header says.

    Attributes:
        path: the file.
        kind: what wrote it (e.g. ``"circuits_llm.train_head"``).
        size: bytes of the payload.
        sha256: hex SHA-256 of the payload (checked).
        summary: the JSON scalars given to :func:`save_checkpoint` (e.g. ``{"step": 12}``).
    """

    path: Path
    kind: str
    size: int
    sha256: str
    summary: Mapping[str, Any] = field(default_factory=dict)


def previous_path(path: str | Path) -> Path:
    """Where :func:`save_checkpoint` keeps the previous file: ``checkpoint.pt`` -> ``checkpoint.prev.pt``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


# ------------------------------------------------------------------------------------- reading
def _header(stream: BinaryIO, path: Path) -> dict[str, Any]:
    """Read and check the magic line and the JSON header; the stream is left at the payload."""
    start = stream.read(len(MAGIC))
    if start != MAGIC:
        if start.startswith(_ZIP_MAGIC):
            raise UnverifiableCheckpointError(
                path, f"checkpoint {path} has no checksum (format {LEGACY_FORMAT_VERSION}, written "
                "by an older circuits-llm), so it cannot be verified")
        raise CheckpointCorruptError(path, f"checkpoint {path} is corrupt: it does not start with "
                                           "the circuits-llm checkpoint header")
    line = stream.readline(_MAX_HEADER_BYTES)
    try:
        header = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not line.endswith(b"\n") or not isinstance(header, dict):
        raise CheckpointCorruptError(path, f"checkpoint {path} is corrupt: its header is not "
                                           "valid JSON")
    if header.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {header.get('format')!r}, this code "
                              f"reads format {FORMAT_VERSION}")
    types = {"kind": str, "sha256": str, "bytes": int, "summary": dict}
    if any(not isinstance(header.get(key), kind) for key, kind in types.items()):
        raise CheckpointCorruptError(path, f"checkpoint {path} is corrupt: its header lacks "
                                           f"{sorted(types)}")
    return header


def _check_kind(path: Path, found: object, kind: str | None) -> None:
    if kind is not None and found != kind:
        raise CheckpointError(f"checkpoint {path} was written by {found!r}, expected {kind!r}")


def _verified(path: Path, header: dict[str, Any], payload_size: int, digest: str) -> None:
    if payload_size != header["bytes"]:
        raise CheckpointCorruptError(
            path, f"checkpoint {path} is corrupt: it holds {payload_size} payload bytes, its header "
                  f"says {header['bytes']} (truncated or appended to)")
    if digest != header["sha256"]:
        raise CheckpointCorruptError(
            path, f"checkpoint {path} is corrupt: its SHA-256 does not match the one recorded when "
                  "it was written (bytes changed on disk)")


def _open(path: Path) -> BinaryIO:
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        return path.open("rb")
    except OSError as error:
        raise CheckpointError(f"cannot read checkpoint {path} ({error})") from None


def inspect_checkpoint(path: str | Path, kind: str | None = None) -> CheckpointInfo:
    """Verify ``path``'s checksum (streaming, nothing is unpickled) and return its header.

    Raises:
        CheckpointCorruptError: bad header, wrong size or checksum mismatch.
        CheckpointError: missing or unreadable, another format, or another ``kind``.
    """
    path = Path(path)
    with _open(path) as stream:
        header = _header(stream, path)
        _check_kind(path, header["kind"], kind)
        digest, size = hashlib.sha256(), 0
        try:
            for block in iter(lambda: stream.read(_BLOCK), b""):
                digest.update(block)
                size += len(block)
        except OSError as error:
            raise CheckpointError(f"cannot read checkpoint {path} ({error})") from None
    _verified(path, header, size, digest.hexdigest())
    return CheckpointInfo(path, header["kind"], size, header["sha256"], header["summary"])


def _unpickle(path: Path, payload: bytes, kind: str, version: int) -> dict[str, Any]:
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    except Exception as error:  # any unpickling failure means the file is unusable
        raise CheckpointCorruptError(path, f"checkpoint {path} is corrupt or unreadable "
                                           f"({error})") from None
    if not isinstance(state, dict):
        raise CheckpointCorruptError(path, f"checkpoint {path} holds a {type(state).__name__}, "
                                           "not a checkpoint dict")
    _check_kind(path, state.get("kind"), kind)
    if state.get("format") != version:
        raise CheckpointError(f"checkpoint {path} has format {state.get('format')!r}, this code "
                              f"reads format {FORMAT_VERSION}")
    return state


def load_checkpoint(path: str | Path, kind: str, *, allow_unverified: bool = False,
                    ) -> dict[str, Any]:
    """Verify and read a checkpoint written by :func:`save_checkpoint` for the same ``kind``.

    Args:
        path: the file.
        kind: the ``kind`` it must have been written with.
        allow_unverified: also read a format 1 file (no checksum); only for a file the user
            named explicitly.

    Returns:
        The saved state, with its ``"kind"`` and ``"format"`` keys.

    Raises:
        CheckpointCorruptError: the file fails its integrity check (its ``problem`` says how).
        CheckpointError: missing, unreadable, another format, or written by another ``kind``.
    """
    path = Path(path)
    with _open(path) as stream:
        try:
            data = stream.read()
        except OSError as error:
            raise CheckpointError(f"cannot read checkpoint {path} ({error})") from None
    if allow_unverified and data.startswith(_ZIP_MAGIC):
        return _unpickle(path, data, kind, LEGACY_FORMAT_VERSION)
    stream = io.BytesIO(data)
    header = _header(stream, path)
    _check_kind(path, header["kind"], kind)
    payload = data[stream.tell():]
    _verified(path, header, len(payload), hashlib.sha256(payload).hexdigest())
    return _unpickle(path, payload, kind, FORMAT_VERSION)


# ------------------------------------------------------------------------------------- writing
def _keep_previous(path: Path) -> None:
    """Keep ``path`` as :func:`previous_path` if it verifies (a hard link, else a copy)."""
    if not path.exists():
        return
    try:
        inspect_checkpoint(path)
    except CheckpointError:
        return  # never let a corrupt file displace the previous good one
    previous = previous_path(path)
    link = path.with_name(f".{previous.name}.{os.getpid()}.link")
    link.unlink(missing_ok=True)
    try:
        os.link(path, link)
    except OSError:  # no hard links on this file system: copy
        atomic_write(previous, lambda tmp: shutil.copyfile(path, tmp))
        return
    try:
        os.replace(link, previous)
    except BaseException:
        link.unlink(missing_ok=True)
        raise


def _write(tmp: Path, parts: tuple[bytes, ...]) -> None:
    with tmp.open("wb") as stream:
        for part in parts:
            stream.write(part)


def save_checkpoint(path: str | Path, kind: str, state: dict[str, Any], *,
                    summary: Mapping[str, Any] | None = None, keep_previous: bool = False,
                    ) -> CheckpointInfo:
    """Atomically write ``state`` (plus ``kind`` and the format version) to ``path``.

    Args:
        path: the checkpoint file (its directory is created).
        kind: what writes it; :func:`load_checkpoint` checks it.
        state: a ``torch.save``-able dict.
        summary: JSON scalars stored in the header (readable with :func:`inspect_checkpoint`).
        keep_previous: first keep the current ``path``, if it verifies, as
            :func:`previous_path`.

    Raises:
        CheckpointWriteError: the file could not be written (full disk, permissions); ``path``
            (and the previous file) hold what they held before.
    """
    path = Path(path)
    buffer = io.BytesIO()
    torch.save({"kind": kind, "format": FORMAT_VERSION, **state}, buffer)
    payload = buffer.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    values = dict(summary or {})
    header = json.dumps({"format": FORMAT_VERSION, "kind": kind, "sha256": digest,
                         "bytes": len(payload), "summary": values}, sort_keys=True,
                        allow_nan=False).encode("utf-8") + b"\n"
    try:
        if keep_previous:
            _keep_previous(path)
        atomic_write(path, lambda tmp: _write(tmp, (MAGIC, header, payload)))
    except OSError as error:
        reason = error.strerror or str(error)
        raise CheckpointWriteError(
            f"cannot write checkpoint {path} ({reason}); the previous {path.name} is left intact; "
            "free disk space (or fix the permissions) and run the same command again") from None
    return CheckpointInfo(path, kind, len(payload), digest, values)
