"""The text side of a model: its tokenizer, loaded from the same reference as the model.

Every command and training run turns text into token ids and back through one
:class:`TextTokenizer`, whatever the model:

* a subword model (an HF directory, a GGUF file, a hub id in the local cache) uses its own
  tokenizer (``AutoTokenizer``; ``gguf_file=`` for a GGUF, ``local_files_only`` always);
* a byte model (the embedded one, or a directory whose config follows this project's byte
  convention: vocabulary 260, BOS 256, EOS 257, and no tokenizer files) uses
  :func:`byte_tokenizer`, a real Hugging Face fast tokenizer whose ids are the UTF-8 bytes
  ``0..255`` plus ``<bos>`` 256, ``<eos>`` 257, ``<pad>`` 258
  (:class:`circuits_llm.text.byte_level.SpecialToken`).
  Encoding a prompt adds BOS, as the byte corpus does, so prompts look like training records;
  everything else (decoding, stop strings, chat errors) is the same code as for a subword model.

Mismatches are one :class:`TokenizerError` each, saying what to do: no tokenizer next to a
subword model (:class:`MissingTokenizerError`), a tokenizer with ids the model does not have
(:class:`VocabularyMismatchError`, :func:`check_vocabulary`), ``--chat`` with a tokenizer that has
no chat template (:class:`ChatTemplateError`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import weakref
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from circuits_llm.text.byte_level import VOCAB_SIZE, SpecialToken
from circuits_llm.text.references import (
    ModelReference,
    ModelSource,
    model_reference,
    parse_model_reference,
    resolve_reference,
)

#: Files whose presence in a model directory means it ships a Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

#: The byte tokenizer's special tokens, with the ids of :class:`circuits_llm.text.byte_level.SpecialToken`.
BYTE_SPECIALS = {"<bos>": int(SpecialToken.BOS), "<eos>": int(SpecialToken.EOS),
                 "<pad>": int(SpecialToken.PAD)}

#: Bumped when the way a document becomes ids changes (it is part of every corpus cache key).
DOCUMENT_FORMAT = 1


class TokenizerError(ValueError):
    """A tokenizer is missing, does not fit its model, or cannot do what was asked (the message
    says what was wrong and what to do)."""


class MissingTokenizerError(TokenizerError):
    """A subword model has no tokenizer next to it."""


class VocabularyMismatchError(TokenizerError):
    """The tokenizer can produce ids the model does not have (it belongs to another model)."""


class ChatTemplateError(TokenizerError):
    """``--chat`` was asked of a tokenizer without a chat template."""


class TokenizerKind(Enum):
    """``BYTES``: :func:`byte_tokenizer` (byte models); ``SUBWORD``: the model's own tokenizer."""

    BYTES = "bytes"
    SUBWORD = "subword"


def byte_tokenizer() -> Any:
    """The byte-level ``PreTrainedTokenizerFast`` of this project's byte models.

    Ids ``0..255`` are the UTF-8 bytes of the text (a byte-level BPE without merges: every byte
    is one token), 256/257/258 are ``<bos>``/``<eos>``/``<pad>``; encoding with special tokens
    prepends BOS; decoding turns invalid UTF-8 into U+FFFD, like :func:`circuits_llm.text.byte_level.decode`.
    Text is never parsed into special tokens (``split_special_tokens``): the text ``"<eos>"`` is
    five bytes, as in the byte corpus.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    vocab = {spelling[byte]: byte for byte in range(256)}
    vocab.update(BYTE_SPECIALS)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False)
                                for name in BYTE_SPECIALS])
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BYTE_SPECIALS["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", split_special_tokens=True)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 (hex) of everything that decides how a tokenizer maps text to ids.

    A fast tokenizer is identified by its whole serialised pipeline (normaliser, pre-tokeniser,
    model, added tokens, post-processor), a slow one by its class, vocabulary and special tokens.
    """
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = {name: getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id",
                                                                   "pad_token_id", "unk_token_id")}
    digest.update(json.dumps(specials, sort_keys=True).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class TextTokenizer:
    """A model's tokenizer, with what kind it is, where it came from and its fingerprint.

    Attributes:
        tokenizer: the Hugging Face tokenizer (``PreTrainedTokenizerBase``).
        kind: :class:`TokenizerKind`.
        source: where it was loaded from (a directory, a GGUF file, a hub id, ``bytes``).
        fingerprint: :func:`tokenizer_fingerprint` (what corpus caches are keyed by).
    """

    tokenizer: Any
    kind: TokenizerKind
    source: str
    fingerprint: str

    @classmethod
    def wrap(cls, tokenizer: Any, source: str, kind: TokenizerKind = TokenizerKind.SUBWORD
             ) -> TextTokenizer:
        """A :class:`TextTokenizer` around a Hugging Face tokenizer built elsewhere."""
        return cls(tokenizer, kind, source, tokenizer_fingerprint(tokenizer))

    @classmethod
    def byte_level(cls) -> TextTokenizer:
        """The byte tokenizer (:func:`byte_tokenizer`), built once per process."""
        return _byte_level()

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (``len(tokenizer)``, added tokens included)."""
        return len(self.tokenizer)

    @property
    def max_token_id(self) -> int:
        """The largest id of the vocabulary, added tokens included."""
        return max(self.tokenizer.get_vocab().values())

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """``text`` -> ids; ``special_tokens`` adds what the tokenizer adds to a sequence (BOS for
        the byte tokenizer and for Llama-style tokenizers, nothing for GPT-2-style ones)."""
        return list(self.tokenizer(text, add_special_tokens=special_tokens)["input_ids"])

    def encode_prompt(self, text: str, *, chat: bool = False, system: str | None = None
                      ) -> list[int]:
        """The prompt ids of ``text``: plain (:meth:`encode`), or with ``chat`` the model's chat
        template applied to one user message (after an optional system message), ending with the
        assistant's turn opened (``add_generation_prompt``).

        Raises:
            ChatTemplateError: ``chat`` with a tokenizer that has no chat template.
        """
        if not chat:
            if system is not None:
                raise ChatTemplateError("a system message needs --chat (the chat template places it)")
            return self.encode(text)
        if not self.has_chat_template:
            what = "the byte tokenizer" if self.kind is TokenizerKind.BYTES else \
                f"the tokenizer of {self.source}"
            raise ChatTemplateError(f"--chat needs a chat template, and {what} has none (a base or "
                                    "byte-level model); drop --chat to continue the prompt as text")
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": text}]
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)
        return list(encoded["input_ids"])

    def decode(self, ids: Any, *, skip_special_tokens: bool = True) -> str:
        """ids (a list or a 1-D tensor) -> text; special tokens are dropped unless asked."""
        values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.tokenizer.decode(values, skip_special_tokens=skip_special_tokens)

    def documents(self, contents: list[bytes]) -> list[np.ndarray]:
        """Corpus records, one int64 id array per file: ``[specials] text [EOS]``.

        The text is tokenised as text (never parsed into special tokens), after the special
        tokens the tokenizer adds to a sequence (BOS where it has that convention), and the
        record ends with EOS when the tokenizer has one. The byte tokenizer's records are the
        file's raw bytes (``BOS bytes EOS``, exactly :func:`circuits_llm.text.byte_level.pack`'s), read
        directly; other tokenizers read the files as UTF-8 (invalid bytes become U+FFFD).
        """
        if self.kind is TokenizerKind.BYTES:
            bos, eos = np.array([SpecialToken.BOS]), np.array([SpecialToken.EOS])
            return [np.concatenate([bos, np.frombuffer(data, dtype=np.uint8), eos]).astype(np.int64)
                    for data in contents]
        texts = [data.decode("utf-8", errors="replace") for data in contents]
        encoded = self.tokenizer(texts, add_special_tokens=True, split_special_tokens=True)
        tail = [] if self.eos_token_id is None else [int(self.eos_token_id)]
        return [np.asarray(list(ids) + tail, dtype=np.int64) for ids in encoded["input_ids"]]


@functools.lru_cache(maxsize=1)
def _byte_level() -> TextTokenizer:
    return TextTokenizer.wrap(byte_tokenizer(), "bytes", TokenizerKind.BYTES)


# ---------------------------------------------------------------------------- loading
def is_byte_model_config(config: Any) -> bool:
    """Whether a model config follows this project's byte convention (vocabulary 260, BOS 256,
    EOS 257): such a model needs no tokenizer files."""
    return (getattr(config, "vocab_size", None) == VOCAB_SIZE
            and getattr(config, "bos_token_id", None) == int(SpecialToken.BOS)
            and getattr(config, "eos_token_id", None) == int(SpecialToken.EOS))


def _has_tokenizer_files(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def _hf_tokenizer(location: str, source: str, advice: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(location, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as error:
        raise MissingTokenizerError(f"cannot load the tokenizer of {source} ({error}); "
                                    f"{advice}") from None


#: GGUF metadata keys of the special tokens, and the tokenizer attribute each one sets.
_GGUF_SPECIALS = {"tokenizer.ggml.eos_token_id": "eos_token", "tokenizer.ggml.bos_token_id": "bos_token"}


def _specials_from_gguf(tokenizer: Any, path: Path) -> None:
    """Set the special tokens the GGUF file itself records, where the loaded tokenizer differs.

    The file's metadata is the source of truth; transformers up to 5.17 built SmolLM2's GGUF
    tokenizer with EOS 1 (``<|im_start|>``) where the file says 2 (``<|im_end|>``), so decoding
    would stop at the wrong token. Later releases read it right, and nothing changes there.
    """
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    for key, attribute in _GGUF_SPECIALS.items():
        field = fields.get(key)
        if field is None:
            continue
        token_id = int(field.parts[field.data[0]][0])
        if getattr(tokenizer, f"{attribute}_id", None) != token_id:
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(token_id))


_FILES_ADVICE = "put the model's tokenizer files (tokenizer.json, tokenizer_config.json) next to it"


def load_tokenizer(reference: ModelReference | str, model_config: Any = None) -> TextTokenizer:
    """The tokenizer of the model ``reference`` names (see the module docstring).

    Args:
        reference: a :class:`~circuits_llm.text.references.ModelReference` or a ``--model`` string.
        model_config: the loaded model's config, if at hand: a directory without tokenizer files
            holds a byte model only if this config says so (read from ``config.json`` otherwise).

    Raises:
        MissingTokenizerError: a subword model without a loadable tokenizer.
        circuits_llm.text.references.ModelLoadError: ``reference`` names nothing loadable.
    """
    ref = parse_model_reference(reference) if isinstance(reference, str) else reference
    if ref.source is ModelSource.EMBEDDED:
        return TextTokenizer.byte_level()
    if ref.source is ModelSource.GGUF:
        path = Path(ref.location)
        tokenizer = _hf_tokenizer(str(path.parent), f"the GGUF file {path}",
                                  "use a GGUF file that embeds its tokenizer (llama.cpp's "
                                  "converters write one), or the model's Hugging Face directory",
                                  gguf_file=path.name)
        _specials_from_gguf(tokenizer, path)
        return TextTokenizer.wrap(tokenizer, str(path))
    if ref.source is ModelSource.HUB:
        local = load_tokenizer(resolve_reference(ref), model_config)
        return dataclasses.replace(local, source=ref.location)
    directory = Path(ref.location)
    if _has_tokenizer_files(directory):
        tokenizer = _hf_tokenizer(str(directory), f"the model directory {directory}", _FILES_ADVICE)
        return TextTokenizer.wrap(tokenizer, str(directory))
    if model_config is None:
        from transformers import AutoConfig
        try:
            model_config = AutoConfig.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as error:
            raise MissingTokenizerError(f"the model directory {directory} has no tokenizer and no "
                                        f"readable config.json ({error})") from None
    if is_byte_model_config(model_config):
        return TextTokenizer.byte_level()
    raise MissingTokenizerError(
        f"the model directory {directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}) "
        f"and is not a byte model (vocabulary {getattr(model_config, 'vocab_size', '?')}); copy "
        "the model's tokenizer files into it")


#: Tokenizers already loaded for a model (:func:`attach_tokenizer`; weak: no leak).
_ATTACHED: weakref.WeakKeyDictionary[Any, TextTokenizer] = weakref.WeakKeyDictionary()


def attach_tokenizer(model: Any, tokenizer: TextTokenizer) -> None:
    """Remember ``tokenizer`` as ``model``'s, so :func:`tokenizer_for` does not load it again."""
    _ATTACHED[model] = tokenizer


def tokenizer_for(model: Any) -> TextTokenizer:
    """The tokenizer of a loaded model: the one attached to it (:func:`attach_tokenizer`, done by
    :func:`circuits_llm.text.models.load_model`), else loaded from the reference
    :func:`circuits_llm.text.models.load_causal_lm` recorded, the byte tokenizer for a byte model built
    in code, else an error.

    Raises:
        MissingTokenizerError: a subword model built in code (nothing says where its tokenizer is).
    """
    attached = _ATTACHED.get(model)
    if attached is not None:
        return attached
    reference = model_reference(model)
    if reference is not None:
        return load_tokenizer(reference, model.config)
    if is_byte_model_config(model.config):
        return TextTokenizer.byte_level()
    raise MissingTokenizerError(
        f"the model (vocabulary {getattr(model.config, 'vocab_size', '?')}) is not byte-level and "
        "was not loaded with circuits_llm.text.models.load_causal_lm, so its tokenizer is unknown: pass "
        "tokenizer=load_tokenizer(<its directory, GGUF file or hub id>)")


def model_vocab_size(model: Any) -> int:
    """Rows of the model's output embedding (its vocabulary), or ``config.vocab_size``."""
    embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if weight is not None and weight.dim() == 2:
        return int(weight.shape[0])
    return int(model.config.vocab_size)


def check_vocabulary(tokenizer: TextTokenizer, model: Any) -> None:
    """Raise :class:`VocabularyMismatchError` unless ``tokenizer`` fits ``model``.

    It fits when every id it can produce is one of the model's (``max id < V``; a model's
    vocabulary is often padded past its tokenizer's, e.g. to a multiple of 64) and, for the byte
    tokenizer, when the model is a byte model (a subword model would read bytes as word ids).
    """
    vocab = model_vocab_size(model)
    if tokenizer.kind is TokenizerKind.BYTES and not is_byte_model_config(model.config):
        raise VocabularyMismatchError(
            f"the byte tokenizer (ids 0..{VOCAB_SIZE - 1}) is for byte models, but the model has a "
            f"vocabulary of {vocab} and is not one; use the model's own tokenizer")
    largest = tokenizer.max_token_id
    if largest >= vocab:
        raise VocabularyMismatchError(
            f"tokenizer vocabulary vs model vocabulary: the tokenizer of {tokenizer.source} has "
            f"{tokenizer.vocab_size} tokens (ids up to {largest}) but the model has only {vocab}; "
            "it belongs to another model: use the tokenizer shipped with this model")
