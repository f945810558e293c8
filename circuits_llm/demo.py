"""The main job: train (or reuse) FF and BTree heads, then compare AR, FF and BTree decoding.

:func:`run_comparison` is what ``circuits-llm demo`` and ``circuits-llm bench`` run:

1. load the model (the embedded byte-level Llama, or a Hugging Face model directory) onto the
   requested device (``--device``; heads trained or loaded for it follow the model there);
2. for each head (FF and BTree), load it from the head cache or train it there with
   :func:`circuits_llm.training.train_head`; the cache entry is keyed by the model's
   fingerprint (a SHA-256 of its config and weights) and the head's training configuration, so a
   second run with the same model and settings trains nothing;
3. decode held-out prompts (:func:`circuits_llm.data.evaluation_prompts`) with the
   autoregressive decoder and both speculative decoders, greedy and sampling, with fixed seeds,
   the decoders interleaved prompt by prompt so machine-load drift hits them alike;
4. print the table, check that the greedy outputs of the three decoders are identical, show a
   sample, and write ``tradeoff.png``, ``table.txt`` and ``results.json`` (atomically, JSON
   last) to the output directory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, is_dataclass, replace
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from circuits.files import atomic_write_text
from circuits_llm import report as rep
from circuits_llm.data import SpecialToken, decode, evaluation_prompts
from circuits_llm.devices import describe_device
from circuits_llm.metrics import DecodeResult, aggregate
from circuits_llm.models import EMBEDDED, ModelLoadError, load_causal_lm
from circuits_llm.report import DecodeMode, DecoderRow

HEAD_MARKER = "demo_head.json"
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


@dataclass
class LoadedModel:
    """A causal LM ready for decoding, with where it came from and its fingerprint."""

    model: Any
    source: str
    fingerprint: str

    def describe(self) -> dict[str, Any]:
        """JSON-ready facts about the model for the report."""
        config = self.model.config
        info: dict[str, Any] = {
            "source": self.source, "fingerprint": self.fingerprint,
            "model_type": str(getattr(config, "model_type", "")),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "layers": getattr(config, "num_hidden_layers", None),
            "hidden_size": getattr(config, "hidden_size", None),
            "vocab_size": getattr(config, "vocab_size", None),
        }
        if self.source == EMBEDDED:
            from circuits_llm.embedded import embedded_model_card
            card = embedded_model_card()
            info["card"] = {k: v for k, v in card.items() if k != "history"}
        return info


# ---------------------------------------------------------------------------- the model
def model_fingerprint(model: Any) -> str:
    """SHA-256 (hex) of a model's computation-relevant config and of every weight tensor."""
    from circuits_llm.backbone._arch import config_fingerprint
    digest = hashlib.sha256(config_fingerprint(model).encode())
    for name, tensor in sorted(model.state_dict().items()):
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def load_model(spec: str | Path, device: torch.device | None = None) -> LoadedModel:
    """``"embedded"`` -> the packaged byte-level Llama; otherwise a local HF model directory
    (:func:`circuits_llm.models.load_causal_lm`), checked to be byte-level.

    The model is moved to ``device`` (None: left where it was loaded, the CPU). Its fingerprint
    does not depend on the device, so heads cached on one device are found on another.
    """
    try:
        model = load_causal_lm(spec, device)
    except ModelLoadError as error:
        raise DemoError(str(error)) from None
    vocab = int(getattr(model.config, "vocab_size", 0))
    if vocab <= max(SpecialToken):
        raise DemoError(f"--model {spec}: vocabulary of {vocab} ids is not byte-level (need bytes "
                        f"0..255 plus special ids up to {int(max(SpecialToken))})")
    source = EMBEDDED if str(spec) == EMBEDDED else str(Path(spec).resolve())
    return LoadedModel(model, source, model_fingerprint(model))


# ---------------------------------------------------------------------------- the head cache
def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/circuits_llm/heads`` (``~/.cache`` when the variable is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "circuits_llm" / "heads"


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):  # NaN and inf are not JSON
        return None
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


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


def head_dir(cache: Path, fingerprint: str, training: Any) -> Path:
    """The cache entry of a head: ``cache/<model>/<arch>-n<window>-r<rank>-<config hash>``."""
    record = _jsonable(training)
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:12]
    name = f"{record['architecture']}-n{record['window']}-r{record['rank']}-{key}"
    return cache / fingerprint[:16] / name


@dataclass
class ReadyHead:
    """A trained head with the backbone it was trained with, and its cache record."""

    name: str
    head: Any
    backbone: Any
    record: dict[str, Any]


def obtain_head(loaded: LoadedModel, training: Any, cache: Path, max_seconds: float,
                retrain: bool = False, progress: bool = True) -> ReadyHead:
    """Load a head from the cache, or train it into the cache first (then write its marker)."""
    from circuits_llm.training import load_trained_head, train_head
    run_dir = head_dir(cache, loaded.fingerprint, training)
    marker = run_dir / HEAD_MARKER
    name = str(_jsonable(training)["architecture"])
    cached = marker.is_file() and not retrain
    if not cached:
        run_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        result = train_head(loaded.model, training, run_dir, max_seconds=max_seconds,
                            progress=progress)
        record = {"architecture": name, "model_fingerprint": loaded.fingerprint,
                  "training_config": _jsonable(training), "train_wall_s": time.perf_counter() - start,
                  "steps": result.step, "finished": result.finished,
                  "tokens_seen": result.tokens_seen,
                  "validation_bits_before": result.initial_validation.mean_bits,
                  "validation_bits_after": result.validation.mean_bits,
                  "validation_bits_by_position": list(result.validation.bits),
                  "max_seconds": max_seconds}
        rep.write_json(record, marker)
    record = json.loads(marker.read_text())
    head, backbone = load_trained_head(run_dir, loaded.model)
    record.update(cached=cached, run_dir=str(run_dir), parameters=int(head.num_parameters()))
    return ReadyHead(name, head.eval(), backbone, record)


def find_cached_head(cache: Path, fingerprint: str, architecture: str,
                     preferred: list[Any]) -> Path | None:
    """A cached head of ``architecture`` for this model: a ``preferred`` config's, else the newest."""
    for training in preferred:
        run_dir = head_dir(cache, fingerprint, training)
        if (run_dir / HEAD_MARKER).is_file():
            return run_dir
    found = sorted((cache / fingerprint[:16]).glob(f"{architecture}-*/{HEAD_MARKER}"),
                   key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


# ---------------------------------------------------------------------------- decoding
@dataclass
class Comparison:
    """Every decoder's results, per mode, in prompt order."""

    results: dict[DecodeMode, dict[str, list[DecodeResult]]]

    def rows(self) -> list[DecoderRow]:
        """Pooled rows with speed-ups (see :mod:`circuits_llm.report`)."""
        rows = [DecoderRow.from_summary(name, mode, len(results), aggregate(results))
                for mode, by_decoder in self.results.items() for name, results in by_decoder.items()]
        return rep.with_speedups(rows)

    def greedy_identical(self) -> dict[str, Any]:
        """Whether every decoder's greedy output equals the autoregressive one, prompt by prompt."""
        by_decoder = self.results.get(DecodeMode.GREEDY, {})
        reference = by_decoder.get(rep.BASELINE, [])
        mismatches = []
        for name, results in by_decoder.items():
            for index, (ours, ref) in enumerate(zip(results, reference, strict=True)):
                if not torch.equal(ours.tokens, ref.tokens):
                    diff = (ours.tokens != ref.tokens).nonzero()
                    first = int(diff[0, 0]) if diff.numel() else min(len(ours.tokens),
                                                                     len(ref.tokens))
                    mismatches.append({"decoder": name, "prompt": index, "first_difference": first})
        return {"all": bool(reference) and not mismatches, "prompts": len(reference),
                "decoders": sorted(by_decoder), "mismatches": mismatches}


def compare_decoders(decoders: dict[str, Any], prompts: list[Tensor], new_tokens: int,
                     temperature: float, seed: int, progress: bool = True) -> Comparison:
    """Decode every prompt with every decoder, greedy then sampling (seed ``seed + i``).

    Each decoder first runs one short warm-up generation per mode (not recorded). The seeded
    generators live on each decoder's device (sampling on CUDA needs a CUDA generator).
    """
    modes = {DecodeMode.GREEDY: 0.0, DecodeMode.SAMPLING: temperature}
    results: dict[DecodeMode, dict[str, list[DecodeResult]]] = {}
    bar = tqdm(total=len(modes) * len(decoders) * len(prompts), desc="decode", unit="run",
               disable=not progress, file=sys.stderr)
    with bar:
        for mode, temp in modes.items():
            for decoder in decoders.values():
                decoder.generate(prompts[0], min(8, new_tokens), temp,
                                 generator=_generator(decoder, seed))
            results[mode] = {name: [] for name in decoders}
            for index, prompt in enumerate(prompts):
                for name, decoder in decoders.items():
                    generator = _generator(decoder, seed + index)
                    results[mode][name].append(decoder.generate(prompt, new_tokens, temp,
                                                                generator=generator))
                    bar.update(1)
    return Comparison(results)


def _generator(decoder: Any, seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` on the decoder's device (the CPU if it names none)."""
    device = getattr(decoder, "device", None)
    return torch.Generator(device=device if isinstance(device, torch.device) else "cpu"
                           ).manual_seed(seed)


def machine_info(device: torch.device | None = None) -> dict[str, Any]:
    """Where the timings were taken (they mean little without it), with the device that ran."""
    import transformers
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"platform": platform.platform(), "python": sys.version.split()[0],
            "torch": torch.__version__, "transformers": transformers.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average": list(load) if load else None,
            "device": describe_device(device if device is not None else torch.device("cpu"))}


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
    loaded = load_model(model, device)
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
    result = _jsonable(result)
    rep.check_report(result)
    rep.write_json(result, out / RESULTS_FILE)
    log(f"wrote {out / RESULTS_FILE}, {out / PLOT_FILE}, {out / TABLE_FILE} "
        f"({result['wall_s']:.0f} s)")
    return result
