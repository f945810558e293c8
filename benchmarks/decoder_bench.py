"""Speculative decoding with circuit heads on a random-weight byte-level Llama: where time goes.

Run ``python -m benchmarks.decoder_bench [--quick] [--out PATH] [--threads N]
[--device auto|cpu|cuda[:N]] [--kernels auto|torch|triton]``. ``--device`` defaults to ``cpu`` so
that a plain run reproduces the recorded CPU numbers; the JSON records the device that actually
ran (``config.device``, resolved: ``cuda:0`` rather than ``auto``; ``machine.device`` with the GPU
name). On a CUDA machine, ``--device cuda`` (or ``auto``) times the same rounds on the GPU
(synchronised) with the kernel backend chosen by ``--kernels`` (``auto``: triton when
importable); run it once with ``--kernels torch`` and once with ``--kernels triton`` to compare
the end-to-end round time of the two paths.

Backbone: a byte-level Llama built from a config with random weights (4 layers, hidden 256,
8 heads, intermediate 688, vocab 260: the planned embedded size; its parameter count is
reported). For every head (FF, CP, HMM, BTree; rank 32; windows 8 and 16; LEAN and FULL) it
reports, from ONE run:

* the head's cost per round, split as in :class:`~circuits_llm.decoder.SpeculativeDecoder`:
  parameterise (``head(e)``), draft (``circuit.log_parameters`` once per round, then sampling:
  ``conditional_sample``; greedy: ``map_state``) and the exact draft conditionals
  (``log_prefix_conditionals`` on the same log-parameters, sampling only), against the verify
  forward (one ``extend`` of ``n`` tokens) and one plain AR step (one ``extend`` of 1 token):
  medians of interleaved repeats;
* decoding with :class:`~circuits_llm.decoder.SpeculativeDecoder` against
  :class:`~circuits_llm.decoder.AutoregressiveDecoder` on the same backbone and prompt, greedy
  and sampling: tokens per call, throughput, speed-up;
* the forced-acceptance upper bound (the paper's ``max_tok/s``): the same decoder on a backbone
  wrapper whose verifier agrees with every draft (:class:`ForcedAcceptance`), so each round
  emits ``n`` tokens at the real round cost.

With random weights the draft and the target are unrelated: acceptance (hence the measured
speed-up) is meaningless and only the latencies and the forced bound carry information. The key
number is the BTree n=16 r=32 head round as a fraction of one verify forward (target <= 15%);
for that head the three phases are also profiled (top torch ops).

Results are printed as tables and written atomically as JSON (default
``benchmarks/results/decoder_bench.json``) with machine, load and thread information.
``--threads`` defaults to 2; on a 2-core machine that other jobs share, 2 intra-op threads wait
for each other (every op ~10x slower here under load 5), so use ``--threads 1`` there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import LlamaForCausalLM

from benchmarks.spec_tools import ForcedAcceptance
from circuits.compiled.circuit import LogParameters
from circuits.kernels import KernelBackend, failed_kernels, resolve_backend, use_backend
from circuits_llm import data
from circuits_llm.backbone import HFBackbone
from circuits_llm.decoder import AutoregressiveDecoder, SpeculativeDecoder, draft_conditionals, draft_window
from circuits_llm.devices import DeviceError, add_device_argument, resolve_device
from circuits_llm.heads import MTPHead
from circuits_llm.metrics import DecodeSummary
from circuits_llm.pretrain import ModelShape
from circuits_llm.timing import (
    GradMode,
    count_ops,
    interleaved,
    load_average,
    machine_info,
    medians,
    publish,
)

SCHEMA_VERSION = 1
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "decoder_bench.json"
TARGET_RATIO = 0.15
RANDOM_WEIGHTS_NOTE = (
    "random weights: the draft head and the target model are unrelated, so acceptance rates and "
    "the measured speed-ups are meaningless; only latencies and the forced-acceptance bound "
    "(every draft accepted at the real round cost) carry information")
PHASES = ("parameterise", "draft_sample", "draft_greedy", "conditionals", "verify", "ar_step")


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and budgets of one benchmark run (defaults: the full run).

    ``device`` takes any ``--device`` form (:mod:`circuits_llm.devices`); :func:`run_benchmark`
    resolves it and records the resolved device (``"cpu"``, ``"cuda:0"``) in the result.
    """

    hidden_size: int = 256
    layers: int = 4
    attention_heads: int = 8
    intermediate_size: int = 688
    vocab_size: int = data.VOCAB_SIZE
    architectures: tuple[str, ...] = ("ff", "cp", "hmm", "btree")
    windows: tuple[int, ...] = (8, 16)
    rank: int = 32
    variants: tuple[str, ...] = ("lean", "full")
    prompt_tokens: int = 64
    new_tokens: int = 64
    repeats: int = 2
    timing_rounds: int = 7
    temperature: float = 1.0
    threads: int = 2
    seed: int = 0
    profile: bool = True
    device: str = "cpu"
    kernels: str = "auto"

    @classmethod
    def quick(cls, threads: int = 2, device: str = "cpu", kernels: str = "auto") -> BenchConfig:
        """The ``--quick`` run (< 90 s): FF and BTree, n=16, LEAN, short decodes."""
        return cls(architectures=("ff", "btree"), windows=(16,), variants=("lean",),
                   new_tokens=16, repeats=1, timing_rounds=5, threads=threads, device=device,
                   kernels=kernels)


def build_model(config: BenchConfig) -> LlamaForCausalLM:
    """The random-weight byte-level Llama of ``config``, in eval mode."""
    torch.manual_seed(config.seed)
    shape = ModelShape(hidden_size=config.hidden_size, num_layers=config.layers,
                       num_heads=config.attention_heads,
                       intermediate_size=config.intermediate_size, max_positions=2048)
    llama = shape.config()  # the embedded model's architecture (tied embeddings, specials)
    llama.vocab_size = config.vocab_size
    return LlamaForCausalLM(llama).eval().to(config.device)


def _generator(device: torch.device | str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _medians(candidates: dict[str, Callable[[], object]], rounds: int,
             device: torch.device) -> dict[str, float]:
    """Median seconds of one call of each candidate, round-robin (:func:`interleaved`, one call
    per sample), under ``no_grad`` (not ``inference_mode``: the conditional queries need
    autograd), synchronised on CUDA."""
    return medians(interleaved(candidates, rounds, max_calls=1, grad_mode=GradMode.NO_GRAD,
                               device=device))


def _block_step(backbone: HFBackbone, width: int, generator: torch.Generator) -> Callable[[], None]:
    """One ``extend`` of ``width`` random byte tokens, then a crop back (the cache is restored)."""
    def run() -> None:
        base = backbone.length
        backbone.extend(torch.randint(0, 256, (1, width), generator=generator))
        backbone.crop(base)
    return run


def backbone_timings(backbone: HFBackbone, windows: tuple[int, ...], rounds: int,
                     ) -> dict[str, float]:
    """Median seconds of a verify ``extend`` of ``n`` tokens and of a 1-token AR step.

    The backbone must hold the context already; it is left as it was.
    """
    generator = torch.Generator().manual_seed(0)  # token ids: drawn on the CPU, moved by extend
    candidates = {f"verify_{n}": _block_step(backbone, n, generator) for n in windows}
    candidates["ar_step"] = _block_step(backbone, 1, generator)
    return _medians(candidates, rounds, backbone.device)


def round_phases(head: MTPHead, hidden: Tensor, c: int,
                 generator: torch.Generator) -> dict[str, Callable[[], object]]:
    """The head's phases of a round, as :class:`SpeculativeDecoder` runs them.

    ``draft_*`` include the round's one ``circuit.log_parameters``; ``conditionals`` starts from
    log-parameters in the state a sampling draft leaves them (sum weights exponentiated, input
    distributions not), so the phases add up to a round.
    """
    with torch.no_grad():
        params = head(hidden)
        prepared = head.circuit.log_parameters(params)
        draft = draft_window(head.circuit, prepared, c, False, generator)
    after_draft = {k: v for k, v in prepared.derived.items() if k[0] == "exp_weights"}

    def draft_phase(greedy: bool) -> Tensor:
        return draft_window(head.circuit, head.circuit.log_parameters(params), c, greedy,
                            generator)

    def conditionals() -> Tensor:
        fresh = LogParameters(prepared.values, prepared.batch, dict(after_draft))
        return draft_conditionals(head.circuit, fresh, c, draft[None])

    return {"parameterise": lambda: head(hidden), "draft_sample": lambda: draft_phase(False),
            "draft_greedy": lambda: draft_phase(True), "conditionals": conditionals}


def head_timings(head: MTPHead, backbone: HFBackbone, hidden: Tensor, c: int,
                 rounds: int) -> dict[str, Any]:
    """Median seconds of each phase of a round, interleaved with the verify forward and an AR step.

    Timing the head next to the backbone calls (round-robin, same seconds of machine load) makes
    the head/verify ratio robust to load drift. ``backbone`` must hold the context.
    """
    tokens = torch.Generator().manual_seed(0)
    candidates = {
        **round_phases(head, hidden, c, _generator(hidden.device, 0)),
        "verify": _block_step(backbone, head.window, tokens),
        "ar_step": _block_step(backbone, 1, tokens),
    }
    return _medians(candidates, rounds, hidden.device)


def phase_ops(head: MTPHead, backbone: HFBackbone, hidden: Tensor, c: int) -> dict[str, Any]:
    """Torch ops dispatched per call of each phase of a round, of the verify forward and of an
    AR step (eager; :func:`circuits_llm.timing.count_ops`). ``backbone`` must hold the context.

    ``head_sampling`` = parameterise + draft_sample + conditionals and ``head_greedy`` =
    parameterise + draft_greedy: the head side of a round, beside ``verify``.
    """
    tokens = torch.Generator().manual_seed(0)
    phases = {**round_phases(head, hidden, c, _generator(hidden.device, 0)),
              "verify": _block_step(backbone, head.window, tokens),
              "ar_step": _block_step(backbone, 1, tokens)}
    counts = {name: count_ops(fn) for name, fn in phases.items()}
    per_call = {name: count.per_call for name, count in counts.items()}
    per_call["head_sampling"] = (per_call["parameterise"] + per_call["draft_sample"]
                                 + per_call["conditionals"])
    per_call["head_greedy"] = per_call["parameterise"] + per_call["draft_greedy"]
    return {"per_call": per_call,
            "top": {name: count.top() for name, count in counts.items()}}


def profile_phases(head: MTPHead, hidden: Tensor, c: int, calls: int = 5,
                   top: int = 6) -> dict[str, dict[str, Any]]:
    """Op count, total and top torch ops by self CPU time per phase of a sampling round.

    ``self_ms_per_round`` sums the ops' own CPU time; the rest of a phase's wall time is Python
    and dispatch overhead between ops.
    """
    from torch.profiler import ProfilerActivity, profile

    phases = round_phases(head, hidden, c, _generator(hidden.device, 0))
    del phases["draft_greedy"]
    result: dict[str, dict[str, Any]] = {}
    for name, fn in phases.items():
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                fn()
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops) or 1.0
        result[name] = {
            "ops_per_round": sum(e.count for e in ops) / calls,
            "self_ms_per_round": total / 1e3 / calls,
            "top": [{"op": e.key, "calls_per_round": e.count / calls,
                     "self_ms_per_round": e.self_cpu_time_total / 1e3 / calls,
                     "share": e.self_cpu_time_total / total} for e in ops[:top]]}
    return result


def _summary(summary: DecodeSummary) -> dict[str, Any]:
    return {
        "new_tokens": summary.new_tokens, "rounds": summary.rounds,
        "tokens_per_call": summary.tokens_per_call, "tokens_per_round": summary.tokens_per_round,
        "acceptance_rate": summary.acceptance_rate,
        "acceptance_by_position": list(summary.acceptance_by_position),
        "mean_latency_s": summary.mean_latency_s, "mean_split_s": dict(summary.mean_split_s),
        "throughput_tok_s": summary.throughput,
    }


def decode_block(backbone: HFBackbone, head: MTPHead, prompt: list[int], config: BenchConfig,
                 greedy: bool) -> dict[str, Any]:
    """AR, speculative and forced-acceptance decoding, interleaved ``config.repeats`` times."""
    temperature = 0.0 if greedy else config.temperature
    decoders = {"autoregressive": AutoregressiveDecoder(backbone),
                "speculative": SpeculativeDecoder(backbone, head),
                "forced": SpeculativeDecoder(ForcedAcceptance(backbone), head)}
    runs: dict[str, list[Any]] = {name: [] for name in decoders}
    for repeat in range(config.repeats):
        for name, decoder in decoders.items():
            generator = _generator(config.device, config.seed + repeat)
            runs[name].append(decoder.generate(prompt, config.new_tokens, temperature,
                                               generator=generator))
    out: dict[str, Any] = {}
    for name, results in runs.items():
        ordered = sorted(results, key=lambda r: r.summary.throughput)
        out[name] = _summary(ordered[len(ordered) // 2].summary)
    ar = out["autoregressive"]["throughput_tok_s"]
    for name in ("speculative", "forced"):
        out[name]["speedup_vs_ar"] = out[name]["throughput_tok_s"] / ar if ar > 0 else 0.0
    if greedy:
        out["matches_ar"] = all(torch.equal(s.tokens, a.tokens) for s, a in
                                zip(runs["speculative"], runs["autoregressive"], strict=True))
    return out


def run_benchmark(config: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every measurement of ``config`` under its kernel backend; the JSON-ready result.

    ``config.device`` is resolved first (``auto`` -> ``cuda:0`` or ``cpu``; a CUDA device this
    machine lacks raises :class:`~circuits_llm.devices.DeviceError`), and the run uses and records
    the resolved device. On CUDA that device is made current, so the timing synchronisations wait
    for the GPU that does the work.
    """
    device = resolve_device(config.device)
    config = dataclasses.replace(config, device=str(device))
    current = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with use_backend(config.kernels), current:
        return _run_benchmark(config, log)


def _run_benchmark(config: BenchConfig, log: Callable[[str], None]) -> dict[str, Any]:
    torch.set_num_threads(config.threads)
    machine = machine_info(torch.device(config.device), config.threads)
    probe = torch.zeros(1, device=config.device)
    machine["kernels"] = resolve_backend(probe).value  # what actually runs, not what was asked
    model = build_model(config)
    backbone = HFBackbone(model)
    prompt = [int(t) for t in data.evaluation_prompts(1, config.prompt_tokens)[0].tolist()]
    lm_head = model.get_output_embeddings().weight.detach()
    log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"{config.threads} torch threads; {RANDOM_WEIGHTS_NOTE}")
    with torch.no_grad():
        hidden = backbone.extend(torch.tensor([prompt[:-1]])).draft_hidden[:, -1]
    timings = backbone_timings(backbone, config.windows, config.timing_rounds * 2)
    heads: list[dict[str, Any]] = []
    profile: dict[str, Any] | None = None
    for window in config.windows:
        for architecture in config.architectures:
            for variant in config.variants:
                rank = 1 if architecture == "ff" else config.rank
                head = MTPHead.from_name(architecture, window, rank, config.hidden_size,
                                         config.vocab_size, variant, lm_head, seed=config.seed)
                head.eval().to(config.device)
                backbone.reset()
                with torch.no_grad():
                    backbone.extend(torch.tensor([prompt[:-1]]))
                phases = head_timings(head, backbone, hidden, prompt[-1], config.timing_rounds)
                verify = phases["verify"]
                sampling = phases["parameterise"] + phases["draft_sample"] + phases["conditionals"]
                greedy = phases["parameterise"] + phases["draft_greedy"]
                entry: dict[str, Any] = {
                    "architecture": architecture, "window": window, "rank": rank,
                    "variant": variant, "parameters": head.num_parameters(),
                    "phases_s": phases, "round_sampling_s": sampling, "round_greedy_s": greedy,
                    "round_over_verify": {"sampling": sampling / verify, "greedy": greedy / verify},
                    "ops": phase_ops(head, backbone, hidden, prompt[-1]),
                    "decode": {mode: decode_block(backbone, head, prompt, config, mode == "greedy")
                               for mode in ("greedy", "sampling")},
                }
                if config.profile and config.device == "cpu" and profile is None \
                        and architecture == "btree" \
                        and window == max(config.windows):
                    profile = {"head": f"btree n={window} r={rank} {variant}",
                               "phases": profile_phases(head, hidden, prompt[-1])}
                heads.append(entry)
                log(f"  {architecture:>5} n={window:<2} {variant:<4} round/verify "
                    f"{entry['round_over_verify']['sampling']:.2f} (sampling)")
                del head
    machine["load_average_end"] = load_average()
    # kernels AUTO replaced by torch during the run (a triton kernel that failed here): the
    # "kernels" entry above is then only partly true, and this says where
    machine["kernel_fallbacks"] = {f"{kernel.name} {dtype} {device}": why
                                   for (kernel, dtype, device), why in failed_kernels().items()}
    return {
        "schema_version": SCHEMA_VERSION, "benchmark": "decoder_bench",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": dataclasses.asdict(config), "machine": machine, "note": RANDOM_WEIGHTS_NOTE,
        "model": {"architecture": "llama", "parameters": sum(p.numel() for p in model.parameters()),
                  "config": {k: getattr(model.config, k) for k in (
                      "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "intermediate_size")}},
        "backbone_s": timings, "heads": heads, "target": _target(heads),
        "profile": profile,
    }


def _target(heads: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The BTree n=16 r=32 head round over one verify forward (timed alongside), per variant."""
    rows = [h for h in heads if h["architecture"] == "btree" and h["window"] == 16
            and h["rank"] == 32]
    if not rows:
        return None
    return {
        "head": "btree n=16 r=32", "target": TARGET_RATIO,
        "variants": {h["variant"]: {
            "ratio_sampling": h["round_over_verify"]["sampling"],
            "ratio_greedy": h["round_over_verify"]["greedy"],
            "met": h["round_over_verify"]["sampling"] <= TARGET_RATIO,
            "phases_s": {k: h["phases_s"][k] for k in PHASES}} for h in rows},
    }


def format_tables(result: dict[str, Any]) -> str:
    """Human-readable tables of a :func:`run_benchmark` result."""
    ms = 1e3
    machine, timings = result["machine"], result["backbone_s"]
    lines = [f"machine: {machine['processor']}, {machine['cpu_count']} CPU cores (shared), "
             f"{machine['torch_threads']} torch threads, load {machine['load_average']}",
             f"model: byte-level Llama {result['model']['config']}, "
             f"{result['model']['parameters']:,} parameters (random weights)",
             f"NOTE: {result['note']}",
             "backbone: " + ", ".join(f"{k} {v * ms:.2f} ms" for k, v in timings.items()), "",
             f"{'head':<16}{'params':>11}{'param':>7}{'samp':>7}{'map':>7}{'cond':>7}"
             f"{'verify':>7}{'AR':>7}{'rnd/ver':>8}{'greedy':>7}{'ops head':>9}{'ops ver':>8}"]
    for h in result["heads"]:
        p = h["phases_s"]
        name = f"{h['architecture']} n={h['window']} {h['variant']}"
        lines.append(f"{name:<16}{h['parameters']:>11,}{p['parameterise'] * ms:>7.2f}"
                     f"{p['draft_sample'] * ms:>7.2f}{p['draft_greedy'] * ms:>7.2f}"
                     f"{p['conditionals'] * ms:>7.2f}"
                     f"{p['verify'] * ms:>7.2f}{p['ar_step'] * ms:>7.2f}"
                     f"{h['round_over_verify']['sampling']:>8.2f}"
                     f"{h['round_over_verify']['greedy']:>7.2f}"
                     f"{h['ops']['per_call']['head_sampling']:>9.0f}"
                     f"{h['ops']['per_call']['verify']:>8.0f}")
    lines.append("(ms: param = head(e), samp = log_parameters + conditional_sample, map = "
                 "log_parameters + map_state, cond = log_prefix_conditionals on the same "
                 "log-parameters. Ratios of verify_n: rnd/ver = param+samp+cond, greedy = param+map; "
                 "ops: torch ops dispatched by the head side of a sampling round and by the verify "
                 "forward)")
    lines += ["", f"{'head':<16}{'mode':<9}{'tok/call':>9}{'lat ms':>8}{'tok/s':>8}{'AR tok/s':>9}"
              f"{'xAR':>6}{'forced':>8}{'xAR':>6}{'match':>7}"]
    for h in result["heads"]:
        name = f"{h['architecture']} n={h['window']} {h['variant']}"
        for mode, d in h["decode"].items():
            s, f, a = d["speculative"], d["forced"], d["autoregressive"]
            match = str(d.get("matches_ar", "-"))
            lines.append(f"{name:<16}{mode:<9}{s['tokens_per_call']:>9.2f}"
                         f"{s['mean_latency_s'] * ms:>8.1f}{s['throughput_tok_s']:>8.1f}"
                         f"{a['throughput_tok_s']:>9.1f}{s['speedup_vs_ar']:>6.2f}"
                         f"{f['throughput_tok_s']:>8.1f}{f['speedup_vs_ar']:>6.2f}{match:>7}")
    target = result.get("target")
    if target:
        for variant, t in target["variants"].items():
            p = t["phases_s"]
            lines.append(
                f"\nTARGET btree n=16 r=32 {variant}: head round {t['ratio_sampling']:.0%} of one "
                f"verify forward ({p['verify'] * ms:.2f} ms; target <= "
                f"{target['target']:.0%}, met={t['met']}): parameterise {p['parameterise'] * ms:.2f}"
                f" + conditional_sample {p['draft_sample'] * ms:.2f} + log_prefix_conditionals "
                f"{p['conditionals'] * ms:.2f} ms; greedy round {t['ratio_greedy']:.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="FF and BTree n=16 LEAN only (< 90 s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    add_device_argument(parser, default="cpu",
                        note="cpu by default so a plain run reproduces the recorded CPU numbers; the "
                             "JSON records the resolved device.")
    parser.add_argument("--kernels", default="auto", choices=[b.value for b in KernelBackend],
                        help="kernel backend of the circuit queries (default auto)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    try:
        device = resolve_device(args.device)
    except DeviceError as error:
        parser.error(str(error))
    options = {"threads": args.threads, "device": str(device), "kernels": args.kernels}
    config = BenchConfig.quick(**options) if args.quick else BenchConfig(**options)
    start = time.perf_counter()
    result = run_benchmark(config)
    result["wall_s"] = time.perf_counter() - start
    publish(format_tables(result), result, args.out, sort_keys=True,
            note=f" ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
