"""Arrays of shape (N, L, d) written to disk once, streamed, checksummed, resumable, memory-mapped.

The feature cache's files (:mod:`circuits_llm.training.features` decides what goes in them). An
entry is named by the SHA-256 of its key (:attr:`EntrySpec.name`) and lives in one directory:

* ``<name>.features``: the rows, raw little-endian in C order, (N, L, d) of the entry's dtype;
* ``<name>.json``: the marker of a complete entry (key, shape, dtype, the features file's SHA-256),
  written last (:func:`circuits.files.atomic_write_json`). Only entries with a marker are read, and
  a reader verifies the file against it (:func:`open_entry`), so nothing half-written is ever
  read as complete; an entry that fails is built again.

Building (:func:`build_entry`) never holds more than one chunk of rows in memory. Chunks are
appended to ``<name>.partial``; after each one the bytes are synced to the disk, then
``<name>.progress.json`` records the rows done and the chunk's SHA-256 (atomically). An
interrupted build (SIGINT, SIGKILL, a full disk) continues: the partial file is cut back to the
recorded rows, its chunks are checked against their digests (a mismatch starts the entry over),
and the next chunk is computed. The finished file is published through
:func:`circuits.files.atomic_write` (the partial file is renamed into its temporary file), then
the marker is written. A lock file (``<name>.lock``, ``flock``) keeps two processes from building
one entry at once: the second waits, then reads the first one's entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from circuits.files import atomic_write, atomic_write_json, fsync, sha256_file
from circuits_llm.training.config import TrainingConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["CHUNK_BYTES", "ENTRY_KIND", "EntrySpec", "FeatureCacheError", "FeatureEntry",
           "build_entry", "describe", "missing_room", "open_entry", "room_error"]

ENTRY_KIND = "circuits_llm.feature_cache"
#: Bumped when the layout of an entry changes.
ENTRY_FORMAT = 1
#: Bytes of features per durable chunk (rounded to whole forwards, at least one).
CHUNK_BYTES = 32 << 20
#: Room left free on the disk beyond the entry itself.
_SPARE_BYTES = 64 << 20
#: Stored dtypes: torch dtype -> numpy dtype of the file (bfloat16 is kept as its raw bits).
_NUMPY = {torch.float16: "<f2", torch.bfloat16: "<u2", torch.float32: "<f4", torch.float64: "<f8"}


class FeatureCacheError(TrainingConfigError):
    """Features cannot be cached (no room, a value float16 cannot hold, a model whose draft
    branch does not fit); the message says what to do."""


@dataclass(frozen=True)
class EntrySpec:
    """What an entry holds.

    Attributes:
        key: JSON-able description of the rows (model, layer, data, dtype...): the name's source.
        rows: N.
        length: L, positions per row.
        width: d, values per position.
        dtype: the stored torch dtype (float16, bfloat16, float32 or float64).
    """

    key: dict[str, Any]
    rows: int
    length: int
    width: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in _NUMPY:
            raise FeatureCacheError(f"features cannot be stored as {self.dtype}; use float16, "
                                    "bfloat16, float32 or float64")

    @property
    def name(self) -> str:
        record = {"format": ENTRY_FORMAT, "key": self.key, "shape": self.shape,
                  "dtype": str(self.dtype)}
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:32]

    @property
    def shape(self) -> list[int]:
        return [self.rows, self.length, self.width]

    @property
    def row_bytes(self) -> int:
        return self.length * self.width * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def paths(self, directory: Path) -> dict[str, Path]:
        """``features``, ``marker``, ``partial``, ``progress`` and ``lock`` files of the entry."""
        stem = directory / self.name
        return {"features": stem.with_suffix(".features"), "marker": stem.with_suffix(".json"),
                "partial": stem.with_suffix(".partial"),
                "progress": stem.with_suffix(".progress.json"), "lock": stem.with_suffix(".lock")}


@dataclass(frozen=True)
class FeatureEntry:
    """A complete, verified entry, memory-mapped read-only.

    Attributes:
        spec: what it holds.
        path: the features file.
        array: (N, L, d) read-only memory map (raw bits for bfloat16).
    """

    spec: EntrySpec
    path: Path
    array: np.ndarray

    def rows(self, index: Tensor) -> Tensor:
        """(b, L, d) features of rows ``index`` (b,), copied out, in the stored dtype."""
        picked = np.ascontiguousarray(self.array[np.asarray(index.reshape(-1).tolist(),
                                                            dtype=np.int64)])
        values = torch.from_numpy(picked)
        return values.view(torch.bfloat16) if self.spec.dtype is torch.bfloat16 else values


def _numpy(spec: EntrySpec) -> np.dtype[Any]:
    return np.dtype(_NUMPY[spec.dtype])


def open_entry(directory: Path, spec: EntrySpec) -> FeatureEntry | None:
    """The complete entry of ``spec`` in ``directory`` if its marker and file agree (the file's
    SHA-256 is checked), else None (absent, or damaged: build it again)."""
    paths = spec.paths(directory)
    try:
        meta = json.loads(paths["marker"].read_text())
        ok = (meta.get("kind") == ENTRY_KIND and meta.get("name") == spec.name
              and meta.get("shape") == spec.shape and meta.get("dtype") == str(spec.dtype)
              and paths["features"].stat().st_size == spec.nbytes
              and sha256_file(paths["features"]) == meta["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not ok:
        return None
    array = np.memmap(paths["features"], dtype=_numpy(spec), mode="r", shape=tuple(spec.shape)) \
        if spec.nbytes else np.zeros(spec.shape, _numpy(spec))
    return FeatureEntry(spec, paths["features"], array)


def _digest(path: Path, start: int, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        stream.seek(start)
        while size > 0:
            block = stream.read(min(size, 1 << 20))
            if not block:
                break
            digest.update(block)
            size -= len(block)
    return digest.hexdigest()


def _resume_point(spec: EntrySpec, paths: dict[str, Path], notify: Callable[[str], None],
                  ) -> tuple[int, list[list[Any]]]:
    """``(rows done, chunk records)`` of an interrupted build whose record and bytes check out;
    ``(0, [])`` (the partial files removed) otherwise."""
    try:
        progress = json.loads(paths["progress"].read_text())
        done, chunks = int(progress["done"]), [list(c) for c in progress["chunks"]]
        if progress.get("kind") != ENTRY_KIND or progress.get("name") != spec.name \
                or not 0 < done <= spec.rows or chunks[-1][1] != done:
            raise ValueError("the progress record is not this entry's")
        size = done * spec.row_bytes
        if paths["partial"].stat().st_size < size:
            raise ValueError("the partial file is shorter than its record")
        with paths["partial"].open("r+b") as stream:  # bytes written after the last record
            stream.truncate(size)
        for first, last, sha in chunks:
            if _digest(paths["partial"], first * spec.row_bytes,
                       (last - first) * spec.row_bytes) != sha:
                raise ValueError(f"rows {first}..{last} fail their checksum")
        return done, chunks
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
        notify(f"the interrupted feature build in {paths['partial']} cannot be continued "
               f"({error}); starting it over")
    for name in ("partial", "progress"):
        paths[name].unlink(missing_ok=True)
    return 0, []


@contextlib.contextmanager
def _build_lock(path: Path, notify: Callable[[str], None]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (waiting, with a notice, while another holds it)."""
    if fcntl is None:  # pragma: no cover - not POSIX
        yield
        return
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            notify(f"another process is building the features of {path.stem}; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def missing_room(directory: Path, needed: int) -> int:
    """How many of ``needed`` bytes (plus a spare margin) ``directory``'s disk lacks (0: none)."""
    directory.mkdir(parents=True, exist_ok=True)
    return max(0, needed + _SPARE_BYTES - shutil.disk_usage(directory).free)


def room_error(directory: Path, needed: int, missing: int, what: str) -> FeatureCacheError:
    """The error of a disk without room for ``needed`` bytes of ``what``."""
    return FeatureCacheError(
        f"caching the features needs {needed / 2**20:,.1f} MiB ({what}) in {directory}, "
        f"{missing / 2**20:,.1f} MiB more than the disk has free; free space, point "
        "$CIRCUITS_LLM_FEATURE_CACHE elsewhere, use fewer rows, or train without --cache-features")


def describe(spec: EntrySpec, rows: int | None = None) -> str:
    """``"N rows x L positions x d values x b bytes"`` of ``spec`` (``rows`` instead of N)."""
    size = spec.row_bytes // (spec.length * spec.width)
    return f"{spec.rows if rows is None else rows} rows x {spec.length} positions x " \
        f"{spec.width} values x {size} bytes"


def build_entry(directory: Path, spec: EntrySpec, compute: Callable[[int, int], Tensor], *,
                forward_rows: int, progress: bool = False, label: str = "features",
                notify: Callable[[str], None] = lambda message: print(message, file=sys.stderr),
                on_chunk: Callable[[int], None] | None = None) -> FeatureEntry:
    """The entry of ``spec``: opened if complete, else built (or its build continued).

    Args:
        directory: where entries live (created).
        spec: what to build.
        compute: ``compute(first, last)`` -> (last - first, L, d) tensor of ``spec.dtype``, rows
            ``first .. last - 1``; called with at most ``forward_rows`` rows.
        forward_rows: rows per ``compute`` call; a durable chunk is a whole number of calls,
            about :data:`CHUNK_BYTES`.
        progress: a tqdm bar (rows) while building.
        label: the bar's description.
        notify: where notices go (a continued build, a wait for another builder).
        on_chunk: called with the rows done after each chunk is recorded (tests use it).

    Raises:
        FeatureCacheError: the disk lacks room for the rest of the entry.
        OSError: a write failed (the recorded chunks stay; a later call continues from them).
    """
    from tqdm import tqdm
    directory.mkdir(parents=True, exist_ok=True)
    paths = spec.paths(directory)
    with _build_lock(paths["lock"], notify):
        found = open_entry(directory, spec)
        if found is not None:
            return found
        paths["marker"].unlink(missing_ok=True)  # a damaged entry: never read while rebuilt
        done, chunks = _resume_point(spec, paths, notify)
        needed = (spec.rows - done) * spec.row_bytes
        missing = missing_room(directory, needed)
        if missing:
            raise room_error(directory, needed, missing, describe(spec, spec.rows - done))
        per_chunk = max(1, CHUNK_BYTES // max(1, forward_rows * spec.row_bytes)) * forward_rows
        bar = tqdm(total=spec.rows, initial=done, desc=label, unit="row", disable=not progress,
                   dynamic_ncols=True)
        with bar, paths["partial"].open("r+b" if done else "wb") as stream:
            stream.seek(done * spec.row_bytes)
            while done < spec.rows:
                last = min(done + per_chunk, spec.rows)
                digest = hashlib.sha256()
                for first in range(done, last, forward_rows):
                    values = compute(first, min(first + forward_rows, last))
                    block = _bytes(values, spec, first)
                    stream.write(block)
                    digest.update(block)
                    bar.update(values.shape[0])
                stream.flush()
                os.fsync(stream.fileno())
                chunks.append([done, last, digest.hexdigest()])
                done = last
                atomic_write_json(paths["progress"], {"kind": ENTRY_KIND, "name": spec.name,
                                                      "done": done, "chunks": chunks})
                if on_chunk is not None:
                    on_chunk(done)
        fsync(paths["partial"])
        atomic_write(paths["features"], lambda tmp: os.replace(paths["partial"], tmp))
        atomic_write_json(paths["marker"], {
            "kind": ENTRY_KIND, "format": ENTRY_FORMAT, "name": spec.name, "key": spec.key,
            "shape": spec.shape, "dtype": str(spec.dtype),
            "sha256": sha256_file(paths["features"])})
        paths["progress"].unlink(missing_ok=True)
        entry = open_entry(directory, spec)
    if entry is None:  # pragma: no cover - only if the files changed under us
        raise FeatureCacheError(f"the feature cache entry {paths['marker']} could not be read "
                                "back after writing it")
    return entry


def _bytes(values: Tensor, spec: EntrySpec, first: int) -> bytes:
    """The little-endian bytes of a computed block (checked against the spec)."""
    expected = (spec.length, spec.width)
    if values.dtype is not spec.dtype or values.dim() != 3 or tuple(values.shape[1:]) != expected:
        raise FeatureCacheError(f"rows from {first} came out as {values.dtype} "
                                f"{tuple(values.shape)}, expected {spec.dtype} (b, *{expected})")
    values = values.detach().cpu().contiguous()
    array = values.view(torch.int16).numpy().view(np.uint16) if spec.dtype is torch.bfloat16 \
        else values.numpy()
    return array.astype(_numpy(spec), copy=False).tobytes()
