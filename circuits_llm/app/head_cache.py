"""The trained-head cache of ``demo``, ``bench``, ``generate`` and the study, and the heads shipped
in the package: find a head, install a shipped one, or train it into the cache first.

A cache entry is a :func:`circuits_llm.training.train_head` run directory,
``<cache>/<model fingerprint[:16]>/<arch>-n<window>-r<rank>-<config hash>``, keyed by the
model's :func:`~circuits_llm.text.models.model_fingerprint` (config and every weight) and the head's
whole training configuration, so a second run with the same model and settings trains nothing.
The entry is complete once its marker :data:`HEAD_MARKER` (JSON) is written, which happens last.

**Shipped heads.** ``circuits_llm/heads_shipped/<name>/`` holds a head trained by
``scripts/train_demo_heads.sh`` (``circuits-llm train-head``), written by :func:`ship_head`:

* ``head.safetensors``: the head's trained tensors, floating point ones in float16 (half the
  bytes; a head is an approximation of the model, and the decoder is exact for any head). The
  frozen LM-head copy of a LEAN head and the token input's embedding rows are left out: they are
  rebuilt from the model;
* ``shipped.json``: :data:`SHIPPED_FORMAT`, the run's ``training.json`` record (configuration,
  validation, the model fingerprint it was trained against), the head's structure, and the
  SHA-256 of the tensor file.

:func:`obtain_head` looks in the cache, then among the shipped heads for one trained against this
model (:func:`circuits_llm.text.models.backbone_identity`: its config and LM head) with the
same structure (:data:`STRUCTURE_FIELDS`: architecture, window, rank, draft vocabulary...), and
installs it as an ordinary cache entry (:func:`install_shipped_head`): ``generate --head btree``
and ``load_trained_head`` read it like a head trained there.

``python -m circuits_llm.app.head_cache ship RUN_DIR --name NAME`` ships a finished run.
"""

from __future__ import annotations

import argparse
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
from torch import Tensor

from circuits.files import atomic_write, sha256_file
from circuits_llm.app.report import jsonable, write_json
from circuits_llm.text.models import LoadedModel, backbone_identity

#: The file whose presence marks a complete cache entry.
HEAD_MARKER = "demo_head.json"
#: Where the package's shipped heads live.
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "heads_shipped"
SHIPPED_MANIFEST = "shipped.json"
SHIPPED_TENSORS = "head.safetensors"
SHIPPED_FORMAT = "circuits_llm.shipped_head"
SHIPPED_VERSION = 1
#: Training-config fields that fix a head's tensors: a shipped head serves a request that agrees
#: with it on these (budgets, learning rate or data may differ).
STRUCTURE_FIELDS = ("architecture", "circuit_file", "window", "rank", "variant", "lean_rank",
                    "lora_layers", "lora_rank", "draft_vocab", "token_input")


class HeadOrigin(Enum):
    """Where :func:`obtain_head` found a head."""

    CACHE = "cache"
    SHIPPED = "shipped"
    TRAINED = "trained"


class ShippedHeadError(ValueError):
    """A shipped head cannot be read, or a run cannot be shipped (the message says why)."""


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
    """A trained head with the backbone it was trained with, and its cache record."""

    name: str
    head: Any
    backbone: Any
    record: dict[str, Any]


# ---------------------------------------------------------------------------- shipped heads
@dataclass(frozen=True)
class ShippedHead:
    """One head of :data:`SHIPPED_DIR` (or another shipped-heads directory).

    Attributes:
        directory: ``<root>/<name>``.
        manifest: the parsed ``shipped.json``.
    """

    directory: Path
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return self.directory.name

    @property
    def record(self) -> dict[str, Any]:
        """The ``training.json`` record of the run the head came from."""
        return self.manifest["record"]

    @property
    def training(self) -> dict[str, Any]:
        """The run's :class:`~circuits_llm.training.HeadTrainingConfig` as a dict."""
        return self.record["config"]

    def serves(self, training: Any, model_fingerprint: dict[str, str]) -> bool:
        """Whether this head was trained against ``model_fingerprint`` (the training record's
        model identity) with the structure ``training`` asks for."""
        from circuits_llm.training import HeadTrainingConfig
        wanted = jsonable(training)
        # a record written before a structure field existed has that field's default
        theirs = HeadTrainingConfig.from_dict(self.training).to_dict()
        return self.record.get("model_fingerprint") == model_fingerprint and all(
            wanted.get(name) == theirs.get(name) for name in STRUCTURE_FIELDS)


def read_shipped_head(directory: Path) -> ShippedHead:
    """Read and check ``directory/shipped.json`` (the tensors are checked when installed).

    Raises:
        ShippedHeadError: the manifest is missing, not JSON, or not a shipped-head manifest.
    """
    path = Path(directory) / SHIPPED_MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ShippedHeadError(f"cannot read the shipped head manifest {path} ({error}); "
                               "reinstall circuits-llm") from None
    if not isinstance(manifest, dict) or manifest.get("format") != SHIPPED_FORMAT \
            or manifest.get("version") != SHIPPED_VERSION \
            or not isinstance(manifest.get("record"), dict) \
            or not isinstance(manifest["record"].get("config"), dict) \
            or not isinstance(manifest.get("tensors_sha256"), str):
        raise ShippedHeadError(f"{path} is not a {SHIPPED_FORMAT} version {SHIPPED_VERSION} "
                               "manifest")
    return ShippedHead(Path(directory), manifest)


def shipped_heads(root: Path | None = None) -> list[ShippedHead]:
    """Every shipped head under ``root`` (default :data:`SHIPPED_DIR`), by name; none when the
    directory does not exist."""
    root = SHIPPED_DIR if root is None else Path(root)
    if not root.is_dir():
        return []
    return [read_shipped_head(path.parent) for path in sorted(root.glob(f"*/{SHIPPED_MANIFEST}"))]


def find_shipped_head(model: Any, training: Any, root: Path | None = None) -> ShippedHead | None:
    """A shipped head trained for ``model`` with the structure of ``training``, or None."""
    candidates = shipped_heads(root)
    if not candidates:
        return None
    identity = backbone_identity(model)
    return next((head for head in candidates if head.serves(training, identity)), None)


def _shipped_tensors(head: Any) -> dict[str, Tensor]:
    """The tensors a shipped head stores: all of the head's except its floating-point buffers
    (frozen copies of the model's LM head, rebuilt from the model), floats in float16."""
    from circuits_llm.heads.io import head_tensors
    frozen = {name for name, value in head.named_buffers() if value.is_floating_point()}
    return {name: (value.detach().to("cpu", torch.float16) if value.is_floating_point()
                   else value.detach().cpu()).contiguous()
            for name, value in head_tensors(head).items() if name not in frozen}


def ship_head(run_dir: Path, out: Path) -> ShippedHead:
    """Write the exported head of a finished ``train-head`` run as a shipped head in ``out``.

    Raises:
        ShippedHeadError: the run has no exported head, or ``out`` holds something else.
        circuits_llm.runtime.checkpoint.CheckpointError: the run's record is missing or corrupt.
    """
    from safetensors.torch import save_file

    from circuits_llm.heads import HeadConfigError, load_head
    from circuits_llm.heads.io import head_config
    from circuits_llm.training import read_record
    from circuits_llm.training.results import HEAD_DIR
    run_dir, out = Path(run_dir), Path(out)
    record = read_record(run_dir)
    if int(record["config"].get("lora_layers", 0)):
        raise ShippedHeadError(f"cannot ship {run_dir}: it trained LoRA layers, and only heads "
                               "that read the final hidden state (--lora-layers 0) are shipped")
    try:
        head = load_head(run_dir / HEAD_DIR)
    except HeadConfigError as error:
        raise ShippedHeadError(f"cannot ship {run_dir}: {error}") from None
    if out.exists() and not (out / SHIPPED_MANIFEST).is_file() and any(out.iterdir()):
        raise ShippedHeadError(f"{out} exists and is not a shipped head; choose another --name")
    out.mkdir(parents=True, exist_ok=True)
    tensors = _shipped_tensors(head)
    atomic_write(out / SHIPPED_TENSORS, lambda tmp: save_file(tensors, str(tmp)))
    manifest = {"format": SHIPPED_FORMAT, "version": SHIPPED_VERSION,
                "tensors_sha256": sha256_file(out / SHIPPED_TENSORS),
                "head_config": json.loads(head_config(head).to_json()),
                "parameters": int(head.num_parameters()),
                "record": {k: v for k, v in record.items() if k not in ("format", "version")}}
    write_json(manifest, out / SHIPPED_MANIFEST)
    return read_shipped_head(out)


def _rebuild_head(shipped: ShippedHead, model: Any) -> tuple[Any, Any]:
    """The shipped head as a float32 ``MTPHead`` on ``model``'s LM head, and its backbone.

    Raises:
        ShippedHeadError: the tensor file fails its checksum or does not fit the head.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from circuits_llm.backbone import HFBackbone
    from circuits_llm.heads import HeadConfigError, MTPHead
    from circuits_llm.heads.config import HeadConfig
    from circuits_llm.heads.io import DRAFT_TOKENS, head_tensors
    from circuits_llm.text.models import config_fingerprint
    from circuits_llm.training.build import input_embedding_weight, lm_head_weight
    path = shipped.directory / SHIPPED_TENSORS
    if not path.is_file() or sha256_file(path) != shipped.manifest["tensors_sha256"]:
        raise ShippedHeadError(f"{path} is missing or does not match its checksum in "
                               f"{SHIPPED_MANIFEST}; reinstall circuits-llm")
    try:
        stored = load_file(str(path))
        config = HeadConfig.from_json(json.dumps(shipped.manifest.get("head_config")),
                                      str(shipped.directory / SHIPPED_MANIFEST))
        if config.architecture is None or config.rank is None:
            raise HeadConfigError("a shipped head must be of a registered head kind")
        embedding = None  # the token input's frozen rows, rebuilt from the model like the LM head
        if config.token_width is not None:
            embedding = input_embedding_weight(model).detach().float().cpu()
        head = MTPHead.from_name(config.architecture, config.window, config.rank,
                                 config.hidden_size, config.vocab_size, config.variant,
                                 lm_head_weight(model).detach().float().cpu(),
                                 token_embedding=embedding, token_width=config.token_width,
                                 draft_vocab=stored.get(DRAFT_TOKENS), input_bias=config.input_bias,
                                 lean_rank=config.lean_rank, identity_init=config.identity_init,
                                 identity_bias=config.identity_bias)
    except (SafetensorError, OSError, HeadConfigError) as error:
        raise ShippedHeadError(f"cannot rebuild the shipped head {shipped.directory} ({error}); "
                               "reinstall circuits-llm") from None
    head.model_fingerprint = config_fingerprint(model)
    expected = head_tensors(head)
    frozen = {name for name, value in head.named_buffers() if value.is_floating_point()}
    missing = sorted(set(expected) - frozen - set(stored))
    unknown = sorted(set(stored) - set(expected))
    wrong = sorted(name for name in set(stored) & set(expected)
                   if tuple(stored[name].shape) != tuple(expected[name].shape))
    if missing or unknown or wrong:
        raise ShippedHeadError(f"{path} does not fit the head it describes: missing tensors "
                               f"{missing}, unexpected {unknown}, wrong shapes {wrong}")
    head.load_state_dict({name: value.to(expected[name].dtype) for name, value in stored.items()},
                         strict=False)
    lora = int(shipped.training.get("lora_layers", 0))
    if lora:
        raise ShippedHeadError(f"{shipped.directory}: shipped heads read the final hidden state; "
                               f"this one needs {lora} LoRA layers, which are not shipped")
    backbone = HFBackbone(model)
    return head.to(backbone.device), backbone


def install_shipped_head(shipped: ShippedHead, loaded: LoadedModel, run_dir: Path) -> None:
    """Write ``shipped`` into the cache entry ``run_dir`` as an exported run (``head/``,
    ``training.json``) and then its marker."""
    from circuits_llm.training.results import export_run
    head, backbone = _rebuild_head(shipped, loaded.model)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = shipped.record
    export_run(run_dir, head, backbone, record)
    validation, initial = record["validation"], record["initial_validation"]
    write_json({"architecture": str(shipped.training["architecture"]),
                "model_fingerprint": loaded.fingerprint, "training_config": shipped.training,
                "train_wall_s": float(record.get("elapsed_s", 0.0)), "steps": record["step"],
                "finished": record["finished"], "tokens_seen": record["tokens_seen"],
                "validation_bits_before": initial["mean_bits"],
                "validation_bits_after": validation["mean_bits"],
                "validation_bits_by_position": list(validation["bits"]), "max_seconds": None,
                "origin": HeadOrigin.SHIPPED.value, "shipped_as": shipped.name},
               run_dir / HEAD_MARKER)


# ---------------------------------------------------------------------------- obtaining a head
def obtain_head(loaded: LoadedModel, training: Any, cache: Path, max_seconds: float,
                retrain: bool = False, progress: bool = True,
                shipped: Path | None = None) -> ReadyHead:
    """The head of ``training`` for ``loaded``: from the cache, else a shipped head installed into
    the cache, else trained into the cache (then its marker is written).

    ``training`` is a :class:`~circuits_llm.training.HeadTrainingConfig`; ``max_seconds`` bounds
    the training, ``retrain`` ignores shipped heads and trains the entry afresh (its old files
    removed, :func:`clear_entry`); ``shipped`` is the shipped-heads
    directory (default :data:`SHIPPED_DIR`). The record says where the head came from
    (``origin``, a :class:`HeadOrigin` value; ``cached`` is True unless it was trained now).
    """
    from circuits_llm.training import HeadTrainingConfig, load_trained_head, train_head
    run_dir = head_dir(cache, loaded.fingerprint, training)
    name = str(jsonable(training)["architecture"])
    found, fresh = None, False
    if retrain or not (run_dir / HEAD_MARKER).is_file():
        found = None if retrain else find_shipped_head(loaded.model, training, shipped)
        if found is None:
            if retrain:
                clear_entry(run_dir)
            _train_into(loaded, training, run_dir, max_seconds, progress, train_head)
            fresh = True
        else:
            run_dir = head_dir(cache, loaded.fingerprint,
                               HeadTrainingConfig.from_dict(found.training))
            if not (run_dir / HEAD_MARKER).is_file():
                install_shipped_head(found, loaded, run_dir)
    record = json.loads((run_dir / HEAD_MARKER).read_text())
    if fresh:
        origin = HeadOrigin.TRAINED
    elif found is not None or record.get("origin") == HeadOrigin.SHIPPED.value:
        origin = HeadOrigin.SHIPPED
    else:
        origin = HeadOrigin.CACHE
    head, backbone = load_trained_head(run_dir, loaded.model)
    record.update(origin=origin.value, cached=origin is not HeadOrigin.TRAINED,
                  run_dir=str(run_dir), parameters=int(head.num_parameters()))
    return ReadyHead(name, head.eval(), backbone, record)


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
    """A cached head of ``architecture`` for this model: a ``preferred`` config's, else the newest."""
    for training in preferred:
        run_dir = head_dir(cache, fingerprint, training)
        if (run_dir / HEAD_MARKER).is_file():
            return run_dir
    found = sorted((cache / fingerprint[:16]).glob(f"{architecture}-*/{HEAD_MARKER}"),
                   key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


# ---------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    """``python -m circuits_llm.app.head_cache ship RUN_DIR --name NAME [--root DIR]``."""
    parser = argparse.ArgumentParser(prog="python -m circuits_llm.app.head_cache",
                                     description="ship a trained head inside the package")
    sub = parser.add_subparsers(dest="command", required=True)
    ship = sub.add_parser("ship", help="write a finished train-head run as a shipped head")
    ship.add_argument("run_dir", type=Path)
    ship.add_argument("--name", required=True, help="the shipped head's directory name")
    ship.add_argument("--root", type=Path, default=SHIPPED_DIR,
                      help=f"shipped-heads directory (default: {SHIPPED_DIR})")
    args = parser.parse_args(argv)
    from circuits_llm.runtime.checkpoint import CheckpointError
    try:
        shipped = ship_head(args.run_dir, args.root / args.name)
    except (ShippedHeadError, CheckpointError) as error:
        print(f"{parser.prog} ship: error: {error}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in shipped.directory.iterdir())
    print(f"shipped {args.run_dir} as {shipped.directory} ({size / 1e6:.1f} MB, "
          f"{shipped.manifest['parameters']:,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
