"""The head's configuration: variants, the errors a head raises, and the on-disk config record.

:class:`HeadConfig` is everything needed to rebuild an :class:`~circuits_llm.heads.MTPHead`'s
modules before loading its tensors; it is what ``head_config.json`` holds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any

#: Bumped whenever the meaning of ``head_config.json`` or the tensor names change. Version 2
#: added the draft vocabulary and the model fingerprint, version 3 the verified-token input
#: (``token_width``), version 4 tensors stored in a narrower float (``storage_dtype``) and the
#: token input's rows stored once when they equal the LM head's (``tied_token_embedding``);
#: older files (without them) still load.
FORMAT_VERSION = 4
#: Every version this library reads.
READABLE_VERSIONS = (1, 2, 3, 4)
#: ``storage_dtype`` values: floats a head's tensor file may hold instead of its ``dtype``
STORAGE_DTYPES = ("float16", "bfloat16")


class HeadVariant(Enum):
    """How input units (token distributions) are parameterised from the hidden state ``e_t``.

    ``FULL``: the paper's unembedding tensor, one ``(V, d)`` matrix per input unit, initialised
    from the LM head. ``LEAN``: the frozen LM head applied to per-unit low-rank transforms of
    ``e_t`` (``h = e + U V^T e``), for backbones whose ``n r V d`` floats do not fit.
    """

    FULL = "full"
    LEAN = "lean"


class HeadConfigError(ValueError):
    """A head was configured with values that do not fit, or a saved head cannot be loaded.

    The message says which value was wrong and what was expected.
    """


def parse_variant(variant: HeadVariant | str) -> HeadVariant:
    """``"lean"`` -> ``HeadVariant.LEAN``; raises :class:`HeadConfigError` for other values."""
    if isinstance(variant, HeadVariant):
        return variant
    try:
        return HeadVariant(str(variant).lower())
    except ValueError:
        known = ", ".join(v.value for v in HeadVariant)
        raise HeadConfigError(f"unknown head variant {variant!r}; choose one of: {known}") from None


@dataclass(frozen=True)
class HeadConfig:
    """Everything that fixes the shapes of a head's tensors (the contents of ``head_config.json``).

    Attributes:
        window: number of future tokens (circuit variables ``0 .. window-1``).
        hidden_size: ``d``, the size of the hidden state the head reads.
        vocab_size: ``V``, the categories of every variable.
        variant: ``"full"`` or ``"lean"`` (:class:`HeadVariant` values).
        architecture: the head kind's registered name (``"cp"``, ``"hmm"``..., or one added with
            :func:`~circuits_llm.heads.register_head_kind`), or None for a custom circuit.
        rank: the kind's rank, or None for a custom circuit.
        circuit: the serialised symbolic circuit (custom circuits only), else None.
        input_bias: whether input units have a learned per-unit bias over the vocabulary.
        lean_rank: ``rho``, the rank of the LEAN per-unit transforms (unused by FULL).
        identity_init: whether square sum layers were initialised near identity.
        identity_bias: the diagonal bias used for that initialisation.
        dtype: parameter dtype name, ``"float32"`` or ``"float64"``.
        draft_vocab_size: ``K`` of a compressed draft vocabulary (the circuit's categories; the
            ids are the tensor ``draft_tokens``), or None (the whole vocabulary).
        draft_tokens_sha256: SHA-256 of the draft ids (int64 little-endian), checked on load.
        token_width: the inner width of the head's verified-token input
            (:class:`~circuits_llm.heads.token_input.TokenInput`), or None for a head that reads
            the hidden state only.
        token_embedding_size: the size ``d_e`` of the input-embedding rows it keeps (with
            ``token_width``).
        model_fingerprint: the backbone's ``circuits_llm.text.models.config_fingerprint`` the head
            was built for, or None when unknown; a load for another model is refused.
        storage_dtype: the float type of the tensor file's floating-point tensors when narrower
            than ``dtype`` (``"float16"`` or ``"bfloat16"``: half the bytes; a load casts them
            to ``dtype``), or None (stored as ``dtype``).
        tied_token_embedding: the token input's embedding rows equal the LEAN LM-head rows (a
            model with tied embeddings) and are stored once, as ``inputs.lm_head``.
        tensors_sha256: SHA-256 of ``head.safetensors`` as written with this config.
        format_version: :data:`FORMAT_VERSION` of the writer.
    """

    window: int
    hidden_size: int
    vocab_size: int
    variant: str
    architecture: str | None = None
    rank: int | None = None
    circuit: dict[str, Any] | None = None
    input_bias: bool = True
    lean_rank: int = 8
    identity_init: bool = False
    identity_bias: float = 8.0
    dtype: str = "float32"
    draft_vocab_size: int | None = None
    draft_tokens_sha256: str | None = None
    token_width: int | None = None
    token_embedding_size: int | None = None
    model_fingerprint: str | None = None
    storage_dtype: str | None = None
    tied_token_embedding: bool = False
    tensors_sha256: str | None = None
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "head_config.json") -> HeadConfig:
        """Parse and check a config; every problem is a :class:`HeadConfigError` naming ``source``."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise HeadConfigError(f"{source} is not valid JSON ({error}); the file is corrupt") from None
        if not isinstance(raw, dict):
            raise HeadConfigError(f"{source} must hold a JSON object, got {type(raw).__name__}")
        version = raw.get("format_version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise HeadConfigError(
                f"{source} has format_version {version!r}; this library reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        missing = sorted(f.name for f in fields(cls) if f.name in
                         ("window", "hidden_size", "vocab_size", "variant") and f.name not in raw)
        if unknown or missing:
            raise HeadConfigError(
                f"{source} does not describe a head: missing keys {missing}, unknown keys {unknown}")
        for name in ("window", "hidden_size", "vocab_size", "lean_rank"):
            if name in raw and (not isinstance(raw[name], int) or isinstance(raw[name], bool)
                                or raw[name] < 1):
                raise HeadConfigError(f"{source}: {name} must be an int >= 1, got {raw[name]!r}")
        for name in ("token_width", "token_embedding_size"):
            value = raw.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise HeadConfigError(f"{source}: {name} must be null or an int >= 1, got "
                                      f"{value!r}")
        if (raw.get("token_width") is None) != (raw.get("token_embedding_size") is None):
            raise HeadConfigError(f"{source}: token_width and token_embedding_size must be given "
                                  "together")
        draft = raw.get("draft_vocab_size")
        if draft is not None and (not isinstance(draft, int) or isinstance(draft, bool)
                                  or not 1 <= draft <= raw["vocab_size"]):
            raise HeadConfigError(f"{source}: draft_vocab_size must be null or an int in "
                                  f"1..vocab_size, got {draft!r}")
        if (draft is None) != (raw.get("draft_tokens_sha256") is None):
            raise HeadConfigError(f"{source}: draft_vocab_size and draft_tokens_sha256 must be "
                                  "given together")
        for name in ("draft_tokens_sha256", "model_fingerprint", "tensors_sha256"):
            if raw.get(name) is not None and not isinstance(raw[name], str):
                raise HeadConfigError(f"{source}: {name} must be null or a string, got "
                                      f"{raw[name]!r}")
        for name in ("input_bias", "identity_init", "tied_token_embedding"):
            if name in raw and not isinstance(raw[name], bool):
                raise HeadConfigError(f"{source}: {name} must be true or false, got {raw[name]!r}")
        bias = raw.get("identity_bias", 0.0)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise HeadConfigError(f"{source}: identity_bias must be a number, got {bias!r}")
        if raw.get("architecture") is None and raw.get("circuit") is None:
            raise HeadConfigError(f"{source} names neither an architecture nor a circuit")
        parse_variant(raw["variant"])
        if raw.get("dtype", "float32") not in ("float32", "float64"):
            raise HeadConfigError(f"{source}: dtype must be float32 or float64, got {raw['dtype']!r}")
        if raw.get("storage_dtype") not in (None, *STORAGE_DTYPES):
            raise HeadConfigError(f"{source}: storage_dtype must be null or one of "
                                  f"{', '.join(STORAGE_DTYPES)}, got {raw['storage_dtype']!r}")
        if raw.get("tied_token_embedding") and (
                parse_variant(raw["variant"]) is not HeadVariant.LEAN
                or raw.get("token_embedding_size") != raw["hidden_size"]):
            raise HeadConfigError(f"{source}: tied_token_embedding needs a LEAN head whose token "
                                  "input reads embeddings of the hidden size")
        return cls(**raw)
