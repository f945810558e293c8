"""The one error type of the constraint room, kept apart so every module of the room can raise it."""

from __future__ import annotations


class ConstraintError(ValueError):
    """A constraint that is malformed, cannot be completed with a tokenizer, or a token it forbids.

    The message says what was wrong and what to do about it.
    """
