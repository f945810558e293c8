"""Byte-level training data from the CPython standard library sources on this machine (PSF licence).

Nothing is downloaded: the corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``
outside ``site-packages``. Files are assigned to a split by a hash of their path relative to the
stdlib root, so the split is the same on every machine with the same Python version and does not
depend on file order or on which files exist.

Token ids are bytes ``0..255`` plus a few special ids (:class:`SpecialToken`); a stream of files is
packed as ``BOS file-bytes EOS BOS file-bytes EOS ...`` and cut into overlapping windows.

This module is the byte level and the splits. Corpora in a model's own tokens (a subword model's,
or the byte tokenizer's), tokenised once and memory-mapped from a disk cache, are
:mod:`circuits_llm.text.corpus`'s, which builds on this module (never the other way).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum, IntEnum
from pathlib import Path

import torch
from torch import Tensor


class SpecialToken(IntEnum):
    """Special token ids that follow the 256 byte values."""

    BOS = 256
    EOS = 257
    PAD = 258


#: Bytes plus specials, rounded up to a multiple of 4 for friendlier matrix shapes.
VOCAB_SIZE = 260


class Split(Enum):
    TRAIN = "train"
    VALIDATION = "validation"
    TEST = "test"


#: Percent of files per split (by path hash): 90 / 5 / 5.
_SPLIT_BUCKETS = {Split.TRAIN: range(0, 90), Split.VALIDATION: range(90, 95), Split.TEST: range(95, 100)}


#: Never part of the corpus: third-party packages and bytecode caches (pruned, not walked).
_SKIPPED_DIRECTORIES = frozenset({"site-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The directory holding this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> Split:
    """The split a file belongs to, from the SHA-256 of its path relative to the stdlib root."""
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 100
    for split, buckets in _SPLIT_BUCKETS.items():
        if bucket in buckets:
            return split
    raise AssertionError("buckets cover 0..99")


def corpus_files(split: Split, root: Path | None = None) -> list[Path]:
    """The sorted ``*.py`` files of ``split`` under ``root`` (default: the stdlib)."""
    root = root or stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"no standard library sources at {root}; pass root= explicitly")
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d not in _SKIPPED_DIRECTORIES)
        for name in names:
            if name.endswith(".py"):
                path = Path(directory) / name
                if split_of(path.relative_to(root).as_posix()) is split:
                    files.append(path)
    return sorted(files)


def encode(text: bytes) -> Tensor:
    """Bytes -> token ids (1-D long tensor)."""
    if not text:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def decode(tokens: Tensor | list[int]) -> str:
    """Token ids -> text; special ids are dropped, invalid UTF-8 is replaced."""
    values = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
    return bytes(v for v in values if 0 <= v < 256).decode("utf-8", errors="replace")


def pack(files: list[Path], max_bytes: int | None = None) -> Tensor:
    """Concatenate files as ``BOS bytes EOS`` records into one 1-D token stream."""
    pieces: list[Tensor] = []
    total = 0
    for path in files:
        record = torch.cat([torch.tensor([SpecialToken.BOS]), encode(path.read_bytes()),
                            torch.tensor([SpecialToken.EOS])])
        if max_bytes is not None and total + record.numel() > max_bytes:
            record = record[: max_bytes - total]
        pieces.append(record)
        total += record.numel()
        if max_bytes is not None and total >= max_bytes:
            break
    if not pieces:
        raise ValueError("no data: the file list is empty")
    return torch.cat(pieces)


@dataclass(frozen=True)
class WindowSpec:
    """How a token stream is cut into training windows.

    Attributes:
        length: tokens per window (the model's context during training).
        stride: start-to-start distance; ``stride < length`` makes windows overlap, so every
            position is seen with some left context.
    """

    length: int
    stride: int

    def __post_init__(self) -> None:
        if self.length < 2 or not 1 <= self.stride <= self.length:
            raise ValueError(
                f"need length >= 2 and 1 <= stride <= length, got length={self.length}, "
                f"stride={self.stride}")


def windows(stream: Tensor, spec: WindowSpec) -> Tensor:
    """All full windows of ``stream``: ``(num_windows, spec.length)`` (a view, no copy)."""
    if stream.numel() < spec.length:
        raise ValueError(f"stream of {stream.numel()} tokens is shorter than one window ({spec.length})")
    return stream.unfold(0, spec.length, spec.stride)


def batches(stream: Tensor, spec: WindowSpec, batch_size: int, generator: torch.Generator,
            ) -> Iterator[Tensor]:
    """Shuffled batches of windows, ``(batch_size, length)`` each, one pass over the data."""
    table = windows(stream, spec)
    order = torch.randperm(table.shape[0], generator=generator)
    for start in range(0, order.numel() - batch_size + 1, batch_size):
        yield table[order[start:start + batch_size]]


def evaluation_prompts(count: int, prompt_bytes: int, root: Path | None = None,
                       min_file_bytes: int = 512) -> list[Tensor]:
    """Prefixes of held-out test files: ``count`` prompts of ``prompt_bytes`` byte ids (BOS first).

    The same prompts in a model's own token ids are
    :func:`circuits_llm.text.corpus.evaluation_prompts`'s (the byte tokenizer gives exactly these).
    """
    prompts = []
    for path in corpus_files(Split.TEST, root):
        data = path.read_bytes()
        if len(data) < max(min_file_bytes, prompt_bytes):
            continue
        prompts.append(torch.cat([torch.tensor([SpecialToken.BOS]), encode(data[: prompt_bytes - 1])]))
        if len(prompts) == count:
            break
    if len(prompts) < count:
        raise ValueError(f"only {len(prompts)} test files are long enough for {count} prompts")
    return prompts
