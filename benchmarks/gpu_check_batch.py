"""The batch rows of :mod:`benchmarks.gpu_check` (issue 46): batched speculative decoding
(:mod:`circuits_llm.decoding.batch`, the draft block's per-row states:
:mod:`circuits_llm.draft_block.batch`) exact on the device, and its throughput against batched AR
on the SmolLM2-135M-shaped model.

* **exactness**: greedy batched speculative decoding of a ragged batch (:data:`EXACT_PROMPTS`: 3
  rows of different prompt lengths) on the tiny float64 Llama of the greedy rows
  (:func:`~benchmarks.gpu_check_decoder.tiny_model`) equals ``model.generate(do_sample=False)``
  on each row alone, with a circuit head (BTree, window 4) and with the recursive draft block
  (3 drafts a round, moved off its identity start); drafts must be both accepted and rejected
  (so the accept and the reject paths both ran). Eager: the batched path runs over a dynamic,
  ragged cache (no static cache, nothing compiled).
* **throughput**, per batch size (1, 2, 4, 8, 16): batched AR and batched speculative decoding
  with a random draft block of the shipped shapes (:func:`~benchmarks.gpu_check_blocks.
  shipped_block_shapes`: 1 layer, 5 recursive drafts, the context copy, every draft verified), on
  the speed rows' model (:class:`~benchmarks.gpu_check_speed.SpeedBench`: built once, bfloat16 on
  CUDA; eager over its own dynamic-cache backbone), greedy and sampling. A forced batched backbone
  would have to force every row's block inside the ragged ``extend_rows``; instead the rows time
  the batch's phases (a batched AR step; a speculative round's draft, verify of the window for
  every row, and accept, with random weights: rows accept little and stay in the batch, so nearly
  every round is at full width, the mean rows per round is reported) and **predict** the
  speed-up from the tokens per round the shipped block reached on the real model in the same
  batched setting on this project's CPU (:data:`BATCH_RESULTS`: ``batch_bench --block block``
  with the copy; its per-row rate ``tokens_per_round / B``, the
  largest measured batch's rate beyond it): ``rate x AR ms per step / round ms``. The last row
  names the batch size from which the predicted speed-up falls below 1, per mode.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check_blocks import BLOCK_NOISE, ROOT, shipped_block_shapes
from benchmarks.gpu_check_core import Group, Outcome, Settings, Status
from benchmarks.gpu_check_decoder import HIDDEN, VOCAB, tiny_model
from benchmarks.gpu_check_speed import DEMO, Mode, SpeedBench
from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.metrics import BatchResult, BatchSummary, DecodeResult, single_row_batch
from circuits_llm.draft_block import BlockDrafter, DraftBlock
from circuits_llm.heads import MTPHead

RowSpec = tuple[Group, str, Callable[[], Outcome]]
#: ``python -m benchmarks.batch_bench --block block --batch-sizes 1,2,4,8 --new-tokens 48`` with
#: the copy of the context: the shipped recursive block (5 drafts) on the real SmolLM2, CPU
BATCH_RESULTS = ROOT / "benchmarks" / "results" / "batch_bench_block_copy.json"
#: the ragged batch of the exactness rows: prompt lengths, and new tokens per row
EXACT_PROMPTS, EXACT_NEW = (3, 7, 12), 16
FULL_BATCHES, QUICK_BATCHES = (1, 2, 4, 8, 16), (1, 2, 4)
#: new tokens per row of a timed batch decode, and timed decodes per batch size, decoder and mode
#: (the eager SmolLM2-shaped step takes 30-60 ms on the H200 machine: 16 tokens keep the five
#: batch sizes within about 30 s there)
FULL_TIMING, QUICK_TIMING = (16, 1), (8, 1)
#: new tokens of the untimed warm-up decodes at each batch size (new shapes)
WARMUP_TOKENS = 4


def measured_rates(path: Path = BATCH_RESULTS) -> dict[tuple[Mode, int], float]:
    """Per mode and batch size: tokens per round per row (``tokens_per_round / B``) of the
    speculative decoder in ``path``'s batched runs on the real model."""
    results = json.loads(path.read_text())["results"]
    return {(Mode(r["mode"]), r["batch_size"]):
            r["decoders"]["speculative"]["tokens_per_round"] / r["batch_size"] for r in results}


def _summary(result: DecodeResult | BatchResult) -> BatchSummary:
    """The batch summary of a result (a batch of one decodes on the single-prompt path)."""
    return (single_row_batch(result) if isinstance(result, DecodeResult) else result).summary


# ------------------------------------------------------------------ exactness
def exact_row(settings: Settings, kind: str) -> Outcome:
    """Greedy batched speculative decoding of :data:`EXACT_PROMPTS` equals ``model.generate`` on
    each row alone: ``kind`` ``circuit`` (a BTree head on the backbone's hidden state) or
    ``block`` (the recursive draft block)."""
    model = tiny_model("llama", settings.device)
    generator = torch.Generator().manual_seed(3)
    drafter: MTPHead | BlockDrafter
    if kind == "circuit":
        lm_head = model.get_output_embeddings().weight.detach().cpu()
        drafter = MTPHead.from_name("btree", 4, 2, HIDDEN, VOCAB, lm_head_weight=lm_head,
                                    dtype=torch.float64, sum_init_std=0.5,
                                    init_noise=0.3).to(settings.device).eval()
    else:
        block = DraftBlock(model, steps=3, draft_vocab=list(range(0, VOCAB, 2)))
        with torch.no_grad():
            for parameter in block.parameters():
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator,
                                                 dtype=parameter.dtype).to(parameter.device))
        drafter = BlockDrafter(block.eval())
    decoder = SpeculativeDecoder(HFBackbone(model), drafter)
    prompts = [torch.randint(1, VOCAB - 1, (length,), generator=generator).tolist()
               for length in EXACT_PROMPTS]
    result = decoder.generate(prompts, EXACT_NEW)
    assert isinstance(result, BatchResult)
    mismatches = 0
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        ids = torch.tensor([prompt], device=settings.device)
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=EXACT_NEW, pad_token_id=0)
        mismatches += tokens != expected[0, len(prompt):].tolist()
    summary = result.summary
    numbers = (f"ragged batch of {len(prompts)} (prompts {'/'.join(map(str, EXACT_PROMPTS))} "
               f"tokens), eager, {kind}: {mismatches} rows differ from model.generate alone; "
               f"drafts accepted {summary.accepted}/{summary.drafted}, {summary.rounds} rounds "
               f"of {summary.mean_rows:.2f} rows")
    both = 0 < summary.accepted < summary.drafted
    return Outcome.verdict(mismatches == 0 and both, numbers,
                           {"rows": len(prompts), "mismatches": mismatches,
                            "accepted": summary.accepted, "drafted": summary.drafted,
                            "rounds": summary.rounds},
                           f"{mismatches} rows differ" if mismatches
                           else "drafts were all accepted or all rejected: a path went unchecked")


# ------------------------------------------------------------------ throughput
class BatchBench:
    """Batched AR and speculative decoding on a :class:`SpeedBench`'s model (an eager,
    dynamic-cache backbone of its own), and the predictions."""

    def __init__(self, speed: SpeedBench) -> None:
        self.speed = speed
        self.settings = speed.settings
        self.batches = QUICK_BATCHES if self.settings.quick else FULL_BATCHES
        self.new_tokens, self.repeats = QUICK_TIMING if self.settings.quick else FULL_TIMING
        self.state: dict[str, Any] = {}
        self.results: dict[int, dict[str, Any]] = {}

    def setup(self) -> dict[str, Any]:
        """The decoders (once): a random block of the shipped shapes drafting recursively with
        the copy; ragged prompts from the speed rows' draft vocabulary."""
        if self.state:
            return self.state
        speed = self.speed.setup()
        model, device = speed["model"], self.settings.device
        shapes = shipped_block_shapes()
        draft_tokens = speed["draft_tokens"]
        block = DraftBlock(model, steps=shapes.draft_steps, layers=shapes.layers,
                           draft_vocab=draft_tokens)
        gen = torch.Generator().manual_seed(self.settings.seed + 21)
        with torch.no_grad():
            for parameter in block.parameters():
                noise = torch.randn(parameter.shape, generator=gen)
                parameter.add_((BLOCK_NOISE * noise).to(device=device, dtype=parameter.dtype))
        backbone = HFBackbone(model)  # the batched path: a dynamic, ragged cache (eager)
        lookup = None if DEMO.lookup is None else ContextLookup(tuple(DEMO.lookup))
        length = self.speed.sizes.prompt_tokens
        prompts = [draft_tokens[torch.randint(0, len(draft_tokens),
                                              (length - (7 * b) % max(1, length // 4),),
                                              generator=gen)].tolist()
                   for b in range(max(self.batches))]
        self.state.update(
            decoders={"autoregressive": AutoregressiveDecoder(backbone),
                      "speculative": SpeculativeDecoder(
                          backbone, BlockDrafter(block.eval(), steps=shapes.draft_steps),
                          lookup=lookup)},
            prompts=prompts, window=shapes.draft_steps + 1)
        return self.state

    def decode(self, name: str, size: int, mode: Mode) -> BatchSummary:
        """The timed decode of least round time of ``repeats`` (per-row generators on the
        device; the decoders' clocks synchronise on CUDA)."""
        state = self.state
        summaries = []
        for repeat in range(self.repeats):
            generators = [self.settings.generator(100 * repeat + b) for b in range(size)]
            result = state["decoders"][name].generate(
                state["prompts"][:size], self.new_tokens, mode.temperature,
                generator=None if mode is Mode.GREEDY else generators, eos_token_id=())
            summaries.append(_summary(result))
        return min(summaries, key=lambda s: s.mean_latency_s)

    def size_row(self, size: int) -> Outcome:
        """Batch ``size``: batched AR ms per step and the speculative round's phases, per mode,
        and the predicted speed-up at the measured per-row rate."""
        state = self.setup()
        for decoder in state["decoders"].values():  # warm-up at this size (new shapes)
            decoder.generate(state["prompts"][:size], WARMUP_TOKENS, 0.0, eos_token_id=())
        rates = measured_rates()
        measured_sizes = sorted({b for _, b in rates})
        values: dict[str, Any] = {"batch_size": size, "window": state["window"]}
        parts, complete = [], True
        for mode in (Mode.GREEDY, Mode.SAMPLING):
            ar, spec = (self.decode(name, size, mode) for name in ("autoregressive", "speculative"))
            complete = complete and ar.new_tokens == spec.new_tokens == size * self.new_tokens
            rate_size = size if (mode, size) in rates else max(b for b in measured_sizes if b <= size)
            rate = rates[(mode, rate_size)]
            ar_ms, round_ms = 1e3 * ar.mean_latency_s, 1e3 * spec.mean_latency_s
            phases = {p.removesuffix("_s"): 1e3 * v for p, v in spec.mean_split_s.items()}
            predicted = rate * ar_ms / round_ms
            values[mode.value] = {
                "ar_ms_per_step": ar_ms, "ar_tok_s": size / ar.mean_latency_s,
                "round_ms": round_ms, "phases_ms": phases, "mean_rows": spec.mean_rows,
                "rate_per_row": rate, "rate_batch_size": rate_size,
                "predicted_speedup": predicted,
                "predicted_tok_s": rate * size / spec.mean_latency_s}
            note = "" if rate_size == size else f" (B={rate_size}'s)"
            parts.append(f"{mode.value}: AR {ar_ms:.2f} ms/step, round {round_ms:.2f} ms = draft "
                         f"{phases['draft']:.2f} + verify {phases['verify']:.2f} + accept "
                         f"{phases['accept']:.2f} ({spec.mean_rows:.1f} rows); {rate:.2f} "
                         f"tok/round/row{note} -> {predicted:.2f}x batched AR")
        self.results[size] = values
        dtype = str(self.speed.model_dtype).removeprefix("torch.")
        numbers = f"{dtype}, eager, block k={state['window'] - 1} + copy; " + "; ".join(parts)
        return Outcome.verdict(complete, numbers, values,
                               f"a decoder did not make {self.new_tokens} tokens in every row")

    def crossover_row(self) -> Outcome:
        """Per mode, the smallest batch size whose predicted speed-up is below 1 (``None``:
        none measured)."""
        if not self.results:
            return Outcome.verdict(False, "", {}, "no batch size was measured")
        crossover: dict[str, int | None] = {}
        for mode in Mode:
            below = [b for b, v in self.results.items() if v[mode.value]["predicted_speedup"] < 1]
            crossover[mode.value] = min(below) if below else None
        speedups = {mode.value: {b: round(v[mode.value]["predicted_speedup"], 3)
                                 for b, v in sorted(self.results.items())} for mode in Mode}
        numbers = "; ".join(
            f"{m}: predicted x{'/'.join(f'{s:.2f}' for s in speedups[m].values())} at B="
            f"{'/'.join(map(str, speedups[m]))}, below 1 from B="
            f"{crossover[m] if crossover[m] is not None else 'none measured'}" for m in speedups)
        return Outcome(Status.PASS, numbers, {"crossover": crossover, "predicted": speedups,
                                              "source": str(BATCH_RESULTS.relative_to(ROOT))})


def batch_rows(settings: Settings, speed: SpeedBench | None = None) -> list[RowSpec]:
    """Exactness (circuit head, draft block), then one throughput row per batch size and the
    crossover, over ``speed``'s model (a new :class:`SpeedBench` when ``None``)."""
    bench = BatchBench(SpeedBench(settings) if speed is None else speed)
    rows: list[RowSpec] = [(Group.BATCH, f"greedy = generate, ragged, {kind}",
                            lambda kind=kind: exact_row(settings, kind))
                           for kind in ("circuit", "block")]
    rows += [(Group.BATCH, f"throughput B={size}", lambda size=size: bench.size_row(size))
             for size in bench.batches]
    rows.append((Group.BATCH, "predicted crossover", bench.crossover_row))
    return rows
