"""Graceful SIGINT / SIGTERM for training: finish the step, write a checkpoint, then stop.

:class:`StopSignals` installs handlers for SIGINT and SIGTERM (in the main thread only; elsewhere
it does nothing) and restores the previous handlers on exit. Its behaviour:

* Inside :meth:`StopSignals.deferred` (the training loop), the first signal is only recorded in
  :attr:`StopSignals.received` and announced on stderr; the loop finishes its step, writes a
  checkpoint and returns, and the command exits ``128 + signal`` (130 for SIGINT, 143 for
  SIGTERM).
* A second signal, or any signal outside :meth:`~StopSignals.deferred` (setup, which may take
  long), raises :class:`TrainingInterrupted` at once. It is not an ``Exception``, like
  ``KeyboardInterrupt``, so that no ``except Exception`` swallows it; atomic writes in progress
  are abandoned (their previous files stay) and the run directory's lock is released on the way
  out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any

HANDLED = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(BaseException):
    """A signal stopped training at once (the message says what was kept and how to resume).

    Attributes:
        signal: the signal that stopped it.
        second: whether an earlier signal had asked for a graceful stop already.
    """

    def __init__(self, received: signal.Signals, message: str | None = None, *,
                 second: bool = False) -> None:
        super().__init__(message or f"stopped at once by {received.name}")
        self.signal = received
        self.second = second

    @property
    def exit_status(self) -> int:
        """The shell convention for a process ended by ``signal``: ``128 + signal``."""
        return 128 + int(self.signal)


class StopSignals:
    """SIGINT / SIGTERM handling of one training call (see the module docstring).

    Args:
        enabled: install the handlers (False: a context manager that does nothing).
        command: names the program in the stderr notice of a first signal.
    """

    def __init__(self, enabled: bool = True, command: str = "circuits-llm train-head") -> None:
        self.enabled = enabled
        self.command = command
        self.received: signal.Signals | None = None
        self._deferring = False
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        received = signal.Signals(number)
        if self._deferring and self.received is None:
            self.received = received
            notice = (f"\n{self.command}: {received.name} received: finishing this step and "
                      "writing a checkpoint (send it again to stop at once)\n")
            with contextlib.suppress(OSError):  # raw: the step may be inside a stderr write
                os.write(2, notice.encode())
            return
        raise TrainingInterrupted(received, second=self.received is not None)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Within this block a first signal is recorded instead of raised."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def __enter__(self) -> StopSignals:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for number in HANDLED:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()
