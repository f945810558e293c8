"""Exact acceptance of a drafter's drafts at T = 1 and greedy, per position of fixed held-out text:
the measures behind ``python -m benchmarks.expected_acceptance`` (the table and CLI) and
:mod:`benchmarks.expected_acceptance_block` (draft blocks).

Why: the sampled tokens per round that ``make demo`` and ``experiments.acceptance_sweep`` report
move by up to +-0.1 between runs of 6 prompts, because every draw changes the text that follows.
Here the text is fixed (held-out standard-library files, the demo's split) and, at every position
``t`` where the verified token ``c = x_{t+1}`` is in the head's draft vocabulary, the head reads
the hidden state the decoder would give it and the exact conditionals ``q`` the round would verify
with (:meth:`~circuits_llm.decoding.round.RoundProgram.conditionals`) are compared with the model's
next-token laws ``p`` (temperature 1):

* ``alpha1 = sum_x min(p(x | x_{<=t+1}), q(X_1 = x | X_0 = c))``: the probability that the round's
  first draft is accepted (speculative sampling accepts a draft from ``q`` with exactly this
  probability);
* ``beta2 = sum_x min(p(x | x_{<=t+2}), q(X_2 = x | c, x_{t+2}))``: the same for the second draft,
  given a first draft equal to the text's own next token;
* ``beta3``: the same for the third draft given the first two equal to the text's
  (``q(X_3 | c, x_{t+2}, x_{t+3})``; windows of 4 or more). ``beta2`` and ``beta3`` cover the
  positions whose conditioning tokens are in the draft vocabulary (a draft can only be one of
  those).

Greedy (``temperature 0``): the target's law is the point mass on its argmax and the draft is
deterministic, so ``sum_x min(p, q)`` is the indicator that the draft IS the target's argmax (over
the whole vocabulary): ``alpha1`` is the share of positions whose greedy first draft is the
model's argmax, ``beta2`` / ``beta3`` the same for the greedy draft of slot 2 / 3 given the text's
tokens before it. A head's greedy draft is its max-product completion of the window given the
evidence (``X_0 = c``, then also ``X_1 = x_{t+2}``, ...): exactly the decoder's greedy drafts
whenever its own earlier drafts equal the text's. (``p(argmax q)``, the acceptance of greedy
drafts verified by sampling at T = 1, is not measured: no decoder here pairs the two.)

A drafter that reads something other than the backbone's hidden state (a circuit head on a draft
block reads the block's outputs) is measured through a :data:`FeatureMap`. With the round's costs
(:class:`~benchmarks.acceptance_speed.RoundCosts`), :func:`measure_head` adds the speed bounds of
:mod:`benchmarks.acceptance_speed` to its record.

**Which text.** By default the held-out files themselves. A decoder at T = 1 drafts on the model's
own samples, though, and a drafter trained on corpus text may accept less there:
``--continuations T`` of :mod:`benchmarks.expected_acceptance` appends to each file's first
``--length`` tokens the model's own continuation at temperature ``T``
(:func:`own_continuations`) and measures only the rounds that draft it (``first``: the row ``t``
whose verified token ``c = x_{t+1}`` is the prompt's last).

The copy of the context (:class:`~circuits_llm.decoding.lookup.ContextLookup`) is left out: it is
no property of the head. :class:`TemperedHead` measures drafts from heads whose categorical
inputs are tempered: a draft-side choice that would keep the decoder's law exact, and would pay
off only if the heads were miscalibrated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from benchmarks.acceptance_speed import RoundCosts, speed_bounds
from circuits.compiled import FoldKind
from circuits.compiled.layers import Semiring
from circuits.compiled.prepared import Trace
from circuits.compiled.sampling import argmax_chooser, descend
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.protocols import Backbone

#: What a drafter reads in place of the backbone's features: ``(hidden (T, d), ids (T,)) ->
#: (T', d)``, row ``t`` the hidden state a round after ``c = x_{t+1}`` hands the head (a circuit
#: head on a draft block reads the block's outputs ``o_1``, ``T' = T - 1``:
#: :func:`benchmarks.expected_acceptance_block.block_features`).
FeatureMap = Callable[[Tensor, Tensor], Tensor]


class TemperedHead:
    """A draft head whose categorical inputs' log-weights are divided by ``temperature``.

    Every other attribute is the wrapped head's. For inputs with a softmax parameterisation each
    input distribution ``l`` becomes ``l^(1/T) / Z``; the mixture weights are unchanged. Drafting
    from it and verifying with its own conditionals keeps a speculative decoder exact for every
    ``T > 0`` (the draft law is any law whose conditionals the round knows).
    """

    def __init__(self, head: Any, temperature: float) -> None:
        if not temperature > 0 or temperature == float("inf"):
            raise ValueError(f"a draft temperature must be a finite number > 0, got {temperature!r}")
        self.head = head
        self.temperature = float(temperature)
        #: the external parameter names of the circuit's input folds (tempered)
        self.inputs = frozenset(name for name, spec in head.circuit.parameter_specs().items()
                                if spec.kind is FoldKind.INPUT)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.head, name)

    def __call__(self, *args: Tensor) -> dict[str, Tensor]:
        raw = self.head(*args)
        return {name: value / self.temperature if name in self.inputs else value
                for name, value in raw.items()}


@dataclass(frozen=True)
class Position:
    """One position ``t`` of the fixed text, ready for the head.

    Attributes:
        hidden: (1, d) the draft hidden state before ``c`` (what a round after ``c`` reads; on a
            block, the block's output ``o_1`` after ``c``).
        c: the verified token's model id ``x_{t+1}``.
        second: the draft-vocabulary index of the text's token after ``c`` (-1 outside it).
        third: the same for the token after that one, ``x_{t+3}``.
        p1, p2, p3: (K,) float64, the model's laws of ``x_{t+2}``, ``x_{t+3}``, ``x_{t+4}`` over
            the draft vocabulary.
        targets: the model's argmax ids of those three tokens (greedy decoding's choices).
    """

    hidden: Tensor
    c: int
    second: int
    third: int
    p1: Tensor
    p2: Tensor
    p3: Tensor
    targets: tuple[int, int, int]


def text_features(backbone: Backbone, ids: Tensor, features: FeatureMap | None = None
                  ) -> tuple[Tensor, Tensor]:
    """One prefill of ``ids`` (T,): ``(hidden (T', d), logits (T, V))``, the hidden state a round
    after ``c = x_{t+1}`` hands its drafter at row ``t`` (the backbone's ``h_t``, ``T' = T``; with
    ``features``, what it maps them to, e.g. a block's output ``o_1``, ``T' = T - 1``) and the
    model's next-token logits."""
    with torch.no_grad():
        backbone.reset()
        step = backbone.extend(ids[None])
    hidden = step.draft_hidden[0]
    if features is not None:
        hidden = features(hidden, ids)
    return hidden, step.verifier_logits[0]


def collect_positions(backbone: Backbone, texts: Sequence[Tensor], program: RoundProgram,
                      features: FeatureMap | None = None, *, first: int = 0
                      ) -> tuple[list[Position], int]:
    """Every usable position ``t >= first`` of ``texts`` (each (T,) model ids) for ``program``'s
    head (reading ``features`` of the backbone's hidden states when given): the positions and how
    many were skipped because ``c`` is outside the draft vocabulary (a round there drafts with a
    stand-in, which these measures do not cover)."""
    positions: list[Position] = []
    skipped = 0
    tokens = program.draft_tokens
    lookup = None if program.position is None else program.position.tolist()

    def index(token: int) -> int:  # model id -> draft-vocabulary index (-1 outside it)
        return token if lookup is None else lookup[token]

    for ids in texts:
        hidden, logits = text_features(backbone, ids, features)
        logits = logits[first:]  # row j: the law after x_{first + j}; rows before are not read
        probs = torch.softmax(logits.double(), -1)
        if tokens is not None:
            probs = probs[:, tokens.to(probs.device)]
        best = logits.argmax(-1).tolist()
        for t in range(first, ids.shape[0] - 3):
            c = int(ids[t + 1])
            if index(c) < 0:
                skipped += 1
                continue
            j = t - first  # row j + 1 of logits and probs: the law after c = x_{t+1}
            positions.append(Position(
                hidden[t:t + 1].clone(), c, index(int(ids[t + 2])), index(int(ids[t + 3])),
                probs[j + 1], probs[j + 2], probs[j + 3], (best[j + 1], best[j + 2], best[j + 3])))
    return positions, skipped


@dataclass(frozen=True)
class Acceptance:
    """Per-position measures of one drafter (module docstring).

    Attributes:
        alpha1: (P,) float64, the probability that the round's first draft is accepted.
        beta2: (P,) float64, the same for the second draft given a first draft equal to the text's
            token; NaN where that token is outside the draft vocabulary.
        peak: (P,) float64, ``max_x q(X_1 = x | X_0 = c)``: what
            ``DraftLength.confident`` reads for the first draft (a draft-side quantity; NaN in
            greedy measures, which do not compute it).
        beta3: (P,) float64, the third draft given the first two equal to the text's tokens (NaN
            where undefined), or None (not measured).
    """

    alpha1: Tensor
    beta2: Tensor
    peak: Tensor
    beta3: Tensor | None = None

    def summary(self) -> dict[str, Any]:
        """``alpha1``, ``beta2`` and ``beta3`` averaged, with how many positions each average
        has (``beta3`` None without positions)."""
        known = ~self.beta2.isnan()
        seconds = int(known.sum())
        third = self.beta3 if self.beta3 is not None else self.alpha1.new_full(
            self.alpha1.shape, float("nan"))
        thirds = int((~third.isnan()).sum())
        return {"alpha1": float(self.alpha1.mean()) if self.alpha1.numel() else 0.0,
                "beta2": float(self.beta2[known].sum()) / max(seconds, 1),
                "beta3": float(third.nansum()) / thirds if thirds else None,
                "positions": int(self.alpha1.numel()), "positions_beta2": seconds,
                "positions_beta3": thirds}


def greedy_drafts(program: RoundProgram, hidden: Tensor, c: int, drafts: Tensor) -> Tensor:
    """The head's greedy drafts of slots ``1..m`` (model ids (m,)), slot ``k``'s given ``X_0 =
    c`` and ``X_1..X_{k-1} = drafts[:k-1]`` (``drafts`` (m-1,) draft-vocabulary indices): the
    max-product completion of the window under that evidence, as the decoder's greedy draft
    program completes it after ``c`` alone (one pass over ``m`` rows sharing the head's
    parameters). ``c`` must be in the draft vocabulary."""
    circuit, n = program.circuit, program.window
    device = circuit.device
    first = torch.tensor([c], device=device)
    with torch.no_grad():
        prepared = circuit.resolve_params(program.head_parameters(hidden, first), None,
                                          check=False)
        m = drafts.numel() + 1
        x = torch.zeros(m, n, dtype=torch.long, device=device)
        x[:, 0] = c if program.position is None else program.position[c]
        for k in range(1, m):
            x[k, 1:k + 1] = drafts[:k].to(device)
        observed = torch.arange(n, device=device)[None, :] <= torch.arange(m, device=device)[:, None]
        trace = Trace()
        circuit.evaluate(x, observed, prepared, semiring=Semiring.MAX, trace=trace)
        state = descend(circuit, trace, x, observed, argmax_chooser)
    chosen = state[torch.arange(m, device=device), torch.arange(1, m + 1, device=device)]
    return chosen if program.draft_tokens is None else program.draft_tokens[chosen]


def position_acceptance(program: RoundProgram, positions: Sequence[Position], *,
                        greedy: bool = False) -> Acceptance:
    """:class:`Acceptance` of ``program``'s head at every one of ``positions``: at T = 1 (the
    head's exact conditionals, :meth:`RoundProgram.conditionals`) or ``greedy``
    (:func:`greedy_drafts` against the model's argmax)."""
    n = program.window
    nan = float("nan")
    rows: list[tuple[float, float, float, float]] = []
    with torch.no_grad():
        for position in positions:
            has2 = n > 2 and position.second >= 0
            has3 = n > 3 and has2 and position.third >= 0
            drafts = torch.zeros(1, n - 1, dtype=torch.long)
            drafts[0, 0] = max(position.second, 0)
            if n > 2:
                drafts[0, 1] = max(position.third, 0)
            if greedy:
                chosen = greedy_drafts(program, position.hidden, position.c,
                                       drafts[0, :min(n - 2, 2)]).tolist()
                hits = [float(d == target) for d, target in
                        zip(chosen, position.targets[:len(chosen)], strict=True)] + [nan, nan]
                rows.append((hits[0], hits[1] if has2 else nan, hits[2] if has3 else nan, nan))
                continue
            q = program.conditionals(position.hidden, position.c, drafts)[0].cpu()
            laws = (position.p1, position.p2, position.p3)
            accept = [float(torch.minimum(laws[k].cpu(), q[k]).sum()) for k in range(min(3, n - 1))]
            rows.append((accept[0], accept[1] if has2 else nan, accept[2] if has3 else nan,
                         float(q[0].max())))
    alpha1, beta2, beta3, peak = torch.tensor(rows, dtype=torch.float64).view(-1, 4).unbind(1)
    return Acceptance(alpha1, beta2, peak, beta3)


def expected_acceptance(program: RoundProgram, positions: Sequence[Position], *,
                        greedy: bool = False) -> dict[str, Any]:
    """``alpha1``, ``beta2`` and ``beta3`` (module docstring) averaged over ``positions``, with
    how many positions each average has."""
    return position_acceptance(program, positions, greedy=greedy).summary()


def measure_head(head: Any, backbone: Backbone, texts: Sequence[Tensor],
                 temperatures: Sequence[float], costs: RoundCosts | None = None, *,
                 features: FeatureMap | None = None, greedy: bool = False,
                 first: int = 0) -> dict[str, Any]:
    """:func:`expected_acceptance` of ``head`` (reading ``features``, :func:`text_features`)
    tempered at each of ``temperatures``, on one set of positions, those from row ``first`` of
    each text on (:func:`collect_positions`; the hidden states and target
    laws do not depend on the temperature); with the round's ``costs``
    (:func:`~benchmarks.acceptance_speed.measure_costs`), also each temperature's
    :func:`~benchmarks.acceptance_speed.speed_bounds`; with ``greedy``, also the greedy
    measures."""
    config = SamplingConfig(temperature=1.0)
    positions, skipped = collect_positions(backbone, texts, RoundProgram(head, config), features,
                                           first=first)
    rows = {}
    for temperature in temperatures:
        tempered = head if temperature == 1.0 else TemperedHead(head, temperature)
        acceptance = position_acceptance(RoundProgram(tempered, config), positions)
        rows[f"{temperature:g}"] = acceptance.summary()
        if costs is not None:
            rows[f"{temperature:g}"]["speed_bounds"] = speed_bounds(acceptance, costs)
    record: dict[str, Any] = {"skipped_outside_vocabulary": skipped, "by_temperature": rows}
    if greedy:
        record["greedy"] = expected_acceptance(RoundProgram(head, config), positions, greedy=True)
    if costs is not None:
        record["costs_in_plain_steps"] = {"verify_2": costs.verify, "head": costs.head}
    return record


def own_continuations(model: Any, texts: Sequence[Tensor], new_tokens: int, temperature: float,
                      seed: int = 0) -> list[Tensor]:
    """Each of ``texts`` (T_i,) followed by ``model``'s own continuation of ``new_tokens`` tokens
    (plain decoding at ``temperature``, 0 greedy; text ``i`` drawn with a generator seeded
    ``seed + i``; no EOS stop): the text a decoder drafts on. Its rounds are the rows from
    ``T_i - 2`` on (the first one's verified token is the prompt's last)."""
    from circuits_llm.backbone import HFBackbone
    from circuits_llm.decoding.decoder import AutoregressiveDecoder
    decoder = AutoregressiveDecoder(HFBackbone(model))
    extended = []
    for index, ids in enumerate(texts):
        generator = torch.Generator(device=decoder.device).manual_seed(seed + index)
        result = decoder.generate(ids, new_tokens, temperature, generator=generator,
                                  eos_token_id=())
        extended.append(torch.cat([ids, result.tokens.to(ids.device, ids.dtype)]))
    return extended
