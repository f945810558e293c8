"""``MTPHead``: maps a hidden state to the parameters of any circuit over a window of tokens."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from circuits.compiled import CompiledCircuit, LogParameters, compile
from circuits.compiled.folding import FoldKind
from circuits.compiled.layers import FoldedInput
from circuits.errors import InvalidInputError, StructureError
from circuits.symbolic import Categorical, Circuit, InputLayer, Layer, ProductLayer, SumLayer
from circuits.templates import Architecture
from circuits_llm.heads.config import HeadConfigError, HeadVariant, parse_variant
from circuits_llm.heads.kinds import head_kind
from circuits_llm.heads.projections import FoldShape, FullInputs, LeanInputs, SumProjection
from circuits_llm.heads.token_input import TokenInput, check_token_options, mix_token
from circuits_llm.heads.vocab import (
    COMPRESS_ABOVE,
    DraftVocab,
    DraftVocabSource,
    DraftVocabSpec,
    check_draft_tokens,
    resolve_draft_vocab,
)


def check_head_circuit(circuit: Circuit, vocab_size: int, *, compressed: bool = False) -> int:
    """Check that ``circuit`` can be a head's circuit and return its window ``n``.

    A head's circuit has variables exactly ``0 .. n-1``, each ``Categorical(vocab_size)`` (the
    head's categories: the vocabulary, or the draft vocabulary when ``compressed``), no
    integrated (summed-out) input layers, and only normalised (softmax) parameterisations, so that
    it is a distribution for any raw parameters the head emits. Smoothness, decomposability and a
    single output unit are checked by :func:`circuits.compile`.
    """
    if not isinstance(circuit, Circuit):
        raise StructureError(f"a head needs a circuits.Circuit, got {type(circuit).__name__}")
    families = sorted({layer.distribution.describe() for layer in circuit.input_layers
                       if not isinstance(layer.distribution, Categorical)})
    if families:
        raise StructureError(
            f"every input layer of a head's circuit must be Categorical (tokens are categories); "
            f"this circuit has {', '.join(families)} inputs: build it with "
            f"input_distribution=Categorical")
    wrong = {v: c for v, c in circuit.num_categories.items() if c != vocab_size}
    if wrong:
        what = "draft vocabulary" if compressed else "vocabulary"
        raise StructureError(
            f"every variable of a head's circuit must be Categorical({vocab_size}) (the {what} "
            f"size); variables {sorted(wrong)} have {sorted(set(wrong.values()))} categories")
    integrated = [layer.describe() for layer in circuit.input_layers if layer.integrated]
    if integrated:
        raise StructureError(
            f"a head's circuit cannot contain integrated input layers: {', '.join(integrated)}")
    window = circuit.num_variables
    missing = sorted(set(range(window)) - set(circuit.scope))
    if missing:
        raise StructureError(
            f"a head's circuit must cover variables 0..{window - 1} exactly (variable j is the "
            f"j-th future token); variables {missing} are missing")
    unnormalised = [layer.describe() for layer in circuit.layers
                    if isinstance(layer, (InputLayer, SumLayer))
                    and not layer.parameterization.normalized]
    if unnormalised:
        raise StructureError(
            "a head's circuit must use normalised (Softmax) parameterisations so that every "
            f"parameter set is a distribution; these layers do not: {', '.join(unnormalised)}")
    return window


def canonical_copy(circuit: Circuit) -> Circuit:
    """A structural copy of ``circuit`` without ``initial`` parameter values.

    A head's circuit parameters come from the hidden state, never from ``initial``, so the copy
    drops them (nothing is stored or validated for them). Fold names and layout depend only on
    the structure (:func:`circuits.compiled.folding.plan_folds`), so a head rebuilt from a saved
    structure (:mod:`circuits.serialization`) or a template gets the same tensor names.
    """
    new: dict[Layer, Layer] = {}
    for layer in circuit.layers:
        if isinstance(layer, InputLayer):
            new[layer] = InputLayer(layer.variable, layer.num_units, layer.distribution,
                                    layer.parameterization, integrated=layer.integrated)
        elif isinstance(layer, SumLayer):
            new[layer] = SumLayer([new[i] for i in layer.inputs], layer.num_units,
                                  layer.parameterization)
        elif isinstance(layer, ProductLayer):
            new[layer] = ProductLayer([new[i] for i in layer.inputs], layer.kind)
        else:
            raise StructureError(f"a head cannot use {layer.describe()}: unknown layer type")
    return Circuit(new[circuit.output])


def parameter_count(variant: HeadVariant, input_units: int, sum_weights: int, hidden_size: int,
                    vocab_size: int, input_bias: bool = True, lean_rank: int = 8,
                    token_width: int = 0, token_embedding_size: int = 0) -> int:
    """Number of trainable parameters of a head (the frozen LEAN LM head and the frozen token
    embedding are not counted).

    With ``N`` = input units (``sum F*K`` over input folds: ``n`` for FF, ``n r`` for CP / HMM /
    BTree), ``S`` = sum weights (``sum F*K*D`` over sum folds), ``d`` = hidden size, ``V`` = the
    categories of every variable (the vocabulary, or ``K`` for a compressed draft vocabulary):

    * FULL: ``N V d + N V [input_bias] + S (d + 1)``;
    * LEAN: ``2 N d rho + N V [input_bias] + S (d + 1)``;

    plus ``m (2 d + d_e + 1)`` for a head that reads the verified token (:class:`TokenInput` of
    width ``m = token_width`` over embeddings of size ``d_e``; 0 when ``token_width`` is 0).
    """
    bias = input_units * vocab_size if input_bias else 0
    sums = sum_weights * (hidden_size + 1)
    token = token_width * (2 * hidden_size + token_embedding_size + 1) if token_width else 0
    if variant is HeadVariant.FULL:
        return input_units * vocab_size * hidden_size + bias + sums + token
    return 2 * input_units * hidden_size * lean_rank + bias + sums + token


class MTPHead(nn.Module):
    """A draft head: ``hidden`` (B, d) -> raw parameters of a circuit over ``window`` tokens.

    Any smooth, decomposable, normalised circuit over variables ``0 .. n-1`` (each
    ``Categorical(vocab_size)``) becomes a head (:func:`check_head_circuit`). Every parameterised
    fold of the compiled circuit gets its raw parameters from the hidden state:

    * input folds ``(B, F, K, V)`` logits, by the ``variant``'s unembedding (see
      :class:`~circuits_llm.heads.projections.FullInputs` and
      :class:`~circuits_llm.heads.projections.LeanInputs`);
    * sum folds ``(B, F, K, D)`` raw weights, by one linear map (the paper's ``R``,
      :class:`~circuits_llm.heads.projections.SumProjection`).

    The circuit's softmax parameterisation normalises them, so
    ``head.circuit.log_likelihood(x, params=head(hidden))`` is a normalised log-probability.
    Training reads the input units only at the observed tokens:
    :meth:`observed_log_parameters` gives those log-probabilities without the ``(B, F, K, V)``
    logits (in tiles, exact gradients), which is what :func:`circuits_llm.training.loss.mtp_loss` uses.

    Parameter count (:meth:`num_parameters`, :func:`parameter_count`), with ``N`` input units,
    ``S`` sum weights: FULL ``N V d + N V + S (d + 1)``; LEAN ``2 N d rho + N V + S (d + 1)``
    (``N V`` only with ``input_bias``). For n=16, r=32, V=259, d=256 a FULL CP head has 34.1M
    parameters (136 MB in float32) against 2.2M for LEAN with rho=8: prefer LEAN when
    ``n r V d`` floats dominate the backbone's own size or memory, i.e. for small backbones or
    large vocabularies.

    Compressed draft vocabulary (FR-Spec, FastMTP; :mod:`circuits_llm.heads.vocab`): with
    ``draft_vocab`` (``V'`` model ids; ``K`` elsewhere in this package, not to be confused with
    the units ``K`` of a fold) every variable has ``V'`` categories, category ``k`` being model
    id ``draft_tokens[k]``; the input logits are computed for those ``V'`` rows of the LM head
    only (FULL: ``(V', d)`` unembeddings per unit; LEAN: the frozen ``(V', d)`` rows), so ``V``
    becomes ``V'`` = :attr:`draft_vocab_size` in the shapes and counts above. ``vocab_size``
    stays the model's ``V``; the decoder maps drafts through :attr:`draft_tokens` and gives
    ``q = 0`` to every other id, which the verifier's residual covers (the output law stays the
    LM's).

    Reading the verified token (``token_embedding``, :attr:`reads_token`): the hidden state is
    first mixed with the input embedding of ``c``, the token ``X_0`` the verifier has just decided
    (:class:`~circuits_llm.heads.token_input.TokenInput`), as EAGLE / Hydra draft models read it;
    every map below then reads the mixed state. ``c`` is known when a round drafts, so the
    decoder stays exact.

    Args:
        circuit: the symbolic circuit; a :func:`canonical_copy` is compiled, whose own parameters
            are frozen and unused (the head supplies every fold's parameters). Its variables have
            ``vocab_size`` categories, or ``K`` with ``draft_vocab``.
        hidden_size: ``d``, size of the hidden state.
        vocab_size: ``V``, the model's vocabulary (the categories of every variable unless
            ``draft_vocab`` is given).
        variant: :class:`HeadVariant` (or its value).
        lm_head_weight: (V, d) the LM's unembedding. FULL: initialises every input unit (plus
            ``init_noise`` relative noise); optional. LEAN: the frozen shared map; required.
            With ``draft_vocab`` only its rows ``draft_vocab`` are used (and kept).
        draft_vocab: (K,) distinct model ids to draft over, by decreasing frequency
            (:func:`~circuits_llm.heads.vocab.frequent_tokens`), or None for the whole vocabulary.
        input_bias: learn a per-unit bias over the vocabulary (zero-initialised).
        lean_rank: ``rho`` of the LEAN per-unit transforms.
        identity_init: put ``identity_bias`` on the diagonal of every square sum fold
            (HMM transitions, BTree inner sums), so they start near identity (Appendix E).
        identity_bias: that diagonal bias; the diagonal weight starts at
            ``exp(b) / (exp(b) + D - 1)`` (0.99 for b=8, D=32).
        init_noise: FULL: std, relative to ``std(lm_head_weight)``, of the noise added to the
            input units of variables that have several (CP components, HMM states...) so they
            can diverge; variables with one unit (FF) start exactly at the LM head.
        sum_init_std: std of the sum map's initial weights (0: sums start context-free).
        token_embedding: (V, d_e) the model's input embedding
            (``model.get_input_embeddings().weight``): the head then reads the verified token
            ``c`` (the category of ``X_0``) besides the hidden state
            (:class:`~circuits_llm.heads.token_input.TokenInput`; :attr:`reads_token`). With
            ``draft_vocab`` only its rows ``draft_vocab`` are kept (a frozen buffer). None: the
            head reads the hidden state alone.
        token_width: the inner width ``m`` of that map (default: ``hidden_size``).
        dtype: float32 or float64 for parameters and outputs.
        seed: seeds every random initialisation.
    """

    def __init__(self, circuit: Circuit, hidden_size: int, vocab_size: int,
                 variant: HeadVariant | str = HeadVariant.FULL,
                 lm_head_weight: Tensor | None = None, *,
                 draft_vocab: Tensor | Sequence[int] | None = None, input_bias: bool = True,
                 lean_rank: int = 8, identity_init: bool = False, identity_bias: float = 8.0,
                 init_noise: float = 1e-5, sum_init_std: float = 0.0,
                 token_embedding: Tensor | None = None, token_width: int | None = None,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("vocab_size", vocab_size),
                            ("lean_rank", lean_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise HeadConfigError(f"{name} must be an int >= 1, got {value!r}")
        if dtype not in (torch.float32, torch.float64):
            raise HeadConfigError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self.variant = parse_variant(variant)
        if lm_head_weight is not None:
            if not isinstance(lm_head_weight, Tensor) or not lm_head_weight.is_floating_point() \
                    or tuple(lm_head_weight.shape) != (vocab_size, hidden_size):
                got = tuple(lm_head_weight.shape) if isinstance(lm_head_weight, Tensor) else \
                    type(lm_head_weight).__name__
                raise HeadConfigError(
                    f"lm_head_weight must be a float tensor of shape (vocab_size, hidden_size) = "
                    f"({vocab_size}, {hidden_size}), got {got}")
        elif self.variant is HeadVariant.LEAN:
            raise HeadConfigError(
                "the LEAN variant applies the LM head to transformed states: pass lm_head_weight "
                f"({vocab_size}, {hidden_size}), e.g. model.get_output_embeddings().weight")
        check_token_options(token_embedding, token_width, vocab_size)
        tokens = None if draft_vocab is None else check_draft_tokens(draft_vocab, vocab_size)
        #: ``K``: the categories of every circuit variable (``V`` without compression)
        self.draft_vocab_size = vocab_size if tokens is None else int(tokens.numel())
        #: how the draft vocabulary was chosen (:meth:`from_name` records its default)
        self.draft_vocab_source = DraftVocabSource.FULL if tokens is None else \
            DraftVocabSource.GIVEN
        self.window = check_head_circuit(circuit, self.draft_vocab_size,
                                         compressed=tokens is not None)
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.draft_tokens: Tensor | None
        #: (K,) long model ids of the circuit's categories, or None (no compression)
        self.register_buffer("draft_tokens", tokens)
        if tokens is not None and lm_head_weight is not None:
            lm_head_weight = lm_head_weight.detach().index_select(
                0, tokens.to(lm_head_weight.device))
        #: the backbone this head was built for (``circuits_llm.text.models.config_fingerprint``,
        #: saved with the head and checked on load), or None when unknown
        self.model_fingerprint: str | None = None
        self.input_bias = input_bias
        self.lean_rank = lean_rank
        self.identity_init = identity_init
        self.identity_bias = float(identity_bias)
        #: the head kind the circuit came from (set by :meth:`from_name`), else None.
        self.architecture: str | None = None
        #: the kind's rank (set by :meth:`from_name`), else None.
        self.rank: int | None = None
        #: the symbolic circuit, as a :func:`canonical_copy` of the one given.
        self.symbolic = canonical_copy(circuit)
        self.circuit: CompiledCircuit = compile(self.symbolic, dtype=dtype, seed=seed)
        self.circuit.requires_grad_(False)  # every fold is supplied externally

        specs = self.circuit.parameter_specs().values()
        inputs = [FoldShape(s.name, *s.shape, s.variables) for s in specs
                  if s.kind is FoldKind.INPUT]
        sums = [FoldShape(s.name, *s.shape) for s in specs if s.kind is FoldKind.SUM]
        self.input_units = sum(fold.slots for fold in inputs)
        self.sum_weights = sum(fold.numel for fold in sums)
        if identity_init and not any(fold.units == fold.width for fold in sums):
            raise HeadConfigError(
                "identity_init=True but the circuit has no square sum layer (num_units equal to "
                "its number of inputs) to initialise as an identity; pass identity_init=False")
        generator = torch.Generator().manual_seed(seed)
        self.inputs: FullInputs | LeanInputs
        if self.variant is HeadVariant.FULL:
            units = {v: 0 for v in range(self.window)}
            for fold in inputs:
                for v in fold.variables:
                    units[v] += fold.units
            noisy = {v for v, count in units.items() if count > 1}
            self.inputs = FullInputs(inputs, hidden_size, self.draft_vocab_size, input_bias,
                                     lm_head_weight, init_noise, noisy, generator, dtype)
        else:
            assert lm_head_weight is not None
            self.inputs = LeanInputs(inputs, hidden_size, self.draft_vocab_size, input_bias,
                                     lm_head_weight, lean_rank, generator, dtype)
        self.sums = SumProjection(sums, hidden_size, sum_init_std, identity_init, identity_bias,
                                  generator, dtype)
        #: the map that mixes the verified token into the hidden state, or None
        self.token_input: TokenInput | None = None
        if token_embedding is not None:
            rows = token_embedding.detach()
            if tokens is not None:
                rows = rows.index_select(0, tokens.to(rows.device))
            self.token_input = TokenInput(rows, hidden_size, token_width or hidden_size,
                                          generator, dtype)

    # ------------------------------------------------------------------ construction by name
    @classmethod
    def from_name(cls, name: str | Architecture, window: int, rank: int, hidden_size: int,
                  vocab_size: int, variant: HeadVariant | str = HeadVariant.FULL,
                  lm_head_weight: Tensor | None = None, *, identity_init: bool | None = None,
                  draft_vocab: DraftVocabSpec = DraftVocab.AUTO, eos_ids: Iterable[int] = (),
                  compress_above: int = COMPRESS_ABOVE, **options: object) -> MTPHead:
        """A head over a registered head kind: ``ff``, ``cp``, ``hmm``, ``btree`` or one added
        with :func:`~circuits_llm.heads.register_head_kind`.

        ``identity_init`` defaults to the kind's (True for ``hmm``, Appendix E); other keyword
        options are those of :class:`MTPHead`. ``ff`` requires ``rank=1``.

        The draft vocabulary (:func:`~circuits_llm.heads.vocab.resolve_draft_vocab`; the choice
        is :attr:`draft_vocab_source`, shown in ``repr``): by default, on a vocabulary larger than
        ``compress_above`` (:data:`~circuits_llm.heads.vocab.COMPRESS_ABOVE`, 16,384 ids) the
        head drafts over its first :data:`~circuits_llm.heads.vocab.DEFAULT_DRAFT_VOCAB` ids
        (for a BPE vocabulary the bytes and earliest merges) and the ``eos_ids``, chosen without
        data, since its input units cost ``O(V)`` each per round; every other id gets draft
        probability 0 and the verifier's residual covers it, so the output law stays the LM's.
        ``draft_vocab="full"`` (or None) drafts over every id, an int ``K`` over the first ``K``
        ids (and ``eos_ids``), a (K,) tensor or sequence over those ids (e.g.
        :func:`~circuits_llm.heads.vocab.frequent_tokens` of the training data).

        Raises :class:`~circuits.errors.UnknownArchitectureError` (listing the registered names)
        for other names and :class:`HeadConfigError` for ``window < 2`` or a bad ``draft_vocab``.
        """
        kind = head_kind(name)
        if not isinstance(window, int) or isinstance(window, bool) or window < 2:
            raise HeadConfigError(
                f"window must be an int >= 2 (a draft of at least one token after the verified "
                f"one), got {window!r}")
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise HeadConfigError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        tokens, source = resolve_draft_vocab(draft_vocab, vocab_size, eos_ids, compress_above)
        circuit = kind.circuit(window, rank, vocab_size if tokens is None else int(tokens.numel()))
        if identity_init is None:
            identity_init = kind.identity_init
        head = cls(circuit, hidden_size, vocab_size, variant, lm_head_weight, draft_vocab=tokens,
                   identity_init=identity_init, **options)  # type: ignore[arg-type]
        head.architecture = kind.name
        head.rank = rank
        head.draft_vocab_source = source
        return head

    # ------------------------------------------------------------------ forward
    @property
    def dtype(self) -> torch.dtype:
        return self.sums.bias.dtype

    @property
    def reads_token(self) -> bool:
        """Whether the head reads the verified token ``c`` (``X_0``) besides the hidden state:
        :meth:`forward` then takes ``token``."""
        return self.token_input is not None

    def forward(self, hidden: Tensor, token: Tensor | None = None) -> dict[str, Tensor]:
        """``hidden`` (B, d) -> raw external parameters of :attr:`circuit` with batch ``B``.

        Returns ``{fold name: tensor}`` for every parameterised fold: input folds ``(B, F, K, V)``
        logits (``V`` = :attr:`draft_vocab_size`), sum folds ``(B, F, K, D)`` raw weights.
        ``hidden`` is cast to the head's dtype. A head that :attr:`reads_token` needs ``token``
        (B,) long: the category of ``X_0`` (the verified token ``c``; a draft-vocabulary index
        with a compressed vocabulary, -1 for a token outside it: that row reads no token); other
        heads take none.
        """
        if not isinstance(hidden, Tensor) or not hidden.is_floating_point():
            raise InvalidInputError("hidden must be a floating-point torch.Tensor of shape (B, d)")
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise InvalidInputError(
                f"hidden must have shape (batch, {self.hidden_size}), got {tuple(hidden.shape)}; "
                "flatten (batch, time, d) states to (batch * time, d) first")
        hidden = mix_token(self.token_input, hidden.to(self.dtype), token)
        return {**self.inputs(hidden), **self.sums(hidden)}

    def observed_log_parameters(self, hidden: Tensor, targets: Tensor,
                                chunk_rows: int | None = None) -> LogParameters:
        """The circuit's parameters for a training pass that reads every variable at its target.

        A training pass (``log_prefix_marginals``, ``log_likelihood`` under any mask) reads each
        input unit only at its variable's observed category. This returns, for ``hidden`` (S, d)
        and ``targets`` (S, n) (the category of every variable: draft-vocabulary indices with a
        compressed vocabulary), :class:`~circuits.compiled.LogParameters` in which every input
        fold holds a one-column ``(S, F, K, 1)`` table: each unit's log-softmax at its target,
        computed in tiles of ``chunk_rows`` (position, unit) pairs
        (:func:`~circuits_llm.heads.chunked.target_log_softmax`; default about 16M logits a tile),
        never as a ``(S, F, K, V)`` tensor. Evaluate it at data ``x = 0`` (every target relabelled
        category 0: ``torch.zeros_like(targets)``); unobserved variables still sum out to 1. The
        sum folds are the head's outputs, checked like any external parameters
        (:class:`~circuits.errors.InvalidParameterError` for NaN, +inf or no mass) and normalised.

        The result equals ``circuit.<query>(targets, params=head(hidden))`` for every query that
        only reads input units at observed values, gradients included (exact, float64-tested).
        ``targets`` (S, n, m) gives ``m`` columns per variable, ``(S, F, K, m)`` tables: evaluate
        at data ``x`` in ``0 .. m-1`` to read variable ``v`` at ``targets[:, v, x_v]`` (column 0
        is the one a head that reads the token takes as ``X_0``); the training loss's teacher
        candidates use it (:mod:`circuits_llm.training.loss`).
        A head that :attr:`reads_token` reads ``targets[:, 0]`` (``X_0``, the verified token):
        it equals ``head(hidden, targets[:, 0])``'s.
        """
        if not isinstance(hidden, Tensor) or not hidden.is_floating_point() or hidden.dim() != 2 \
                or hidden.shape[1] != self.hidden_size:
            got = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
            raise InvalidInputError(f"hidden must be a float tensor of shape (batch, "
                                    f"{self.hidden_size}), got {got}")
        if not isinstance(targets, Tensor) or targets.dtype != torch.long \
                or targets.dim() not in (2, 3) \
                or tuple(targets.shape[:2]) != (hidden.shape[0], self.window):
            got = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
            raise InvalidInputError(f"targets must be a long tensor of shape ({hidden.shape[0]}, "
                                    f"{self.window}) or ({hidden.shape[0]}, {self.window}, m), "
                                    f"got {got}")
        if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int)
                                       or chunk_rows < 1):
            raise InvalidInputError(f"chunk_rows must be None or an int >= 1, got {chunk_rows!r}")
        hidden = hidden.to(self.dtype)
        targets = targets.to(hidden.device)
        several = targets.dim() == 3
        if self.token_input is not None:  # X_0 is the verified token the head reads
            hidden = mix_token(self.token_input, hidden,
                               targets[:, 0, 0] if several else targets[:, 0])
        sums = self.circuit.resolve_params(self.sums(hidden), hidden.shape[0])
        picked = self.inputs.target_log_probs(hidden, targets, chunk_rows)
        values = dict(sums.values)
        for plan, module in zip(self.circuit.plans, self.circuit.folds, strict=True):
            if isinstance(module, FoldedInput):
                values[plan.fold_id] = picked[plan.name] if several else picked[plan.name][..., None]
        return LogParameters(values, hidden.shape[0])

    def clear_cache(self) -> None:
        """Drop derived tensors cached for gradient-free calls (LEAN: ``W_lm U`` and the flat
        ``V``; the sum map's transposed weight; see
        :class:`~circuits_llm.heads.projections.DerivedCache`). They follow in-place updates,
        ``load_state_dict`` and ``.to()`` by themselves; only edits through ``tensor.data`` need
        this call."""
        if isinstance(self.inputs, LeanInputs):
            self.inputs.clear_cache()
        self.sums.cache.clear()

    def refresh_derived(self) -> None:
        """Rebuild stale cached derived tensors now, eagerly.

        Compiled rounds (:class:`circuits_llm.decoding.round.RoundProgram`) call this before each compiled
        draft: traced code reads the cache as it stands and cannot notice an optimiser step."""
        if isinstance(self.inputs, LeanInputs):
            self.inputs.refresh()
        if self.sums.folds:
            with torch.no_grad():
                self.sums.transposed_weight()

    # ------------------------------------------------------------------ sizes
    def num_parameters(self) -> int:
        """Trainable parameters (equals :func:`parameter_count` for this head's sizes)."""
        return sum(p.numel() for name, p in self.named_parameters()
                   if not name.startswith("circuit."))

    def expected_num_parameters(self) -> int:
        """:func:`parameter_count` evaluated on this head's ``N``, ``S``, ``V``, ``d``."""
        token = self.token_input
        return parameter_count(self.variant, self.input_units, self.sum_weights, self.hidden_size,
                               self.draft_vocab_size, self.input_bias, self.lean_rank,
                               0 if token is None else token.width,
                               0 if token is None else token.embedding_size)

    def describe_draft_vocab(self) -> str:
        """The draft vocabulary in words, e.g. ``"4096 of 49152 ids (default: the leading ids
        and EOS; draft_vocab='full' opts out)"`` (what ``repr`` shows)."""
        source = self.draft_vocab_source
        if self.draft_tokens is None:
            return f"full ({self.vocab_size} ids)"
        size = f"{self.draft_vocab_size} of {self.vocab_size} ids"
        if source is DraftVocabSource.DEFAULT:
            return f"{size} (default: the leading ids and EOS; draft_vocab='full' opts out)"
        return f"{size} ({source.value})"

    def extra_repr(self) -> str:
        name = self.architecture or "custom"
        return (f"architecture={name}, window={self.window}, rank={self.rank}, "
                f"variant={self.variant.value}, hidden_size={self.hidden_size}, "
                f"vocab_size={self.vocab_size}, draft_vocab={self.describe_draft_vocab()}, "
                f"reads_token={self.reads_token}, parameters={self.num_parameters()}")
