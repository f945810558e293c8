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
8 heads, intermediate 688, vocab 260: the embedded model's size; its parameter count is
reported). For every head (FF, CP, HMM, BTree; rank 32; windows 8 and 16; LEAN and FULL) it
reports, from ONE run, eagerly and (for ``compiled_windows`` x ``compiled_variants``, default
the n=16 LEAN heads) compiled: both round programs through ``torch.compile`` and the backbone
with a static KV cache and compiled forwards, never one side compiled and the other not:

* the head's cost per round as :class:`~circuits_llm.decoding.decoder.SpeculativeDecoder` pays it: the
  draft program (parameterise, normalise, draw or max-product completion, exact conditionals;
  :class:`~circuits_llm.decoding.round.RoundProgram`) and the accept program, greedy and sampling,
  against the verify forward (one ``extend`` of ``n`` tokens) and one AR step (one ``extend``
  of 1 token): medians of interleaved repeats;
* ops per call of every phase: torch ops dispatched (eager, :func:`~circuits_llm.runtime.timing.count_ops`)
  and kernels launched (generated kernels plus top-level aten calls, eager and compiled;
  :func:`~circuits_llm.runtime.timing.count_kernels`; device kernels on CUDA);
* decoding with :class:`~circuits_llm.decoding.decoder.SpeculativeDecoder` against
  :class:`~circuits_llm.decoding.decoder.AutoregressiveDecoder` on the same backbone and prompt, greedy
  and sampling: tokens per call, throughput, speed-up;
* the forced-acceptance upper bound (the paper's ``max_tok/s``): the same decoder on a backbone
  wrapper whose verifier agrees with every draft (:class:`ForcedAcceptance`), so each round
  emits ``n`` tokens at the real round cost.

With random weights the draft and the target are unrelated: acceptance (hence the measured
speed-up) is meaningless and only the latencies and the forced bound carry information. The key
numbers are the BTree n=16 r=32 head round as a fraction of one verify forward (issue 13's
target on this model: <= 50%) and its head-side ops per round (target: <= 100 eager, about 10
compiled).

A program the compiler refuses (the draft or accept program of a head, or the backbone's step
for one block length; :class:`~circuits_llm.runtime.compiling.CompileFallbackWarning`) runs eager
from then on: the JSON records which programs fell back and why (``machine.compile_fallbacks``
for the run, ``compile_fallbacks`` in each compiled entry for that head), and the table marks such
rows ``compiled*`` and lists them, so that a partly eager "compiled" number is never mistaken for
a compiled one.

Results are printed as tables and written atomically as JSON (default
``benchmarks/results/decoder_bench.json``) with machine, load and thread information.

``--first-head`` measures instead the README's first head on the real SmolLM2-135M (``--model``;
``MTPHead.from_name("btree", window=8, rank=16, ..., variant="lean")`` with no ``draft_vocab``:
the default compressed vocabulary of :func:`circuits_llm.heads.vocab.resolve_draft_vocab`, beside
other sizes and the whole vocabulary): its eager round (draft + accept) over one eager verify
forward of the model, as ``SpeculativeDecoder(model, head)`` runs them
(:func:`first_head_costs`; issue 45's target: at most :data:`FIRST_HEAD_TARGET`), written to
``benchmarks/results/decoder_bench_first_head.json``.
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

from benchmarks.batch_bench import decode_batch_block
from benchmarks.spec_tools import ForcedAcceptance
from circuits.kernels import KernelBackend, failed_kernels, resolve_backend, use_backend
from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.metrics import DecodeSummary
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.heads import MTPHead
from circuits_llm.heads.vocab import DraftVocab, DraftVocabSpec
from circuits_llm.protocols import Backbone
from circuits_llm.runtime.compiling import compile_fallbacks
from circuits_llm.runtime.devices import DeviceError, add_device_argument, resolve_device
from circuits_llm.runtime.timing import (
    GradMode,
    count_kernels,
    count_ops,
    interleaved,
    load_average,
    machine_info,
    medians,
    profile_compiled_kernels,
    publish,
)
from circuits_llm.text import byte_level as data
from circuits_llm.training.pretrain import ModelShape

SCHEMA_VERSION = 1
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "decoder_bench.json"
RANDOM_WEIGHTS_NOTE = (
    "random weights: the draft head and the target model are unrelated, so acceptance rates and "
    "the measured speed-ups are meaningless; only latencies and the forced-acceptance bound "
    "(every draft accepted at the real round cost) carry information")
PHASES = ("draft_greedy", "accept_greedy", "draft_sampling", "accept_sampling", "verify", "ar_step")
MODES = ("greedy", "sampling")
#: issue 13's targets on this embedded-size model: head round / verify, head ops per round eager
ROUND_TARGET = 0.5
EAGER_OPS_TARGET = 100
#: issue 45: the README's first head on SmolLM2, with its default draft vocabulary, costs at most
#: this share of a verify forward per round
FIRST_HEAD_TARGET = 0.15
FIRST_HEAD_OUT = DEFAULT_OUT.with_name("decoder_bench_first_head.json")
#: the draft vocabularies :func:`first_head_costs` compares (the default first)
FIRST_HEAD_VOCABS: tuple[DraftVocabSpec, ...] = (DraftVocab.AUTO, 2048, 8192, DraftVocab.FULL)
#: the context the first head's round reads (code, as the README's prompt)
_FIRST_HEAD_CONTEXT = (
    "def fibonacci(n):\n    \"\"\"The n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\ndef main():\n"
    "    for n in range(10):\n        print(n, fibonacci(n))\n")


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and budgets of one benchmark run (defaults: the full run).

    ``device`` takes any ``--device`` form (:mod:`circuits_llm.runtime.devices`); :func:`run_benchmark`
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
    device: str = "cpu"
    kernels: str = "auto"
    #: where the round also runs compiled (both programs and the backbone's static-cache forward)
    compiled_windows: tuple[int, ...] = (16,)
    compiled_variants: tuple[str, ...] = ("lean",)
    #: above 1: the eager decodes also run ``batch_size`` prompts as one batch (AR and
    #: speculative; :func:`benchmarks.batch_bench.decode_batch_block`)
    batch_size: int = 1

    @classmethod
    def quick(cls, threads: int = 2, device: str = "cpu", kernels: str = "auto") -> BenchConfig:
        """The ``--quick`` run: BTree n=16 LEAN, eager and compiled, short decodes."""
        return cls(architectures=("btree",), windows=(16,), variants=("lean",),
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


def _block_step(backbone: Backbone, width: int, generator: torch.Generator) -> Callable[[], None]:
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


def _programs(head: MTPHead, config: BenchConfig, compiled: bool) -> dict[str, RoundProgram]:
    """The greedy and sampling round programs of ``head`` (compiled or eager)."""
    return {"greedy": RoundProgram(head, SamplingConfig(0.0), compile=compiled),
            "sampling": RoundProgram(head, SamplingConfig(config.temperature), compile=compiled)}


def round_calls(programs: dict[str, RoundProgram], hidden: Tensor, c: int,
                generator: torch.Generator) -> dict[str, Callable[[], object]]:
    """The head side of a round, as :class:`SpeculativeDecoder` runs it, per mode: ``draft``
    (parameterise, normalise, draft, conditionals: one program) and ``accept`` (verification on
    fixed verifier logits), each ending in what the decoder reads on the host."""
    calls: dict[str, Callable[[], object]] = {}
    token = torch.tensor([c], device=hidden.device)
    # each accept call reuses one draft, read after many later compiled calls: fine, since a
    # compiled program's outputs are copies (never a CUDA graph's static outputs)
    for mode, program in programs.items():
        uniforms = None if mode == "greedy" else program.draw_uniforms(generator)
        with torch.no_grad():
            draft = program.draft(hidden, token, uniforms)
            logits = torch.randn(program.window, program.vocab_size, generator=torch.Generator()
                                 .manual_seed(0)).to(hidden.device)
        calls[f"draft_{mode}"] = (lambda p=program, u=uniforms: p.draft(hidden, token, u).block)
        calls[f"accept_{mode}"] = (lambda p=program, d=draft, u=uniforms, g=logits:
                                   p.outcome(p.accept(g, d, u)))
    return calls


def head_costs(head: MTPHead, backbone: Backbone, hidden: Tensor, c: int, config: BenchConfig,
               compiled: bool) -> dict[str, Any]:
    """Median seconds and op counts of a round's head side beside the verify forward and an AR
    step, all eager or all compiled (backbone included). ``backbone`` must hold the context."""
    programs = _programs(head, config, compiled)
    calls = round_calls(programs, hidden, c, _generator(hidden.device, 0))
    tokens = torch.Generator().manual_seed(0)
    timed = {**calls, "verify": _block_step(backbone, head.window, tokens),
             "ar_step": _block_step(backbone, 1, tokens)}
    for fn in timed.values():  # warm-up: compiles the programs and the backbone's graphs
        fn()
    phases = _medians(timed, config.timing_rounds, hidden.device)
    head_s = {mode: phases[f"draft_{mode}"] + phases[f"accept_{mode}"] for mode in MODES}
    ops: dict[str, Any] = {"kernels": {name: count_kernels(fn).per_call
                                       for name, fn in timed.items()}}
    if not compiled:  # what eager code dispatches (a compiled graph bypasses the dispatcher)
        counted = {name: count_ops(fn) for name, fn in timed.items()}
        ops["dispatched"] = {name: count.per_call for name, count in counted.items()}
        ops["top"] = {name: count.top() for name, count in counted.items()}
    for kind in ("kernels", "dispatched"):
        if kind in ops:
            ops[kind].update({f"head_{mode}": ops[kind][f"draft_{mode}"]
                              + ops[kind][f"accept_{mode}"] for mode in MODES})
    return {"phases_s": phases, "round_s": head_s,
            "round_over_verify": {mode: value / phases["verify"] for mode, value in head_s.items()},
            "ops": ops}


def _summary(summary: DecodeSummary) -> dict[str, Any]:
    return {
        "new_tokens": summary.new_tokens, "rounds": summary.rounds,
        "tokens_per_call": summary.tokens_per_call, "tokens_per_round": summary.tokens_per_round,
        "acceptance_rate": summary.acceptance_rate,
        "acceptance_by_position": list(summary.acceptance_by_position),
        "mean_latency_s": summary.mean_latency_s, "mean_split_s": dict(summary.mean_split_s),
        "throughput_tok_s": summary.throughput,
    }


def decode_block(backbone: Backbone, head: MTPHead, prompt: list[int], config: BenchConfig,
                 greedy: bool, compiled: bool) -> dict[str, Any]:
    """AR, speculative and forced-acceptance decoding, interleaved ``config.repeats`` times;
    every decoder eager or every decoder compiled (the backbone is shared, so it is either)."""
    temperature = 0.0 if greedy else config.temperature
    decoders = {"autoregressive": AutoregressiveDecoder(backbone),
                "speculative": SpeculativeDecoder(backbone, head, compile=compiled),
                "forced": SpeculativeDecoder(ForcedAcceptance(backbone), head, compile=compiled)}
    runs: dict[str, list[Any]] = {name: [] for name in decoders}
    for repeat in range(-1, config.repeats):  # repeat -1: warm-up (compilation), not recorded
        for name, decoder in decoders.items():
            generator = _generator(config.device, config.seed + max(repeat, 0))
            result = decoder.generate(prompt, config.new_tokens, temperature, generator=generator,
                                      eos_token_id=())  # a fixed length: no EOS stop
            if repeat >= 0:
                runs[name].append(result)
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
    if config.batch_size > 1 and not compiled:  # a batch needs the dynamic cache: eager only
        prompts = [p.tolist()[:config.prompt_tokens - 3 * b] for b, p in
                   enumerate(data.evaluation_prompts(config.batch_size, config.prompt_tokens))]
        out["batch"] = decode_batch_block(backbone, head, prompts, config.new_tokens,  # type: ignore[arg-type]
                                          temperature, config.repeats, config.seed)
    return out


def run_benchmark(config: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every measurement of ``config`` under its kernel backend; the JSON-ready result.

    ``config.device`` is resolved first (``auto`` -> ``cuda:0`` or ``cpu``; a CUDA device this
    machine lacks raises :class:`~circuits_llm.runtime.devices.DeviceError`), and the run uses and records
    the resolved device. On CUDA that device is made current, so the timing synchronisations wait
    for the GPU that does the work.
    """
    device = resolve_device(config.device)
    config = dataclasses.replace(config, device=str(device))
    current = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with use_backend(config.kernels), current:
        return _run_benchmark(config, log)


def _backbone(model: LlamaForCausalLM, config: BenchConfig, compiled: bool) -> HFBackbone:
    if not compiled:
        return HFBackbone(model)
    return HFBackbone(model, compile=True, max_cache_len=config.prompt_tokens + 2 * config.new_tokens
                      + 2 * max(config.windows), compiled_lengths=(1, *config.windows))


def _fallbacks_since(start: int) -> dict[str, str]:
    """Program -> why it runs eager, for the compile fall backs after the first ``start``."""
    return {f.program: f.error for f in compile_fallbacks()[start:]}


def _run_benchmark(config: BenchConfig, log: Callable[[str], None]) -> dict[str, Any]:
    torch.set_num_threads(config.threads)
    first_fallback = len(compile_fallbacks())
    if config.compiled_windows:
        profile_compiled_kernels()  # before anything compiles: CPU kernels become countable
    machine = machine_info(torch.device(config.device), config.threads)
    probe = torch.zeros(1, device=config.device)
    machine["kernels"] = resolve_backend(probe).value  # what actually runs, not what was asked
    model = build_model(config)
    backbones = {False: _backbone(model, config, False)}
    if config.compiled_windows:
        backbones[True] = _backbone(model, config, True)
    prompt = [int(t) for t in data.evaluation_prompts(1, config.prompt_tokens)[0].tolist()]
    lm_head = model.get_output_embeddings().weight.detach()
    log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"{config.threads} torch threads; {RANDOM_WEIGHTS_NOTE}")
    context = torch.tensor([prompt[:-1]], device=config.device)
    with torch.no_grad():
        hidden = backbones[False].extend(context).draft_hidden[:, -1]
    timings = backbone_timings(backbones[False], config.windows, config.timing_rounds * 2)
    heads: list[dict[str, Any]] = []
    for window in config.windows:
        for architecture in config.architectures:
            for variant in config.variants:
                rank = 1 if architecture == "ff" else config.rank
                head = MTPHead.from_name(architecture, window, rank, config.hidden_size,
                                         config.vocab_size, variant, lm_head, seed=config.seed)
                head.eval().to(config.device)
                entry: dict[str, Any] = {
                    "architecture": architecture, "window": window, "rank": rank,
                    "variant": variant, "parameters": head.num_parameters()}
                ways = [False] + ([True] if window in config.compiled_windows
                                  and variant in config.compiled_variants else [])
                for compiled in ways:
                    backbone = backbones[compiled]
                    backbone.reset()
                    with torch.no_grad():
                        backbone.extend(context)
                    way = "compiled" if compiled else "eager"
                    mark = len(compile_fallbacks())
                    costs = head_costs(head, backbone, hidden, prompt[-1], config, compiled)
                    costs["decode"] = {mode: decode_block(backbone, head, prompt, config,
                                                          mode == "greedy", compiled)
                                       for mode in MODES}
                    if compiled:  # the programs the compiler refused: they ran eager
                        costs["compile_fallbacks"] = _fallbacks_since(mark)
                        for program, why in costs["compile_fallbacks"].items():
                            log(f"  compile fall back: {program} ran eager ({why})")
                    entry[way] = costs
                    log(f"  {architecture:>5} n={window:<2} {variant:<4} {way:<8} round/verify "
                        f"{costs['round_over_verify']['sampling']:.2f} sampling, "
                        f"{costs['round_over_verify']['greedy']:.2f} greedy")
                heads.append(entry)
                del head
    machine["load_average_end"] = load_average()
    # kernels AUTO replaced by torch during the run (a triton kernel that failed here): the
    # "kernels" entry above is then only partly true, and this says where
    machine["kernel_fallbacks"] = {f"{kernel.name} {dtype} {device}": why
                                   for (kernel, dtype, device), why in failed_kernels().items()}
    # programs the compiler refused during the run (they ran eager; see each compiled entry)
    machine["compile_fallbacks"] = _fallbacks_since(first_fallback)
    return {
        "schema_version": SCHEMA_VERSION, "benchmark": "decoder_bench",
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "config": dataclasses.asdict(config), "machine": machine, "note": RANDOM_WEIGHTS_NOTE,
        "model": {"architecture": "llama", "parameters": sum(p.numel() for p in model.parameters()),
                  "config": {k: getattr(model.config, k) for k in (
                      "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "intermediate_size")}},
        "backbone_s": timings, "heads": heads, "target": _target(heads),
    }


def _target(heads: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The BTree n=16 r=32 head round over one verify forward (timed alongside), per variant and
    way (eager, compiled), with the head-side op counts of issue 13's targets."""
    rows = [h for h in heads if h["architecture"] == "btree" and h["window"] == 16
            and h["rank"] == 32]
    if not rows:
        return None
    out: dict[str, Any] = {"head": "btree n=16 r=32", "round_over_verify_target": ROUND_TARGET,
                           "eager_ops_target": EAGER_OPS_TARGET, "variants": {}}
    for h in rows:
        for way in ("eager", "compiled"):
            if way not in h:
                continue
            costs = h[way]
            ops = costs["ops"]
            out["variants"][f"{h['variant']} {way}"] = {
                "round_over_verify": costs["round_over_verify"],
                "met": costs["round_over_verify"]["sampling"] <= ROUND_TARGET,
                "head_kernels": {m: ops["kernels"][f"head_{m}"] for m in MODES},
                "head_dispatched": {m: ops["dispatched"][f"head_{m}"] for m in MODES}
                if "dispatched" in ops else None}
    return out


def _way_label(way: str, costs: dict[str, Any]) -> str:
    """``compiled*`` for a compiled entry in which some program ran eager (a compile fall back)."""
    return f"{way}*" if costs.get("compile_fallbacks") else way


def format_tables(result: dict[str, Any]) -> str:
    """Human-readable tables of a :func:`run_benchmark` result."""
    ms = 1e3
    machine, timings = result["machine"], result["backbone_s"]
    lines = [f"machine: {machine['processor']}, {machine['cpu_count']} CPU cores (shared), "
             f"{machine['torch_threads']} torch threads, load {machine['load_average']}",
             f"model: byte-level Llama {result['model']['config']}, "
             f"{result['model']['parameters']:,} parameters (random weights)",
             f"NOTE: {result['note']}",
             "backbone (eager): " + ", ".join(f"{k} {v * ms:.2f} ms" for k, v in timings.items()),
             "", f"{'head':<16}{'way':<9}{'params':>10}{'draft':>7}{'acc':>6}{'d-grdy':>7}"
             f"{'verify':>7}{'AR':>7}{'rnd/ver':>8}{'greedy':>7}{'ops head':>9}{'krn head':>9}"
             f"{'krn ver':>8}"]
    for h in result["heads"]:
        name = f"{h['architecture']} n={h['window']} {h['variant']}"
        for way in ("eager", "compiled"):
            if way not in h:
                continue
            c = h[way]
            p, ops = c["phases_s"], c["ops"]
            dispatched = ops.get("dispatched")
            shown = _way_label(way, c)
            lines.append(
                f"{name:<16}{shown:<9}{h['parameters']:>10,}{p['draft_sampling'] * ms:>7.2f}"
                f"{p['accept_sampling'] * ms:>6.2f}{p['draft_greedy'] * ms:>7.2f}"
                f"{p['verify'] * ms:>7.2f}{p['ar_step'] * ms:>7.2f}"
                f"{c['round_over_verify']['sampling']:>8.2f}{c['round_over_verify']['greedy']:>7.2f}"
                + (f"{dispatched['head_sampling']:>9.0f}" if dispatched else f"{'-':>9}")
                + f"{ops['kernels']['head_sampling']:>9.0f}{ops['kernels']['verify']:>8.0f}")
    lines.append("(ms per call, medians of interleaved repeats: draft = the draft program "
                 "(parameterise, normalise, draw, conditionals), acc = the accept program, d-grdy = "
                 "the greedy draft program; verify = one extend of n tokens, AR = one extend of 1; "
                 "rnd/ver = (draft + accept) / verify, sampling and greedy; ops head = torch ops "
                 "dispatched by the head side of a sampling round (eager only); krn = kernels "
                 "launched: generated kernels plus top-level aten calls; compiled* = some "
                 "programs ran eager: the compiler refused them, listed below)")
    lines += ["", f"{'head':<16}{'way':<9}{'mode':<9}{'tok/call':>9}{'lat ms':>8}{'tok/s':>8}"
              f"{'AR tok/s':>9}{'xAR':>6}{'forced':>8}{'xAR':>6}{'match':>7}"]
    for h in result["heads"]:
        name = f"{h['architecture']} n={h['window']} {h['variant']}"
        for way in ("eager", "compiled"):
            if way not in h:
                continue
            for mode, d in h[way]["decode"].items():
                s, f, a = d["speculative"], d["forced"], d["autoregressive"]
                match = str(d.get("matches_ar", "-"))
                lines.append(f"{name:<16}{_way_label(way, h[way]):<9}{mode:<9}{s['tokens_per_call']:>9.2f}"
                             f"{s['mean_latency_s'] * ms:>8.1f}{s['throughput_tok_s']:>8.1f}"
                             f"{a['throughput_tok_s']:>9.1f}{s['speedup_vs_ar']:>6.2f}"
                             f"{f['throughput_tok_s']:>8.1f}{f['speedup_vs_ar']:>6.2f}{match:>7}")
            batched = {mode: d["batch"] for mode, d in h[way]["decode"].items() if "batch" in d}
            for mode, b in batched.items():
                lines.append(f"{name:<16}{'batch ' + str(b['batch_size']):<9}{mode:<9}"
                             f"{b['speculative']['tokens_per_round']:>9.2f}"
                             f"{b['speculative']['ms_per_round']:>8.1f}{b['speculative']['tok_s']:>8.1f}"
                             f"{b['autoregressive']['tok_s']:>9.1f}{b['speedup_vs_ar']:>6.2f}"
                             f"{'-':>8}{'-':>6}{b.get('matches_ar', '-')!s:>7}")
    lines.append("(xAR: against autoregressive decoding run the same way, eager or compiled; "
                 "batch B: B prompts decoded as one batch, tok/s over the batch)")
    for program, why in result["machine"].get("compile_fallbacks", {}).items():
        lines.append(f"COMPILE FALLBACK {program}: ran eager ({why})")
    target = result.get("target")
    if target:
        for key, t in target["variants"].items():
            r = t["round_over_verify"]
            kernels = t["head_kernels"]
            dispatched = t["head_dispatched"]
            lines.append(
                f"TARGET btree n=16 r=32 {key}: head round {r['sampling']:.0%} of one verify "
                f"forward sampling, {r['greedy']:.0%} greedy (embedded-size target <= "
                f"{target['round_over_verify_target']:.0%}); head kernels {kernels['sampling']:.0f}"
                + (f", ops dispatched {dispatched['sampling']:.0f} (target <= "
                   f"{target['eager_ops_target']})" if dispatched else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- --first-head
def first_head_costs(model: str = "smollm2", draft_vocabs: tuple[DraftVocabSpec, ...] =
                     FIRST_HEAD_VOCABS, timing_rounds: int = 9, threads: int = 1,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """The README's first head on a real model: its eager round over one eager verify forward.

    For each ``draft_vocabs`` entry, ``MTPHead.from_name("btree", window=8, rank=16,
    hidden_size, vocab_size, variant="lean", lm_head_weight=...)`` with that ``draft_vocab``
    (:attr:`DraftVocab.AUTO`: the argument left out, as the README writes it) is timed by
    :func:`head_costs` (draft and accept programs, greedy and sampling, interleaved with a verify
    ``extend`` of 8 tokens and an AR step on the plain model, as ``SpeculativeDecoder(model,
    head)`` wraps it) after a prefill of a fixed code context. The JSON records the machine.
    """
    from circuits_llm.text.models import load_model
    torch.set_num_threads(threads)
    loaded = load_model(model)
    lm = loaded.model
    backbone = HFBackbone(lm)
    ids = loaded.tokenizer.encode_prompt(_FIRST_HEAD_CONTEXT)
    context = torch.tensor([ids[:-1]])
    with torch.no_grad():
        hidden = backbone.extend(context).draft_hidden[:, -1]
    config = BenchConfig(timing_rounds=timing_rounds, threads=threads, temperature=1.0)
    weight = lm.get_output_embeddings().weight.detach()
    log(f"model: {loaded.source} ({sum(p.numel() for p in lm.parameters()):,} parameters); "
        f"context {len(ids)} tokens; {threads} torch threads")
    rows: list[dict[str, Any]] = []
    for choice in draft_vocabs:
        options = {} if choice is DraftVocab.AUTO else {"draft_vocab": choice}
        head = MTPHead.from_name("btree", window=8, rank=16, hidden_size=lm.config.hidden_size,
                                 vocab_size=lm.config.vocab_size, variant="lean",
                                 lm_head_weight=weight, **options).eval()
        costs = head_costs(head, backbone, hidden, ids[-1], config, compiled=False)
        ratio = costs["round_over_verify"]
        label = choice.value if isinstance(choice, DraftVocab) else str(choice)
        rows.append({"draft_vocab": label, "described": head.describe_draft_vocab(),
                     "draft_vocab_size": head.draft_vocab_size,
                     "parameters": head.num_parameters(), **costs})
        log(f"  draft_vocab={label:<6} K={head.draft_vocab_size:>6}: round/verify "
            f"{ratio['sampling']:.3f} sampling, {ratio['greedy']:.3f} greedy "
            f"(verify {costs['phases_s']['verify'] * 1e3:.1f} ms)")
        del head
    default = rows[0] if draft_vocabs and draft_vocabs[0] is DraftVocab.AUTO else None
    worst = None if default is None else max(default["round_over_verify"].values())
    return {"schema_version": SCHEMA_VERSION, "benchmark": "decoder_bench --first-head",
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "machine": machine_info(torch.device("cpu"), threads), "model": loaded.describe(),
            "head": "btree window=8 rank=16 lean", "context_tokens": len(ids),
            "rows": rows, "target": FIRST_HEAD_TARGET, "default_round_over_verify": worst,
            "met": None if worst is None else worst <= FIRST_HEAD_TARGET}


def format_first_head(result: dict[str, Any]) -> str:
    """The table of a :func:`first_head_costs` result."""
    machine = result["machine"]
    lines = [f"machine: {machine['processor']}, {machine['cpu_count']} CPU cores, "
             f"{machine['torch_threads']} torch threads, load {machine['load_average']}",
             f"{result['head']} on {result['model'].get('source', result['model'])}",
             f"{'draft_vocab':<12}{'K':>7}{'params':>11}{'draft':>8}{'acc':>7}{'verify':>8}"
             f"{'rnd/ver':>9}{'greedy':>8}"]
    for row in result["rows"]:
        p = row["phases_s"]
        lines.append(f"{row['draft_vocab']:<12}{row['draft_vocab_size']:>7}{row['parameters']:>11,}"
                     f"{p['draft_sampling'] * 1e3:>8.2f}{p['accept_sampling'] * 1e3:>7.2f}"
                     f"{p['verify'] * 1e3:>8.2f}{row['round_over_verify']['sampling']:>9.3f}"
                     f"{row['round_over_verify']['greedy']:>8.3f}")
    if result["default_round_over_verify"] is not None:
        verdict = "met" if result["met"] else "NOT met"
        lines.append(f"TARGET the default head's round <= {result['target']:.0%} of a verify "
                     f"forward: {result['default_round_over_verify']:.1%} ({verdict})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="BTree n=16 LEAN only")
    parser.add_argument("--eager-only", action="store_true",
                        help="skip the compiled measurements (no torch.compile warm-up)")
    parser.add_argument("--first-head", action="store_true",
                        help="time the README's first head on a real model (--model) with its "
                             "default draft vocabulary, other sizes and the whole vocabulary")
    parser.add_argument("--model", default="smollm2",
                        help="the model of --first-head (default: smollm2)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON output path (default: {DEFAULT_OUT}, with --first-head "
                             f"{FIRST_HEAD_OUT})")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="also decode this many prompts as one batch (eager; default 1: no)")
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
    if args.first_head:
        start = time.perf_counter()
        found = first_head_costs(args.model, threads=args.threads)
        found["wall_s"] = time.perf_counter() - start
        publish(format_first_head(found), found, args.out or FIRST_HEAD_OUT, sort_keys=True,
                note=f" ({found['wall_s']:.0f} s)")
        return 0
    options = {"threads": args.threads, "device": str(device), "kernels": args.kernels}
    config = BenchConfig.quick(**options) if args.quick else BenchConfig(**options)
    if args.eager_only:
        config = dataclasses.replace(config, compiled_windows=())
    if args.batch_size > 1:
        config = dataclasses.replace(config, batch_size=args.batch_size)
    start = time.perf_counter()
    result = run_benchmark(config)
    result["wall_s"] = time.perf_counter() - start
    publish(format_tables(result), result, args.out or DEFAULT_OUT, sort_keys=True,
            note=f" ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
