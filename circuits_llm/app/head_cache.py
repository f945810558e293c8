"""Finding a model's head: the heads a user trained (the head cache) and the heads shipped in the
package (:mod:`circuits_llm.heads.shipped`), for ``demo``, ``bench``, ``generate``, the study and
the Python helper :func:`shipped_head`.

**The head cache** holds only heads trained on this machine. An entry is a
:func:`circuits_llm.training.train_head` run directory,
``<cache>/<model fingerprint[:16]>/<arch>-n<window>-r<rank>-<config hash>``, keyed by the model's
:func:`~circuits_llm.text.models.model_fingerprint` (config and every weight) and the head's whole
training configuration, so a second run with the same model and settings trains nothing. The
entry is complete once its marker :data:`HEAD_MARKER` (JSON) is written, which happens last.
(Older versions copied shipped heads into the cache; such entries, marked ``origin: shipped``,
are passed over: the package's own directory is read instead.)

**Shipped heads** (``circuits_llm/heads_shipped/<name>/``: a head as ``save_head`` writes it,
float16, and ``shipped.json``) serve the model they were trained against, matched by its
identity (:func:`~circuits_llm.text.models.backbone_identity`: config fingerprint and LM head),
and are read in place, with no step before:

* :func:`obtain_head` (demo, bench, the study): the cache entry of the requested training
  config, else a shipped head of the same structure (:data:`STRUCTURE_FIELDS`), else it trains;
* :func:`find_head` (``generate --head ff|btree|...``): a head of that kind the user trained for
  the model, else its shipped head, else one :class:`NoHeadError` naming ``train-head``;
* :func:`shipped_head` (``circuits_llm.shipped_head("smollm2", "btree")``): the shipped head of
  a model (by its ``--model`` name, a loaded model, or anything ``load_model`` reads).

**Shipped draft blocks** (issue 44: the recursive block, kind ``block``, and a circuit head on
it, ``btree-block``) are found the same way, by kind and model identity
(:func:`find_shipped_drafter`), and loaded on the model (:func:`shipped_drafter`,
``circuits_llm.shipped_drafter(loaded, "block")``: the drafter ``SpeculativeDecoder`` takes).

``circuits-llm ship RUN_DIR --name NAME --model MODEL`` ships a finished run
(:mod:`circuits_llm.app.shipping`: a head, or a ``--draft-block`` run's block, with
``--circuit-head DIR`` a head trained on it; ``scripts/train_demo_heads.sh`` ships the demo's
heads). ``python -m circuits_llm.app.head_cache ship ...``, its former spelling, still forwards
to it (:func:`~circuits_llm.app.ship_command.main`), with runpy's warning about running a module the
package has already imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from circuits_llm.app.report import jsonable, write_json
from circuits_llm.app.ship_command import main
from circuits_llm.app.shipping import (
    BLOCK_LAYOUTS,
    NoHeadError,
    find_shipped_drafter,
    load_shipped_drafter,
    no_drafter_message,
    ship_block,
    ship_head,
    shipped_drafter,
)
from circuits_llm.heads import MTPHead
from circuits_llm.heads.shipped import (
    SHIPPED_DIR,
    SHIPPED_MANIFEST,
    ShippedHead,
    ShippedHeadError,
    ShippedLayout,
    is_block_kind,
    read_shipped_head,
    shipped_heads,
)
from circuits_llm.text.models import LoadedModel, backbone_identity, config_fingerprint

__all__ = ["BLOCK_LAYOUTS", "HEAD_LAYOUTS", "HEAD_MARKER", "SHIPPED_DIR", "SHIPPED_MANIFEST",
           "STRUCTURE_FIELDS", "FoundHead",
           "HeadOrigin", "NoHeadError", "ReadyHead", "ShippedHead", "ShippedHeadError",
           "clear_entry", "default_cache_dir", "find_cached_head", "find_head",
           "find_shipped_drafter", "find_shipped_head", "head_dir", "load_shipped_drafter", "main",
           "no_drafter_message", "no_head_message", "obtain_head", "read_shipped_head",
           "ship_block", "ship_head", "shipped_drafter", "shipped_head", "shipped_heads"]

#: The layouts that ship a circuit head on the model's hidden state (the draft blocks':
#: :data:`BLOCK_LAYOUTS`).
HEAD_LAYOUTS = (ShippedLayout.HEAD,)

#: The file whose presence marks a complete cache entry.
HEAD_MARKER = "demo_head.json"
#: Training-config fields that fix a head's tensors: a shipped head serves a request that agrees
#: with it on these (budgets, learning rate or data may differ).
STRUCTURE_FIELDS = ("architecture", "circuit_file", "window", "rank", "variant", "lean_rank",
                    "lora_layers", "lora_rank", "draft_vocab", "token_input")


class HeadOrigin(Enum):
    """Where a head was found."""

    CACHE = "cache"
    SHIPPED = "shipped"
    TRAINED = "trained"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/circuits_llm/heads`` (``~/.cache`` when the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "circuits_llm" / "heads"


def head_dir(cache: Path, fingerprint: str, training: Any) -> Path:
    """The cache entry of a head: ``cache/<model>/<arch>-n<window>-r<rank>-<config hash>``."""
    record = jsonable(training)
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:12]
    name = f"{record['architecture']}-n{record['window']}-r{record['rank']}-{key}"
    return cache / fingerprint[:16] / name


@dataclass
class ReadyHead:
    """A trained head with the backbone it decodes with, and its record (where it came from,
    its training, validation and size)."""

    name: str
    head: Any
    backbone: Any
    record: dict[str, Any]


def _trained_entry(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a complete entry of a head trained here (not a shipped head's copy
    made by an older version)."""
    marker = run_dir / HEAD_MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("origin") != HeadOrigin.SHIPPED.value
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


# ---------------------------------------------------------------------------- shipped heads
def _lm(model: Any) -> Any:
    """The Hugging Face model of a :class:`LoadedModel` or of a model given as it is."""
    return model.model if isinstance(model, LoadedModel) else model


def find_shipped_head(model: Any, training: Any, root: Path | None = None) -> ShippedHead | None:
    """A shipped head trained for ``model`` with the structure of ``training``, or None."""
    from circuits_llm.training import HeadTrainingConfig
    candidates = shipped_heads(root, HEAD_LAYOUTS)
    if not candidates:
        return None
    identity, wanted = backbone_identity(_lm(model)), jsonable(training)
    for head in candidates:
        # a record written before a structure field existed has that field's default
        theirs = HeadTrainingConfig.from_dict(head.training).to_dict()
        if head.trained_for(identity) and all(wanted.get(name) == theirs.get(name)
                                              for name in STRUCTURE_FIELDS):
            return head
    return None


def no_head_message(kind: str, model: str, heads: list[ShippedHead], then: str,
                    cache: Path | None = None) -> str:
    """The one message for a model without a ``kind`` head: what ships, and the ``train-head``
    command that makes one (``then``: how to use the trained head)."""
    served = sorted({f"{h.kind} for {h.model_name}" for h in heads})
    shipped = f"the shipped heads are {', '.join(served)}" if served else "no head is shipped"
    where = f"; none is in the head cache {cache}" if cache is not None else ""
    return (f"no trained {kind} head for this model ({shipped}{where}); train one with "
            f"`circuits-llm train-head --model {model} --arch {kind} --run-dir DIR`, then {then}")


def shipped_head(model: str | Path | Any, kind: str, *, root: Path | None = None,
                 device: torch.device | str | None = None) -> MTPHead:
    """The package's shipped ``kind`` head for ``model``, loaded (eval mode, float32).

    Args:
        model: the ``--model`` name a shipped head serves (``"smollm2"``: nothing is loaded), a
            :class:`~circuits_llm.text.models.LoadedModel` or Hugging Face model (matched by its
            identity: config fingerprint and LM head), or anything else
            :func:`~circuits_llm.text.models.load_model` reads (loaded, then matched).
        kind: the head kind, e.g. ``"btree"`` or ``"ff"``.
        root: the shipped-heads directory (default: the package's).

    Raises:
        NoHeadError: no ``kind`` head ships for this model (the message names ``train-head``).
        ShippedHeadError: a shipped head's files are damaged.
    """
    kind = str(kind).lower()
    if is_block_kind(kind):
        raise NoHeadError(f"{kind!r} names a draft block, which drafts with the model's own parts: "
                          f"load it with circuits_llm.shipped_drafter(model, {kind!r})")
    heads = shipped_heads(root, HEAD_LAYOUTS)
    then = "load it with circuits_llm.training.load_trained_head(DIR, model)"
    if isinstance(model, (str, Path)):
        named = [h for h in heads if h.model_name == str(model)]
        if named:
            found = next((h for h in named if h.kind == kind), None)
            if found is None:
                raise NoHeadError(no_head_message(kind, str(model), heads, then))
            return found.load(device)
        from circuits_llm.text.models import load_model
        model = load_model(model)
    name = model.source if isinstance(model, LoadedModel) else "MODEL"
    identity = backbone_identity(_lm(model))
    found = next((h for h in heads if h.kind == kind and h.trained_for(identity)), None)
    if found is None:
        raise NoHeadError(no_head_message(kind, name, heads, then))
    return found.load(device)


@dataclass(frozen=True)
class FoundHead:
    """Where :func:`find_head` found a head: a cache entry (a ``train-head`` run directory) or
    a shipped head (exactly one of the two)."""

    kind: str
    run_dir: Path | None = None
    shipped: ShippedHead | None = None

    def describe(self) -> str:
        return f"shipped head {self.shipped.name}" if self.shipped is not None else \
            str(self.run_dir)


def find_head(loaded: LoadedModel, kind: str, cache: Path, preferred: list[Any],
              model_name: str, root: Path | None = None) -> FoundHead:
    """A ``kind`` head for ``loaded``: one the user trained into ``cache`` (a ``preferred``
    config's, else the newest), else the shipped one (``root``: the shipped-heads directory).

    Raises:
        NoHeadError: neither exists; the message names ``train-head`` (for ``model_name``).
    """
    run_dir = find_cached_head(cache, loaded.fingerprint, kind, preferred)
    if run_dir is not None:
        return FoundHead(kind, run_dir=run_dir)
    heads = shipped_heads(root, HEAD_LAYOUTS)
    identity = backbone_identity(loaded.model)
    found = next((h for h in heads if h.kind == kind and h.trained_for(identity)), None)
    if found is None:
        raise NoHeadError(no_head_message(kind, model_name, heads, "pass --head DIR", cache))
    return FoundHead(kind, shipped=found)


def _shipped_ready(found: ShippedHead, loaded: LoadedModel) -> ReadyHead:
    """A shipped head, read in place, with a backbone on ``loaded``'s model and the record the
    demo's report shows (what the head's training run recorded)."""
    from circuits_llm.backbone import HFBackbone
    from circuits_llm.heads import load_head
    from circuits_llm.heads.config import HeadConfigError
    backbone = HFBackbone(loaded.model)
    try:
        head = load_head(found.directory, backbone.hidden_size, backbone.vocab_size,
                         device=backbone.device, expected_fingerprint=config_fingerprint(
                             loaded.model))
    except HeadConfigError as error:
        raise ShippedHeadError(f"the shipped head {found.name} cannot be loaded ({error}); "
                               "reinstall circuits-llm") from None
    record, training = found.record, found.training
    validation, initial = record["validation"], record["initial_validation"]
    summary = {"architecture": str(training["architecture"]),
               "model_fingerprint": loaded.fingerprint, "training_config": training,
               "train_wall_s": float(record.get("elapsed_s", 0.0)), "steps": record["step"],
               "finished": record["finished"], "tokens_seen": record["tokens_seen"],
               "validation_bits_before": initial["mean_bits"],
               "validation_bits_after": validation["mean_bits"],
               "validation_bits_by_position": list(validation["bits"]), "max_seconds": None,
               "origin": HeadOrigin.SHIPPED.value, "shipped_as": found.name, "cached": True,
               "run_dir": str(found.directory), "parameters": int(head.num_parameters())}
    return ReadyHead(str(training["architecture"]), head.eval(), backbone, summary)


# ---------------------------------------------------------------------------- obtaining a head
def obtain_head(loaded: LoadedModel, training: Any, cache: Path, max_seconds: float,
                retrain: bool = False, progress: bool = True,
                shipped: Path | None = None) -> ReadyHead:
    """The head of ``training`` for ``loaded``: the cache entry of a head trained here, else a
    shipped head of the same structure (read in place), else trained into the cache (then its
    marker is written).

    ``training`` is a :class:`~circuits_llm.training.HeadTrainingConfig`; ``max_seconds`` bounds
    the training, ``retrain`` ignores shipped heads and trains the entry afresh (its old files
    removed, :func:`clear_entry`); ``shipped`` is the shipped-heads directory (default
    :data:`SHIPPED_DIR`). The record says where the head came from (``origin``, a
    :class:`HeadOrigin` value; ``cached`` is True unless it was trained now; ``run_dir`` is the
    directory it was read from).
    """
    from circuits_llm.training import load_trained_head, train_head
    run_dir = head_dir(cache, loaded.fingerprint, training)
    fresh = False
    if retrain or not _trained_entry(run_dir):
        found = None if retrain else find_shipped_head(loaded.model, training, shipped)
        if found is not None:
            return _shipped_ready(found, loaded)
        if retrain or (run_dir / HEAD_MARKER).is_file():  # (an older version's shipped copy)
            clear_entry(run_dir)  # else an interrupted run there resumes
        _train_into(loaded, training, run_dir, max_seconds, progress, train_head)
        fresh = True
    record = json.loads((run_dir / HEAD_MARKER).read_text())
    origin = HeadOrigin.TRAINED if fresh else HeadOrigin.CACHE
    head, backbone = load_trained_head(run_dir, loaded.model)
    record.update(origin=origin.value, cached=origin is not HeadOrigin.TRAINED,
                  run_dir=str(run_dir), parameters=int(head.num_parameters()))
    return ReadyHead(str(jsonable(training)["architecture"]), head.eval(), backbone, record)


def clear_entry(run_dir: Path) -> None:
    """Empty a cache entry (marker first, so a crash midway leaves no complete-looking entry)
    under its run lock, so that a run training into it is never disturbed.

    Raises:
        circuits_llm.training.RunDirectoryBusy: a live run holds the entry.
    """
    from circuits_llm.training.lock import LOCK_FILE, RunLock
    if not run_dir.is_dir():
        return
    with RunLock(run_dir, command="demo --retrain"):
        (run_dir / HEAD_MARKER).unlink(missing_ok=True)
        for item in sorted(run_dir.iterdir()):
            if item.name == LOCK_FILE:
                continue
            if item.is_dir() and not item.is_symlink():
                shutil.rmtree(item)
            else:
                item.unlink()


def _train_into(loaded: LoadedModel, training: Any, run_dir: Path, max_seconds: float,
                progress: bool, train_head: Any) -> None:
    """Train ``training`` into the entry ``run_dir`` (resuming an interrupted run there), then
    write its marker."""
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = train_head(loaded.model, training, run_dir, max_seconds=max_seconds,
                        progress=progress)
    write_json({"architecture": str(jsonable(training)["architecture"]),
                "model_fingerprint": loaded.fingerprint, "training_config": jsonable(training),
                "train_wall_s": time.perf_counter() - start, "steps": result.step,
                "finished": result.finished, "tokens_seen": result.tokens_seen,
                "validation_bits_before": result.initial_validation.mean_bits,
                "validation_bits_after": result.validation.mean_bits,
                "validation_bits_by_position": list(result.validation.bits),
                "max_seconds": max_seconds, "origin": HeadOrigin.TRAINED.value},
               run_dir / HEAD_MARKER)


def find_cached_head(cache: Path, fingerprint: str, architecture: str,
                     preferred: list[Any]) -> Path | None:
    """A head of ``architecture`` trained for this model in the cache: a ``preferred``
    config's, else the newest (copies of shipped heads made by older versions are passed over)."""
    for training in preferred:
        run_dir = head_dir(cache, fingerprint, training)
        if _trained_entry(run_dir):
            return run_dir
    found = sorted((marker for marker in (cache / fingerprint[:16]).glob(
        f"{architecture}-*/{HEAD_MARKER}") if _trained_entry(marker.parent)),
        key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


# ---------------------------------------------------------------------------- command line
if __name__ == "__main__":  # the former spelling of `circuits-llm ship`
    sys.exit(main())
