"""Corpora tokenised with a model's own tokenizer, streamed to disk once and memory-mapped.

A split of a corpus directory (the ``*.py`` files of :func:`circuits_llm.text.byte_level.corpus_files`; by
default the CPython standard library of this interpreter) becomes one token file: every file is a
record ``[specials] text [EOS]`` (:meth:`~circuits_llm.text.tokens.TextTokenizer.documents`; for the
byte tokenizer exactly :func:`circuits_llm.text.byte_level.pack`'s ``BOS bytes EOS``), the records one after
the other. Files are tokenised a batch at a time and appended to the file, so no whole-corpus
tensor is ever built; readers get a read-only memory map (:class:`TokenStream`), whose windows are
copied out only when a batch needs them.

The cache entry is keyed by the tokenizer's fingerprint, the record format and the SHA-256 of
every file with its path: a resumed run, a second head or another command on the same corpus and
tokenizer tokenises nothing, while any change to a file or to the tokenizer makes a new entry. An
entry is two files in the cache directory (:func:`corpus_cache_dir`): ``<key>.tokens`` (raw
little-endian ids, ``uint16`` when the vocabulary fits, else ``int32``), written whole or not at
all (:func:`circuits.files.atomic_write`), then ``<key>.json`` (what it holds, with the token
file's SHA-256), the marker of a complete entry, written last. An entry whose token file does not
match its marker (damaged outside this program) is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from circuits.files import atomic_write, atomic_write_json, sha256_file
from circuits_llm.text.byte_level import Split, corpus_files, stdlib_root
from circuits_llm.text.tokens import DOCUMENT_FORMAT, TextTokenizer

#: Bumped when the layout of a cache entry changes.
CACHE_FORMAT = 1
CACHE_KIND = "circuits_llm.tokenized_corpus"
#: Environment variable overriding :func:`corpus_cache_dir`.
CACHE_ENV = "CIRCUITS_LLM_CORPUS_CACHE"
#: Files tokenised per batch (and text bytes, whichever comes first).
_BATCH_FILES, _BATCH_BYTES = 64, 4 << 20


class CorpusError(ValueError):
    """A corpus cannot be used (missing, empty, too short); the message says what to change."""


def corpus_cache_dir() -> Path:
    """``$CIRCUITS_LLM_CORPUS_CACHE``, else ``$XDG_CACHE_HOME/circuits_llm/corpus`` (``~/.cache``)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "circuits_llm" / "corpus"


@dataclass(frozen=True)
class TokenStream:
    """The token ids of one corpus split, in record order.

    Attributes:
        ids: (N,) ``uint16`` or ``int32`` ids, a read-only memory map of the cache file (or a
            slice of one); read windows with :meth:`window` / :meth:`windows`.
        documents: number of records (files) in the whole split.
        path: the token file.
    """

    ids: np.ndarray
    documents: int
    path: Path

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def head(self, count: int | None) -> TokenStream:
        """The first ``count`` tokens (all for None): a view, nothing is read."""
        return self if count is None else TokenStream(self.ids[:count], self.documents, self.path)

    def windows(self, starts: Tensor | np.ndarray | list[int], length: int) -> Tensor:
        """(b, length) int64 ids of the windows starting at ``starts`` (b,) (copied out)."""
        begin = np.asarray(starts.tolist() if isinstance(starts, Tensor) else starts, dtype=np.int64)
        if begin.size and (begin.min() < 0 or begin.max() + length > len(self)):
            raise IndexError(f"windows of {length} tokens at {begin.min()}..{begin.max()} leave the "
                             f"stream of {len(self)} tokens")
        rows = self.ids[begin[:, None] + np.arange(length)[None, :]]
        return torch.from_numpy(rows.astype(np.int64))

    def window(self, start: int, length: int) -> Tensor:
        """(length,) int64 ids from ``start``."""
        return self.windows([start], length)[0]


# ---------------------------------------------------------------------------- cache key
def _files_digest(files: list[Path], root: Path) -> str:
    """SHA-256 over each file's path relative to ``root`` and its content digest, in order."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(bytes.fromhex(sha256_file(path)))
    return digest.hexdigest()


def cache_key(tokenizer: TextTokenizer, split: Split, files: list[Path], root: Path) -> str:
    """The cache key of ``files`` (one split of ``root``) tokenised by ``tokenizer`` (hex)."""
    record = {"format": CACHE_FORMAT, "documents": DOCUMENT_FORMAT, "split": split.value,
              "tokenizer": tokenizer.fingerprint, "files": _files_digest(files, root)}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _dtype(tokenizer: TextTokenizer) -> np.dtype[Any]:
    return np.dtype("<u2") if tokenizer.max_token_id < 1 << 16 else np.dtype("<i4")


# ---------------------------------------------------------------------------- building
def _batches(files: list[Path]) -> Iterator[list[Path]]:
    batch: list[Path] = []
    size = 0
    for path in files:
        batch.append(path)
        size += path.stat().st_size
        if len(batch) >= _BATCH_FILES or size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write_tokens(target: Path, tokenizer: TextTokenizer, files: list[Path], dtype: np.dtype[Any],
                  progress: bool, label: str) -> tuple[int, str]:
    """Tokenise ``files`` batch by batch into ``target``; ``(tokens, sha256 of the file)``."""
    from tqdm import tqdm
    digest = hashlib.sha256()
    count = 0
    bar = tqdm(total=len(files), desc=f"tokenise {label}", unit="file", disable=not progress,
               dynamic_ncols=True)
    with target.open("wb") as stream, bar:
        for batch in _batches(files):
            for record in tokenizer.documents([path.read_bytes() for path in batch]):
                block = record.astype(dtype).tobytes()
                stream.write(block)
                digest.update(block)
                count += int(record.shape[0])
            bar.update(len(batch))
    return count, digest.hexdigest()


def _read_entry(marker: Path, tokens: Path, key: str) -> TokenStream | None:
    """The entry if its marker and token file agree with ``key`` (None: build it again)."""
    try:
        meta = json.loads(marker.read_text())
        dtype = np.dtype(meta["dtype"])
        ok = (meta.get("kind") == CACHE_KIND and meta.get("key") == key and tokens.is_file()
              and tokens.stat().st_size == int(meta["tokens"]) * dtype.itemsize
              and sha256_file(tokens) == meta["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not ok:
        return None
    ids = np.memmap(tokens, dtype=dtype, mode="r") if int(meta["tokens"]) else np.zeros(0, dtype)
    return TokenStream(ids, int(meta["documents"]), tokens)


def tokenized_split(tokenizer: TextTokenizer, split: Split, root: Path | None = None,
                    cache_dir: Path | None = None, progress: bool = False) -> TokenStream:
    """The token stream of ``split`` of the corpus at ``root``, from the cache or built into it.

    Args:
        tokenizer: the model's tokenizer.
        split: which split (:class:`~circuits_llm.text.byte_level.Split`).
        root: the corpus directory (default: this interpreter's standard library).
        cache_dir: where entries live (default: :func:`corpus_cache_dir`).
        progress: a progress bar while tokenising (nothing is shown for a cached entry).

    Raises:
        CorpusError: the directory does not exist, or the split has no files.
        OSError: the cache directory cannot be written (nothing half-written is left).
    """
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise CorpusError(f"the corpus directory {root} does not exist; give --corpus-root a "
                          "directory of .py files")
    files = corpus_files(split, root)
    if not files:
        share = {Split.TRAIN: "about 90%", Split.VALIDATION: "about 5%", Split.TEST: "about 5%"}[split]
        name = {Split.TRAIN: "training", Split.VALIDATION: "validation", Split.TEST: "test"}[split]
        raise CorpusError(
            f"the corpus {root} has no {name} files (.py files whose path hash puts them in the "
            f"{split.value} split: {share} of them); give --corpus-root a directory with more "
            ".py files")
    cache_dir = corpus_cache_dir() if cache_dir is None else Path(cache_dir)
    key = cache_key(tokenizer, split, files, root)
    marker, tokens = cache_dir / f"{key[:32]}.json", cache_dir / f"{key[:32]}.tokens"
    cached = _read_entry(marker, tokens, key) if marker.is_file() else None
    if cached is not None:
        return cached
    dtype = _dtype(tokenizer)
    written: dict[str, Any] = {}

    def write(tmp: Path) -> None:
        written["tokens"], written["sha256"] = _write_tokens(tmp, tokenizer, files, dtype,
                                                             progress, split.value)

    atomic_write(tokens, write)
    atomic_write_json(marker, {
        "kind": CACHE_KIND, "format": CACHE_FORMAT, "key": key, "split": split.value,
        "root": str(root), "files": len(files), "documents": len(files),
        "tokenizer": {"source": tokenizer.source, "kind": tokenizer.kind.value,
                      "fingerprint": tokenizer.fingerprint},
        "dtype": dtype.str, "tokens": written["tokens"], "sha256": written["sha256"]})
    entry = _read_entry(marker, tokens, key)
    if entry is None:  # pragma: no cover - only if the files changed under us
        raise CorpusError(f"the corpus cache entry {marker} could not be read back after writing it")
    return entry


def evaluation_prompts(tokenizer: TextTokenizer, count: int, length: int, root: Path | None = None,
                       min_file_bytes: int = 512) -> list[Tensor]:
    """Prefixes of held-out test files: ``count`` prompts of ``length`` ids each (a record's
    start, so BOS first where the tokenizer has that convention).

    Raises:
        CorpusError: fewer than ``count`` test files are long enough.
    """
    prompts = []
    for path in corpus_files(Split.TEST, root):
        data = path.read_bytes()
        if len(data) < max(min_file_bytes, length):
            continue
        record = tokenizer.documents([data])[0]
        if record.shape[0] < length:
            continue
        prompts.append(torch.from_numpy(record[:length].copy()))
        if len(prompts) == count:
            break
    if len(prompts) < count:
        raise CorpusError(f"only {len(prompts)} test files are long enough for {count} prompts "
                          f"of {length} tokens")
    return prompts
