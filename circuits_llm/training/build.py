"""Building the draft model of a run: the backbone (frozen + optional LoRA) and the circuit head.

A head is built in two steps. :func:`plan_head` decides its size before any data or tensor
exists: the rank and the draft vocabulary size ``K`` that the config leaves open are chosen so
that the head has at most ``head_budget`` (5%) of the backbone's parameters
(:func:`~circuits_llm.heads.sizing.fit_head_size`); a size the config fixes is kept and, when it
is over the budget, announced by a :class:`~circuits_llm.heads.sizing.HeadBudgetWarning` naming
the numbers. :func:`build_head` then builds the head on the training data: the ``K`` most
frequent tokens of the training sequences
(:func:`~circuits_llm.training.datasets.training_token_counts`), always with the
model's EOS ids (:func:`always_drafted`), become its draft vocabulary.

Every way a head or config can fail to fit the model (vocabulary or hidden size, a circuit file
with the wrong categories or window, a window below 2) is reported as one
:class:`~circuits_llm.training.config.TrainingConfigError` by :func:`plan_head`, before anything
is trained or written.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel

from circuits.errors import CircuitError
from circuits.serialization import load_circuit
from circuits.symbolic import Circuit
from circuits_llm.backbone import HFBackbone
from circuits_llm.draft_block.block import DraftBlock
from circuits_llm.heads import HeadConfigError, MTPHead, check_head_circuit
from circuits_llm.heads.io import DRAFT_TOKENS, head_config, head_tensors, load_head
from circuits_llm.heads.sizing import HeadBudgetWarning, HeadSize, fit_head_size
from circuits_llm.heads.vocab import TokenCounts, frequent_tokens
from circuits_llm.text.models import config_fingerprint
from circuits_llm.training.config import HeadTrainingConfig, TrainingConfigError
from circuits_llm.training.teacher import LanguageModelTeacher


def lm_head_weight(model: PreTrainedModel) -> Tensor:
    """The model's (V, d) output embedding (``model.get_output_embeddings().weight``)."""
    embeddings = model.get_output_embeddings()
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise TrainingConfigError(
            f"{type(model).__name__} has no (V, d) output embedding matrix to initialise the head")
    return weight


def input_embedding_weight(model: PreTrainedModel) -> Tensor:
    """The model's (V, d_e) input embedding (``model.get_input_embeddings().weight``)."""
    embeddings = model.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise TrainingConfigError(
            f"{type(model).__name__} has no (V, d_e) input embedding matrix for the head's token "
            "input; train without token_input")
    return weight


def saved_draft_tokens(directory: str | Path, backbone: HFBackbone, draft_vocab: int) -> Tensor:
    """The (K,) draft token ids of the head saved in ``directory`` (``init_from``), which a run
    starting from it keeps.

    Raises:
        TrainingConfigError: no head there, one without a draft vocabulary, or one of another
            size than ``draft_vocab``.
    """
    try:
        saved = load_head(directory, backbone.hidden_size, backbone.vocab_size)
    except HeadConfigError as error:
        raise TrainingConfigError(f"init_from: {error}") from None
    if saved.draft_tokens is None or saved.draft_tokens.numel() != draft_vocab:
        has = "the whole vocabulary" if saved.draft_tokens is None else \
            f"{saved.draft_tokens.numel():,} tokens"
        raise TrainingConfigError(
            f"init_from: the head in {directory} drafts over {has}, this run over {draft_vocab:,} "
            "(--draft-vocab); start from a head with the same draft vocabulary size")
    return saved.draft_tokens.detach().cpu()


def start_from(head: MTPHead, directory: str | Path) -> None:
    """Copy the tensors of the head saved in ``directory`` into ``head`` (``init_from``).

    Every tensor of the saved head must exist in ``head`` with the same shape (the draft
    vocabulary included), except that a LEAN head may have a larger lean rank (the saved
    components come first, the new ones start at zero: the saved law); ``head``'s other tensors
    (a token input the saved head lacks) keep their initialisation.

    Raises:
        TrainingConfigError: the directory holds no head, or one that does not fit ``head``.
    """
    try:
        saved = load_head(directory, head.hidden_size, head.vocab_size)
    except HeadConfigError as error:
        raise TrainingConfigError(f"init_from: {error}") from None
    mine, theirs = head_tensors(head), head_tensors(saved)
    unknown = sorted(set(theirs) - set(mine))
    wrong = sorted(name for name in set(theirs) & set(mine)
                   if tuple(theirs[name].shape) != tuple(mine[name].shape)
                   and _lean_slice(name, theirs[name], mine[name]) is None)
    if unknown or wrong:
        raise TrainingConfigError(
            f"init_from: the head in {directory} does not fit this run's head (tensors it has "
            f"that this head lacks: {unknown}; of other shapes: {wrong}); start from a head of "
            "the same kind, window, rank, variant and draft vocabulary (a LEAN head may grow "
            "its lean rank)")
    draft = theirs.get(DRAFT_TOKENS)
    if draft is not None and not torch.equal(draft.cpu(), mine[DRAFT_TOKENS].cpu()):
        raise TrainingConfigError(
            f"init_from: the head in {directory} drafts over another vocabulary than this run's "
            "(its draft tokens differ: other training data); start from a head trained on the "
            "same data")
    # the frozen copies of the model's rows (LEAN LM head, token embedding) stay this run's own:
    # a saved head may hold them rounded (float16 storage), the model holds them exactly
    frozen = {name for name, buffer in head.named_buffers() if buffer.is_floating_point()}
    with torch.no_grad():
        for name, value in theirs.items():
            if name in frozen:
                continue
            part = _lean_slice(name, value, mine[name])
            (mine[name] if part is None else mine[name][part]).copy_(value)


def _lean_slice(name: str, saved: Tensor, mine: Tensor) -> tuple[slice, ...] | None:
    """Where a saved LEAN transform of a smaller lean rank goes in this head's (None: nowhere).

    ``down`` (F, K, d, rho) and ``up`` (F, K, rho, d) of a head with a larger ``rho`` take the
    saved components first; the others keep their initialisation, ``up`` zero, so the head's law
    is the saved one (``U V^T e`` gains only zero terms)."""
    if saved.dim() != 4 or mine.dim() != 4:
        return None
    axis = {"inputs.down.": 3, "inputs.up.": 2}.get(name[:name.rfind(".") + 1])
    if axis is None:
        return None
    same = all(a == b for i, (a, b) in enumerate(zip(saved.shape, mine.shape, strict=True))
               if i != axis)
    if not same or saved.shape[axis] > mine.shape[axis]:
        return None
    return tuple(slice(0, saved.shape[axis]) if i == axis else slice(None) for i in range(4))


def build_backbone(model: PreTrainedModel, config: HeadTrainingConfig) -> HFBackbone:
    """``HFBackbone(model, lora_layers, lora_rank, feature_layers=fused_layers)`` (a draft block's
    fused layers' outputs come with the LM head's input); the LoRA init draws from the global RNG.

    Raises:
        TrainingConfigError: ``lora_layers`` exceeds the model's layers.
    """
    if not isinstance(model, PreTrainedModel):
        raise TrainingConfigError(f"model must be a Hugging Face PreTrainedModel, got "
                                  f"{type(model).__name__}")
    try:
        backbone = HFBackbone(model, lora_layers=config.lora_layers, lora_rank=config.lora_rank,
                              feature_layers=config.fused_layers)
    except (TypeError, ValueError) as error:
        raise TrainingConfigError(f"cannot build the backbone: {error}") from None
    return backbone


def backbone_parameters(model: PreTrainedModel) -> int:
    """The model's parameter count (shared tensors, e.g. tied embeddings, counted once)."""
    return sum(p.numel() for p in model.parameters())


def always_drafted(model: PreTrainedModel) -> list[int]:
    """The ids every draft vocabulary keeps: the EOS ids of the model's generation config and
    config (so a draft can end an answer where the model would)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        for eos in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0:
                ids.add(eos)
    return sorted(ids)


@dataclass(frozen=True)
class HeadPlan:
    """What :func:`build_head` builds: the config's head at a decided size.

    Attributes:
        config: the run's config.
        size: the rank, draft vocabulary size and parameter count (:class:`HeadSize`).
        circuit: the head's circuit when read from ``config.circuit_file`` (checked), else None.
    """

    config: HeadTrainingConfig
    size: HeadSize
    circuit: Circuit | None = None

    def describe(self) -> str:
        """A short description for messages, e.g. ``"the btree head (window 16, rank 16, lean,
        K = 8192)"``."""
        config = self.config
        kind = getattr(config.architecture, "value", config.architecture) or "circuit-file"
        rank = "" if self.size.rank is None else f", rank {self.size.rank}"
        vocab = "the whole vocabulary" if self.size.draft_vocab is None else \
            f"K = {self.size.draft_vocab}"
        return f"the {kind} head (window {config.window}{rank}, {config.variant.value}, {vocab})"


def _read_circuit(config: HeadTrainingConfig, categories: int, compressed: bool) -> Circuit:
    assert config.circuit_file is not None
    path = Path(config.circuit_file)
    if not path.is_file():
        raise TrainingConfigError(f"circuit file {path} does not exist")
    try:
        circuit = load_circuit(path)
        window = check_head_circuit(circuit, categories, compressed=compressed)
    except CircuitError as error:
        raise TrainingConfigError(f"circuit file {path} cannot be a head for this model: "
                                  f"{error}") from None
    if window != config.window:
        raise TrainingConfigError(
            f"circuit file {path} has {window} variables but the config's window is "
            f"{config.window}; set window={window}")
    return circuit


def plan_head(config: HeadTrainingConfig, backbone: HFBackbone) -> HeadPlan:
    """Decide the head's size for ``backbone`` and check that the config's head fits it.

    Raises:
        TrainingConfigError: the circuit file does not exist or does not fit (categories,
            window), or the kind cannot be built.
    """
    vocab = backbone.vocab_size
    total = backbone_parameters(backbone.model)
    embedding = None  # the token input's parameters count against the budget too
    if config.token_input:
        embedding = int(input_embedding_weight(backbone.model).shape[1])
    try:
        circuit = None
        if config.circuit_file is not None:
            compressed = config.draft_vocab is not None and config.draft_vocab < vocab
            circuit = _read_circuit(config, config.draft_vocab if compressed else vocab,
                                    compressed)
            size = fit_head_size(None, config.window, backbone.hidden_size, vocab, config.variant,
                                 total, draft_vocab=config.draft_vocab or vocab,
                                 lean_rank=config.lean_rank, fraction=config.head_budget,
                                 circuit=circuit, token_embedding_size=embedding)
        else:
            assert config.architecture is not None
            kind = getattr(config.architecture, "value", config.architecture)
            size = fit_head_size(str(kind), config.window, backbone.hidden_size, vocab,
                                 config.variant, total, rank=config.rank,
                                 draft_vocab=config.draft_vocab, lean_rank=config.lean_rank,
                                 fraction=config.head_budget, token_embedding_size=embedding)
    except (CircuitError, HeadConfigError) as error:
        raise TrainingConfigError(f"cannot build the head: {error}") from None
    plan = HeadPlan(config, size, circuit)
    if not size.within_budget:
        warnings.warn(size.over_budget_message(plan.describe()), HeadBudgetWarning, stacklevel=2)
    return plan


def build_head(plan: HeadPlan, backbone: HFBackbone, counts: TokenCounts | None = None) -> MTPHead:
    """The planned head on ``backbone``'s sizes, initialised from its LM head, on its device.

    With a draft vocabulary (``plan.size.draft_vocab``), ``counts`` (the training data's,
    :func:`~circuits_llm.training.datasets.training_token_counts`) chooses its ids: the most
    frequent, plus the model's EOS ids; a run that starts from a saved head (``init_from``) keeps
    that head's ids instead.

    Shapes: the head maps draft hidden states (B, d) to the parameters of a circuit over
    ``window`` variables with ``K`` categories (``V`` without a draft vocabulary).

    Raises:
        TrainingConfigError: a draft vocabulary is planned but no ``counts`` are given, or they
            count another vocabulary.
    """
    config, size = plan.config, plan.size
    weight = lm_head_weight(backbone.model).detach().float().cpu()
    if tuple(weight.shape) != (backbone.vocab_size, backbone.hidden_size):
        raise TrainingConfigError(
            f"the output embedding has shape {tuple(weight.shape)}, expected (vocab, hidden) = "
            f"({backbone.vocab_size}, {backbone.hidden_size})")
    try:
        tokens = None
        if size.draft_vocab is not None and config.init_from is not None:
            tokens = saved_draft_tokens(config.init_from, backbone, size.draft_vocab)
        elif size.draft_vocab is not None:
            if counts is None:
                raise TrainingConfigError("a head with a draft vocabulary is built from token "
                                          "counts of its training data; pass counts")
            tokens = frequent_tokens(counts, size.draft_vocab, vocab_size=backbone.vocab_size,
                                     always=always_drafted(backbone.model))
        embedding = None
        if config.token_input:
            embedding = input_embedding_weight(backbone.model).detach().float().cpu()
        if plan.circuit is not None:
            head = MTPHead(plan.circuit, backbone.hidden_size, backbone.vocab_size, config.variant,
                           weight, draft_vocab=tokens, lean_rank=config.lean_rank,
                           token_embedding=embedding, seed=config.seed)
        else:
            assert config.architecture is not None and size.rank is not None
            head = MTPHead.from_name(config.architecture, config.window, size.rank,
                                     backbone.hidden_size, backbone.vocab_size, config.variant,
                                     weight, draft_vocab=tokens, lean_rank=config.lean_rank,
                                     token_embedding=embedding, seed=config.seed)
    except (CircuitError, HeadConfigError) as error:
        raise TrainingConfigError(f"cannot build the head: {error}") from None
    if config.init_from is not None:
        start_from(head, config.init_from)
    head.model_fingerprint = config_fingerprint(backbone.model)
    return head.to(backbone.device)


#: how a head's file stores its tensors, not what the head is: left out of its fingerprint, so a
#: run checkpointed by an older writer resumes (format version 3 is the last without them)
_STORAGE_FIELDS = ("storage_dtype", "tied_token_embedding")
_STRUCTURE_FORMAT_VERSION = 3


def head_fingerprint(head: MTPHead) -> str:
    """SHA-256 of the head's structure record (template or full circuit, sizes, variant); the
    file format's storage choices are not part of it."""
    record = asdict(head_config(head))
    for name in _STORAGE_FIELDS:
        record.pop(name)
    record["format_version"] = _STRUCTURE_FORMAT_VERSION
    return hashlib.sha256(json.dumps(record, indent=2, sort_keys=True).encode()).hexdigest()


#: the largest relative gap between the logits rebuilt from cached features and the live ones
#: (float16 features round at 2^-11 relative; scaled or soft-capped logits are far above)
TEACHER_FEATURE_GAP = 0.02


def build_teacher(model: PreTrainedModel, backbone: HFBackbone, head: MTPHead | DraftBlock,
                  config: HeadTrainingConfig, tokens: Tensor | None = None,
                  features: Tensor | None = None) -> LanguageModelTeacher:
    """The LM's law as the loss's target (``TargetLaw.MODEL``).

    With cached features, give one training row's ``tokens`` (1, L) and ``features`` (1, L, d):
    the logits rebuilt from them are checked once against a live forward, so a model whose
    logits are not its LM head applied to its last hidden state is one clear error.

    Raises:
        TrainingConfigError: the model has no such LM head, or its logits differ.
    """
    try:
        teacher = LanguageModelTeacher(model, head.draft_tokens, config.teacher_top_k,
                                       config.teacher_law_temperature, config.teacher_weight)
    except CircuitError as error:
        raise TrainingConfigError(str(error)) from None
    if tokens is not None and features is not None:
        with torch.no_grad():
            logits, _ = backbone.hidden_states(tokens.to(backbone.device))
        gap = teacher.check_features(features.to(backbone.device), logits)
        if gap > TEACHER_FEATURE_GAP:
            raise TrainingConfigError(
                f"{type(model).__name__}'s logits are not its LM head applied to the cached last "
                f"hidden state (relative gap {gap:.3g} > {TEACHER_FEATURE_GAP}: scaled or capped "
                f"logits?); train the model target with --no-cache-features")
    return teacher
