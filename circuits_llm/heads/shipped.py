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

The heads are trained by ``scripts/train_demo_heads.sh`` and written here by ``circuits-llm ship``
(:func:`write_shipped_head`). Finding the shipped head of a model is the application's
(``circuits_llm.app.head_cache``: ``shipped_head``, ``find_shipped_head``), which computes a
model's identity; this module reads and writes the directories.

**Layouts** (:class:`ShippedLayout`, the manifest's ``layout``; absent: ``head``). Besides a
circuit head on the model's hidden state, a directory may ship a draft block (issue 44):

* ``head``: ``save_head``'s two files (above); ``kind`` is the head kind (``ff``, ``btree``);
* ``block``: ``save_draft_block``'s two files (``block_config.json``, ``block.safetensors``,
  float16): the recursive drafter (FastMTP); ``kind`` is ``block``;
* ``block_head``: both pairs of files side by side in one directory (their names differ), a
  circuit head that reads the block's output; ``kind`` is ``<head kind>-block`` (``btree-block``)
  and the manifest's ``head`` says what the circuit head is (kind, window, parameters, how it was
  trained).

A block needs the model's embedding, final norm and LM head to be rebuilt, so the block layouts
are loaded by the application (:mod:`circuits_llm.app.shipping`), which this room cannot import;
this module checks their files. The manifests written now record the SHA-256 of every file of the
directory (``files``) and of the manifest itself (``manifest_sha256``): :meth:`ShippedHead.verify`
refuses a flipped byte anywhere with one :class:`ShippedHeadError` that says to reinstall (the
block layouts are always verified before use; the heads' tensors are verified by ``load_head``).
A shipped directory weighs at most :data:`SHIPPED_LIMIT_BYTES`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from circuits.files import atomic_write_json, sha256_file
from circuits_llm.heads.config import HeadConfigError
from circuits_llm.heads.head import MTPHead
from circuits_llm.heads.io import CONFIG_FILE, TENSORS_FILE, load_head, save_head

__all__ = ["BLOCK_FILES", "BLOCK_KIND", "HEAD_FILES", "SHIPPED_DIR", "SHIPPED_FORMAT",
           "SHIPPED_LIMIT_BYTES", "SHIPPED_MANIFEST", "SHIPPED_STORAGE", "SHIPPED_VERSION",
           "ShippedHead", "ShippedHeadError", "ShippedLayout", "block_kind", "check_draft_steps",
           "is_block_kind", "prepare_shipped_dir", "read_shipped_head", "shipped_heads",
           "write_shipped_head", "write_shipped_manifest"]

#: Where the package's shipped heads live.
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "heads_shipped"
SHIPPED_MANIFEST = "shipped.json"
SHIPPED_FORMAT = "circuits_llm.shipped_head"
#: Version 2: the head in ``save_head``'s format beside the manifest (version 1 kept float16
#: tensors of its own format, rebuilt against the model). The block layouts, the file checksums
#: and the manifest's own checksum are optional keys of version 2 (a version-2 reader that
#: predates them reads the head layout as before).
SHIPPED_VERSION = 2
#: The float type of a shipped head's tensors.
SHIPPED_STORAGE = torch.float16
#: The most bytes one shipped directory may hold (issue 44: at most 20 MB each, in float16).
SHIPPED_LIMIT_BYTES = 20_000_000
#: The kind of the recursive draft block; a circuit head on the block is ``<head kind>-block``.
BLOCK_KIND = "block"
#: ``save_head``'s files and ``save_draft_block``'s (``circuits_llm.draft_block.io``: the names
#: are repeated here, a floor below it, and checked against it by tests/test_shipped_blocks.py).
HEAD_FILES = (CONFIG_FILE, TENSORS_FILE)
BLOCK_FILES = ("block_config.json", "block.safetensors")
_REINSTALL = "reinstall circuits-llm"


class ShippedHeadError(HeadConfigError):
    """A shipped head cannot be read, written or found (the message says why and what to do)."""


class ShippedLayout(Enum):
    """What a shipped directory holds besides ``shipped.json``."""

    HEAD = "head"
    """A circuit head on the model's hidden state (``save_head``'s files)."""
    BLOCK = "block"
    """A draft block, drafting recursively (``save_draft_block``'s files)."""
    BLOCK_HEAD = "block_head"
    """A draft block and a circuit head that reads its output (both, side by side)."""

    @property
    def files(self) -> tuple[str, ...]:
        """The files of the layout (besides the manifest)."""
        return {ShippedLayout.HEAD: HEAD_FILES, ShippedLayout.BLOCK: BLOCK_FILES,
                ShippedLayout.BLOCK_HEAD: BLOCK_FILES + HEAD_FILES}[self]

    @property
    def has_block(self) -> bool:
        return self is not ShippedLayout.HEAD


def block_kind(head_kind: str | None) -> str:
    """The shipped kind of a draft block: ``block`` alone, ``<head_kind>-block`` under a circuit
    head (``btree-block``)."""
    return BLOCK_KIND if head_kind is None else f"{head_kind}-{BLOCK_KIND}"


def is_block_kind(name: str) -> bool:
    """Whether ``name`` (a ``--head`` value) names a draft block (``block``, ``btree-block``)."""
    name = str(name).lower()
    return name == BLOCK_KIND or name.endswith(f"-{BLOCK_KIND}")


def _manifest_sha256(manifest: Mapping[str, Any]) -> str:
    """The SHA-256 of ``manifest`` without its own ``manifest_sha256`` (canonical JSON)."""
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=True).encode()).hexdigest()


@dataclass(frozen=True)
class ShippedHead:
    """One shipped directory: a head, a draft block, or both (:class:`ShippedLayout`), and its
    ``shipped.json``.

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
    def layout(self) -> ShippedLayout:
        """What the directory holds (a manifest without ``layout`` holds a head)."""
        return ShippedLayout(self.manifest.get("layout", ShippedLayout.HEAD.value))

    @property
    def kind(self) -> str:
        """The head kind (``ff``, ``btree``...), ``block``, or ``<head kind>-block``."""
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
        """The ``training.json`` record of the run the head (or the block) came from."""
        return self.manifest["record"]

    @property
    def training(self) -> dict[str, Any]:
        """The run's :class:`~circuits_llm.training.HeadTrainingConfig` as a dict."""
        return self.record["config"]

    @property
    def size_bytes(self) -> int:
        """The bytes of the directory's files, the manifest included."""
        return sum(path.stat().st_size for path in self.directory.iterdir() if path.is_file())

    def trained_for(self, identity: Mapping[str, str]) -> bool:
        """Whether the head was trained against the model of ``identity``
        (:func:`circuits_llm.text.models.backbone_identity`)."""
        return dict(identity) == self.model_identity

    def verify(self) -> None:
        """Check every file against the SHA-256 the manifest records (a manifest written before
        the checksums has none to check).

        Raises:
            ShippedHeadError: a file is missing or differs from what was shipped.
        """
        for name, digest in sorted(self.manifest.get("files", {}).items()):
            path = self.directory / name
            if not path.is_file():
                raise ShippedHeadError(f"the shipped {self.kind} {self.name} lacks {path}; "
                                       f"{_REINSTALL}")
            if sha256_file(path) != digest:
                raise ShippedHeadError(f"{path} does not match the checksum of the shipped "
                                       f"{self.kind} {self.name} (the file is damaged); "
                                       f"{_REINSTALL}")

    def load(self, device: torch.device | str | None = None) -> MTPHead:
        """The circuit head (float32, eval mode), through :func:`~circuits_llm.heads.load_head`:
        the head of a ``head`` layout, or the one on the block of a ``block_head`` layout (the
        block itself needs the model: :func:`circuits_llm.app.shipping.load_shipped_drafter`).

        Raises:
            ShippedHeadError: the files are damaged (reinstalling restores them), or the
                directory holds a block alone.
        """
        if self.layout is ShippedLayout.BLOCK:
            raise ShippedHeadError(f"the shipped {self.name} is a draft block, not a circuit head; "
                                   f"load it with circuits_llm.shipped_drafter(model, "
                                   f"{self.kind!r})")
        self.verify()
        try:
            head = load_head(self.directory, device=device,
                             expected_fingerprint=self.model_identity.get("config"))
        except HeadConfigError as error:
            raise ShippedHeadError(f"the shipped head {self.name} cannot be loaded ({error}); "
                                   f"{_REINSTALL}") from None
        return head.eval()


def _check_manifest(manifest: Any, path: Path) -> None:
    """Raise :class:`ShippedHeadError` unless ``manifest`` is a version-2 manifest (with its
    checksums when it records them; a block layout must)."""
    problem = None
    if not isinstance(manifest, dict) or manifest.get("format") != SHIPPED_FORMAT \
            or manifest.get("version") != SHIPPED_VERSION:
        problem = f"is not a {SHIPPED_FORMAT} version {SHIPPED_VERSION} manifest"
    elif not all(isinstance(manifest.get(key), str) for key in ("model_name", "kind")) \
            or not isinstance(manifest.get("model_identity"), dict) \
            or not isinstance(manifest.get("record"), dict) \
            or not isinstance(manifest["record"].get("config"), dict):
        problem = "lacks model_name, kind, model_identity or the training record"
    elif manifest.get("layout", ShippedLayout.HEAD.value) not in {x.value for x in ShippedLayout}:
        problem = f"names an unknown layout {manifest.get('layout')!r}"
    elif ShippedLayout(manifest.get("layout", "head")).has_block and not (
            isinstance(manifest.get("files"), dict) and "manifest_sha256" in manifest):
        problem = "ships a draft block without the checksums of its files"
    elif "manifest_sha256" in manifest and manifest["manifest_sha256"] != \
            _manifest_sha256(manifest):
        problem = "does not match its own checksum (the file is damaged)"
    if problem is not None:
        raise ShippedHeadError(f"{path} {problem}; {_REINSTALL}")


def read_shipped_head(directory: str | Path) -> ShippedHead:
    """Read and check ``directory/shipped.json`` and that the files of its layout exist (their
    contents are checked by :meth:`ShippedHead.verify` and when loaded).

    Raises:
        ShippedHeadError: the manifest is missing, not JSON or not a shipped-head manifest, or
            the directory lacks a file of its layout.
    """
    directory = Path(directory)
    path = directory / SHIPPED_MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ShippedHeadError(f"cannot read the shipped head manifest {path} ({error}); "
                               f"{_REINSTALL}") from None
    _check_manifest(manifest, path)
    shipped = ShippedHead(directory, manifest)
    for name in (name for name in shipped.layout.files if name.endswith(".json")):
        if not (directory / name).is_file():
            raise ShippedHeadError(f"{directory} has a {SHIPPED_MANIFEST} but no {name}; "
                                   f"{_REINSTALL}")
    return shipped


def shipped_heads(root: str | Path | None = None,
                  layouts: tuple[ShippedLayout, ...] | None = None) -> list[ShippedHead]:
    """Every shipped directory under ``root`` (default :data:`SHIPPED_DIR`) of one of
    ``layouts`` (None: every layout), by name; none when the directory does not exist."""
    root = SHIPPED_DIR if root is None else Path(root)
    if not root.is_dir():
        return []
    found = [read_shipped_head(path.parent) for path in sorted(root.glob(f"*/{SHIPPED_MANIFEST}"))]
    return [item for item in found if layouts is None or item.layout in layouts]


def prepare_shipped_dir(out: Path, layout: ShippedLayout) -> None:
    """Make ``out`` ready for a shipped directory of ``layout``: created when missing; refused
    when it holds anything but the files a shipped directory holds; an earlier shipped directory
    there (or one whose shipping was interrupted) loses its manifest first, so a crash midway
    leaves nothing that looks shipped, and the files of its layout that the new one does not
    write.

    Raises:
        ShippedHeadError: ``out`` exists and holds other files.
    """
    known = {SHIPPED_MANIFEST, *ShippedLayout.BLOCK_HEAD.files}
    if out.exists() and (not out.is_dir() or any(p.name not in known for p in out.iterdir())):
        raise ShippedHeadError(f"{out} exists and is not a shipped head; choose another --name")
    out.mkdir(parents=True, exist_ok=True)
    (out / SHIPPED_MANIFEST).unlink(missing_ok=True)
    for name in set(ShippedLayout.BLOCK_HEAD.files) - set(layout.files):
        (out / name).unlink(missing_ok=True)


def check_draft_steps(draft_steps: int | None, layout: ShippedLayout) -> None:
    """Check a manifest's ``draft_steps`` before anything is written: ``None``, or a positive
    integer for a recursive block (:attr:`ShippedLayout.BLOCK`).

    Raises:
        ShippedHeadError: otherwise (the message says why).
    """
    if draft_steps is not None and (layout is not ShippedLayout.BLOCK or isinstance(
            draft_steps, bool) or not isinstance(draft_steps, int) or draft_steps < 1):
        raise ShippedHeadError(f"draft_steps (recursive drafts per round) goes with a recursive "
                               f"draft block and is a positive integer; got {draft_steps!r} for a "
                               f"{layout.value} layout")


def write_shipped_manifest(out: Path, layout: ShippedLayout, *, kind: str, model_name: str,
                           model_identity: Mapping[str, str], record: Mapping[str, Any],
                           parameters: int, head: Mapping[str, Any] | None = None,
                           draft_steps: int | None = None) -> ShippedHead:
    """Write ``out/shipped.json`` (atomically, last) for the files of ``layout`` already in
    ``out``, with their SHA-256 and the manifest's own, then read it back.

    Args:
        kind: what ``--head`` / ``shipped_head`` / ``shipped_drafter`` call it.
        model_name, model_identity: the ``--model`` name and identity of the model it serves.
        record: the ``train-head`` run's record (``training.json``, with its ``config``).
        parameters: the trained parameters shipped.
        head: for :attr:`ShippedLayout.BLOCK_HEAD`, what the circuit head is.
        draft_steps: for :attr:`ShippedLayout.BLOCK`, the recursive drafts per round its drafter
            takes by default (``None``: the depth the block was trained for).

    Raises:
        ShippedHeadError: a file of the layout is missing, the directory would exceed
            :data:`SHIPPED_LIMIT_BYTES`, or ``draft_steps`` is given for another layout or is
            not a positive integer.
    """
    check_draft_steps(draft_steps, layout)
    missing = [name for name in layout.files if not (out / name).is_file()]
    if missing:
        raise ShippedHeadError(f"{out} lacks {missing} of a {layout.value} layout")
    size = sum((out / name).stat().st_size for name in layout.files)
    if size > SHIPPED_LIMIT_BYTES:
        raise ShippedHeadError(f"{out} would hold {size / 1e6:.1f} MB, over the "
                               f"{SHIPPED_LIMIT_BYTES / 1e6:.0f} MB a shipped drafter may weigh; "
                               "ship a smaller one (a lower rank or draft vocabulary)")
    manifest: dict[str, Any] = {
        "format": SHIPPED_FORMAT, "version": SHIPPED_VERSION, "layout": layout.value,
        "model_name": model_name, "model_identity": dict(model_identity), "kind": kind,
        "parameters": int(parameters),
        "record": {k: v for k, v in record.items() if k not in ("format", "version")},
        "files": {name: sha256_file(out / name) for name in layout.files}}
    if head is not None:
        manifest["head"] = dict(head)
    if draft_steps is not None:
        manifest["draft_steps"] = draft_steps
    # through JSON once, so that the checksum is that of what a reader parses
    manifest = json.loads(json.dumps(manifest, allow_nan=True))
    manifest["manifest_sha256"] = _manifest_sha256(manifest)
    _check_manifest(manifest, out / SHIPPED_MANIFEST)
    # a training record keeps a diverged loss as Python's json writes it (NaN)
    atomic_write_json(out / SHIPPED_MANIFEST, manifest, sort_keys=True, allow_nan=True)
    return read_shipped_head(out)


def write_shipped_head(head: MTPHead, out: str | Path, *, model_name: str,
                       model_identity: Mapping[str, str], record: Mapping[str, Any],
                       ) -> ShippedHead:
    """Write ``head`` as a shipped head in ``out``: the head in float16 (:func:`save_head` with
    :data:`SHIPPED_STORAGE`), then ``shipped.json`` (:func:`write_shipped_manifest`).

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
    prepare_shipped_dir(out, ShippedLayout.HEAD)
    save_head(head, out, storage_dtype=SHIPPED_STORAGE)
    return write_shipped_manifest(out, ShippedLayout.HEAD, kind=head.architecture,
                                  model_name=model_name, model_identity=model_identity,
                                  record=record, parameters=head.num_parameters())
