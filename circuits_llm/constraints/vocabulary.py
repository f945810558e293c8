"""The bytes each token id of a Hugging Face tokenizer stands for, and ``outlines-core``'s vocabulary.

A constraint is a language of *texts*, while a model emits *token ids*; the automaton needs, for
every id, the exact bytes it appends to the text. Tokenizers spell those bytes in three ways
(:class:`TokenSpelling`):

* byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen): each of the 256 bytes is spelled by one
  printable character (GPT-2's bytes<->unicode table, ``Ġ`` = space), so a token's string maps
  back to bytes character by character;
* SentencePiece (Llama 2, Mistral, Gemma): ``▁`` is a space and, with byte fallback, the tokens
  ``<0x00>`` .. ``<0xFF>`` are single raw bytes;
* plain: the token string is its UTF-8 text.

Tokens added to a tokenizer (``added_tokens_decoder``) are raw text in every spelling. Special
tokens (BOS, EOS, PAD, chat markers...) are never text: :func:`token_bytes` gives None for them
and for ids whose spelling cannot be read; the EOS id is handed to ``outlines-core`` separately
(:func:`build_vocabulary`) and only allowed where the constraint is complete.

``outlines_core.Vocabulary(eos_token_id, {token: [ids]})`` takes keys that are all ``bytes`` or
all ``str`` (a ``str`` key is read as its UTF-8 bytes, *not* decoded from a byte-level
spelling), refuses the EOS id among the values, and lists every id that spells the same bytes.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Any

from circuits_llm.constraints.errors import ConstraintError
from circuits_llm.text.tokens import tokenizer_fingerprint

#: The SentencePiece spelling of a space.
SENTENCEPIECE_SPACE = "\u2581"
#: A SentencePiece byte-fallback token, e.g. ``<0x0A>``.
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
#: How many built vocabularies stay cached (each holds a tokenizer's whole byte table).
VOCABULARY_CACHE_SIZE = 8


class TokenSpelling(Enum):
    """How a tokenizer spells the bytes of its (non-added) tokens."""

    BYTE_LEVEL = "byte_level"
    SENTENCEPIECE = "sentencepiece"
    SENTENCEPIECE_BYTE_FALLBACK = "sentencepiece_byte_fallback"
    PLAIN = "plain"


class _Decoder(Enum):
    """The ``tokenizers`` decoder types that decide the spelling."""

    BYTE_LEVEL = "ByteLevel"
    BYTE_FALLBACK = "ByteFallback"
    METASPACE = "Metaspace"
    REPLACE = "Replace"


def byte_spelling() -> dict[int, str]:
    """GPT-2's table: byte (0..255) -> the printable character that spells it in byte-level BPE.

    Printable Latin-1 bytes spell themselves; the others (controls, space, 0x7F-0xA0, 0xAD) are
    given the characters U+0100 onwards, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_CHARACTER = {character: byte for byte, character in byte_spelling().items()}


def _decoder_types(node: Any) -> list[dict[str, Any]]:
    """Every decoder of a serialised ``tokenizers`` pipeline, flattening ``Sequence`` decoders."""
    if not isinstance(node, dict):
        return []
    found = [node]
    for child in node.get("decoders", None) or []:
        found.extend(_decoder_types(child))
    return found


def detect_spelling(tokenizer: Any) -> TokenSpelling:
    """How ``tokenizer`` spells its tokens' bytes.

    A fast tokenizer is read from its serialised decoder (``ByteLevel`` -> byte level;
    ``Metaspace`` or a ``Replace`` of ``▁`` -> SentencePiece, with ``ByteFallback`` -> byte
    tokens); any other tokenizer from its vocabulary: byte level when every token is spelled with
    GPT-2's table and some start with ``Ġ``, SentencePiece when tokens start with ``▁``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        decoders = _decoder_types(json.loads(backend.to_str()).get("decoder"))
        kinds = {decoder.get("type") for decoder in decoders}
        if _Decoder.BYTE_LEVEL.value in kinds:
            return TokenSpelling.BYTE_LEVEL
        spaced = _Decoder.METASPACE.value in kinds or any(
            decoder.get("type") == _Decoder.REPLACE.value
            and SENTENCEPIECE_SPACE in json.dumps(decoder.get("pattern")) for decoder in decoders)
        if _Decoder.BYTE_FALLBACK.value in kinds:
            return TokenSpelling.SENTENCEPIECE_BYTE_FALLBACK
        if spaced:
            return TokenSpelling.SENTENCEPIECE
        return TokenSpelling.PLAIN
    vocab = _base_vocabulary(tokenizer)
    if any(token.startswith(SENTENCEPIECE_SPACE) for token in vocab):
        if any(_BYTE_TOKEN.fullmatch(token) for token in vocab):
            return TokenSpelling.SENTENCEPIECE_BYTE_FALLBACK
        return TokenSpelling.SENTENCEPIECE
    spelled = all(character in _BYTE_OF_CHARACTER for token in vocab for character in token)
    if spelled and any(token.startswith(byte_spelling()[ord(" ")]) for token in vocab):
        return TokenSpelling.BYTE_LEVEL
    return TokenSpelling.PLAIN


def _added_tokens(tokenizer: Any) -> dict[int, Any]:
    """Id -> ``AddedToken`` (with ``.content`` and ``.special``) of the tokens added to ``tokenizer``."""
    return dict(getattr(tokenizer, "added_tokens_decoder", None) or {})


def _base_vocabulary(tokenizer: Any) -> dict[str, int]:
    """Token string -> id of the tokenizer's model vocabulary (added tokens left out)."""
    added = _added_tokens(tokenizer)
    return {token: index for token, index in tokenizer.get_vocab().items() if index not in added}


def _special_ids(tokenizer: Any) -> set[int]:
    """The ids of every special token: the named ones and added tokens marked special."""
    special = {int(index) for index in getattr(tokenizer, "all_special_ids", None) or []}
    special.update(index for index, token in _added_tokens(tokenizer).items()
                   if getattr(token, "special", False))
    return special


def _spelled_bytes(token: str, spelling: TokenSpelling) -> bytes | None:
    """The bytes a model-vocabulary token stands for (None: its spelling cannot be read)."""
    if spelling is TokenSpelling.BYTE_LEVEL:
        try:
            return bytes(_BYTE_OF_CHARACTER[character] for character in token)
        except KeyError:
            return None
    if spelling is TokenSpelling.SENTENCEPIECE_BYTE_FALLBACK:
        match = _BYTE_TOKEN.fullmatch(token)
        if match is not None:
            return bytes([int(match.group(1), 16)])
    if spelling in (TokenSpelling.SENTENCEPIECE, TokenSpelling.SENTENCEPIECE_BYTE_FALLBACK):
        token = token.replace(SENTENCEPIECE_SPACE, " ")
    return token.encode("utf-8")


def token_bytes(tokenizer: Any, spelling: TokenSpelling | None = None) -> list[bytes | None]:
    """The bytes each token id of ``tokenizer`` appends to the text, by id.

    Args:
        tokenizer: a Hugging Face tokenizer (``PreTrainedTokenizerBase``, fast or slow), or any
            object with ``get_vocab()`` (and optionally ``added_tokens_decoder``,
            ``all_special_ids``).
        spelling: how its tokens are spelled (None: :func:`detect_spelling`).

    Returns:
        A list of length ``max(len(tokenizer), largest id + 1)``: entry ``i`` is the bytes of id
        ``i``, or None for special tokens (EOS included), ids without a token, and tokens that
        spell no bytes or cannot be read. A SentencePiece ``▁Hello`` is `` Hello``: the leading
        space a decoder strips at the start of a text is part of the token's bytes here.
    """
    spelling = detect_spelling(tokenizer) if spelling is None else spelling
    vocab = tokenizer.get_vocab()
    added = _added_tokens(tokenizer)
    size = max([len(tokenizer), *(index + 1 for index in vocab.values())])
    table: list[bytes | None] = [None] * size
    for token, index in vocab.items():
        if index not in added:
            table[index] = _spelled_bytes(token, spelling)
    for index, token in added.items():
        table[index] = str(getattr(token, "content", token)).encode("utf-8")
    for index in _special_ids(tokenizer):
        if 0 <= index < size:
            table[index] = None
    return [value if value else None for value in table]


def resolve_eos(tokenizer: Any, eos_token_id: int | None) -> int:
    """The EOS id to use: ``eos_token_id`` or the tokenizer's own (which must be one int)."""
    eos = getattr(tokenizer, "eos_token_id", None) if eos_token_id is None else eos_token_id
    if isinstance(eos, (list, tuple)) and len(eos) == 1:
        eos = eos[0]
    if isinstance(eos, bool) or not isinstance(eos, int) or eos < 0:
        raise ConstraintError(f"No single EOS token id (got {eos!r}): a constrained generation ends "
                              "with EOS once the constraint is complete; pass eos_token_id=<id>")
    return eos


@dataclass(frozen=True)
class TokenizerVocabulary:
    """A tokenizer's token bytes, the ids the automaton may use and its ``outlines-core`` vocabulary.

    Attributes:
        fingerprint: :func:`circuits_llm.text.tokens.tokenizer_fingerprint` of the tokenizer.
        spelling: how its tokens are spelled.
        token_bytes: by id (length ``len(tokenizer)`` or more), as :func:`token_bytes` gives.
        eos_token_id: the EOS id (never in the ``outlines-core`` token map).
        vocab_size: the model's vocabulary size V; ids ``>= min(V, len(token_bytes))`` are never used.
        outlines: the ``outlines_core.Vocabulary`` of every usable id below V.
    """

    fingerprint: str
    spelling: TokenSpelling
    token_bytes: tuple[bytes | None, ...]
    eos_token_id: int
    vocab_size: int
    outlines: Any

    @property
    def usable_ids(self) -> int:
        """How many ids (EOS excluded) the automaton can emit as text."""
        return sum(value is not None for value in self.token_bytes[: self.vocab_size])


_CACHE: OrderedDict[tuple[str, int, int], TokenizerVocabulary] = OrderedDict()
_LOCK = threading.Lock()


def build_vocabulary(tokenizer: Any, *, eos_token_id: int | None = None, vocab_size: int | None = None,
                     fingerprint: str | None = None) -> TokenizerVocabulary:
    """The :class:`TokenizerVocabulary` of ``tokenizer``, cached per (fingerprint, EOS, V).

    Args:
        tokenizer: a Hugging Face tokenizer.
        eos_token_id: the EOS id (None: the tokenizer's).
        vocab_size: the model's vocabulary size V (None: ``len(tokenizer)``); a model may pad its
            embedding beyond the tokenizer, and those ids are never allowed.
        fingerprint: the tokenizer's fingerprint when the caller has it already.

    Raises:
        ConstraintError: no usable EOS id, or EOS not below V.
    """
    from outlines_core import Vocabulary

    eos = resolve_eos(tokenizer, eos_token_id)
    size = len(tokenizer) if vocab_size is None else vocab_size
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ConstraintError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if eos >= size:
        raise ConstraintError(f"EOS id {eos} is not below the vocabulary size {size}: pass the "
                              "model's vocab_size (its embedding rows) or the right eos_token_id")
    fingerprint = tokenizer_fingerprint(tokenizer) if fingerprint is None else fingerprint
    key = (fingerprint, eos, size)
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    spelling = detect_spelling(tokenizer)
    table = token_bytes(tokenizer, spelling)
    ids_of: dict[bytes, list[int]] = {}
    for index, value in enumerate(table[:size]):
        if value is not None and index != eos:
            ids_of.setdefault(value, []).append(index)
    if not ids_of:
        raise ConstraintError("The tokenizer has no token that spells text below the vocabulary "
                              f"size {size}: a constraint needs a text vocabulary")
    built = TokenizerVocabulary(fingerprint=fingerprint, spelling=spelling, token_bytes=tuple(table),
                                eos_token_id=eos, vocab_size=size, outlines=Vocabulary(eos, ids_of))
    with _LOCK:
        _CACHE[key] = built
        while len(_CACHE) > VOCABULARY_CACHE_SIZE:
            _CACHE.popitem(last=False)
    return built
