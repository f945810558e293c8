"""The main job: train (or reuse) FF and BTree heads, then compare AR, FF and BTree decoding.

:func:`run_comparison` is what ``circuits-llm demo`` and ``circuits-llm bench`` run, a script
over one module per step:

1. load the model (the embedded byte-level Llama, or a Hugging Face model directory) onto the
   requested device (``--device``; heads trained or loaded for it follow the model there):
   :func:`circuits_llm.models.load_byte_model`;
2. for each head (FF and BTree), load it from the head cache or train it there
   (:func:`circuits_llm.head_cache.obtain_head`); the entry is keyed by the model's fingerprint
   and the head's training configuration (:func:`training_config`), so a second run with the
   same model and settings trains nothing;
3. decode held-out prompts (:func:`circuits_llm.data.evaluation_prompts`) with the
   autoregressive decoder and both speculative decoders, greedy and sampling, with fixed seeds,
   the decoders interleaved prompt by prompt (:func:`circuits_llm.compare.compare_decoders`);
4. print the table, check that the greedy outputs of the three decoders are identical, show a
   sample, and write ``tradeoff.png``, ``table.txt`` and ``results.json`` (atomically, JSON
   last) to the output directory (:mod:`circuits_llm.report`), with the machine record of
   :func:`circuits_llm.timing.machine_info`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from circuits.files import atomic_write_text
from circuits_llm import report as rep
from circuits_llm.compare import compare_decoders
from circuits_llm.data import decode, evaluation_prompts
from circuits_llm.devices import describe_device
from circuits_llm.head_cache import obtain_head
from circuits_llm.models import load_byte_model
from circuits_llm.report import DecodeMode
from circuits_llm.timing import machine_info

RESULTS_FILE, PLOT_FILE, TABLE_FILE = "results.json", "tradeoff.png", "table.txt"


class DemoError(ValueError):
    """A demo, bench or generate run got an input it cannot use (the message says which)."""


#: Share of the training budget per head architecture (others: :data:`_OTHER_WEIGHT`): an FF
#: step costs about 1/25 of a BTree n=16 r=32 step on CPU, so FF needs far less time.
_HEAD_WEIGHT = {"ff": 1.0}
_OTHER_WEIGHT = 4.0


@dataclass(frozen=True)
class ComparisonConfig:
    """What a decoder comparison trains and decodes.

    Attributes:
        heads: head architectures to train and compare (besides autoregressive decoding).
        window: MTP window ``n`` of every head.
        rank: circuit rank of non-FF heads (FF heads always have rank 1).
        variant: ``"lean"`` or ``"full"`` head parameterisation.
        lora_layers: decoder layers in the LoRA draft branch (0: heads read the final hidden state).
        train_steps: optimisation steps per head (an upper bound: the time budget usually ends
            training first; a cached head is never trained further).
        train_seconds: wall-clock training budget of all heads together, split 1 : 4 between an
            FF head and each other head (:func:`head_seconds`).
        train_seq_len, train_batch_size: tokens per training sequence, sequences per step.
        learning_rate: Adam learning rate of the heads (higher than the paper's 3e-4: the runs
            here are a few hundred steps long).
        prompts: held-out prompts decoded per mode.
        prompt_bytes: prompt length in tokens (BOS + bytes).
        new_tokens: tokens generated per prompt.
        temperature: temperature of the sampling mode (greedy uses 0).
        seed: decoding seed; prompt ``i`` uses ``seed + i`` for every decoder.
    """

    heads: tuple[str, ...] = ("ff", "btree")
    window: int = 16
    rank: int = 32
    variant: str = "lean"
    lora_layers: int = 0
    train_steps: int = 5000
    train_seconds: float = 560.0
    train_seq_len: int = 64
    train_batch_size: int = 4
    learning_rate: float = 3e-3
    prompts: int = 6
    prompt_bytes: int = 128
    new_tokens: int = 128
    temperature: float = 1.0
    seed: int = 0

    @classmethod
    def demo(cls, quick: bool = False) -> ComparisonConfig:
        """``demo`` defaults: window 16, ~9 min of training; quick: window 8, 90 s."""
        if quick:
            return cls(window=8, train_seconds=90.0, prompts=3, new_tokens=64)
        return cls()

    @classmethod
    def bench(cls, quick: bool = False) -> ComparisonConfig:
        """``bench`` defaults: the demo's heads (reused from the cache) on more prompts."""
        return replace(cls.demo(quick), prompts=6 if quick else 16)


def head_seconds(config: ComparisonConfig, architecture: str) -> float:
    """The training budget of one head: its weighted share of ``config.train_seconds``."""
    weights = [_HEAD_WEIGHT.get(name, _OTHER_WEIGHT) for name in config.heads]
    return config.train_seconds * _HEAD_WEIGHT.get(architecture, _OTHER_WEIGHT) / sum(weights)


def training_config(config: ComparisonConfig, architecture: str) -> Any:
    """The :class:`~circuits_llm.training.HeadTrainingConfig` of one head of a comparison."""
    from circuits_llm.training import HeadTrainingConfig
    rank = 1 if architecture == "ff" else config.rank
    return HeadTrainingConfig(architecture=architecture, window=config.window, rank=rank,
                              variant=config.variant, lora_layers=config.lora_layers,
                              steps=config.train_steps, seq_len=config.train_seq_len,
                              batch_size=config.train_batch_size,
                              learning_rate=config.learning_rate, eval_every=config.train_steps,
                              eval_windows=16)


# ---------------------------------------------------------------------------- the run
def run_comparison(config: ComparisonConfig, model: str | Path, out: Path, cache: Path,
                   command: str, retrain: bool = False, progress: bool = True,
                   show_sample: bool = True, log: Callable[[str], None] = print,
                   device: torch.device | None = None) -> dict[str, Any]:
    """Train or load the heads, compare the decoders, print and write the report; returns it.

    Everything runs on ``device`` (None: the CPU): the model, the heads trained or loaded for it,
    and the decoders' tensors and generators; the report's ``machine.device`` records it.
    """
    from circuits_llm.decoder import AutoregressiveDecoder, SpeculativeDecoder
    start = time.perf_counter()
    device = device if device is not None else torch.device("cpu")
    loaded = load_byte_model(model, device)
    log(f"model: {loaded.source} ({sum(p.numel() for p in loaded.model.parameters()):,} "
        f"parameters, fingerprint {loaded.fingerprint[:12]}) on {describe_device(device)}")
    try:
        prompts = evaluation_prompts(config.prompts, config.prompt_bytes)
    except (ValueError, FileNotFoundError) as error:
        raise DemoError(f"cannot build {config.prompts} evaluation prompts: {error}") from None
    heads = []
    for architecture in config.heads:
        training = training_config(config, architecture)
        ready = obtain_head(loaded, training, cache, head_seconds(config, architecture), retrain,
                            progress)
        r = ready.record
        log(f"head {architecture}: {'cached' if r['cached'] else 'trained'} ({r['steps']} steps, "
            f"{r['train_wall_s']:.0f} s; validation bits/byte over the window "
            f"{r['validation_bits_before']:.2f} -> {r['validation_bits_after']:.2f}) in {r['run_dir']}")
        heads.append(ready)
    from circuits_llm.backbone import HFBackbone
    decoders: dict[str, Any] = {rep.BASELINE: AutoregressiveDecoder(HFBackbone(loaded.model))}
    decoders.update({h.name: SpeculativeDecoder(h.backbone, h.head) for h in heads})
    comparison = compare_decoders(decoders, prompts, config.new_tokens, config.temperature,
                                  config.seed, progress)
    rows = comparison.rows()
    identical = comparison.greedy_identical()
    table = rep.format_table(rows)
    log("\n" + table + "\n")
    verdict = "IDENTICAL" if identical["all"] else f"DIFFERENT {identical['mismatches']}"
    log(f"greedy outputs of {', '.join(identical['decoders'])} on {identical['prompts']} prompts: "
        f"{verdict}")
    sample_decoder = heads[-1].name if heads else rep.BASELINE
    tokens = comparison.results[DecodeMode.SAMPLING][sample_decoder][0].tokens
    sample = {"decoder": sample_decoder, "mode": DecodeMode.SAMPLING.value,
              "temperature": config.temperature, "prompt": decode(prompts[0]),
              "continuation": decode(tokens)}
    if show_sample:
        log(f"\nsample ({sample_decoder}, temperature {config.temperature}, seed {config.seed}):\n"
            f"----- prompt -----\n{sample['prompt']}\n----- continuation -----\n"
            f"{sample['continuation']}\n------------------")
    title = (f"{command}: window {config.window}, {config.variant}, {config.lora_layers} LoRA "
             f"layer(s); {config.prompts} prompts x {config.new_tokens} bytes")
    rep.write_tradeoff_plot(rows, out / PLOT_FILE, title)
    atomic_write_text(out / TABLE_FILE, table + "\n")
    result = {
        "schema_version": rep.SCHEMA_VERSION, "kind": rep.REPORT_KIND, "command": command,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": loaded.describe(), "machine": machine_info(device), "config": asdict(config),
        "heads": {h.name: h.record for h in heads}, "rows": [row.to_json() for row in rows],
        "greedy_identical": identical, "sample": sample, "plot": PLOT_FILE,
        "wall_s": time.perf_counter() - start,
    }
    result = rep.jsonable(result)
    rep.check_report(result)
    rep.write_json(result, out / RESULTS_FILE)
    log(f"wrote {out / RESULTS_FILE}, {out / PLOT_FILE}, {out / TABLE_FILE} "
        f"({result['wall_s']:.0f} s)")
    return result
