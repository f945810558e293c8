"""An exclusive lock on a run directory, so that two runs never write the same files.

:class:`RunLock` holds an advisory ``flock`` on ``<run_dir>/train-head.lock`` while a run lasts and
writes its holder (pid, host, start time) into that file. The kernel drops a ``flock`` when the
process holding it dies, however it dies (SIGKILL included), so:

* a second run finds the lock taken and fails with :class:`RunDirectoryBusy`, naming the holder;
* a lock file that names a holder although nobody holds its ``flock`` was left by a process that
  died: the next run takes it over and says so (``notify``), naming the dead holder.

On release the file is removed while still locked. An acquirer that locked a file which was
removed in the meantime (the path no longer leads to it) retries, so a run starting while another
ends never leaves two holders. Needs ``fcntl`` (Linux, macOS).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = "train-head.lock"
_ATTEMPTS = 8


class RunDirectoryBusy(RuntimeError):
    """Another live process holds the run directory's lock (the message names it)."""


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or held) a run directory's lock.

    Attributes:
        pid: process id.
        host: host name.
        started: when it took the lock (ISO 8601, UTC, seconds).
        command: what it runs (e.g. ``"train-head"``).
    """

    pid: int
    host: str
    started: str
    command: str

    @classmethod
    def current(cls, command: str) -> LockHolder:
        """This process, now."""
        started = datetime.now(UTC).isoformat(timespec="seconds")
        return cls(os.getpid(), socket.gethostname(), started, command)

    @classmethod
    def parse(cls, text: str) -> LockHolder | None:
        """The holder recorded in a lock file, or None when it is empty or unreadable."""
        try:
            values = json.loads(text)
            return cls(int(values["pid"]), str(values["host"]), str(values["started"]),
                       str(values["command"]))
        except (ValueError, TypeError, KeyError):
            return None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"

    def describe(self) -> str:
        return f"{self.command} pid {self.pid} on host {self.host}, started {self.started}"


def _read(handle: int) -> str:
    os.lseek(handle, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(handle, 4096):
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _same_file(handle: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(handle)
    return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class RunLock:
    """The exclusive lock of one run directory (a context manager; see the module docstring).

    Args:
        directory: the run directory (created if missing; removed again on release when this
            lock created it and it is still empty).
        command: recorded as the holder's command.
        notify: receives the one-line message when a dead holder's lock is taken over.
    """

    def __init__(self, directory: str | Path, command: str = "train-head",
                 notify: Callable[[str], None] = _to_stderr) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.command = command
        self.notify = notify
        self.holder: LockHolder | None = None
        self._handle: int | None = None  # the open lock file, flocked or being flocked
        self._owned = False  # flocked, and still the file at self.path
        self._created_directory = False

    def acquire(self) -> LockHolder:
        """Take the lock; returns this process's holder record.

        Whatever interrupts it (an error, a signal's exception) leaves nothing held.

        Raises:
            RunDirectoryBusy: another live process holds it.
            OSError: the directory or the lock file cannot be created.
        """
        if fcntl is None:  # pragma: no cover - not POSIX
            raise RunDirectoryBusy("locking a run directory needs fcntl (Linux or macOS)")
        if self._handle is not None:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        self._created_directory = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self._take()
            assert self._handle is not None
            stale = LockHolder.parse(_read(self._handle))
            self.holder = LockHolder.current(self.command)
            os.ftruncate(self._handle, 0)
            os.lseek(self._handle, 0, os.SEEK_SET)
            os.write(self._handle, self.holder.to_json().encode("utf-8"))
            os.fsync(self._handle)
        except BaseException:
            self.release()
            raise
        if stale is not None:
            self.notify(f"took over the lock of {self.directory} left by {stale.describe()}, "
                        "which is no longer running (it was killed or crashed)")
        return self.holder

    def _take(self) -> None:
        """``flock`` the file at :attr:`path`, retrying while a releasing holder removes it."""
        assert fcntl is not None
        for _ in range(_ATTEMPTS):
            self._handle = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                recorded = LockHolder.parse(_read(self._handle))
                who = recorded.describe() if recorded else "its holder is still starting"
                raise RunDirectoryBusy(
                    f"{self.directory} is in use by another run ({who}); wait for it to end or "
                    "stop it, or use another run directory") from None
            if _same_file(self._handle, self.path):
                self._owned = True
                return
            handle, self._handle = self._handle, None  # locked a removed file: try again
            os.close(handle)
        raise RunDirectoryBusy(f"{self.path} keeps being replaced while locking it; is another "
                               "program deleting it?")

    def release(self) -> None:
        """Remove the lock file (if this lock owns it) and drop the lock; a no-op when not held."""
        handle, self._handle = self._handle, None
        owned, self._owned = self._owned, False
        if handle is None:
            return
        try:
            if owned:  # only while holding the flock: the file is this run's
                self.path.unlink(missing_ok=True)
        finally:
            os.close(handle)
            self.holder = None
        if self._created_directory:
            with contextlib.suppress(OSError):  # only succeeds when nothing else was written
                self.directory.rmdir()

    @property
    def held(self) -> bool:
        return self._owned

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()
