"""One ``generate`` call at a time per decoder and per backbone: a clear error instead of a race.

A decoder's state (its backbone's KV cache, the position of the current round) belongs to one
call. Two threads decoding with one decoder, or two decoders sharing one backbone, would
interleave cache updates and fail later with misleading shape errors, or decode garbage. Making
them wait would hide the mistake and serialise the threads, so :func:`exclusive` detects the
overlap (or a re-entrant call from the same thread) and raises at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from circuits_llm.decoding.warping import DecoderError

_LOCK = threading.Lock()
#: ``id`` of every object held by a running call -> the name of the thread running it
_HELD: dict[int, str] = {}


@contextmanager
def exclusive(**objects: object) -> Iterator[None]:
    """Hold every object of ``objects`` (named by its keyword, e.g. ``decoder=..``) for the block.

    Raises:
        DecoderError: one of them is already held (by another thread, or re-entrantly by this
            one); nothing is held by this call then.
    """
    keys = {id(value): name for name, value in objects.items()}
    here = threading.current_thread().name
    with _LOCK:
        busy = [(name, _HELD[key]) for key, name in keys.items() if key in _HELD]
        if not busy:
            _HELD.update(dict.fromkeys(keys, here))
    if busy:
        name, thread = busy[0]
        raise DecoderError(
            f"this {name} is already generating (in thread {thread!r}; this call is in {here!r}): "
            "a decoder and its backbone hold one KV cache and are not thread-safe; use one decoder "
            "(with its own backbone) per thread")
    try:
        yield
    finally:
        with _LOCK:
            for key in keys:
                _HELD.pop(key, None)


__all__ = ["exclusive"]
