"""Saving and loading a draft block: ``block.safetensors`` (its own weights) + ``block_config.json``.

A :class:`~circuits_llm.draft_block.block.DraftBlock` shares the target's token embedding, final
norm and LM head by reference; only the block's own tensors (fusion, norms, decoder layers) and
its compressed draft vocabulary (``draft_tokens`` (K,) int64) are stored, so a SmolLM2 block is a
few MB, not the 28M-parameter embedding again.

The config records what rebuilds the block (steps, layers, the init it started from, the sizes),
a format version, the SHA-256 of the tensor file and of the draft ids, and the identity of the
target it was trained for (:func:`~circuits_llm.text.models.backbone_identity`: the config
fingerprint and the SHA-256 of the LM head's values). :func:`load_draft_block` checks every one of
them and refuses, with one :class:`DraftBlockFileError` naming the file and the problem, a block
for another model, a corrupt or foreign tensor file, and a config it cannot read.

Both files are written through :func:`circuits.files.atomic_write` (the project's one writer), the
tensors first and the config, which records their checksum, last: a crash between the two is a
checksum mismatch, never a half-read block. ``storage_dtype=torch.float16`` (or bfloat16) stores
the floating-point tensors in half the bytes, as :func:`circuits_llm.heads.save_head` does; a
load casts them back to the model's dtype (the decoder's law is exact for any block).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import PreTrainedModel

from circuits.files import atomic_write, atomic_write_json, sha256_file
from circuits_llm.draft_block.block import BlockInit, DraftBlock, DraftBlockError
from circuits_llm.runtime.tensor_files import read_verified_tensors
from circuits_llm.text.models import backbone_identity

__all__ = ["BLOCK_CONFIG_FILE", "BLOCK_TENSORS_FILE", "BlockFileConfig", "DraftBlockFileError",
           "block_tensors", "load_draft_block", "read_block_config",
           "save_draft_block"]

BLOCK_TENSORS_FILE = "block.safetensors"
BLOCK_CONFIG_FILE = "block_config.json"
FORMAT = "circuits_llm.draft_block"
FORMAT_VERSION = 1
#: the tensor holding a compressed draft vocabulary
DRAFT_TOKENS = "draft_tokens"
_STORAGE = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class DraftBlockFileError(DraftBlockError):
    """A draft block's files cannot be written or read as asked (the message names the file)."""


@dataclass(frozen=True)
class BlockFileConfig:
    """What ``block_config.json`` holds.

    Attributes:
        format, format_version: :data:`FORMAT` and :data:`FORMAT_VERSION`.
        steps, layers, init: the block's :class:`DraftBlock` arguments (``init`` by value).
        hidden_size, vocab_size: the target's ``d`` and ``V``.
        draft_vocab_size, draft_tokens_sha256: ``K`` and the SHA-256 of the int64 ids (None: the
            whole vocabulary).
        model_identity: :func:`~circuits_llm.text.models.backbone_identity` of the target.
        storage_dtype: ``"float16"`` / ``"bfloat16"`` when stored narrow, else None.
        tensors_sha256: SHA-256 of ``block.safetensors``.
        fused_layers: the model's layers whose outputs the block reads besides the LM head's
            input (EAGLE-3); written only when there are some, so files of blocks without them
            are as before.
    """

    format: str
    format_version: int
    steps: int
    layers: int
    init: str
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int | None
    draft_tokens_sha256: str | None
    model_identity: dict[str, str]
    storage_dtype: str | None
    tensors_sha256: str
    fused_layers: tuple[int, ...] = ()

    @classmethod
    def read(cls, path: Path) -> BlockFileConfig:
        """Parse and check ``path`` (one :class:`DraftBlockFileError` per problem)."""
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise DraftBlockFileError(f"{path} cannot be read as JSON ({error}); the file is "
                                      "corrupt") from None
        if not isinstance(values, dict) or values.get("format") != FORMAT:
            raise DraftBlockFileError(f"{path} is not a draft block config (format {FORMAT!r})")
        if values.get("format_version") != FORMAT_VERSION:
            raise DraftBlockFileError(
                f"{path} has format version {values.get('format_version')!r}; this version of "
                f"circuits_llm reads version {FORMAT_VERSION}")
        names = {f.name for f in fields(cls)}
        missing = sorted(names - set(values) - {"fused_layers"})
        unknown = sorted(set(values) - names)
        if missing or unknown:
            raise DraftBlockFileError(f"{path}: missing keys {missing}, unknown keys {unknown}")
        config = cls(**values)
        ints = ("steps", "layers", "hidden_size", "vocab_size")
        bad = [name for name in ints if isinstance(getattr(config, name), bool)
               or not isinstance(getattr(config, name), int) or getattr(config, name) < 1]
        if bad:
            raise DraftBlockFileError(f"{path}: {bad} must be ints >= 1")
        if config.init not in {item.value for item in BlockInit}:
            raise DraftBlockFileError(f"{path}: unknown init {config.init!r}")
        if config.storage_dtype not in (None, *_STORAGE):
            raise DraftBlockFileError(f"{path}: unknown storage_dtype {config.storage_dtype!r}")
        if not isinstance(config.model_identity, dict):
            raise DraftBlockFileError(f"{path}: model_identity must be an object")
        layers = config.fused_layers
        if not isinstance(layers, (list, tuple)) or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
            raise DraftBlockFileError(f"{path}: fused_layers must be a list of layer indices, "
                                      f"got {layers!r}")
        return cls(**{**values, "fused_layers": tuple(layers)})


def block_tensors(block: DraftBlock) -> dict[str, Tensor]:
    """The tensors that define ``block`` beyond the target: its own state (fusion, norms,
    layers; the target's parts are not in it) and ``draft_tokens`` when compressed."""
    tensors = {name: value.detach().cpu().contiguous() for name, value in
               block.state_dict().items()}
    if block.draft_tokens is not None:
        tensors[DRAFT_TOKENS] = block.draft_tokens.detach().to("cpu", torch.int64).contiguous()
    return tensors


def _ids_sha256(tokens: Tensor) -> str:
    return hashlib.sha256(tokens.to("cpu", torch.int64).contiguous().numpy()
                          .astype("<i8", copy=False).tobytes()).hexdigest()


def save_draft_block(block: DraftBlock, directory: str | Path, model: PreTrainedModel, *,
                     storage_dtype: torch.dtype | None = None) -> Path:
    """Write ``block`` (trained for ``model``) to ``directory`` (created if needed).

    Args:
        block: the block.
        directory: where ``block.safetensors`` and ``block_config.json`` go.
        model: the target the block drafts for (its identity is recorded).
        storage_dtype: ``torch.float16`` / ``torch.bfloat16``: floats stored narrow; None: as is.

    Returns:
        ``directory`` as a :class:`~pathlib.Path`.

    Raises:
        DraftBlockFileError: a bad ``storage_dtype``, or a block not built on ``model``.
    """
    if not isinstance(block, DraftBlock):
        raise DraftBlockFileError(f"save_draft_block saves a DraftBlock, got {type(block).__name__}")
    narrow = {value: name for name, value in _STORAGE.items()}
    if storage_dtype is not None and storage_dtype not in narrow:
        raise DraftBlockFileError(f"storage_dtype must be None, torch.float16 or torch.bfloat16, "
                                  f"got {storage_dtype}")
    if block.target.lm_head is not model.get_output_embeddings():
        raise DraftBlockFileError("the block was not built on this model (its LM head is another "
                                  "module); pass the model the block drafts for")
    directory = Path(directory)
    tensors = block_tensors(block)
    if storage_dtype is not None:
        tensors = {name: value.to(storage_dtype) if value.is_floating_point() else value
                   for name, value in tensors.items()}
    tensors_path = directory / BLOCK_TENSORS_FILE
    atomic_write(tensors_path, lambda tmp: save_file(tensors, str(tmp), metadata={
        "format": FORMAT, "format_version": str(FORMAT_VERSION)}))
    tokens = block.draft_tokens
    config = BlockFileConfig(
        FORMAT, FORMAT_VERSION, block.steps, len(block.layers), block.init.value,
        block.hidden_size, block.vocab_size,
        None if tokens is None else int(tokens.numel()),
        None if tokens is None else _ids_sha256(tokens), backbone_identity(model),
        None if storage_dtype is None else narrow[storage_dtype], sha256_file(tensors_path),
        block.fused_layers)
    record = asdict(config)
    if block.fused_layers:
        record["fused_layers"] = list(block.fused_layers)
    else:
        del record["fused_layers"]
    atomic_write_json(directory / BLOCK_CONFIG_FILE, record, sort_keys=True)
    return directory


def _check_model(config: BlockFileConfig, path: Path, model: PreTrainedModel) -> None:
    """Refuse a block recorded for another model than ``model``."""
    mine = backbone_identity(model)
    if config.model_identity.get("config") != mine["config"]:
        raise DraftBlockFileError(
            f"the draft block in {path.parent} was trained for a model with another configuration "
            f"(fingerprint {str(config.model_identity.get('config'))[:16]}... != "
            f"{mine['config'][:16]}...); train a block for this model (circuits-llm train-head "
            "--draft-block)")
    if config.model_identity.get("lm_head_sha256") != mine["lm_head_sha256"]:
        raise DraftBlockFileError(
            f"the draft block in {path.parent} was trained for a model with the same "
            "configuration but other LM head weights (another checkpoint of it); train a block "
            "for this model (circuits-llm train-head --draft-block)")


def _read_tensors(config: BlockFileConfig, path: Path) -> dict[str, Tensor]:
    """The tensor file, checked against its checksum and the recorded storage dtype."""
    tensors = read_verified_tensors(path, config.tensors_sha256, BLOCK_CONFIG_FILE,
                                    DraftBlockFileError)
    if config.storage_dtype is not None:
        wanted = _STORAGE[config.storage_dtype]
        wrong = sorted(name for name, value in tensors.items()
                       if value.is_floating_point() and value.dtype != wanted)
        if wrong:
            raise DraftBlockFileError(f"{path}: tensors {wrong} are not {config.storage_dtype} "
                                      "as the config records; the files do not belong together")
    return tensors


def _draft_tokens(config: BlockFileConfig, tensors: dict[str, Tensor], path: Path
                  ) -> Tensor | None:
    stored = tensors.pop(DRAFT_TOKENS, None)
    if (stored is None) != (config.draft_vocab_size is None):
        raise DraftBlockFileError(f"{path}: the config records draft vocabulary "
                                  f"{config.draft_vocab_size} but the file "
                                  f"{'lacks' if stored is None else 'holds'} draft_tokens")
    if stored is None:
        return None
    if stored.dtype != torch.int64 or stored.dim() != 1 \
            or stored.numel() != config.draft_vocab_size \
            or _ids_sha256(stored) != config.draft_tokens_sha256:
        raise DraftBlockFileError(f"{path}: the stored draft vocabulary does not match the "
                                  f"{config.draft_vocab_size} int64 ids and checksum its config "
                                  "records")
    return stored


def load_draft_block(directory: str | Path, model: PreTrainedModel) -> DraftBlock:
    """Read a block written by :func:`save_draft_block`, for ``model`` (its shared parts), in
    eval mode on the model's device and dtype.

    Raises:
        DraftBlockFileError: missing or corrupt files, another format version, or a block
            trained for another model (the message says which and what to do).
    """
    directory = Path(directory)
    config_path, tensors_path = directory / BLOCK_CONFIG_FILE, directory / BLOCK_TENSORS_FILE
    for path in (config_path, tensors_path):
        if not path.is_file():
            raise DraftBlockFileError(f"{path} does not exist; is {directory} a directory written "
                                      "by save_draft_block?")
    config = BlockFileConfig.read(config_path)
    _check_model(config, config_path, model)
    tensors = _read_tensors(config, tensors_path)
    tokens = _draft_tokens(config, tensors, tensors_path)
    try:
        block = DraftBlock(model, steps=config.steps, layers=config.layers, draft_vocab=tokens,
                           fused_layers=config.fused_layers)
    except DraftBlockError as error:
        raise DraftBlockFileError(f"{config_path} describes a block this model cannot carry: "
                                  f"{error}") from None
    if (block.hidden_size, block.vocab_size) != (config.hidden_size, config.vocab_size):
        raise DraftBlockFileError(f"{config_path} records d = {config.hidden_size}, "
                                  f"V = {config.vocab_size}; the model has {block.hidden_size}, "
                                  f"{block.vocab_size}")
    block.init = BlockInit(config.init)
    own = block.state_dict()
    missing, unknown = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    wrong = sorted(name for name in set(own) & set(tensors)
                   if tuple(own[name].shape) != tuple(tensors[name].shape))
    if missing or unknown or wrong:
        raise DraftBlockFileError(f"{tensors_path} does not fit {config_path}: missing tensors "
                                  f"{missing}, unexpected tensors {unknown}, wrong shapes {wrong}")
    block.load_state_dict({name: value.to(own[name].dtype) for name, value in tensors.items()})
    return block.eval()


def read_block_config(directory: str | Path) -> dict[str, Any]:
    """The checked ``block_config.json`` of ``directory`` as a dict (for reports)."""
    return asdict(BlockFileConfig.read(Path(directory) / BLOCK_CONFIG_FILE))
