"""Saving and loading heads: ``head.safetensors`` (tensors) + ``head_config.json`` (structure).

Both files are written atomically (temporary file in the same directory, then ``os.replace``);
the tensors first, then the config, which records the SHA-256 of the tensor file. A reader thus
never sees a config describing tensors that are not there: a crash between the two writes, or a
corrupted tensor file, is reported as a checksum mismatch.

Heads of a registered kind (:mod:`circuits_llm.heads.kinds`: the templates and kinds added with
``register_head_kind``) are stored by kind name and rank, and rebuilt through the registry;
custom circuits by their serialised structure (:mod:`circuits.serialization`).

A compressed draft vocabulary is the tensor ``draft_tokens`` (K,) int64 of the tensor file; the
config records ``K`` and the SHA-256 of the ids, and a load checks both and that the ids are
distinct and inside the vocabulary. A head built for a known backbone records its config
fingerprint (``model_fingerprint``); :func:`load_head` refuses, in one
:class:`~circuits_llm.heads.HeadConfigError`, a head whose hidden size, vocabulary size or
fingerprint differs from the model it is loaded for.

``save_head(head, directory, storage_dtype=torch.float16)`` stores the floating-point tensors in
half the bytes (``storage_dtype`` in the config; a load casts them back to the head's dtype): a
head approximates the model, and the decoder's law is exact for any head. This is how the heads
shipped in the package are stored (:mod:`circuits_llm.heads.shipped`). A LEAN head that reads
the verified token keeps two frozen ``(K, d)`` row sets of the model, its LM head's and its input
embedding's; when they are equal (a model with tied embeddings) the file holds them once
(``tied_token_embedding``).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor

from circuits.errors import CircuitError
from circuits.files import atomic_write, sha256_file
from circuits.symbolic import Circuit
from circuits_llm.heads.config import HeadConfig, HeadConfigError, HeadVariant, parse_variant
from circuits_llm.heads.head import MTPHead
from circuits_llm.heads.kinds import head_kind
from circuits_llm.heads.vocab import check_draft_tokens
from circuits_llm.runtime.tensor_files import read_verified_tensors

TENSORS_FILE = "head.safetensors"
CONFIG_FILE = "head_config.json"
#: the tensor holding a compressed draft vocabulary
DRAFT_TOKENS = "draft_tokens"
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: the LEAN LM-head rows, and the token input's rows that may be stored as them
_LM_HEAD_ROWS, _TOKEN_ROWS = "inputs.lm_head", "token_input.embedding"


def draft_tokens_sha256(tokens: Tensor) -> str:
    """SHA-256 (hex) of draft ids as int64 little-endian bytes (what ``head_config.json`` keeps)."""
    ids = tokens.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8", copy=False)
    return hashlib.sha256(np.ascontiguousarray(ids).tobytes()).hexdigest()


def head_tensors(head: MTPHead) -> dict[str, Tensor]:
    """The tensors that define a head: its parameters and the LEAN LM head, not the circuit's own."""
    return {name: value for name, value in head.state_dict().items()
            if not name.startswith("circuit.")}


def head_config(head: MTPHead) -> HeadConfig:
    """The :class:`HeadConfig` that rebuilds ``head``'s modules (without the checksum)."""
    circuit = None
    if head.architecture is None:
        try:
            from circuits.serialization import circuit_to_dict
        except ImportError as error:
            raise HeadConfigError(
                "saving a head built from a custom circuit needs circuits.serialization "
                f"(circuit_to_dict), which is not available: {error}") from None
        circuit = circuit_to_dict(head.symbolic, include_parameters=False)
    dtype = next(name for name, value in _DTYPES.items() if value == head.dtype)
    tokens = head.draft_tokens
    return HeadConfig(
        window=head.window, hidden_size=head.hidden_size, vocab_size=head.vocab_size,
        variant=head.variant.value,
        architecture=head.architecture, rank=head.rank,
        circuit=circuit, input_bias=head.input_bias, lean_rank=head.lean_rank,
        identity_init=head.identity_init, identity_bias=head.identity_bias, dtype=dtype,
        draft_vocab_size=None if tokens is None else int(tokens.numel()),
        draft_tokens_sha256=None if tokens is None else draft_tokens_sha256(tokens),
        token_width=None if head.token_input is None else head.token_input.width,
        token_embedding_size=None if head.token_input is None else
        head.token_input.embedding_size,
        model_fingerprint=head.model_fingerprint)


def _tied_rows(tensors: dict[str, Tensor]) -> bool:
    """Whether the token input's rows equal the LEAN LM-head rows (stored once)."""
    lm_head, rows = tensors.get(_LM_HEAD_ROWS), tensors.get(_TOKEN_ROWS)
    return lm_head is not None and rows is not None and lm_head.shape == rows.shape \
        and bool(torch.equal(lm_head, rows))


def save_head(head: MTPHead, directory: str | Path, *,
              storage_dtype: torch.dtype | None = None) -> None:
    """Write ``head`` to ``directory`` (created if needed); see the module docstring.

    Args:
        storage_dtype: ``torch.float16`` or ``torch.bfloat16``: store the floating-point tensors
            in that type (half the bytes of float32; loads cast back); None: as the head's dtype.
    """
    config = head_config(head)  # fails before anything is written
    stored = {value: name for name, value in _STORAGE_DTYPES.items()}
    if storage_dtype is not None and storage_dtype != head.dtype and storage_dtype not in stored:
        raise HeadConfigError(f"storage_dtype must be None, torch.float16 or torch.bfloat16, got "
                              f"{storage_dtype}")
    narrow = storage_dtype in stored
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: value.detach().cpu().contiguous() for name, value in head_tensors(head).items()}
    tied = _tied_rows(tensors)
    if tied:
        del tensors[_TOKEN_ROWS]
    if narrow:
        tensors = {name: value.to(storage_dtype) if value.is_floating_point() else value
                   for name, value in tensors.items()}
    tensors_path = directory / TENSORS_FILE
    config = replace(config, storage_dtype=stored[storage_dtype] if narrow else None,
                     tied_token_embedding=tied)
    atomic_write(tensors_path, lambda tmp: save_file(tensors, str(tmp), metadata={
        "format_version": str(config.format_version)}))
    config = replace(config, tensors_sha256=sha256_file(tensors_path))
    atomic_write(directory / CONFIG_FILE, lambda tmp: tmp.write_text(config.to_json() + "\n"))


def _stored_tensors(config: HeadConfig, tensors: dict[str, Tensor], source: Path
                    ) -> dict[str, Tensor]:
    """The file's tensors as the head holds them: floats in the head's dtype, the token input's
    rows restored from the LM head's when they were stored once."""
    if config.storage_dtype is not None:
        wanted = _STORAGE_DTYPES[config.storage_dtype]
        wrong = sorted(name for name, value in tensors.items()
                       if value.is_floating_point() and value.dtype != wanted)
        if wrong:
            raise HeadConfigError(f"{source}: tensors {wrong} are not {config.storage_dtype} as "
                                  "the config records; the files do not belong together")
        dtype = _DTYPES[config.dtype]
        tensors = {name: value.to(dtype) if value.is_floating_point() else value
                   for name, value in tensors.items()}
    if config.tied_token_embedding:
        if _TOKEN_ROWS in tensors or _LM_HEAD_ROWS not in tensors:
            raise HeadConfigError(f"{source}: the config records the token input's rows as the "
                                  f"LM head's ({_LM_HEAD_ROWS}), but the file holds "
                                  f"{'both' if _TOKEN_ROWS in tensors else 'neither'}")
        tensors = {**tensors, _TOKEN_ROWS: tensors[_LM_HEAD_ROWS]}
    return tensors


def _rebuild_circuit(config: HeadConfig, source: Path) -> Circuit:
    if config.architecture is not None:
        if config.rank is None:
            raise HeadConfigError(f"{source} names architecture {config.architecture!r} but no rank")
        categories = config.draft_vocab_size or config.vocab_size
        try:
            return head_kind(config.architecture).circuit(config.window, config.rank, categories)
        except CircuitError as error:
            raise HeadConfigError(f"{source}: cannot rebuild the circuit: {error}") from None
    try:
        from circuits.serialization import circuit_from_dict
    except ImportError as error:
        raise HeadConfigError(
            f"{source} holds a custom circuit; reading it needs circuits.serialization "
            f"(circuit_from_dict), which is not available: {error}") from None
    try:
        return circuit_from_dict(config.circuit)
    except (CircuitError, KeyError, TypeError, ValueError) as error:
        raise HeadConfigError(f"{source}: the stored circuit is malformed: {error}") from None


def _check_expected(config: HeadConfig, source: Path, hidden_size: int | None,
                    vocab_size: int | None, fingerprint: str | None) -> None:
    if hidden_size is not None and config.hidden_size != hidden_size:
        raise HeadConfigError(
            f"the head in {source} reads hidden states of size {config.hidden_size} but the "
            f"backbone's hidden size is {hidden_size}; this head was trained for another model")
    if vocab_size is not None and config.vocab_size != vocab_size:
        raise HeadConfigError(
            f"the head in {source} predicts {config.vocab_size} token ids but the backbone's "
            f"vocabulary has {vocab_size}; this head was trained for another tokenizer/model")
    if fingerprint is not None and config.model_fingerprint is not None \
            and config.model_fingerprint != fingerprint:
        raise HeadConfigError(
            f"the head in {source} was built for a model with another configuration "
            f"(fingerprint {config.model_fingerprint[:16]}... != {fingerprint[:16]}...); this head "
            "was trained for another model: train one for this model (circuits-llm train-head)")


def _draft_tokens(config: HeadConfig, tensors: dict[str, Tensor], source: Path) -> Tensor | None:
    """The stored draft vocabulary, checked against the config (None when not compressed)."""
    stored = tensors.get(DRAFT_TOKENS)
    if config.draft_vocab_size is None:
        if stored is not None:
            raise HeadConfigError(f"{source} holds draft_tokens but its config records no draft "
                                  "vocabulary; the files do not belong together")
        return None
    if stored is None:
        raise HeadConfigError(f"{source} lacks the draft_tokens its config records "
                              f"(K = {config.draft_vocab_size}); the files do not belong together")
    try:
        tokens = check_draft_tokens(stored, config.vocab_size)
    except HeadConfigError as error:
        raise HeadConfigError(f"{source}: the stored draft vocabulary is invalid: {error}") from None
    if tokens.numel() != config.draft_vocab_size or stored.dtype != torch.int64 \
            or draft_tokens_sha256(tokens) != config.draft_tokens_sha256:
        raise HeadConfigError(
            f"{source}: the stored draft vocabulary ({tokens.numel()} ids, {stored.dtype}) does "
            f"not match the {config.draft_vocab_size} int64 ids and checksum its config records")
    return tokens


def load_head(directory: str | Path, expected_hidden_size: int | None = None,
              expected_vocab_size: int | None = None,
              device: torch.device | str | None = None, *,
              expected_fingerprint: str | None = None) -> MTPHead:
    """Read a head written by :func:`save_head`. Every failure is a :class:`HeadConfigError`.

    Args:
        expected_hidden_size, expected_vocab_size: the backbone's ``d`` and ``V``; a head for
            other sizes is refused.
        expected_fingerprint: the backbone's ``circuits_llm.text.models.config_fingerprint``; a head
            that recorded another one is refused (heads without a record are accepted).
    """
    directory = Path(directory)
    config_path, tensors_path = directory / CONFIG_FILE, directory / TENSORS_FILE
    for path in (config_path, tensors_path):
        if not path.is_file():
            raise HeadConfigError(f"{path} does not exist; is {directory} a directory written by "
                                  "save_head?")
    config = HeadConfig.from_json(config_path.read_text(), str(config_path))
    _check_expected(config, config_path, expected_hidden_size, expected_vocab_size,
                    expected_fingerprint)
    tensors = read_verified_tensors(tensors_path, config.tensors_sha256, config_path,
                                    HeadConfigError)
    tensors = _stored_tensors(config, tensors, tensors_path)
    tokens = _draft_tokens(config, tensors, tensors_path)
    circuit = _rebuild_circuit(config, config_path)
    variant = parse_variant(config.variant)
    placeholder = embedding = None
    if variant is HeadVariant.LEAN:  # the real frozen LM head comes from the tensor file
        placeholder = torch.zeros(config.vocab_size, config.hidden_size)
    if config.token_embedding_size is not None:  # so do the token embedding's rows
        embedding = torch.zeros(config.vocab_size, config.token_embedding_size)
    try:
        head = MTPHead(circuit, config.hidden_size, config.vocab_size, variant, placeholder,
                       token_embedding=embedding, token_width=config.token_width,
                       draft_vocab=tokens, input_bias=config.input_bias,
                       lean_rank=config.lean_rank, identity_init=config.identity_init,
                       identity_bias=config.identity_bias, dtype=_DTYPES[config.dtype])
    except CircuitError as error:
        raise HeadConfigError(f"{config_path} describes an invalid head: {error}") from None
    if config.architecture is not None:
        head.architecture = head_kind(config.architecture).name
        head.rank = config.rank
    head.model_fingerprint = config.model_fingerprint
    expected = head_tensors(head)
    missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = sorted(name for name in set(expected) & set(tensors)
                   if tuple(tensors[name].shape) != tuple(expected[name].shape))
    if missing or unknown or wrong:
        raise HeadConfigError(
            f"{tensors_path} does not fit {config_path}: missing tensors {missing}, unexpected "
            f"tensors {unknown}, wrong shapes {wrong}")
    head.load_state_dict(tensors, strict=False)
    return head.to(device) if device is not None else head
