"""The configuration of a head-training run: :class:`HeadTrainingConfig` and its errors.

The config is a frozen dataclass that round-trips through JSON (:meth:`HeadTrainingConfig.to_dict`
/ :meth:`HeadTrainingConfig.from_dict`); it is stored in every checkpoint and in
``training.json`` so that a resumed run can be checked against the one that wrote the files.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any, TypeVar

from circuits.errors import UnknownArchitectureError
from circuits.templates import Architecture
from circuits_llm.draft_block.block import BlockInit
from circuits_llm.heads import HeadConfigError, HeadVariant, head_kind
from circuits_llm.heads.config import parse_variant


class TrainingConfigError(ValueError):
    """A training configuration, or a head built from it, does not fit (the message says why)."""


class DataSource(Enum):
    """What the head is trained on.

    ``CORPUS``: random windows of the stdlib training split, in the model's own tokens
    (:mod:`circuits_llm.text.corpus`, cached on disk).
    ``SELF_DISTILLED`` (``train-head --self-distill``): FastMTP Sec. 2.4: prompts cut from the
    training split, continued by the target model itself at ``distill_temperature`` (fixed seeds;
    generated once into the run directory, resumable: :mod:`circuits_llm.training.self_distill`);
    the loss covers the generated responses only.
    """

    CORPUS = "corpus"
    SELF_DISTILLED = "self-distilled"


class TargetLaw(Enum):
    """What each window slot of the loss is trained towards (:mod:`circuits_llm.training.loss`).

    ``TOKENS`` (default): the data's next tokens (Eq. 4 of the MTPC paper).
    ``MODEL`` (``train-head --target-law model``): the LM's own law at that position, read from
    the hidden states the trainer already has (:mod:`circuits_llm.training.teacher`): the
    cross-entropy to its ``teacher_top_k`` most likely tokens at ``teacher_temperature`` (0: the
    argmax, greedy decoding's law), mixed with the token loss by ``teacher_weight``.
    """

    TOKENS = "tokens"
    MODEL = "model"


_E = TypeVar("_E", bound=Enum)


class FeatureCaching(Enum):
    """Whether a run trains from cached backbone features (:mod:`circuits_llm.training.features`).

    ``ON`` (``--cache-features``): the hidden states the head reads (``lora_layers = 0``) or the
    input of layer ``N - k`` (the LoRA draft branch's, ``k = lora_layers``) are computed once per
    training and validation row, stored on disk (:attr:`HeadTrainingConfig.feature_dtype`) and
    read back by every step, which then runs only the head and the ``k`` draft layers. Corpus
    data is then trained on its disjoint ``seq_len`` windows (every window of stride 1 would
    need ``seq_len`` times the corpus in features). Disk: ``rows * seq_len * hidden_size * 2``
    bytes in float16 (SmolLM2-135M, ``seq_len`` 128: 147 KiB per row).
    ``OFF`` (``--no-cache-features``): every step runs the backbone.
    ``AUTO`` (default): ``ON`` where caching leaves the data unchanged, i.e. for self-distilled
    rows (a fixed set of sequences); ``OFF`` for corpus windows (stride 1). When the disk lacks
    the room, ``AUTO`` trains from the backbone instead and says so.
    """

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class FeatureDtype(Enum):
    """How cached features are stored: ``FLOAT16`` (the default: half the bytes of float32; the
    loss then equals the live one up to the rounding of the features to float16, relative
    ``2^-11``) or ``EXACT`` (the backbone's own dtype: the features a live step reads, up to the
    last bits a different batch composition can change; twice the disk for a float32 model)."""

    FLOAT16 = "float16"
    EXACT = "exact"


def _parse_enum(kind: type[_E], name: str, value: object) -> _E:
    """``value`` (a member or its value) as a member of ``kind``, else one clear error."""
    try:
        return kind(getattr(value, "value", value))
    except ValueError:
        known = ", ".join(str(item.value) for item in kind)
        raise TrainingConfigError(f"unknown {name} {value!r}; choose one of: {known}") from None


#: Fields that change neither the parameters nor the data of any step: a checkpoint written with
#: other values of these may be resumed (e.g. to train a finished run for more steps).
RESUMABLE_FIELDS = frozenset({"steps", "eval_every", "checkpoint_every_s"})


def _int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TrainingConfigError(f"{name} must be an int >= {minimum}, got {value!r}")


def _positive(name: str, value: object, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise TrainingConfigError(f"{name} must be a finite number {bound}, got {value!r}")


def _parse_kind(name: Architecture | str) -> Architecture | str:
    """A built-in template as its :class:`Architecture`, a registered head kind as its name.

    Raises:
        UnknownArchitectureError: ``name`` is neither.
    """
    kind = head_kind(name)
    builtin = {a.value: a for a in Architecture}
    return builtin.get(kind.name, kind.name)


@dataclass(frozen=True)
class HeadTrainingConfig:
    """Hyper-parameters of one head-training run.

    Attributes:
        architecture: the head's kind: a circuit template (``ff``, ``cp``, ``hmm``, ``btree``; names
            are parsed to :class:`~circuits.templates.Architecture`) or the name of a kind added
            with :func:`~circuits_llm.heads.register_head_kind`; None when ``circuit_file`` is
            given. Exactly one of the two is set.
        circuit_file: path of a JSON circuit (:mod:`circuits.serialization`) over variables
            ``0 .. window-1``, each ``Categorical(V)``; its stored parameters are not used.
        window: ``n``, the number of future tokens the head models (>= 2); must equal the
            circuit file's number of variables when one is given.
        rank: the template's rank (``ff`` needs 1; ignored for circuit files); None: the largest
            of 32, 16, 8, 4, 2, 1 whose head fits ``head_budget``
            (:func:`~circuits_llm.heads.sizing.fit_head_size`).
        variant: :class:`HeadVariant` FULL (per-unit unembeddings) or LEAN (frozen LM head).
        lean_rank: ``rho`` of the LEAN per-unit transforms.
        draft_vocab: ``K``: the head drafts over the ``K`` most frequent tokens of the training
            data (plus EOS; FR-Spec / FastMTP; ``K >= V``: the whole vocabulary); None: 8192 or
            4096 when the vocabulary is larger than 8192 (whichever fits ``head_budget``), else
            the whole vocabulary. A circuit file's variables have ``K`` categories (``V`` when
            None).
        token_input: the head also reads the verified token ``c`` (the model's input embedding of
            it, mixed into the hidden state: :class:`~circuits_llm.heads.token_input.TokenInput`),
            as EAGLE / Hydra draft models do.
        init_from: a head directory (:func:`~circuits_llm.heads.save_head`'s, e.g. an earlier
            run's ``head/``) whose tensors start this run's head; tensors it lacks (a new token
            input) keep their initialisation, which leaves the saved head's law unchanged. The
            run drafts over the saved head's draft vocabulary (a fine-tune on other data, e.g.
            with chat rows, keeps the output space it starts from). None: a fresh head.
        head_budget: the most trainable parameters a head gets by default, as a fraction of the
            backbone's; an explicit ``rank`` or ``draft_vocab`` beyond it is kept, with a
            :class:`~circuits_llm.heads.sizing.HeadBudgetWarning` naming the numbers.
        lora_layers: ``k`` LoRA draft layers on top of the frozen backbone (0 = frozen only).
        lora_rank: rank of those LoRA adapters (scale ``alpha / r = 1``).
        seq_len: tokens per training sequence; every position starts a window. The loss reads
            the ``N`` input units' logits (``n r`` for CP, HMM, BTree) over ``K`` tokens in
            tiles of about 16M values (:mod:`circuits_llm.heads.chunked`), so memory grows with
            ``batch_size * seq_len * (N rho + S)`` (codes and sum weights), not with ``N K``;
            time grows with ``batch_size * seq_len * N * K``.
        batch_size: sequences per optimiser step (the global batch under DDP).
        learning_rate: AdamW learning rate, constant as in the MTPC paper (which uses 3e-4 for
            a one-epoch run with batches of 256 sequences; the default suits short CPU runs).
        weight_decay: AdamW weight decay.
        grad_clip: clip the global gradient norm to this value (None: no clipping).
        steps: optimiser steps of the whole run.
        gamma: loss discount in ``(0, 1]`` (None: the paper's 0.8 for ``n <= 8``, else 0.9).
        data: :class:`DataSource`.
        seed: seeds the head, the LoRA initialisation, the data order and the self-distillation.
        eval_every: validate every this many steps (and at the start and the end).
        eval_windows: validation sequences (fixed, the first ones of the validation data).
        checkpoint_every_s: also write a checkpoint when this many seconds passed since the last.
        max_train_bytes: cap on the training corpus size, in tokens of the model's tokenizer
            (bytes for a byte model; None: the whole training split).
        distill_samples: self-distilled training sequences to generate.
        distill_prompt_len: prompt tokens per self-distilled sequence; the response fills the
            rest of ``seq_len`` and must be at least ``window`` tokens long.
        distill_temperature: sampling temperature of the self-distillation (0 = greedy): the
            temperature the head will decode at, so a greedy head learns from greedy
            continuations.
        distill_batch: self-distilled rows generated together, one batched forward per token
            (part of the data's cache key: the batch can change the last bits of the logits).
        distill_chat_samples: self-distilled chat rows added to the corpus rows: the model's
            replies to chat requests (:mod:`circuits_llm.training.chat_distill`; 0: none).
        cache_features: :class:`FeatureCaching` (``AUTO``: on for self-distilled data).
        feature_dtype: :class:`FeatureDtype` of the cached features.
        bf16: run the backbone forward under bf16 autocast (slower than fp32 on most CPUs).
        target_law: :class:`TargetLaw` (``MODEL``: train towards the LM's own law).
        teacher_top_k: with ``MODEL``, the LM's most likely tokens per position the head is
            scored on.
        teacher_temperature: with ``MODEL``, the temperature of the LM's law (0: the argmax);
            None: ``distill_temperature`` for self-distilled data (the decode temperature), 1
            for corpus data.
        teacher_weight: with ``MODEL``, the loss is ``(1 - w)`` token loss ``+ w`` cross-entropy
            to the LM's law, ``w`` in ``[0, 1]``.
        draft_block: train a :class:`~circuits_llm.draft_block.DraftBlock` (FastMTP's recursive
            MTP block, ``train-head --draft-block``) instead of a circuit head
            (:mod:`circuits_llm.training.block_trainer`): ``window - 1`` recursive depths, depth
            ``a`` weighted ``gamma^(a-1)``, on the LM head's input (``lora_layers`` 0); the head's
            fields (architecture, rank, variant, token input) are then unused.
            With ``init_from`` (a saved block directory, e.g. an earlier run's ``block/``) the
            block starts from that block's weights and drafts over its vocabulary.
        block_layers: the block's decoder layers ``L``.
        block_init: :class:`~circuits_llm.draft_block.BlockInit` of the block's layers.
        fused_layers: with ``draft_block``, the model's layers whose outputs the block reads
            besides the LM head's input (EAGLE-3's fused features,
            :class:`~circuits_llm.draft_block.DraftBlock`'s ``fused_layers``; the feature cache
            then holds them too); ``()``: none. With ``init_from`` a block without them starts
            with a fusion that is zero, exactly where it stood.
        fusion_learning_rate: the fusion's learning rate (``None``: 10x ``learning_rate``). The
            fusion starts at zero and has a long way to go when the block's weights start
            trained (a continued block): the probe of ``benchmarks/fused_features_probe.py``
            trained the fusion at 10x the block's rate.
        on_block: train the circuit head on a frozen draft block's outputs (``train-head
            --on-block DIR``; :mod:`circuits_llm.training.block_head_trainer`): a
            ``save_draft_block`` directory or a ``--draft-block`` run directory. The head reads
            the block's output ``o_t`` (the block run causally over ``(h_j, x_{j+1})``, ``j <=
            t``) instead of the backbone's ``h_t``, as
            :class:`~circuits_llm.draft_block.BlockCircuitDrafter` drafts; None: the backbone's.
    """

    architecture: Architecture | str | None = Architecture.BTREE
    circuit_file: str | None = None
    window: int = 16
    rank: int | None = None
    variant: HeadVariant = HeadVariant.LEAN
    lean_rank: int = 8
    draft_vocab: int | None = None
    token_input: bool = False
    init_from: str | None = None
    head_budget: float = 0.05
    lora_layers: int = 0
    lora_rank: int = 8
    seq_len: int = 128
    batch_size: int = 8
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    steps: int = 1000
    gamma: float | None = None
    data: DataSource = DataSource.CORPUS
    seed: int = 0
    eval_every: int = 100
    eval_windows: int = 32
    checkpoint_every_s: float = 300.0
    max_train_bytes: int | None = None
    distill_samples: int = 256
    distill_prompt_len: int = 64
    distill_temperature: float = 1.0
    bf16: bool = False
    distill_batch: int = 16
    distill_chat_samples: int = 0
    cache_features: FeatureCaching = FeatureCaching.AUTO
    feature_dtype: FeatureDtype = FeatureDtype.FLOAT16
    target_law: TargetLaw = TargetLaw.TOKENS
    teacher_top_k: int = 16
    teacher_temperature: float | None = None
    teacher_weight: float = 1.0
    draft_block: bool = False
    block_layers: int = 1
    block_init: BlockInit = BlockInit.IDENTITY
    on_block: str | None = None
    fused_layers: tuple[int, ...] = ()
    fusion_learning_rate: float | None = None

    def __post_init__(self) -> None:
        if self.circuit_file is not None:
            if self.architecture is not None:
                raise TrainingConfigError(
                    "give either architecture or circuit_file, not both (set architecture=None "
                    "to train a head over the circuit file)")
            if not isinstance(self.circuit_file, str) or not self.circuit_file:
                raise TrainingConfigError(f"circuit_file must be a path string, got "
                                          f"{self.circuit_file!r}")
        elif self.architecture is None:
            raise TrainingConfigError("give an architecture (ff, cp, hmm, btree) or a circuit_file")
        else:
            try:
                object.__setattr__(self, "architecture", _parse_kind(self.architecture))
            except UnknownArchitectureError as error:
                raise TrainingConfigError(str(error)) from None
        try:
            object.__setattr__(self, "variant", parse_variant(self.variant))
        except HeadConfigError as error:
            raise TrainingConfigError(str(error)) from None
        object.__setattr__(self, "data", _parse_enum(DataSource, "data source", self.data))
        object.__setattr__(self, "cache_features", _parse_enum(
            FeatureCaching, "cache_features setting", self.cache_features))
        object.__setattr__(self, "feature_dtype", _parse_enum(
            FeatureDtype, "feature_dtype", self.feature_dtype))
        object.__setattr__(self, "target_law", _parse_enum(TargetLaw, "target_law",
                                                           self.target_law))
        object.__setattr__(self, "block_init", _parse_enum(BlockInit, "block_init",
                                                           self.block_init))
        self._check_numbers()

    def _check_numbers(self) -> None:
        _int("window", self.window, 2)
        if self.rank is not None:
            _int("rank", self.rank, 1)
        if self.draft_vocab is not None:
            _int("draft_vocab", self.draft_vocab, 1)
        _positive("head_budget", self.head_budget)
        if self.head_budget > 1:
            raise TrainingConfigError(f"head_budget is a fraction of the backbone's parameters in "
                                      f"(0, 1], got {self.head_budget!r}")
        if self.architecture is Architecture.FF and self.rank not in (None, 1):
            raise TrainingConfigError(f"the ff (fully factorised) head has rank 1, got rank="
                                      f"{self.rank}; pass rank=1")
        for name, minimum in (("lean_rank", 1), ("lora_layers", 0), ("lora_rank", 1),
                              ("batch_size", 1), ("steps", 1), ("seed", 0), ("eval_every", 1),
                              ("eval_windows", 1), ("distill_samples", 1),
                              ("distill_prompt_len", 1), ("distill_batch", 1),
                              ("distill_chat_samples", 0)):
            _int(name, getattr(self, name), minimum)
        _int("seq_len", self.seq_len, self.window + 1)
        _positive("learning_rate", self.learning_rate)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        _positive("checkpoint_every_s", self.checkpoint_every_s, allow_zero=True)
        _positive("distill_temperature", self.distill_temperature, allow_zero=True)
        if self.grad_clip is not None:
            _positive("grad_clip", self.grad_clip)
        if self.gamma is not None:
            _positive("gamma", self.gamma)
            if self.gamma > 1:
                raise TrainingConfigError(f"gamma must be in (0, 1], got {self.gamma!r}")
        if self.max_train_bytes is not None:
            _int("max_train_bytes", self.max_train_bytes, self.seq_len + 1)
        if self.distill_chat_samples and self.data is not DataSource.SELF_DISTILLED:
            raise TrainingConfigError("distill_chat_samples adds self-distilled chat rows to "
                                      "self-distilled corpus rows; pass --self-distill too")
        if self.data is DataSource.SELF_DISTILLED and \
                self.seq_len - self.distill_prompt_len < self.window:
            raise TrainingConfigError(
                f"self-distilled responses have seq_len - distill_prompt_len = "
                f"{self.seq_len - self.distill_prompt_len} tokens, fewer than the window "
                f"{self.window}; raise seq_len or lower distill_prompt_len")
        if not isinstance(self.token_input, bool):
            raise TrainingConfigError(f"token_input must be true or false, got "
                                      f"{self.token_input!r}")
        if self.init_from is not None and not isinstance(self.init_from, str):
            raise TrainingConfigError(f"init_from must be None or a head directory path, got "
                                      f"{self.init_from!r}")
        if not isinstance(self.bf16, bool):
            raise TrainingConfigError(f"bf16 must be true or false, got {self.bf16!r}")
        self._check_teacher()
        self._check_block()

    def _check_block(self) -> None:
        if not isinstance(self.draft_block, bool):
            raise TrainingConfigError(f"draft_block must be true or false, got "
                                      f"{self.draft_block!r}")
        _int("block_layers", self.block_layers, 1)
        self._check_fused_layers()
        if self.on_block is not None:
            self._check_on_block()
        if not self.draft_block:
            return
        unused = [name for name, bad in (
            ("lora_layers", self.lora_layers != 0), ("circuit_file", self.circuit_file is not None),
            ("token_input", self.token_input)) if bad]
        if unused:
            raise TrainingConfigError(
                f"a draft block reads the LM head's input and the verified token itself; drop "
                f"{', '.join(unused)} (they configure circuit heads) or train without "
                "--draft-block")

    def _check_fused_layers(self) -> None:
        layers = self.fused_layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple)) or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers) \
                or len(set(layers)) != len(layers):
            raise TrainingConfigError(f"fused_layers must be distinct layer indices >= 0, got "
                                      f"{layers!r}")
        object.__setattr__(self, "fused_layers", tuple(layers))
        if self.fusion_learning_rate is not None:
            _positive("fusion_learning_rate", self.fusion_learning_rate)
        if layers and not self.draft_block:
            raise TrainingConfigError("fused_layers are the layers a draft block reads besides "
                                      "the LM head's input: pass --draft-block too")

    def _check_on_block(self) -> None:
        if not isinstance(self.on_block, str) or not self.on_block:
            raise TrainingConfigError(f"on_block must be None or a draft block's directory path, "
                                      f"got {self.on_block!r}")
        if self.draft_block:
            raise TrainingConfigError(
                "--on-block trains a circuit head on a frozen draft block and --draft-block "
                "trains a draft block: give one of them (train the block first, then the head "
                "on it)")
        if self.lora_layers != 0:
            raise TrainingConfigError(
                "a head on a draft block reads the block's outputs, which read the LM head's "
                "input of the frozen model: drop --lora-layers (use 0) with --on-block")

    def _check_teacher(self) -> None:
        _int("teacher_top_k", self.teacher_top_k, 1)
        if self.teacher_temperature is not None:
            _positive("teacher_temperature", self.teacher_temperature, allow_zero=True)
        _positive("teacher_weight", self.teacher_weight, allow_zero=True)
        if self.teacher_weight > 1:
            raise TrainingConfigError(f"teacher_weight must be in [0, 1], got "
                                      f"{self.teacher_weight!r}")
        if self.target_law is TargetLaw.MODEL and self.lora_layers > 0 \
                and self.cache_features is FeatureCaching.ON:
            raise TrainingConfigError(
                "target_law model with LoRA layers reads the LM's own last hidden state, which "
                "the feature cache does not hold (it holds the draft branch's input): drop "
                "--cache-features, or train with --lora-layers 0")

    @property
    def fusion_rate(self) -> float:
        """The learning rate of a draft block's fusion (see ``fusion_learning_rate``)."""
        return float(self.fusion_learning_rate) if self.fusion_learning_rate is not None \
            else 10 * self.learning_rate

    @property
    def teacher_law_temperature(self) -> float:
        """The temperature of the LM's law the ``MODEL`` target uses (see the attribute)."""
        if self.teacher_temperature is not None:
            return float(self.teacher_temperature)
        return float(self.distill_temperature) if self.data is DataSource.SELF_DISTILLED else 1.0

    # ------------------------------------------------------------------ JSON
    @property
    def response_len(self) -> int:
        """Generated tokens per self-distilled sequence: ``seq_len - distill_prompt_len``."""
        return self.seq_len - self.distill_prompt_len

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (enums as their values)."""
        values = asdict(self)
        values["architecture"] = getattr(self.architecture, "value", self.architecture)
        values["variant"] = self.variant.value
        values["data"] = self.data.value
        values["cache_features"] = self.cache_features.value
        values["feature_dtype"] = self.feature_dtype.value
        values["target_law"] = self.target_law.value
        values["block_init"] = self.block_init.value
        values["fused_layers"] = list(self.fused_layers)
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> HeadTrainingConfig:
        """Inverse of :meth:`to_dict`; unknown keys are a :class:`TrainingConfigError`."""
        if not isinstance(values, dict):
            raise TrainingConfigError(f"a training config must be a JSON object, got "
                                      f"{type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TrainingConfigError(f"unknown training config keys {unknown}")
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HeadTrainingConfig:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as error:
            raise TrainingConfigError(f"not a JSON training config ({error})") from None

    def differences(self, other: HeadTrainingConfig, ignore: frozenset[str] = RESUMABLE_FIELDS,
                    ) -> list[str]:
        """``"name: mine -> other"`` for every field (outside ``ignore``) that differs."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{name}: {mine[name]!r} -> {theirs[name]!r}" for name in mine
                if name not in ignore and mine[name] != theirs[name]]
