"""Backbone features computed once: train a head (and its LoRA layers) without running the backbone.

Everything below the draft branch is frozen, so what the trainable part reads is a function of the
tokens alone: the LM head's input when ``lora_layers = 0`` (the draft hidden state), else the
hidden state entering layer ``N - k`` (what the ``k`` LoRA draft layers consume;
:func:`~circuits_llm.backbone._features.branch_input`). :func:`cached_feature_sets` computes it
once for every training and validation row and stores it on disk
(:mod:`circuits_llm.training.feature_store`: streamed, checksummed, resumable, atomic); a step then
reads ``(b, L, d)`` rows from the memory map and runs only the head, and the ``k`` draft layers
through :class:`~circuits_llm.backbone._features.BranchArguments`, as EAGLE-style trainers do.

When (:class:`~circuits_llm.training.config.FeatureCaching`): ``ON`` always, ``OFF`` never,
``AUTO`` for self-distilled rows (a fixed set of sequences, so caching changes nothing but the
features' rounding); corpus windows are cached only when asked (``ON``), and are then the
disjoint ``seq_len`` windows of the training split (:func:`~circuits_llm.training.datasets.corpus_sets`).

Exactness: a cached feature is the live one, rounded to the stored dtype
(:class:`~circuits_llm.training.config.FeatureDtype`): float16 by default (relative error
``2^-11``), or the backbone's own dtype (``EXACT``; equal to the live value up to the last bits
that a different batch composition can change). A value float16 cannot hold is one clear error.

Disk: ``rows * seq_len * hidden_size`` values of 2 bytes (float16), e.g. SmolLM2-135M
(``d = 576``) at ``seq_len = 128``: 147 KiB per row, 151 MiB for 1,024 self-distilled rows.

Where: ``$CIRCUITS_LLM_FEATURE_CACHE``, else ``features/`` in the corpus cache
(:func:`~circuits_llm.text.corpus.corpus_cache_dir`). An entry is keyed by the model's
fingerprint (config and every weight), the layer, bf16 autocast, the stored dtype and the SHA-256
of its rows' tokens (so the tokenizer and the corpus or the self-distilled data), so every run on
the same data and model shares it.

Under ``torchrun`` rank 0 decides and builds; the other ranks wait for the finished entry (if
rank 0 fails, torchrun stops them).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from circuits_llm.backbone import HFBackbone, UnsupportedModelError
from circuits_llm.backbone._features import BranchArguments, branch_input
from circuits_llm.text.corpus import corpus_cache_dir
from circuits_llm.text.models import model_fingerprint
from circuits_llm.training.config import (
    DataSource,
    FeatureCaching,
    FeatureDtype,
    HeadTrainingConfig,
    TargetLaw,
)
from circuits_llm.training.datasets import JoinedSequences, SequenceSet
from circuits_llm.training.distributed import DistributedContext
from circuits_llm.training.feature_store import (
    EntrySpec,
    FeatureCacheError,
    FeatureEntry,
    build_entry,
    describe,
    missing_room,
    open_entry,
    room_error,
)

__all__ = ["FEATURE_CACHE_ENV", "FeatureCacheError", "FeatureRows", "cached_feature_sets",
           "caching_wanted", "feature_cache_dir"]

#: Environment variable overriding :func:`feature_cache_dir`.
FEATURE_CACHE_ENV = "CIRCUITS_LLM_FEATURE_CACHE"
#: Seconds between two looks for the entry rank 0 builds.
_POLL_S = 2.0


def feature_cache_dir() -> Path:
    """``$CIRCUITS_LLM_FEATURE_CACHE``, else ``<corpus cache>/features``."""
    explicit = os.environ.get(FEATURE_CACHE_ENV)
    return Path(explicit) if explicit else corpus_cache_dir() / "features"


def caching_wanted(config: HeadTrainingConfig) -> bool:
    """Whether ``config`` asks for cached features (before the disk has its say, for ``AUTO``)."""
    if config.cache_features is FeatureCaching.AUTO:  # the LM's law needs its own last state
        return config.data is DataSource.SELF_DISTILLED and not (
            config.target_law is TargetLaw.MODEL and config.lora_layers > 0)
    return config.cache_features is FeatureCaching.ON


@dataclass(frozen=True)
class JoinedEntry:
    """The features of a :class:`~circuits_llm.training.datasets.JoinedSequences`: one cache
    entry per part (so the corpus rows' entry is shared with runs without the chat rows).

    Attributes:
        joined: the rows.
        entries: the features of each of its parts, in order.
    """

    joined: JoinedSequences
    entries: tuple[FeatureEntry, ...]

    def rows(self, index: Tensor) -> Tensor:
        """(b, L, d) features of rows ``index`` (b,) of the join."""
        flat = index.reshape(-1).long()
        out: Tensor | None = None
        for number, where, local in self.joined.locate(flat):
            values = self.entries[number].rows(local)
            if out is None:
                out = values.new_empty((flat.shape[0], *values.shape[1:]))
            out[where] = values
        if out is None:
            raise IndexError("no rows asked of joined features")
        return out


@dataclass(frozen=True)
class FeatureRows(SequenceSet):
    """Sequences with the cached backbone features of every row.

    Attributes:
        sequences: the rows' tokens and loss masks.
        entry: their (N, L, d) features, row ``i`` for sequence ``i``.
        branch: the draft layers' other arguments for these rows' length (``lora_layers > 0``;
            None: the features are the draft hidden states themselves).
    """

    sequences: SequenceSet
    entry: FeatureEntry | JoinedEntry
    branch: BranchArguments | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    def rows(self, index: Tensor) -> tuple[Tensor, Tensor | None]:
        return self.sequences.rows(index)

    @property
    def entry_paths(self) -> list[Path]:
        """The cache entries these rows read (one per part of a join)."""
        entry = self.entry
        return [e.path for e in entry.entries] if isinstance(entry, JoinedEntry) else [entry.path]

    def features(self, index: Tensor) -> Tensor:
        """(b, L, d) cached features of rows ``index`` (b,), in the stored dtype."""
        return self.entry.rows(index)

    @property
    def token_source(self) -> SequenceSet:
        return self.sequences.token_source


def rows_digest(data: SequenceSet, block: int = 1024) -> str:
    """SHA-256 of every row's int64 tokens, in order: what the features are computed from."""
    digest = hashlib.sha256()
    for index in torch.arange(len(data)).split(block):
        digest.update(data.rows(index)[0].to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


class _Features:
    """The features of one run's backbone: what one row gives, and how its rows are computed."""

    def __init__(self, backbone: HFBackbone, config: HeadTrainingConfig) -> None:
        self.backbone, self.bf16 = backbone, config.bf16
        self.layer = "the LM head's input" if backbone.lora_layers == 0 else \
            f"the input of layer {backbone.num_layers - backbone.lora_layers}"
        if backbone.feature_layers:  # a draft block's fused layers: their outputs come first
            self.layer = f"the outputs of layers {list(backbone.feature_layers)}, then " \
                f"{self.layer}"
        self.model = model_fingerprint(backbone.model)
        self.dtype_choice = config.feature_dtype

    def live(self, tokens: Tensor) -> Tensor:
        """(b, L) tokens -> (b, L, d) features as the backbone computes them (no gradients)."""
        backbone = self.backbone
        with torch.autocast(device_type=backbone.device.type, dtype=torch.bfloat16,
                            enabled=self.bf16):
            return branch_input(backbone, tokens)

    def branch(self, row: Tensor) -> BranchArguments | None:
        """The draft layers' other arguments for rows like ``row`` (L,) (None without LoRA).

        Raises:
            UnsupportedModelError: they depend on the tokens (caching would not be exact).
        """
        if self.backbone.lora_layers == 0:
            return None
        with torch.autocast(device_type=self.backbone.device.type, dtype=torch.bfloat16,
                            enabled=self.bf16):
            return BranchArguments.record(self.backbone, row)

    def spec(self, data: SequenceSet, sample: Tensor) -> EntrySpec:
        stored = torch.float16 if self.dtype_choice is FeatureDtype.FLOAT16 else sample.dtype
        key = {"model": self.model, "layer": self.layer, "bf16": self.bf16,
               "rows": rows_digest(data)}
        return EntrySpec(key, len(data), int(sample.shape[1]), int(sample.shape[2]), stored)

    def compute(self, data: SequenceSet, stored: torch.dtype) -> Callable[[int, int], Tensor]:
        def rows(first: int, last: int) -> Tensor:
            values = self.live(data.rows(torch.arange(first, last))[0])
            cast = values.to(stored)
            if not bool(torch.isfinite(cast).all()):
                if bool(torch.isfinite(values).all()):
                    raise FeatureCacheError(
                        f"the backbone's features ({self.layer}) reach "
                        f"{float(values.abs().max()):.4g} on "
                        f"rows {first}..{last - 1}, beyond what {stored} holds; cache the "
                        "features in the model's dtype (--feature-dtype exact) or train without "
                        "--cache-features")
                raise FeatureCacheError(
                    f"the backbone gives NaN or infinite features ({self.layer}) on rows "
                    f"{first}..{last - 1}; the model is numerically broken for these inputs")
            return cast.cpu()
        return rows


def _check_row(entry: FeatureEntry, sample: Tensor) -> None:
    """Refuse an entry whose row 0 is not what the backbone computes for it (far beyond the
    stored dtype's rounding)."""
    cached, live = entry.rows(torch.tensor([0])).double(), sample.detach().cpu().double()
    scale = float(live.abs().max()) or 1.0
    error = float((cached - live).abs().max())
    if error > 1e-2 * scale:
        raise FeatureCacheError(
            f"the cached features {entry.path} differ from the backbone's by {error:.3g} on row 0 "
            f"(values up to {scale:.3g}); delete {entry.path} and its .json marker and run again")


def _wait_for(directory: Path, spec: EntrySpec, notify: Callable[[str], None]) -> FeatureEntry:
    """The entry rank 0 builds, once it is complete (ranks > 0)."""
    told = False
    while (entry := open_entry(directory, spec)) is None:
        if not told:
            notify(f"waiting for rank 0 to cache the features in {directory}")
            told = True
        time.sleep(_POLL_S)
    return entry


def cached_feature_sets(backbone: HFBackbone, config: HeadTrainingConfig, train: SequenceSet,
                        validation: SequenceSet, *, context: DistributedContext,
                        progress: bool = False, directory: Path | None = None,
                        notify: Callable[[str], None] | None = None,
                        on_chunk: Callable[[int], None] | None = None,
                        ) -> tuple[SequenceSet, SequenceSet]:
    """``(train, validation)`` as :class:`FeatureRows` when the run caches features (see the
    module docstring), built or continued in ``directory`` (default :func:`feature_cache_dir`);
    the sets unchanged otherwise.

    Args:
        backbone: the run's backbone (its ``lora_layers`` choose the layer).
        config: the run's config (``cache_features``, ``feature_dtype``, ``bf16``, ``batch_size``:
            the rows per forward while building).
        train, validation: the run's sequences.
        context: the run's process context (rank 0 decides and writes).
        progress: progress bars while building (rank 0).
        directory: where entries live.
        notify: where notices go (default: stderr).
        on_chunk: called after every durable chunk of a build (tests).

    Raises:
        FeatureCacheError: ``ON`` and the disk lacks room, or a model whose draft layers
            receive token-dependent arguments (``AUTO`` then trains from the backbone, saying
            so); a value the stored dtype cannot hold; an entry that does not match the backbone.
        OSError: the cache directory cannot be written (the chunks written so far are kept).
    """
    if not caching_wanted(config):
        return train, validation
    say = notify or (lambda message: print(message, file=sys.stderr, flush=True))
    directory = feature_cache_dir() if directory is None else Path(directory)
    features = _Features(backbone, config)
    first = train.rows(torch.tensor([0]))[0]
    try:  # before anything is built: a model whose branch cannot run from cached inputs
        branch = features.branch(first[0])
    except UnsupportedModelError as error:
        if config.cache_features is FeatureCaching.ON:
            raise FeatureCacheError(f"cannot cache this model's features: {error}") from None
        say(f"this model's features cannot be cached ({error}); training from the backbone")
        return train, validation
    sample = features.live(first)
    sets = (("train", train), ("validation", validation))
    parts = [(f"{name}, part {k + 1}" if isinstance(data, JoinedSequences) else name, part)
             for name, data in sets
             for k, part in enumerate(data.parts if isinstance(data, JoinedSequences) else [data])]
    specs = [features.spec(part, sample) for _, part in parts]
    use = True
    if context.is_writer:  # the room for the entries not built yet (a partial build counted whole)
        todo = [spec for spec in specs if not spec.paths(directory)["marker"].is_file()]
        needed = sum(spec.nbytes for spec in todo)
        missing = missing_room(directory, needed) if todo else 0
        if missing:
            error = room_error(directory, needed, missing, describe(specs[0], sum(
                spec.rows for spec in todo)))
            if config.cache_features is FeatureCaching.ON:
                raise error
            say(f"{error}; training from the backbone instead")
            use = False
    if context.enabled:  # every rank follows rank 0's decision
        use = bool(context.all_sum(torch.tensor([float(use and context.is_writer)])) > 0)
    if not use:
        return train, validation
    entries = []
    for (name, data), spec in zip(parts, specs, strict=True):
        if context.is_writer:
            entry = build_entry(directory, spec, features.compute(data, spec.dtype),
                                forward_rows=config.batch_size, progress=progress,
                                label=f"features ({name})", notify=say, on_chunk=on_chunk)
        else:
            entry = _wait_for(directory, spec, say)
        entries.append(entry)
    _check_row(entries[0], sample[:1])
    result = []
    for _, data in sets:
        count = len(data.parts) if isinstance(data, JoinedSequences) else 1
        own, entries = entries[:count], entries[count:]
        entry = JoinedEntry(data, tuple(own)) if isinstance(data, JoinedSequences) else own[0]
        result.append(FeatureRows(data, entry, branch))
    return result[0], result[1]
