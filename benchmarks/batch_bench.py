"""Batched speculative decoding against batched autoregressive decoding: throughput over the batch.

Run ``python -m benchmarks.batch_bench [--quick] [--batch-sizes 1,2,4,8,16] [--new-tokens N]
[--repeats R] [--threads T] [--device cpu] [--modes greedy,sampling] [--block KIND|DIR]
[--block-steps K] [--out PATH]``.

For every batch size ``B`` and mode (greedy, and sampling at ``T = 1``: no top-k, no top-p), the
same ``B`` prompts (held-out code prefixes of different lengths) are decoded by

* ``speculative``: :class:`~circuits_llm.decoding.decoder.SpeculativeDecoder` with the shipped
  head (``circuits_llm.shipped_head(model, head)``) and the demo's decoding settings (draft
  confidence 0.3, minimum 0, the context copy): one backbone call per round for the batch, drafts
  in one head pass per round (:mod:`circuits_llm.decoding.batch`); with ``--block KIND|DIR`` (a
  shipped draft block, ``block`` or ``btree-block``, or a ``train-head --draft-block`` run
  directory; ``--block-steps K`` sets the recursion's depth) the draft block's drafts instead
  (:class:`~circuits_llm.draft_block.BlockDrafter`, one block state per row:
  :mod:`circuits_llm.draft_block.batch`; the copy of the context, every draft verified);
* ``autoregressive``: this project's batched autoregressive decoder (one call per token for the
  batch, the same ragged caches);
* ``hf_generate``: ``model.generate`` on the left-padded batch (dynamic cache; EOS suppressed
  with ``min_new_tokens``, so every decoder makes exactly ``new_tokens`` tokens per row).

Times are medians of :func:`~circuits_llm.runtime.timing.interleaved` rounds (each candidate once
per round, round after round: load drift hits them alike) of one whole ``generate`` call, prefill
included; throughput is ``B * new_tokens`` over it. Each of this project's decoders also reports
its batch rounds (rounds, tokens per round, acceptance, ms per round of each phase: draft, verify,
accept) and the peak bytes of its KV caches (verifier and draft caches, measured after every
backbone call); ``hf_generate`` the bytes of its final cache (its peak). The issue's memory
target: the speculative batch's KV cache within 1.25x of batched AR's (``kv_over_ar``). The
greedy rows of the two project decoders must be identical (``greedy_identical``), and the table
ends with the batch size where the speed-up over batched AR falls below 1 (per mode).

``--quick``: the embedded byte model with a random BTree head (window 4: acceptance means
nothing), batch sizes 1, 2, 4, 8 new tokens, one round: a smoke test of the whole pipeline.
Results are printed and written as JSON through :func:`~circuits_llm.runtime.timing.publish`
(default ``benchmarks/results/batch_bench.json``; ``--quick``: ``batch_bench_quick.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_llm.app.verify_packing import Precision, decode_model
from circuits_llm.backbone import HFBackbone
from circuits_llm.backbone.row_invariant import priced_rows
from circuits_llm.decoding.backbones import drafter_backbone
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.metrics import BatchResult, DecodeResult, single_row_batch
from circuits_llm.draft_block import BatchDepth
from circuits_llm.runtime.devices import resolve_device
from circuits_llm.runtime.timing import GradMode, interleaved, load_average, machine_info, publish

SCHEMA_VERSION = 1
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "batch_bench.json"
QUICK_OUT = DEFAULT_OUT.with_name("batch_bench_quick.json")
MODES = {"greedy": 0.0, "sampling": 1.0}
DECODERS = ("speculative", "autoregressive", "hf_generate")
#: the issue's memory target: the speculative batch's KV cache over batched AR's
MEMORY_TARGET = 1.25


@dataclass(frozen=True)
class BatchBenchConfig:
    """One run's model, head, batch sizes and budgets (defaults: the full SmolLM2 run).

    ``head``: a shipped head kind for ``model``, or ``"random"`` (a random BTree head of window
    ``window``: only the quick run). ``draft_confidence`` ``None``: every round verifies the
    whole window; ``lookup`` ``None``: no context copy.
    """

    model: str = "smollm2"
    head: str = "btree"
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    prompt_tokens: int = 64
    new_tokens: int = 64
    repeats: int = 3
    threads: int = 1
    seed: int = 0
    device: str = "cpu"
    draft_confidence: float | None = 0.3
    draft_minimum: int = 0
    lookup: tuple[float, ...] | None = (0.1, 0.3, 0.5)
    packed_linear: bool = True
    window: int = 4
    modes: tuple[str, ...] = tuple(MODES)
    block: str | None = None
    block_steps: int | None = None
    #: ``--precision`` (:class:`~circuits_llm.app.verify_packing.Precision`): float32 (packed with
    #: ``packed_linear``), a row-invariant bfloat16 copy, or auto (bfloat16 on a CPU that computes
    #: it natively); the record keeps the one that ran
    precision: str = "auto"

    @classmethod
    def quick(cls, threads: int = 1, device: str = "cpu") -> BatchBenchConfig:
        """The ``--quick`` smoke run: embedded model, random head, tiny budgets."""
        return cls(model="embedded", head="random", batch_sizes=(1, 2, 4), prompt_tokens=24,
                   new_tokens=8, repeats=1, threads=threads, device=device, packed_linear=False)


def cache_bytes(*caches: Any) -> int:
    """Bytes of the keys and values held by Hugging Face caches (dynamic layers)."""
    total = 0
    for cache in caches:
        for layer in getattr(cache, "layers", ()):
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, Tensor):
                    total += tensor.numel() * tensor.element_size()
    return total


class PeakCache:
    """The peak KV-cache bytes of an :class:`HFBackbone`, read after each of its forwards (its
    ``extend`` and ``extend_rows`` wrapped on the instance; a benchmark's probe)."""

    def __init__(self, backbone: HFBackbone) -> None:
        self.backbone = backbone
        self.peak = 0
        for name in ("extend", "extend_rows"):
            setattr(backbone, name, self._wrap(getattr(backbone, name)))

    def _wrap(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def measured(*args: Any, **kwargs: Any) -> Any:
            step = call(*args, **kwargs)
            self.peak = max(self.peak, cache_bytes(self.backbone.verifier_cache,
                                                   self.backbone.draft_cache))
            return step
        return measured


def batch_prompts(loaded: Any, count: int, length: int) -> list[list[int]]:
    """``count`` held-out code prefixes of different lengths (``length`` down to about 3/4 of it)."""
    from circuits_llm.text.corpus import evaluation_prompts
    prompts = evaluation_prompts(loaded.tokenizer, count, length)
    return [p[:length - (7 * b) % max(1, length // 4)].tolist() for b, p in enumerate(prompts)]


def load_head(config: BatchBenchConfig, loaded: Any, device: torch.device,
              precision: Precision = Precision.FLOAT32) -> Any:
    """The run's head: a trained draft block's recursive drafter (``config.block``; a shipped one
    as deep as ``generate`` loads it in the resolved ``precision``), the shipped ``config.head``
    for the model, or a random BTree head."""
    if config.block is not None:
        from circuits_llm.heads.shipped import is_block_kind
        if is_block_kind(config.block) and not Path(config.block).is_dir():
            from circuits_llm.app.head_cache import find_shipped_drafter
            from circuits_llm.app.shipping import load_shipped_drafter
            found = find_shipped_drafter(loaded, config.block)
            if found is None:
                raise SystemExit(f"--block {config.block}: none ships for {config.model}")
            return load_shipped_drafter(found, loaded.model, config.block_steps,
                                        precision=precision)
        from circuits_llm.draft_block import BlockDrafter
        from circuits_llm.training.block_trainer import load_trained_block
        return BlockDrafter(load_trained_block(config.block, loaded.model).to(device),
                            steps=config.block_steps)
    if config.head != "random":
        from circuits_llm import shipped_head
        return shipped_head(config.model, config.head, device=device).eval()
    from circuits_llm.heads import MTPHead
    model = loaded.model
    return MTPHead.from_name("btree", config.window, 4, model.config.hidden_size,
                             model.config.vocab_size, "lean",
                             model.get_output_embeddings().weight.detach()).eval().to(device)


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, temperature: float,
                pad: int) -> tuple[Tensor, int]:
    """``model.generate`` on the left-padded batch -> (new tokens (B, new_tokens), the bytes of
    its final KV cache)."""
    from transformers import DynamicCache
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt):] = torch.tensor(prompt)
        mask[b, width - len(prompt):] = 1
    cache = DynamicCache()
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} \
        if temperature > 0 else {"do_sample": False}
    out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
                         past_key_values=cache, **sampling)
    return out[:, width:], cache_bytes(cache)


def _ours(result: DecodeResult | BatchResult) -> dict[str, Any]:
    batch = single_row_batch(result) if isinstance(result, DecodeResult) else result
    s = batch.summary
    return {"rounds": s.rounds, "tokens_per_round": s.tokens_per_round,
            "acceptance_rate": s.acceptance_rate, "mean_rows": s.mean_rows,
            "ms_per_round": s.mean_latency_s * 1e3,
            "ms_per_round_phase": {p.removesuffix("_s"): v * 1e3 for p, v in s.mean_split_s.items()},
            "decode_tok_s": s.throughput}


def measure(config: BatchBenchConfig, decoders: dict[str, Any], peaks: dict[str, PeakCache],
            model: Any, prompts: list[list[int]], mode: str, pad: int) -> dict[str, Any]:
    """One batch size and mode: every decoder timed interleaved (see the module docstring)."""
    temperature, device = MODES[mode], torch.device(config.device)
    last: dict[str, Any] = {}
    hf_bytes = [0]

    def ours(name: str) -> Callable[[], None]:
        def run() -> None:
            generators = [torch.Generator(device=device).manual_seed(config.seed + b)
                          for b in range(len(prompts))]
            last[name] = decoders[name].generate(prompts, config.new_tokens, temperature,
                                                 generator=generators, eos_token_id=())
        return run

    def hf() -> None:
        torch.manual_seed(config.seed)
        last["hf_generate"], hf_bytes[0] = hf_generate(model, prompts, config.new_tokens,
                                                       temperature, pad)

    for peak in peaks.values():
        peak.peak = 0
    timings = interleaved({"speculative": ours("speculative"),
                           "autoregressive": ours("autoregressive"), "hf_generate": hf},
                          rounds=config.repeats, warmup=1, max_calls=1, grad_mode=GradMode.NO_GRAD,
                          device=device if device.type == "cuda" else None)
    tokens = len(prompts) * config.new_tokens
    rows: dict[str, Any] = {}
    for name in DECODERS:
        seconds = timings[name].median
        rows[name] = {"seconds": seconds, "tok_s": tokens / seconds, "spread": timings[name].spread,
                      "kv_bytes": hf_bytes[0] if name == "hf_generate" else peaks[name].peak}
        if name != "hf_generate":
            rows[name].update(_ours(last[name]))
    spec, ar = rows["speculative"], rows["autoregressive"]
    spec["speedup_vs_ar"] = spec["tok_s"] / ar["tok_s"]
    spec["speedup_vs_hf"] = spec["tok_s"] / rows["hf_generate"]["tok_s"]
    spec["kv_over_ar"] = spec["kv_bytes"] / ar["kv_bytes"] if ar["kv_bytes"] else 0.0
    tokens_of = {name: (single_row_batch(r) if isinstance(r, DecodeResult) else r).tokens
                 for name, r in last.items() if name != "hf_generate"}
    out: dict[str, Any] = {"batch_size": len(prompts), "mode": mode, "decoders": rows}
    if mode == "greedy":
        out["greedy_identical"] = tokens_of["speculative"] == tokens_of["autoregressive"]
    return out


def decode_batch_block(backbone: HFBackbone, head: Any, prompts: list[list[int]], new_tokens: int,
                       temperature: float, repeats: int, seed: int) -> dict[str, Any]:
    """Batched AR and speculative decoding of ``prompts`` on one dynamic-cache ``backbone``,
    timed interleaved (median wall of one ``generate`` call): tokens per second over the batch,
    the speed-up, and whether greedy rows agree (the batch axis of ``benchmarks/decoder_bench``)."""
    decoders = {"autoregressive": AutoregressiveDecoder(backbone),
                "speculative": SpeculativeDecoder(backbone, head)}
    last: dict[str, BatchResult] = {}

    def run(name: str) -> Callable[[], None]:
        def call() -> None:
            generators = [torch.Generator(device=backbone.device).manual_seed(seed + b)
                          for b in range(len(prompts))]
            last[name] = decoders[name].generate(prompts, new_tokens, temperature,
                                                 generator=generators, eos_token_id=())
        return call

    timings = interleaved({name: run(name) for name in decoders}, rounds=repeats, warmup=1,
                          max_calls=1, grad_mode=GradMode.NO_GRAD)
    tokens = len(prompts) * new_tokens
    out: dict[str, Any] = {"batch_size": len(prompts)}
    for name in decoders:
        out[name] = {"tok_s": tokens / timings[name].median, **_ours(last[name])}
    out["speedup_vs_ar"] = out["speculative"]["tok_s"] / out["autoregressive"]["tok_s"]
    if temperature == 0:
        out["matches_ar"] = last["speculative"].tokens == last["autoregressive"].tokens
    return out


def run_benchmark(config: BatchBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every batch size and mode of ``config``; the JSON-ready record."""
    from circuits_llm.text.models import load_model
    torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    config = dataclasses.replace(config, device=str(device))
    loaded = load_model(config.model, device)
    model = loaded.model
    precision = Precision(config.precision).resolve(device)
    config = dataclasses.replace(config, precision=precision.value)
    head = load_head(config, loaded, device, precision)
    linear = "torch's default linear kernels"
    if precision is Precision.BFLOAT16:  # a copy: the drafters keep the parts they share
        model, linear = decode_model(model, precision, head.window, device)
        rows = priced_rows(model)
        if config.block_steps is None and hasattr(head, "batch_depth") and rows is not None:
            # as generate --prompts-file drafts: verify calls sized by their price
            head.batch_depth = BatchDepth.within(rows, head.batch_most)
            linear += f"; the block drafts {head.batch_depth.describe()}"
    elif config.packed_linear:
        linear = decode_model(model, precision, head.window, device)[1]
    if config.block is not None:  # a draft block verifies all its drafts (journal §11)
        config = dataclasses.replace(config, draft_confidence=None)
    rule = None if config.draft_confidence is None else \
        DraftLength.confident(config.draft_confidence, minimum=config.draft_minimum)
    lookup = None if config.lookup is None else ContextLookup(config.lookup)
    backbones = {"speculative": drafter_backbone(model, head),
                 "autoregressive": HFBackbone(model)}
    peaks = {name: PeakCache(backbone) for name, backbone in backbones.items()}
    decoders = {"speculative": SpeculativeDecoder(backbones["speculative"], head,
                                                  draft_length=rule, lookup=lookup),
                "autoregressive": AutoregressiveDecoder(backbones["autoregressive"])}
    pad = model.generation_config.pad_token_id
    if not isinstance(pad, int):  # padding is never attended to: EOS (or 0) will do
        eos = model.config.eos_token_id
        pad = eos if isinstance(eos, int) else eos[0] if eos else 0
    all_prompts = batch_prompts(loaded, max(config.batch_sizes), config.prompt_tokens)
    log(f"model: {loaded.source} ({sum(p.numel() for p in model.parameters()):,} parameters) on "
        f"{device}; {'block ' + config.block if config.block else 'head ' + config.head} window "
        f"{head.window}; {config.threads} threads; {linear}")
    results = []
    for size in config.batch_sizes:
        for mode in config.modes:
            entry = measure(config, decoders, peaks, model, all_prompts[:size], mode, pad)
            spec = entry["decoders"]["speculative"]
            log(f"  B={size:<3} {mode:<8} speculative {spec['tok_s']:8.1f} tok/s, "
                f"x{spec['speedup_vs_ar']:.2f} vs batched AR, x{spec['speedup_vs_hf']:.2f} vs HF, "
                f"KV x{spec['kv_over_ar']:.2f}")
            results.append(entry)
    machine = machine_info(device, config.threads)
    machine["load_average_end"] = load_average()
    machine["linear_layers"] = linear
    return {"schema_version": SCHEMA_VERSION, "benchmark": "batch_bench",
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "config": dataclasses.asdict(config), "machine": machine,
            "model": loaded.describe(),
            "results": results, "crossover": crossover(results),
            "memory_target": MEMORY_TARGET,
            "memory_ok": all(r["decoders"]["speculative"]["kv_over_ar"] <= MEMORY_TARGET
                             for r in results)}


def crossover(results: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per mode, the smallest batch size where speculative decoding is slower than batched AR
    (``None``: faster at every size measured)."""
    out: dict[str, int | None] = {}
    for mode in dict.fromkeys(r["mode"] for r in results):
        below = [r["batch_size"] for r in results if r["mode"] == mode
                 and r["decoders"]["speculative"]["speedup_vs_ar"] < 1]
        out[mode] = min(below) if below else None
    return out


def _cell(value: float | None, width: int, spec: str = ".2f") -> str:
    """``value`` formatted right-aligned in ``width`` columns, ``-`` when it does not apply."""
    return f"{'-' if value is None else format(value, spec):>{width}}"


def format_table(record: dict[str, Any]) -> str:
    """The record as a text table: one line per batch size, mode and decoder."""
    lines = [f"{'mode':<8} {'B':>3} {'decoder':<14} {'tok/s':>8} {'vs AR':>6} {'vs HF':>6} "
             f"{'tok/rnd':>7} {'acc':>5} {'ms/rnd':>7} {'draft':>6} {'verify':>6} {'accept':>6} "
             f"{'KV MiB':>7} {'KV/AR':>5}"]
    for entry in record["results"]:
        for name, row in entry["decoders"].items():
            phases = row.get("ms_per_round_phase", {})
            cells = [_cell(row["tok_s"], 8, ".1f"), _cell(row.get("speedup_vs_ar"), 6),
                     _cell(row.get("speedup_vs_hf"), 6), _cell(row.get("tokens_per_round"), 7),
                     _cell(row.get("acceptance_rate"), 5), _cell(row.get("ms_per_round"), 7),
                     *(_cell(phases.get(p), 6) for p in ("draft", "verify", "accept")),
                     _cell(row["kv_bytes"] / 2 ** 20, 7), _cell(row.get("kv_over_ar"), 5)]
            lines.append(f"{entry['mode']:<8} {entry['batch_size']:>3} {name:<14} "
                         + " ".join(cells))
    identical = all(e.get("greedy_identical", True) for e in record["results"])
    lines.append(f"\ngreedy rows of speculative and batched AR identical: {identical}; "
                 f"speed-up over batched AR below 1 from batch size: {record['crossover']}; "
                 f"KV cache within {MEMORY_TARGET}x of batched AR's: {record['memory_ok']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="embedded model, random head, tiny")
    parser.add_argument("--model", default=None, help="the model (default smollm2)")
    parser.add_argument("--head", default=None, help="a shipped head kind (default btree)")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,2,4,8,16)")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--plain-linear", action="store_true",
                        help="torch's default linear kernels (default: packed for verify blocks)")
    parser.add_argument("--modes", default=None, help="comma-separated of greedy, sampling")
    parser.add_argument("--block", default=None,
                        help="draft with a draft block: a shipped kind (block, btree-block) or a "
                             "train-head --draft-block run directory")
    parser.add_argument("--block-steps", type=int, default=None,
                        help="a recursive block's drafts per round (default: the shipped block's, "
                             "or a run's trained depth)")
    parser.add_argument("--precision", choices=[p.value for p in Precision], default=None,
                        help="the model's precision (default auto: row-invariant bfloat16 on a "
                             "CPU that computes it natively, float32 elsewhere)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    config = BatchBenchConfig.quick(args.threads, args.device) if args.quick else \
        BatchBenchConfig(threads=args.threads, device=args.device)
    changes: dict[str, Any] = {name: getattr(args, name) for name in
                               ("model", "head", "new_tokens", "prompt_tokens", "repeats",
                                "block", "block_steps", "precision")
                               if getattr(args, name) is not None}
    if args.batch_sizes is not None:
        changes["batch_sizes"] = tuple(int(b) for b in args.batch_sizes.split(","))
    if args.modes is not None:
        modes = tuple(args.modes.split(","))
        if not modes or any(mode not in MODES for mode in modes):
            parser.error(f"--modes takes a comma-separated list of {', '.join(MODES)}, got "
                         f"{args.modes!r}")
        changes["modes"] = modes
    if args.plain_linear:
        changes["packed_linear"] = False
    config = dataclasses.replace(config, **changes)
    record = run_benchmark(config)
    publish(format_table(record), record, args.out or (QUICK_OUT if args.quick else DEFAULT_OUT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
