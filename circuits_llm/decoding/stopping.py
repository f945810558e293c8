"""When decoding stops: exactly where ``model.generate`` stops.

``model.generate`` checks its stopping criteria after every token and stops at the first token
that meets one: the token is an end-of-sequence id of the model's ``generation_config`` (one id or
several), the sequence has ``max_new_tokens`` new tokens, or the token completes a stop string
(``generate(stop_strings=..., tokenizer=...)``). The stop token is kept.

A speculative decoder emits several tokens per round, so it asks after each round how many of its
output tokens to keep: :meth:`StopCondition.keep_length` (or, incrementally,
:meth:`StopScanner.keep`) returns the smallest ``t`` such that ``generate`` would have stopped after
the ``t``-th new token, or None to go on. Stop strings are matched by transformers' own
:class:`~transformers.generation.stopping_criteria.StopStringCriteria` on the prompt and the output
up to each candidate token (the prompt counts, as in ``generate``: a stop string may start in the
prompt), so the cut is the one ``generate`` makes, overhangs and special-token spellings included.
Several candidate positions are checked in one batched call of that criterion.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from circuits_llm.decoding.warping import DecoderError
from circuits_llm.text.tokens import TextTokenizer


class StopConditionError(DecoderError):
    """A stop condition cannot be built from what was given (the message says why)."""


def unescape_stop(text: str) -> str:
    r"""A ``--stop`` value with backslash escapes (``\n``, ``\t``, ``\\``, ``\u00e9``) decoded, so
    a newline can be given on a command line; other characters are kept as they are."""
    try:
        return codecs.decode(text.encode("latin-1", "backslashreplace"), "unicode_escape")
    except UnicodeDecodeError as error:
        raise StopConditionError(f"--stop {text!r}: a bad backslash escape ({error.reason})") from None


def eos_ids(model: Any) -> tuple[int, ...]:
    """The end-of-sequence ids ``model.generate`` stops at: ``generation_config.eos_token_id``
    (an int or a list), else ``config.eos_token_id``; () when the model has none."""
    generation = getattr(model, "generation_config", None)
    value = getattr(generation, "eos_token_id", None)
    if value is None:
        value = getattr(getattr(model, "config", None), "eos_token_id", None)
    return _id_tuple(value, "eos_token_id")


def _id_tuple(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    values = [value] if isinstance(value, int) else list(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise StopConditionError(f"{name} must be token ids (ints >= 0), got {value!r}")
    return tuple(dict.fromkeys(values))


def _hf_tokenizer(tokenizer: Any) -> Any:
    """A Hugging Face tokenizer from itself or from a :class:`~circuits_llm.text.tokens.TextTokenizer`."""
    return tokenizer.tokenizer if isinstance(tokenizer, TextTokenizer) else tokenizer


@dataclass(frozen=True)
class StopCondition:
    """Where decoding stops, as ``model.generate`` decides it (see the module docstring).

    Attributes:
        max_new_tokens: the most new tokens (>= 0).
        eos_token_ids: stop after any of these ids (kept in the output).
        stop_strings: stop after the token that completes any of these strings (kept).
        tokenizer: the model's tokenizer (a Hugging Face one or a
            :class:`~circuits_llm.text.tokens.TextTokenizer`); needed only with ``stop_strings``.
        criteria: the transformers ``StopStringCriteria`` that match ``stop_strings``: built from
            ``tokenizer`` when not given (:meth:`from_criteria` passes the ones ``generate``
            prepared).
    """

    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    tokenizer: Any = field(default=None, compare=False, repr=False)
    criteria: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise StopConditionError(f"max_new_tokens must be an int >= 0, got {n!r}")
        object.__setattr__(self, "eos_token_ids", _id_tuple(self.eos_token_ids, "eos_token_ids"))
        strings = (self.stop_strings,) if isinstance(self.stop_strings, str) else \
            tuple(self.stop_strings)
        if not all(isinstance(s, str) and s for s in strings):
            raise StopConditionError(f"stop strings must be non-empty strings, got {strings!r}")
        object.__setattr__(self, "stop_strings", tuple(dict.fromkeys(strings)))
        object.__setattr__(self, "criteria", tuple(self.criteria))
        if self.stop_strings and not self.criteria:
            if self.tokenizer is None:
                raise StopConditionError("stop strings need the model's tokenizer (tokenizer=...)")
            from transformers.generation.stopping_criteria import StopStringCriteria
            try:
                criteria = StopStringCriteria(_hf_tokenizer(self.tokenizer), list(self.stop_strings))
            except ValueError as error:
                raise StopConditionError(f"stop strings {list(self.stop_strings)}: {error}") from None
            object.__setattr__(self, "criteria", (criteria,))

    @classmethod
    def from_criteria(cls, max_new_tokens: int, eos_token_ids: Sequence[int],
                      criteria: Sequence[Any]) -> StopCondition:
        """A condition over transformers ``StopStringCriteria`` objects already built (the ones
        ``generate`` prepared), instead of building them from a tokenizer."""
        strings = tuple(s for c in criteria for s in c.stop_strings)
        return cls(max_new_tokens, tuple(eos_token_ids), strings, None, tuple(criteria))

    @classmethod
    def for_model(cls, model: Any, max_new_tokens: int, stop_strings: Sequence[str] = (),
                  tokenizer: Any = None, eos_token_ids: int | Sequence[int] | None = None
                  ) -> StopCondition:
        """The condition ``model.generate(max_new_tokens=.., stop_strings=.., tokenizer=..)`` uses:
        EOS from the model's ``generation_config`` unless ``eos_token_ids`` is given (``()``:
        no EOS stop)."""
        eos = eos_ids(model) if eos_token_ids is None else _id_tuple(eos_token_ids, "eos_token_ids")
        return cls(max_new_tokens, eos, tuple(stop_strings), tokenizer)

    # ------------------------------------------------------------------ checks
    def keep_length(self, output: Sequence[int], prompt: Sequence[int] = (), start: int = 0
                    ) -> int | None:
        """How many tokens of ``output`` to keep, or None to go on decoding.

        Args:
            output: the new tokens so far (a list of ints or a 1-D tensor).
            prompt: the prompt ids (stop strings may begin in it).
            start: the first ``start`` tokens are known not to stop (checked before).

        Returns:
            The smallest ``t`` in ``start+1 .. len(output)`` after which ``generate`` stops (the
            ``t``-th token is EOS, completes a stop string, or ``t == max_new_tokens``); None when
            there is none and fewer than ``max_new_tokens`` tokens were generated.
        """
        tokens = output.tolist() if isinstance(output, torch.Tensor) else list(output)
        end = min(len(tokens), self.max_new_tokens)
        if self.max_new_tokens == 0:
            return 0
        if start >= end:
            return None if len(tokens) < self.max_new_tokens else self.max_new_tokens
        eos = set(self.eos_token_ids)
        first = next((t for t in range(start + 1, end + 1) if tokens[t - 1] in eos), None)
        limit = first if first is not None else end
        if self.criteria:
            hit = self._first_stop_string(list(prompt), tokens, start, limit)
            if hit is not None:
                return hit
        if first is not None:
            return first
        return end if end == self.max_new_tokens else None

    def _first_stop_string(self, prompt: list[int], tokens: list[int], start: int,
                           limit: int) -> int | None:
        """The first ``t`` in ``start+1 .. limit`` whose sequence ends a stop string: each criterion
        is called once on the ``limit - start`` candidate sequences, each cut to the tokens it
        reads and left-padded with an id whose row matches nothing (what it does with ids past
        its table)."""
        if limit <= start:
            return None
        full = prompt + tokens
        hits = torch.zeros(limit - start, dtype=torch.bool)
        for criteria in self.criteria:
            width = int(criteria.maximum_token_len)
            never = int(criteria.embedding_vec.shape[0]) - 1
            rows = []
            for t in range(start + 1, limit + 1):
                stop = len(prompt) + t
                tail = full[max(0, stop - width):stop]
                rows.append([never] * (width - len(tail)) + tail)
            hits |= criteria(torch.tensor(rows, dtype=torch.long), None).cpu()
        found = hits.nonzero()
        return start + 1 + int(found[0, 0]) if found.numel() else None

    def scanner(self, prompt: Sequence[int] | torch.Tensor = ()) -> StopScanner:
        """A :class:`StopScanner` for one generation from ``prompt``."""
        ids = prompt.reshape(-1).tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        return StopScanner(self, ids)


class StopScanner:
    """:meth:`StopCondition.keep_length` for one generation, checking each token once.

    Call :meth:`keep` after every round with the whole output so far (it only grows); the
    tokens checked in earlier calls are not checked again.
    """

    def __init__(self, condition: StopCondition, prompt: list[int]) -> None:
        self.condition = condition
        self.prompt = prompt
        self.checked = 0

    def keep(self, output: Sequence[int] | torch.Tensor) -> int | None:
        """How many tokens of ``output`` to keep (the decoding ends), or None to go on."""
        tokens = output.tolist() if isinstance(output, torch.Tensor) else list(output)
        if len(tokens) < self.checked:
            raise StopConditionError(f"the output shrank from {self.checked} to {len(tokens)} "
                                     "tokens: a scanner follows one growing output")
        result = self.condition.keep_length(tokens, self.prompt, self.checked)
        self.checked = len(tokens)
        return result
