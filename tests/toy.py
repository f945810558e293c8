"""A tiny-vocabulary language model and circuit head, small enough to enumerate exactly.

:class:`ToyLM` implements :class:`~circuits_llm.protocols.Backbone`: the next-token logits after a
position are a fixed random function of the last ``order`` tokens and of the position's parity,
so the whole target law of a few tokens can be computed by brute force. It keeps a real token
cache with ``crop`` (a wrong rollback changes the context, hence the law), counts its forward
calls, and can have a *draft branch*: draft hidden states that differ from the verifier's (what
LoRA on the last layers does to a real backbone).

:class:`ToyHead` implements :class:`~circuits_llm.protocols.DraftHead` for any named circuit
template (``ff``, ``cp``, ``hmm``, ``btree``): a random affine map from the hidden state to every
parameter tensor of the compiled circuit.

Example::

    lm = ToyLM(vocab_size=3, draft_branch=True)
    head = ToyHead("btree", window=3, rank=2, hidden_size=lm.hidden_size, vocab_size=3)
    SpeculativeDecoder(lm, head).generate([0, 1], 8, temperature=1.0)
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from circuits.compiled import CompiledCircuit, compile
from circuits.compiled.queries import log_prefix_conditionals
from circuits.templates import build
from circuits_llm.decoding.acceptance import (
    CorrectionPolicy,
    RoundLaw,
    round_law,
    transition,
    usable_conditionals,
)
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import (
    ContextLookup,
    LookupIndex,
    copy_component,
)
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import SamplingConfig, target_probs
from circuits_llm.protocols import BackboneStep


class ToyLM:
    """A Backbone whose logits depend on the last ``order`` tokens and the position parity.

    Args:
        vocab_size: ``V``.
        hidden_size: ``d``.
        order: how many previous tokens the next-token distribution reads (1 or 2 is typical).
        draft_branch: when True, the draft hidden states differ from the verifier's.
        seed: seeds every random table.
        logit_scale: scale of the logits (larger = peakier target distributions).
        dtype: dtype of logits and hidden states.
    """

    def __init__(self, vocab_size: int = 3, hidden_size: int = 6, order: int = 2,
                 draft_branch: bool = False, seed: int = 0, logit_scale: float = 1.5,
                 dtype: torch.dtype = torch.float64) -> None:
        if vocab_size < 2 or hidden_size < 1 or order < 1:
            raise ValueError("ToyLM needs vocab_size >= 2, hidden_size >= 1 and order >= 1")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.order = order
        generator = torch.Generator().manual_seed(seed)
        contexts = 2 * (vocab_size + 1) ** order  # (last tokens incl. "none") x parity
        self.hidden_table = torch.randn(contexts, hidden_size, generator=generator, dtype=dtype)
        self.lm_head = logit_scale * torch.randn(vocab_size, hidden_size, generator=generator,
                                                 dtype=dtype) / hidden_size ** 0.5
        self.draft_table = self.hidden_table + (
            torch.randn(contexts, hidden_size, generator=generator, dtype=dtype)
            if draft_branch else 0.0)
        self.tokens: list[int] = []
        self.calls = 0

    # ------------------------------------------------------------------ Backbone protocol
    @property
    def length(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens = []

    def crop(self, length: int) -> None:
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot crop a cache of {len(self.tokens)} tokens to {length}")
        del self.tokens[length:]

    def extend(self, tokens: Tensor) -> BackboneStep:
        """``tokens`` (1, m) -> logits (1, m, V) and draft hidden states (1, m, d)."""
        if tokens.dim() != 2 or tokens.shape[0] != 1 or tokens.shape[1] < 1:
            raise ValueError(f"ToyLM.extend takes a (1, m) tensor with m >= 1, got {tuple(tokens.shape)}")
        self.calls += 1
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens[0])
        rows = torch.tensor([self._context(self.tokens[: i + 1])
                             for i in range(start, len(self.tokens))])
        hidden = self.hidden_table[rows]
        return BackboneStep(verifier_logits=(hidden @ self.lm_head.T)[None],
                            draft_hidden=self.draft_table[rows][None])

    # ------------------------------------------------------------------ exact target
    def _context(self, sequence: Sequence[int]) -> int:
        """Row of the tables for the position after ``sequence`` (non-empty)."""
        base = self.vocab_size + 1
        index = 0
        for j in range(1, self.order + 1):
            token = sequence[-j] if j <= len(sequence) else self.vocab_size
            index = index * base + token
        return 2 * index + (len(sequence) % 2)

    def next_token_logits(self, sequence: Sequence[int]) -> Tensor:
        """(V,) the verifier's logits for the token after ``sequence`` (no cache involved)."""
        return self.hidden_table[self._context(sequence)] @ self.lm_head.T


class ToyHead(nn.Module):
    """A DraftHead: a random affine map from hidden states to a named circuit's parameters.

    Args:
        architecture: ``"ff"``, ``"cp"``, ``"hmm"`` or ``"btree"``.
        window: ``n``, the number of circuit variables.
        rank: the template's rank (1 for ``ff``).
        hidden_size, vocab_size: must match the backbone.
        seed: seeds the circuit and the affine maps.
        scale: scale of the produced raw parameters (larger = peakier drafts).
        dtype: float32 or float64.
        draft_tokens: a compressed draft vocabulary (model ids, in the circuit's category
            order), or None to draft over the whole vocabulary.
    """

    def __init__(self, architecture: str, window: int, rank: int, hidden_size: int,
                 vocab_size: int, seed: int = 0, scale: float = 1.0,
                 dtype: torch.dtype = torch.float64,
                 draft_tokens: Sequence[int] | None = None) -> None:
        super().__init__()
        self.window = window
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.draft_tokens = None if draft_tokens is None else torch.tensor(list(draft_tokens))
        categories = vocab_size if draft_tokens is None else len(draft_tokens)
        self.circuit: CompiledCircuit = compile(
            build(architecture, num_variables=window, num_categories=categories, rank=rank),
            dtype=dtype, seed=seed)
        generator = torch.Generator().manual_seed(seed + 1)
        self.shapes = self.circuit.parameter_shapes()
        self.maps = nn.ParameterDict()
        for name, shape in self.shapes.items():
            size = shape[0] * shape[1] * shape[2]
            weight = scale * torch.randn(size, hidden_size + 1, generator=generator, dtype=dtype)
            self.maps[name] = nn.Parameter(weight / (hidden_size + 1) ** 0.5)

    def forward(self, hidden: Tensor) -> dict[str, Tensor]:
        """``hidden`` (B, d) -> ``{fold name: (B, F, K, D) raw parameters}``."""
        augmented = torch.cat([hidden, hidden.new_ones(hidden.shape[0], 1)], dim=-1)
        return {name: (augmented.to(weight.dtype) @ weight.T).view(hidden.shape[0], *self.shapes[name])
                for name, weight in self.maps.items()}


# ---------------------------------------------------------------------- exact laws by enumeration
Law = dict[tuple[int, ...], float]

#: A draft-length rule as the tests' negative controls write it: ``(q (n-1, K) the draft's
#: conditionals over the draft vocabulary, drafts (n-1,) draft-vocabulary indices, p (n, V) the
#: target's warped laws at the window positions) -> L``. Unlike a :class:`DraftLength` it may read
#: anything, the target included: what the enumeration must catch as biased.
LengthRule = Callable[[Tensor, Tensor, Tensor], int]


def target_law(lm: ToyLM, prompt: Sequence[int], length: int, config: SamplingConfig) -> Law:
    """The exact (warped) target law of the first ``length`` generated tokens, by brute force."""
    law: Law = {(): 1.0}
    for _ in range(length):
        longer: Law = {}
        for tokens, prob in law.items():
            p = target_probs(lm.next_token_logits([*prompt, *tokens]), config)
            for y in range(lm.vocab_size):
                if p[y] > 0:
                    longer[(*tokens, y)] = prob * float(p[y])
        law = longer
    return law


def decoder_law(lm: ToyLM, head: ToyHead, prompt: Sequence[int], length: int,
                config: SamplingConfig,
                policy: CorrectionPolicy = CorrectionPolicy.EXACT,
                draft_length: DraftLength | LengthRule | None = None,
                lookup: ContextLookup | None = None, mixed_q: bool = True) -> Law:
    """The exact law of the first ``length`` tokens a :class:`SpeculativeDecoder` emits.

    Runs on the head's device (an LM whose outputs are there too: the GPU check's).
    Enumerates every branch of the algorithm with the decoder's own round functions: every draft
    (over the head's draft vocabulary: all tokens, or its compressed ``draft_tokens``) weighted
    by its exact draft probability (the product of the conditionals the round program computes,
    :meth:`RoundProgram.conditionals`), every
    accept/reject outcome and residual or bonus token with its probability
    (:meth:`RoundLaw.outcome_probs` of :func:`round_law`), and the resulting state
    (:func:`transition`). The decoder state after any history is a function of the sequence
    ``prompt + output`` (cache = all but its last token, ``c`` = its last token), which lets
    rounds be memoised by that sequence.

    ``draft_length``: how many drafts a round verifies. ``None`` (default): all ``n - 1``. A
    :class:`DraftLength`: the decoder's rule, applied by the round program's own
    :meth:`DraftLength.decide` to every enumerated whole-window draft and its conditionals (what
    the draft program does); the round then verifies ``[c, d_1..d_L]``
    (``round_law(p[:L+1], q[:L], d[:L])``, the bonus from ``p_{L+1}``). A :data:`LengthRule`
    callable: a rule of the tests (negative controls), which may also read the target ``p``.

    ``lookup``: the decoder's :class:`ContextLookup`. Each draft is then weighted by the mixture
    law written out here independently of the decoder (``(1 - w) H(d) + w [d_{<=m} = s] H(d_{>m})``
    with ``H(d_{>m})`` the head's marginal of the positions after the proposal), the accept test
    uses the round program's mixed conditionals (``mixed_q=False``: the head's alone, the negative
    control), and a draft that starts with the whole proposal is verified up to its ``m`` tokens.
    """
    window, vocab, device = head.window, lm.vocab_size, head.circuit.device
    rule = draft_length if isinstance(draft_length, DraftLength) else None
    program = RoundProgram(head, config, draft_length=rule)
    ids = torch.arange(vocab, device=device) if head.draft_tokens is None else head.draft_tokens.to(device)
    inside = set(ids.tolist())
    drafts = torch.tensor(list(itertools.product(range(len(ids)), repeat=window - 1)), device=device)
    rounds: dict[tuple[int, ...], Law] = {}

    def round_outcomes(sequence: tuple[int, ...]) -> Law:
        if sequence in rounds:
            return rounds[sequence]
        outcomes: Law = defaultdict(float)
        lm.reset()
        c = sequence[-1]
        if len(sequence) == 1:  # one-token prompt: a plain autoregressive step
            p = target_probs(lm.extend(torch.tensor([[c]])).verifier_logits[0, -1], config)
            for y in range(vocab):
                outcomes[(y,)] += float(p[y])
        else:
            hidden = lm.extend(torch.tensor([sequence[:-1]])).draft_hidden[:, -1]
            # c outside the draft vocabulary: X_0 is drawn with the drafts and stands in for c
            branches = [(None, 1.0)] if c in inside else \
                list(enumerate(stand_in_marginal(program, hidden, c).tolist()))
            for stand_in, prior in branches:
                if prior <= 0:
                    continue
                cuts = torch.full((len(drafts),), window - 1)
                compact = program.conditionals(hidden, c, drafts, stand_in=stand_in)  # (D, n-1, K)
                draft_probs = compact.gather(2, drafts[:, :, None])[:, :, 0].prod(1)
                if lookup is not None:
                    draft_probs, cuts, component = _copy_mixture(sequence, lookup, ids, vocab,
                                                                 drafts, draft_probs)
                    if mixed_q:
                        compact = program.conditionals(hidden, c, drafts, component.to(device),
                                                       stand_in=stand_in)
                q_all = torch.zeros(len(drafts), window - 1, vocab, dtype=torch.float64, device=device)
                q_all[:, :, ids] = compact
                for index, q, weight, cut in zip(drafts, q_all, (prior * draft_probs).tolist(),
                                                 cuts.tolist(), strict=True):
                    if weight <= 0:
                        continue
                    draft = ids[index]
                    lm.crop(len(sequence) - 1)
                    step = lm.extend(torch.cat([torch.tensor([c], device=device), draft])[None])
                    p = target_probs(step.verifier_logits[0], config)
                    if draft_length is None and cut == window - 1:
                        law = round_law(p, q, draft)
                        verified = draft
                    else:
                        compact_q = usable_conditionals(q[:, ids])  # what the draft program's rule reads
                        checked = window - 1 if draft_length is None else \
                            program.draft_length.decide(compact_q, index) if rule is not None \
                            else draft_length(compact_q, index, p)  # type: ignore[operator]
                        checked = min(int(checked), cut)
                        law = round_law(p[:checked + 1], q[:checked], draft[:checked])
                        verified = draft[:checked]
                    add_outcomes(outcomes, law, verified, policy, weight)
        rounds[sequence] = dict(outcomes)
        return rounds[sequence]

    return continuation_law(round_outcomes, prompt, length)


def stand_in_marginal(program: RoundProgram, hidden: Tensor, c: int) -> Tensor:
    """(K,) float64: the head's marginal of ``X_0`` when ``c`` is outside the draft vocabulary
    (the head reads no token), the law of the stand-in the draft program draws for ``c``;
    computed with the prefix query, independently of the decoder's top-down pass."""
    with torch.no_grad():
        first = torch.tensor([c], device=program.circuit.device)
        raw = program.head_parameters(hidden, first)
        size = program.draft_size
        x = torch.arange(size, device=first.device)[:, None].expand(size, program.window)
        batch = {k: v.expand(size, *v.shape[1:]) for k, v in raw.items()}
        marginal = log_prefix_conditionals(program.circuit, x.contiguous(), None, batch)[0, 0]
    return marginal.double().exp() / marginal.double().exp().sum()


def _copy_mixture(sequence: tuple[int, ...], lookup: ContextLookup, ids: Tensor, vocab: int,
                  drafts: Tensor, head_probs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The lookup mixture's law of every draft, each draft's verified-length cut, and the copy
    component, written out from the definition (not through the decoder's draw)."""
    position = {int(t): i for i, t in enumerate(ids.tolist())}
    proposal, ngram = LookupIndex(lookup.max_ngram, sequence).propose(drafts.shape[1])
    component = copy_component(proposal, ngram, lookup,
                               [position.get(t, -1) for t in range(vocab)],
                               drafts.shape[1], torch.device("cpu"))
    count, weight = int(component[-2]), float(component[-1])
    cuts = torch.full((len(drafts),), drafts.shape[1])
    if count == 0 or weight == 0:
        return head_probs, cuts, component
    on_path = (drafts[:, :count].cpu() == component[:count].long()).all(1)
    tails = [tuple(d[count:].tolist()) for d in drafts]
    marginal: dict[tuple[int, ...], float] = defaultdict(float)
    for tail, prob in zip(tails, head_probs.tolist(), strict=True):
        marginal[tail] += prob
    copied = torch.tensor([marginal[t] for t in tails], dtype=torch.float64)
    mixture = (1 - weight) * head_probs.cpu() + weight * on_path.double() * copied
    return mixture.to(head_probs.device), torch.where(on_path, count, cuts), component


def add_outcomes(outcomes: Law, law: RoundLaw, verified: Tensor, policy: CorrectionPolicy,
                 weight: float) -> None:
    """Add one verified draft's outcomes to a round's law: every (accepted count, emitted token)
    of ``law`` moved by :func:`transition`, weighted by the draft's probability ``weight``."""
    probs = law.outcome_probs()
    for s, y in probs.nonzero().tolist():
        move = transition(policy, verified.tolist(), s, y)
        outcomes[move.emitted] += weight * float(probs[s, y])


def total_variation(first: Law, second: Law) -> float:
    """``0.5 * sum |first - second|`` over the union of outcomes."""
    keys = set(first) | set(second)
    return 0.5 * sum(abs(first.get(k, 0.0) - second.get(k, 0.0)) for k in keys)


def law_p_value(samples: Sequence[tuple[int, ...]], law: Law) -> float:
    """Pearson chi-square p-value of ``samples`` (decoded sequences) against an enumerated ``law``
    (every cell's expected count should be >= 5); a sequence outside the law's support fails."""
    counts = Counter(samples)
    assert set(counts) <= set(law), "the decoder emitted a sequence the target forbids"
    n = len(samples)
    statistic = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in law.items())
    return float(torch.special.gammaincc(torch.tensor((len(law) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def continuation_law(round_outcomes: Callable[[tuple[int, ...]], Law], prompt: Sequence[int],
                     length: int) -> Law:
    """The law of the first ``length`` tokens after ``prompt`` of a decoder whose rounds emit
    ``round_outcomes(sequence)`` (emitted tuple -> probability), by enumeration over rounds."""

    def continuation(sequence: tuple[int, ...], remaining: int) -> Law:
        result: Law = defaultdict(float)
        for emitted, prob in round_outcomes(sequence).items():
            if len(emitted) >= remaining:
                result[emitted[:remaining]] += prob
                continue
            for tail, tail_prob in continuation(sequence + emitted, remaining - len(emitted)).items():
                result[emitted + tail] += prob * tail_prob
        return result

    return dict(continuation(tuple(prompt), length)) if length > 0 else {(): 1.0}
