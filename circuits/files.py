"""Files written whole or not at all, and their checksums: the project's one copy of each.

:func:`atomic_write` is how every file of the project is written (circuit JSON, heads, adapters,
checkpoints, reports, benchmark records, plots): ``write`` fills a temporary file in the target's
directory, the file is flushed to the disk (``fsync``), renamed over the target with
``os.replace`` (atomic on POSIX), and the directory is synced so the new name survives a power
loss. Anything that fails on the way (a full disk included: ``OSError`` ``ENOSPC`` from ``write``
or from ``fsync``) removes the temporary file and leaves the target as it was, or absent.

The file ends with the mode an ordinary ``open(path, "w")`` would have given it (``0o666`` less
the umask, or what the directory's default ACL says): the temporary file is created with
``os.open(..., 0o666)``, so the kernel applies the umask itself, and nothing reads or changes the
process's umask (``os.umask`` can only be read by setting it, which races with other threads).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary file next to ``path``, then rename it over ``path``.

    The temporary file keeps ``path``'s suffix, so writers that infer a format from it (matplotlib,
    safetensors) work. The parent directory is created if needed. The file ends with the mode
    ``open()`` would have given it (``0o666 & ~umask``), also when ``write`` replaced the temporary
    file by another one (``os.replace(partial, tmp)``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, mode = _create_temporary(path)
    try:
        write(tmp)
        if stat.S_IMODE(tmp.stat().st_mode) != mode:  # a writer that put another file there
            tmp.chmod(mode)
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if os.name == "posix":  # directories cannot be opened for fsync elsewhere
        fsync(path.parent)
    return path


def _create_temporary(path: Path, attempts: int = 100) -> tuple[Path, int]:
    """Create a new, empty temporary file next to ``path``; return it and its permission bits.

    Like :func:`tempfile.mkstemp` (a random name, ``O_EXCL``: never an existing file or a
    symlink), but with the mode ``open()`` uses (``0o666`` under the umask) instead of ``0o600``.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(attempts):
        tmp = path.parent / f".{path.stem}.{secrets.token_hex(6)}.tmp{path.suffix}"
        try:
            handle = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        try:
            mode = stat.S_IMODE(os.fstat(handle).st_mode)
        finally:
            os.close(handle)
        return tmp, mode
    raise FileExistsError(f"no unused temporary file name next to {path} after {attempts} tries")


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write`)."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | os.PathLike[str], payload: Mapping[str, Any], *,
                      sort_keys: bool = False, allow_nan: bool = False) -> Path:
    """Write ``payload`` as indented JSON to ``path`` atomically.

    NaN and infinity are refused (they are not JSON) unless ``allow_nan``: a training record
    keeps a diverged loss as written by Python's ``json``.
    """
    text = json.dumps(payload, indent=2, sort_keys=sort_keys, allow_nan=allow_nan) + "\n"
    return atomic_write_text(path, text)


def fsync(path: str | os.PathLike[str]) -> None:
    """Flush ``path`` (a file or, on POSIX, a directory) to the disk."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The SHA-256 hex digest of the file at ``path``, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
