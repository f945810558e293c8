"""The heads shipped inside the package: ``circuits_llm/heads_shipped/<name>/``.

A shipped head's directory is a head directory as :func:`~circuits_llm.heads.save_head` writes
it, so ``load_head(directory)`` reads it like any head (checksums, sizes and fingerprint
verified):

* ``head_config.json`` and ``head.safetensors``: the head, its floating-point tensors stored in
  float16 (``storage_dtype``; half the bytes, cast back to float32 on load: a head approximates
  the model, and the decoder's law is exact for any head), the LEAN LM-head rows and the token
  input's rows once when the model ties its embeddings;
* ``shipped.json`` (:data:`SHIPPED_FORMAT`, which the loader ignores): the ``--model`` name the
  head serves (``model_name``, e.g. ``smollm2``), the identity of the model it was trained
  against (``model_identity``: :func:`circuits_llm.text.models.backbone_identity`, its config
  fingerprint and the SHA-256 of its LM head), its kind and parameter count, and the record of
  the ``train-head`` run it came from (``record``: configuration, validation, history), which
  the demo's report shows.

The heads are trained by ``scripts/train_demo_heads.sh`` and written here by
``python -m circuits_llm.app.head_cache ship`` (:func:`write_shipped_head`). Finding the shipped
head of a model is the application's (``circuits_llm.app.head_cache``: ``shipped_head``,
``find_shipped_head``), which computes a model's identity; this module reads and writes the
directories.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from circuits.files import atomic_write_json
from circuits_llm.heads.config import HeadConfigError
from circuits_llm.heads.head import MTPHead
from circuits_llm.heads.io import CONFIG_FILE, load_head, save_head

__all__ = ["SHIPPED_DIR", "SHIPPED_FORMAT", "SHIPPED_MANIFEST", "SHIPPED_STORAGE",
           "SHIPPED_VERSION", "ShippedHead", "ShippedHeadError", "read_shipped_head",
           "shipped_heads", "write_shipped_head"]

#: Where the package's shipped heads live.
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "heads_shipped"
SHIPPED_MANIFEST = "shipped.json"
SHIPPED_FORMAT = "circuits_llm.shipped_head"
#: Version 2: the head in ``save_head``'s format beside the manifest (version 1 kept float16
#: tensors of its own format, rebuilt against the model).
SHIPPED_VERSION = 2
#: The float type of a shipped head's tensors.
SHIPPED_STORAGE = torch.float16


class ShippedHeadError(HeadConfigError):
    """A shipped head cannot be read, written or found (the message says why and what to do)."""


@dataclass(frozen=True)
class ShippedHead:
    """One shipped head: a head directory and its ``shipped.json``.

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
    def kind(self) -> str:
        """The head kind (``ff``, ``btree``...)."""
        return str(self.manifest["kind"])

    @property
    def model_name(self) -> str:
        """The ``--model`` name of the model the head serves (e.g. ``smollm2``)."""
        return str(self.manifest["model_name"])

    @property
    def model_identity(self) -> dict[str, str]:
        """The identity of the model it was trained against (config fingerprint, LM head hash)."""
        return dict(self.manifest["model_identity"])

    @property
    def record(self) -> dict[str, Any]:
        """The ``training.json`` record of the run the head came from."""
        return self.manifest["record"]

    @property
    def training(self) -> dict[str, Any]:
        """The run's :class:`~circuits_llm.training.HeadTrainingConfig` as a dict."""
        return self.record["config"]

    def trained_for(self, identity: Mapping[str, str]) -> bool:
        """Whether the head was trained against the model of ``identity``
        (:func:`circuits_llm.text.models.backbone_identity`)."""
        return dict(identity) == self.model_identity

    def load(self, device: torch.device | str | None = None) -> MTPHead:
        """The head (float32, eval mode), through :func:`~circuits_llm.heads.load_head`.

        Raises:
            ShippedHeadError: the files are damaged (reinstalling restores them).
        """
        try:
            head = load_head(self.directory, device=device,
                             expected_fingerprint=self.model_identity.get("config"))
        except HeadConfigError as error:
            raise ShippedHeadError(f"the shipped head {self.name} cannot be loaded ({error}); "
                                   "reinstall circuits-llm") from None
        return head.eval()


def _check_manifest(manifest: Any, path: Path) -> None:
    """Raise :class:`ShippedHeadError` unless ``manifest`` is a version-2 manifest."""
    problem = None
    if not isinstance(manifest, dict) or manifest.get("format") != SHIPPED_FORMAT \
            or manifest.get("version") != SHIPPED_VERSION:
        problem = f"is not a {SHIPPED_FORMAT} version {SHIPPED_VERSION} manifest"
    elif not all(isinstance(manifest.get(key), str) for key in ("model_name", "kind")) \
            or not isinstance(manifest.get("model_identity"), dict) \
            or not isinstance(manifest.get("record"), dict) \
            or not isinstance(manifest["record"].get("config"), dict):
        problem = "lacks model_name, kind, model_identity or the training record"
    if problem is not None:
        raise ShippedHeadError(f"{path} {problem}; reinstall circuits-llm")


def read_shipped_head(directory: str | Path) -> ShippedHead:
    """Read and check ``directory/shipped.json`` (the head's files are checked when loaded).

    Raises:
        ShippedHeadError: the manifest is missing, not JSON or not a shipped-head manifest, or
            the directory holds no head.
    """
    directory = Path(directory)
    path = directory / SHIPPED_MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ShippedHeadError(f"cannot read the shipped head manifest {path} ({error}); "
                               "reinstall circuits-llm") from None
    _check_manifest(manifest, path)
    if not (directory / CONFIG_FILE).is_file():
        raise ShippedHeadError(f"{directory} has a {SHIPPED_MANIFEST} but no {CONFIG_FILE}; "
                               "reinstall circuits-llm")
    return ShippedHead(directory, manifest)


def shipped_heads(root: str | Path | None = None) -> list[ShippedHead]:
    """Every shipped head under ``root`` (default :data:`SHIPPED_DIR`), by name; none when the
    directory does not exist."""
    root = SHIPPED_DIR if root is None else Path(root)
    if not root.is_dir():
        return []
    return [read_shipped_head(path.parent) for path in sorted(root.glob(f"*/{SHIPPED_MANIFEST}"))]


def write_shipped_head(head: MTPHead, out: str | Path, *, model_name: str,
                       model_identity: Mapping[str, str], record: Mapping[str, Any],
                       ) -> ShippedHead:
    """Write ``head`` as a shipped head in ``out``: the head in float16 (:func:`save_head` with
    :data:`SHIPPED_STORAGE`), then ``shipped.json`` (atomically, last).

    Args:
        head: a head of a registered kind (``head.architecture`` set).
        model_name: the ``--model`` name of the model it serves.
        model_identity: that model's :func:`circuits_llm.text.models.backbone_identity`.
        record: the ``train-head`` run's record (``training.json``, with its ``config``).

    Raises:
        ShippedHeadError: a head of no registered kind, or ``out`` holds something else.
    """
    out = Path(out)
    if head.architecture is None:
        raise ShippedHeadError("only heads of a registered kind are shipped; this one has a "
                               "custom circuit")
    if out.exists() and not (out / SHIPPED_MANIFEST).is_file() and any(out.iterdir()):
        raise ShippedHeadError(f"{out} exists and is not a shipped head; choose another --name")
    save_head(head, out, storage_dtype=SHIPPED_STORAGE)
    manifest = {"format": SHIPPED_FORMAT, "version": SHIPPED_VERSION, "model_name": model_name,
                "model_identity": dict(model_identity), "kind": head.architecture,
                "parameters": int(head.num_parameters()),
                "record": {k: v for k, v in record.items() if k not in ("format", "version")}}
    _check_manifest(manifest, out / SHIPPED_MANIFEST)
    # a training record keeps a diverged loss as Python's json writes it (NaN)
    atomic_write_json(out / SHIPPED_MANIFEST, manifest, sort_keys=True, allow_nan=True)
    return read_shipped_head(out)
