"""The speed rows of :mod:`benchmarks.gpu_check`: compiled autoregressive decoding against the
compiled speculative round on a SmolLM2-135M-shaped Llama with random weights, and the speed-up
the shipped heads' measured acceptance predicts.

The model has SmolLM2-135M's shapes (:data:`SMOLLM2`: 30 layers, hidden 576, 9 heads, 3 KV heads,
vocabulary 49,152, tied embeddings) and random weights: no network, no model package. The heads
have the shipped heads' shapes (``circuits_llm/heads_shipped/``: FF and BTree r=16, window 8,
LEAN with ``lean_rank`` 8, a compressed draft vocabulary of 4,096 tokens) and the demo's settings
(:meth:`~circuits_llm.app.demo.ComparisonConfig.demo`): the FF head reads the verified token and
every draft mixes in a copy of the context (:class:`~circuits_llm.decoding.lookup.ContextLookup`),
so the round pays for the host-side lookup and the copy component as the measured rounds did.
Everything runs compiled (``HFBackbone(compile=True)``: static cache, compiled forwards for blocks
of 1 and 8; ``SpeculativeDecoder(..., compile=True)``: compiled round programs; CUDA graphs on
CUDA).

With random weights nothing would be accepted, so acceptance is forced
(:class:`ForcedInsideDraftVocabulary`: the verifier agrees with every draft, and its bonus token
is drawn inside the head's draft vocabulary, so the next round's known token is one the head can
condition on): each round emits 8 tokens at the real round's cost (fewer in a round whose draft
is a whole copy shorter than the window: such a round verifies only the copy). Reported: ms per
token of compiled AR decoding, the compiled round's phases (draft, verify, accept: means over the
rounds of the median run), the forced speed-up over compiled AR, (draft + accept) / a compiled
verify of 8 tokens, and on CUDA the kernels, launches and GPU time of a backbone call and of a
round (:mod:`benchmarks.gpu_profile`). Then the **predicted** speed-up at the acceptance the
shipped heads achieved on the real model (:data:`MEASURED_TOKENS_PER_ROUND`): ``tokens per round
x AR ms per token / round ms``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.decoder_bench import backbone_timings
from benchmarks.gpu_check_core import Group, Outcome, Settings, Status, compiler_scope
from benchmarks.gpu_profile import cudagraph_skips, describe, device_activity
from benchmarks.spec_tools import ForcedAcceptance
from circuits.templates import Architecture
from circuits_llm.app.demo import ComparisonConfig
from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.metrics import DecodeSummary
from circuits_llm.heads import MTPHead
from circuits_llm.protocols import BackboneStep

RowSpec = tuple[Group, str, Callable[[], Outcome]]


class Mode(Enum):
    """Greedy decoding, or sampling at temperature 1."""

    GREEDY = "greedy"
    SAMPLING = "sampling"

    @property
    def temperature(self) -> float:
        """0 (greedy) or 1."""
        return 0.0 if self is Mode.GREEDY else 1.0


@dataclass(frozen=True)
class LlamaShape:
    """The shapes of a Llama (random weights, tied embeddings)."""

    hidden_size: int
    intermediate_size: int
    layers: int
    attention_heads: int
    kv_heads: int
    vocab_size: int
    max_positions: int

    def config(self) -> LlamaConfig:
        """The ``LlamaConfig`` of these shapes."""
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=self.layers,
                           num_attention_heads=self.attention_heads,
                           num_key_value_heads=self.kv_heads,
                           max_position_embeddings=self.max_positions, tie_word_embeddings=True,
                           bos_token_id=1, eos_token_id=2, pad_token_id=2)


SMOLLM2 = LlamaShape(576, 1536, 30, 9, 3, 49152, 2048)
TINY = LlamaShape(64, 128, 2, 4, 2, 2048, 256)


@dataclass(frozen=True)
class SpeedSizes:
    """The model shape, draft vocabulary size, prompt and decode lengths, and repeats of a run."""

    shape: LlamaShape
    draft_vocab: int
    prompt_tokens: int
    new_tokens: int
    repeats: int
    timing_rounds: int


FULL = SpeedSizes(SMOLLM2, 4096, 64, 128, 3, 10)
QUICK = SpeedSizes(TINY, 256, 16, 32, 1, 3)
WINDOW, LEAN_RANK = 8, 8
HEADS: tuple[tuple[Architecture, int], ...] = ((Architecture.FF, 1), (Architecture.BTREE, 16))
#: the demo's settings (heads, token input, copy of the context), which produced
#: :data:`MEASURED_TOKENS_PER_ROUND` with ``draft_minimum=1``
DEMO = ComparisonConfig.demo()

#: Tokens per round (``mu_acc``, the ``acc.len`` column) the shipped SmolLM2 heads reached on the
#: real SmolLM2-135M-Instruct: docs/journal.md, section 6, the latest ``make demo`` text table
#: whose rounds all verify at least one draft (``--draft-minimum 1``, the demo's default before a
#: round could be a plain step: those are no rounds of the forced-draft round timed here) (6
#: held-out stdlib prompts x 128 tokens, AMD EPYC CPU, compiled rounds over the eager model;
#: the FF head reads the verified token, every round's draft mixes in a copy of the context
#: (``ContextLookup((0.1, 0.3, 0.5))``), rounds verify the drafts the draft is 30% confident in).
#: Rounds after a token outside the heads' draft vocabulary draft after a stand-in. Per-position
#: acceptance of the same run (% of rounds whose k-th draft was accepted): greedy FF
#: 63 37 32 28 24 20 15, BTree 64 38 33 29 24 20 16; sampling FF 32 3 2 2 1 1 1, BTree 37 2 1 0
#: 0 0 0. The smoke test checks these values against that table. (A round here verifies all 7
#: drafts, so at these acceptances the prediction is conservative.)
MEASURED_TOKENS_PER_ROUND: dict[tuple[Architecture, Mode], float] = {
    (Architecture.FF, Mode.GREEDY): 3.12, (Architecture.BTREE, Mode.GREEDY): 3.16,
    (Architecture.FF, Mode.SAMPLING): 1.42, (Architecture.BTREE, Mode.SAMPLING): 1.40}
MEASURED_SOURCE = "real SmolLM2, docs/journal.md section 6"


class ForcedInsideDraftVocabulary(ForcedAcceptance):
    """:class:`~benchmarks.spec_tools.ForcedAcceptance` whose last position's logits (the bonus
    token's) are restricted to the head's draft vocabulary ``draft_tokens`` (K,): every draft is
    accepted and the next round's known token ``c`` lies inside the draft vocabulary, so every
    round is a full speculative round (outside it, the head could not condition on ``c`` and the
    round would emit one token)."""

    def __init__(self, inner: HFBackbone, draft_tokens: Tensor) -> None:
        super().__init__(inner)
        penalty = torch.full((inner.vocab_size,), -1e4, device=inner.device)
        penalty[draft_tokens.to(inner.device)] = 0.0
        self.penalty = penalty

    def extend(self, tokens: Tensor) -> BackboneStep:
        """Forced acceptance, then the last position's logits (V,) pushed into the draft vocabulary."""
        step = super().extend(tokens)  # a fresh logits tensor for blocks of 2 or more
        logits = step.verifier_logits if tokens.shape[1] >= 2 else step.verifier_logits.clone()
        logits[:, -1] += self.penalty.to(logits.dtype)
        return BackboneStep(logits, step.draft_hidden)


def forced_outcome(summary: DecodeSummary, window: int, numbers: str,
                   values: dict[str, Any]) -> Outcome:
    """The verdict of a forced round of ``window`` tokens (shared with the draft-block rows):
    PASS when every verified draft was accepted and rounds emitted at least half the window."""
    held = (summary.drafted > 0 and summary.accepted == summary.drafted
            and summary.tokens_per_round >= window / 2)
    return Outcome.verdict(held, numbers, values,
                           f"forced acceptance did not hold: {summary.accepted} of "
                           f"{summary.drafted} drafts accepted, {summary.tokens_per_round:.2f} "
                           f"tokens per round")


def _median(summaries: list[DecodeSummary]) -> DecodeSummary:
    """The run of median throughput."""
    return sorted(summaries, key=lambda s: s.throughput)[len(summaries) // 2]


class SpeedBench:
    """The model, compiled backbone, prompt and measurements shared by the speed rows (built by
    the first row that needs them)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sizes = QUICK if settings.quick else FULL
        self.state: dict[str, Any] = {}
        self.results: dict[str, Any] = {}
        #: SmolLM2 ships in bfloat16 and runs so on a GPU; float32 on the CPU (the smoke run)
        self.model_dtype = torch.bfloat16 if settings.cuda else torch.float32

    def setup(self) -> dict[str, Any]:
        """The random-weight model on the device, its compiled backbone (blocks of 1 and 8), the
        draft vocabulary (K,) and a prompt drawn from it (once)."""
        if self.state:
            return self.state
        sizes, device = self.sizes, self.settings.device
        torch.manual_seed(self.settings.seed)
        with torch.device(device):
            model = LlamaForCausalLM(sizes.shape.config()).to(self.model_dtype).eval()
        gen = torch.Generator().manual_seed(self.settings.seed)
        draft_tokens = torch.randperm(sizes.shape.vocab_size, generator=gen)[:sizes.draft_vocab].sort()[0]
        prompt = draft_tokens[torch.randint(0, sizes.draft_vocab, (sizes.prompt_tokens,), generator=gen)]
        with compiler_scope(self.settings.compiler):
            backbone = HFBackbone(model, compile=True, compiled_lengths=(1, WINDOW),
                                  max_cache_len=sizes.prompt_tokens + sizes.new_tokens + 2 * WINDOW)
        self.state.update(model=model, backbone=backbone, draft_tokens=draft_tokens,
                          prompt=prompt.tolist(),
                          parameters=sum(p.numel() for p in model.parameters()))
        return self.state

    def decode(self, decoder: AutoregressiveDecoder, mode: Mode) -> DecodeSummary:
        """The median of ``repeats`` decodes after one warm-up (compilation, graph capture)."""
        runs = []
        for repeat in range(-1, self.sizes.repeats):
            generator = None if mode is Mode.GREEDY else self.settings.generator(max(repeat, 0))
            result = decoder.generate(self.state["prompt"], self.sizes.new_tokens,
                                      mode.temperature, generator=generator, eos_token_id=())
            if repeat >= 0:
                runs.append(result.summary)
        return _median(runs)

    def ar_row(self) -> Outcome:
        """Compiled AR decoding (ms per token, greedy and sampling), the AR step and the verify
        forward of 8 tokens (medians of interleaved calls)."""
        state = self.setup()
        backbone: HFBackbone = state["backbone"]
        ar = {mode: self.decode(AutoregressiveDecoder(backbone), mode) for mode in Mode}
        backbone.reset()
        with torch.no_grad():
            backbone.extend(torch.tensor([state["prompt"][:-1]], device=self.settings.device))
        steps = backbone_timings(backbone, (WINDOW,), self.sizes.timing_rounds)
        ms = {mode.value: 1e3 * s.mean_latency_s for mode, s in ar.items()}
        dtype = str(self.model_dtype).removeprefix("torch.")
        self.results.update(model_dtype=dtype, ar_ms=ms, verify_ms=1e3 * steps[f"verify_{WINDOW}"],
                            step_ms=1e3 * steps["ar_step"])
        profiles = {width: self.profile_block(backbone, width) for width in (1, WINDOW)}
        self.results.update(profile_step=profiles[1], profile_verify=profiles[WINDOW],
                            cudagraph_skips=cudagraph_skips())
        shape, step, verify = self.sizes.shape, self.results["step_ms"], self.results["verify_ms"]
        numbers = (f"{shape.layers}L d={shape.hidden_size} V={shape.vocab_size} "
                   f"({state['parameters'] / 1e6:.1f}M, {dtype}): greedy {ms['greedy']:.2f} ms/tok, sampling "
                   f"{ms['sampling']:.2f} ms/tok; step {step:.2f} ms, verify-{WINDOW} {verify:.2f} ms "
                   f"({verify / step:.2f}x step)")
        if self.settings.cuda:
            numbers += (f"; step: {describe(profiles[1])}; verify-{WINDOW}: "
                        f"{describe(profiles[WINDOW])}; graphs run without CUDA graphs: "
                        f"{self.results['cudagraph_skips']}")
        return Outcome(Status.PASS, numbers, dict(self.results, parameters=state["parameters"]))

    def profile_block(self, backbone: HFBackbone, width: int) -> dict[str, Any]:
        """:func:`~benchmarks.gpu_profile.device_activity` of one compiled extend of ``width``
        tokens (then a crop back), after a warm-up call."""
        tokens = torch.tensor([self.state["prompt"][:width]], device=self.settings.device)

        def call() -> None:
            base = backbone.length
            backbone.extend(tokens)
            backbone.crop(base)
        with torch.no_grad():
            call()
            return device_activity(call, self.settings.device)

    def profile_rounds(self, decoder: AutoregressiveDecoder, mode: Mode) -> dict[str, Any]:
        """:func:`~benchmarks.gpu_profile.device_activity` of one short decode (warm), per round:
        what a whole round (draft, verify, accept and the host between them) launches and runs."""
        rounds: list[int] = []

        def call() -> None:
            generator = None if mode is Mode.GREEDY else self.settings.generator(0)
            result = decoder.generate(self.state["prompt"], 4 * WINDOW, mode.temperature,
                                      generator=generator, eos_token_id=())
            rounds.append(result.summary.rounds)
        activity = device_activity(call, self.settings.device)
        if not rounds or "error" in activity or not activity:
            return activity
        count = max(rounds[-1], 1)
        return {key: value / count if isinstance(value, (int, float)) else value
                for key, value in activity.items()} | {"rounds": count}

    def forced_row(self, architecture: Architecture, rank: int, mode: Mode) -> Outcome:
        """The compiled speculative round with forced acceptance: its phases, the speed-up over
        compiled AR, and (draft + accept) / verify, and what a round launches on CUDA; FAIL unless
        every verified draft was accepted."""
        state = self.setup()
        if "ar_ms" not in self.results:
            return Outcome.verdict(False, "", {}, "the compiled AR row did not run")
        model, sizes = state["model"], self.sizes
        reads_token = architecture.value in DEMO.token_input
        token_embedding = model.get_input_embeddings().weight.detach().cpu() if reads_token else None
        head = MTPHead.from_name(architecture.value, WINDOW, rank, sizes.shape.hidden_size,
                                 sizes.shape.vocab_size, "lean",
                                 model.get_output_embeddings().weight.detach().cpu(),
                                 draft_vocab=state["draft_tokens"], lean_rank=LEAN_RANK,
                                 identity_init=False, token_embedding=token_embedding,
                                 ).eval().to(self.settings.device)
        forced = ForcedInsideDraftVocabulary(state["backbone"], state["draft_tokens"])
        lookup = None if DEMO.lookup is None else ContextLookup(tuple(DEMO.lookup))
        with compiler_scope(self.settings.compiler):
            decoder = SpeculativeDecoder(forced, head, compile=True, lookup=lookup)
        summary = self.decode(decoder, mode)
        per_round = self.profile_rounds(decoder, mode)
        split = {k.removesuffix("_s"): 1e3 * v for k, v in summary.mean_split_s.items()}
        round_ms = 1e3 * summary.mean_latency_s
        ar_ms = self.results["ar_ms"][mode.value]
        head_share = (split["draft"] + split["accept"]) / self.results["verify_ms"]
        values = {"parameters": head.num_parameters(), "reads_token": reads_token,
                  "lookup": None if lookup is None else list(lookup.weights),
                  "round_ms": round_ms, "phases_ms": split,
                  "tokens_per_round": summary.tokens_per_round,
                  "speedup_vs_ar": ar_ms * summary.tokens_per_round / round_ms,
                  "draft_accept_over_verify": head_share, "profile_per_round": per_round}
        self.results[f"{architecture.value} {mode.value}"] = values
        setting = ("token input, " if reads_token else "") + ("copy, " if lookup else "")
        numbers = (f"{values['parameters']:,} params; {setting}round {round_ms:.2f} ms = draft "
                   f"{split['draft']:.2f} + verify {split['verify']:.2f} + accept {split['accept']:.2f}; "
                   f"{summary.tokens_per_round:.2f} tok/round -> {values['speedup_vs_ar']:.2f}x "
                   f"compiled AR; (draft+accept)/verify-{WINDOW} {head_share:.0%}")
        if per_round:
            numbers += f"; per round: {describe(per_round)}"
        return forced_outcome(summary, WINDOW, numbers, values)

    def predicted_row(self, architecture: Architecture, mode: Mode) -> Outcome:
        """Tokens per round measured on the real model x AR ms per token / forced round ms."""
        forced = self.results.get(f"{architecture.value} {mode.value}")
        if forced is None:
            return Outcome.verdict(False, "", {}, "the forced round was not measured")
        tokens = MEASURED_TOKENS_PER_ROUND[(architecture, mode)]
        ar_ms = self.results["ar_ms"][mode.value]
        predicted = tokens * ar_ms / forced["round_ms"]
        numbers = (f"{tokens:.2f} tok/round measured ({MEASURED_SOURCE}) x AR {ar_ms:.2f} ms/tok / "
                   f"round {forced['round_ms']:.2f} ms = {predicted:.2f}x compiled AR")
        return Outcome(Status.PASS, numbers, {"tokens_per_round": tokens, "source": MEASURED_SOURCE,
                                              "predicted_speedup": predicted})


def speed_rows(settings: Settings, bench: SpeedBench | None = None) -> list[RowSpec]:
    """Compiled AR, then per mode (sampling first) and head: the forced round and the prediction
    (over ``bench``'s model and compiled backbone, shared with other rows; ``None``: a new one)."""
    bench = SpeedBench(settings) if bench is None else bench
    rows: list[RowSpec] = [(Group.SPEED, "compiled AR", bench.ar_row)]
    for mode in (Mode.SAMPLING, Mode.GREEDY):
        for architecture, rank in HEADS:
            label = f"{architecture.value} n={WINDOW} r={rank} {mode.value}"
            rows.append((Group.SPEED, f"forced {label}",
                         lambda a=architecture, r=rank, m=mode: bench.forced_row(a, r, m)))
            rows.append((Group.SPEED, f"predicted {label}",
                         lambda a=architecture, m=mode: bench.predicted_row(a, m)))
    return rows
