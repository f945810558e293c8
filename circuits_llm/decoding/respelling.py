"""Greedy drafts respelled the way the tokenizer spells their text.

A token automaton (:class:`~circuits_llm.constraints.TokenAutomaton`) allows *every* tokenization
of an allowed text: after ``{"role`` both ``":`` and ``"`` then ``:`` are allowed, and so are
``city`` and ``c`` then ``ity``. The model itself almost always writes its tokenizer's own
spelling (``":``, ``city``). The head x constraint product
(:class:`~circuits_llm.decoding.constrained.ProductDrafter`) renormalises the head over the
allowed windows, and a split spelling often keeps more of the head's mass than the merged one
(more allowed continuations follow a short token), so its argmax drafts ``"``, ``:`` where the
model writes ``":``: the right text, rejected at its first token (``docs/journal.md`` section 9
counts how often).

A greedy round may verify any drafts: its output is the chain of the masked target's argmax
whatever is drafted (docs/decoder-exactness.md section 3). So under a constraint a greedy round
re-encodes its drafts' text with the tokenizer before the verify (:class:`DraftRespeller`); the
verify block then holds the model's own spelling of the same text. Sampling rounds keep the
product's drafts: their acceptance test needs the drafts' law, and the law of a respelled draft
is a sum over every spelling of its text, which the product does not give.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from circuits_llm.constraints import ConstraintError, TokenAutomaton
from circuits_llm.constraints.vocabulary import token_bytes
from circuits_llm.decoding.round_data import DraftResult

__all__ = ["DraftRespeller"]


class DraftRespeller:
    """Re-encode a draft's text with the tokenizer (module docstring).

    Args:
        tokenizer: the Hugging Face tokenizer the constraint's automaton was built over (its
            ``encode`` gives the model's own spelling; its vocabulary, each id's bytes). One
            without ``encode`` and ``get_vocab`` (a duck-typed vocabulary) respells nothing.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        #: whether the tokenizer can encode text and list its vocabulary
        self.usable = callable(getattr(tokenizer, "encode", None)) \
            and callable(getattr(tokenizer, "get_vocab", None))
        #: model id -> the bytes it appends to the text (None: a special token, or no bytes)
        self.spellings: list[bytes | None] = token_bytes(tokenizer) if self.usable else []

    def _bytes_of(self, ids: list[int]) -> list[bytes | None]:
        """Each id's bytes (None: a special token, an id without bytes or outside the vocabulary)."""
        return [self.spellings[token] if 0 <= token < len(self.spellings) else None
                for token in ids]

    def respell(self, drafts: list[int], automaton: TokenAutomaton, state: int,
                limit: int) -> list[int] | None:
        """The tokenizer's spelling of the text of ``drafts`` (model ids), at most ``limit``
        tokens, or None when there is none to use instead.

        None when: the tokenizer cannot encode; the drafts hold a special token or an id
        without bytes; their bytes are not whole UTF-8 text (a character split across the
        window's end); the tokenizer spells the text with the same ids, or with ids whose bytes
        differ from the drafts' (a normaliser, a prefix space); or the automaton, from ``state``
        (after the verified token ``c``), does not allow the respelled ids (never expected: it
        allows every spelling of an allowed text, but a draft must be allowed for the verify
        rows' masks).
        """
        if not drafts or not self.usable:
            return None
        parts = self._bytes_of(drafts)
        if any(part is None for part in parts):
            return None
        spelled = b"".join(parts)  # type: ignore[arg-type]
        try:
            text = spelled.decode("utf-8")
        except UnicodeDecodeError:
            return None
        ids = [int(token) for token in self.tokenizer.encode(text, add_special_tokens=False)]
        if ids == drafts or not ids:
            return None
        respelled = self._bytes_of(ids)
        if any(part is None for part in respelled) \
                or b"".join(respelled) != spelled:  # type: ignore[arg-type]
            return None
        ids = ids[:limit]
        try:
            for token in ids:
                state = automaton.advance(state, token)
        except ConstraintError:
            return None
        return ids

    def respell_draft(self, draft: DraftResult, length: int, automaton: TokenAutomaton,
                      state: int) -> tuple[DraftResult, int]:
        """A greedy round's drafts ``d_1..d_L`` (``L = length``) replaced by the tokenizer's
        spelling of their text from the automaton's ``state`` (:meth:`respell`), with the new
        ``L``; the draft and ``length`` as they were when there is none."""
        drafts = draft.block.shape[1] - 1
        ids = self.respell(draft.block[0, 1:length + 1].tolist(), automaton, state, drafts)
        if ids is None:
            return draft, length
        block = draft.block.clone()
        block[0, 1:] = 0
        block[0, 1:len(ids) + 1] = torch.tensor(ids, dtype=block.dtype)
        return replace(draft, tokens=block[0, 1:], block=block,
                       length=torch.tensor(len(ids), device=block.device)), len(ids)
