"""Pretraining the embedded byte-level Llama on the CPython standard library (resumable).

The job samples random windows of the packed training stream (:mod:`circuits_llm.text.byte_level`) with a
seeded ``torch.Generator``, trains with AdamW under a warmup + cosine schedule (optional bf16
autocast), evaluates bits per byte on fixed validation windows, and writes an atomic checkpoint
every few minutes. Interrupt it at any time: ``run_pretraining`` on the same directory resumes from
the last checkpoint and continues exactly as an uninterrupted run would (same seed, same machine,
same device). The model trains on the ``device`` it is given (the CPU by default); the data
stream and the window sampler stay on the CPU and checkpoints are stored with CPU tensors, so a
run may be resumed or exported on another device.

:func:`export_model` turns the best checkpoint into a Hugging Face model directory (safetensors +
config) with its held-out test bits per byte recorded in ``training.json``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from circuits_llm.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from circuits_llm.text.byte_level import VOCAB_SIZE, SpecialToken, Split, corpus_files, pack

CHECKPOINT_KIND = "circuits_llm.training.pretrain"

#: Settings a resumed run may change: the schedule length (the cosine decay is recomputed from
#: the current step) and how often it evaluates or checkpoints. Everything else must match.
RESUMABLE_CHANGES = ("total_steps", "eval_every", "checkpoint_every_s")


@dataclass(frozen=True)
class ModelShape:
    """Size of the byte-level Llama (defaults: 4 layers x 256 wide, about 3.2M parameters)."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    intermediate_size: int = 688
    max_positions: int = 1024

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=VOCAB_SIZE, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_heads,
            max_position_embeddings=self.max_positions, tie_word_embeddings=True,
            bos_token_id=int(SpecialToken.BOS), eos_token_id=int(SpecialToken.EOS),
            pad_token_id=int(SpecialToken.PAD))


@dataclass(frozen=True)
class PretrainConfig:
    """Hyper-parameters of a pretraining run (stored in its checkpoints)."""

    model: ModelShape = field(default_factory=ModelShape)
    seq_len: int = 256
    batch_size: int = 16
    learning_rate: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    total_steps: int = 6000
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 200
    eval_windows: int = 64
    checkpoint_every_s: float = 180.0
    bf16: bool = False  # bf16 autocast is slower than fp32 on CPUs without AVX512-BF16/AMX
    max_train_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.batch_size < 1 or self.total_steps < 1:
            raise ValueError("seq_len >= 2, batch_size >= 1 and total_steps >= 1 are required")
        if self.seq_len + 1 > self.model.max_positions + 1:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_positions {self.model.max_positions}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, object]) -> PretrainConfig:
        values = dict(data)
        values["model"] = ModelShape(**values["model"])  # type: ignore[arg-type]
        return PretrainConfig(**values)  # type: ignore[arg-type]


def learning_rate(config: PretrainConfig, step: int) -> float:
    """Linear warmup to ``learning_rate`` then cosine decay to ``min_lr_ratio`` of it."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.total_steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.learning_rate * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def next_token_loss(model: LlamaForCausalLM, windows: Tensor, bf16: bool) -> Tensor:
    """Mean cross-entropy (nats) of ``windows[:, 1:]`` given ``windows[:, :-1]``."""
    with torch.autocast(windows.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             windows[:, 1:].reshape(-1))


@torch.no_grad()
def bits_per_byte(model: LlamaForCausalLM, stream: Tensor, seq_len: int, max_windows: int,
                  batch_size: int = 16) -> float:
    """Bits per byte on consecutive (non-overlapping) windows of ``stream``; byte targets only.

    ``stream`` may live anywhere: each batch is moved to the model's device.
    """
    device = next(model.parameters()).device
    model.eval()
    count = min(max_windows, (stream.numel() - 1) // seq_len)
    if count < 1:
        raise ValueError(f"the evaluation stream ({stream.numel()} tokens) is shorter than one window")
    windows = stream[: count * seq_len + 1].unfold(0, seq_len + 1, seq_len)[:count]
    total_nats, total_bytes = 0.0, 0
    for start in range(0, count, batch_size):
        batch = windows[start:start + batch_size].to(device)
        logits = model(input_ids=batch[:, :-1]).logits.float()
        targets = batch[:, 1:]
        nats = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1), reduction="none")
        is_byte = targets.reshape(-1) < 256
        total_nats += float(nats[is_byte].sum())
        total_bytes += int(is_byte.sum())
    model.train()
    return total_nats / max(1, total_bytes) / math.log(2)


@dataclass
class PretrainResult:
    steps: int
    bytes_seen: int
    validation_bits_per_byte: float
    best_validation_bits_per_byte: float
    seconds: float


def _streams(config: PretrainConfig, root: Path | None) -> tuple[Tensor, Tensor]:
    train = pack(corpus_files(Split.TRAIN, root), max_bytes=config.max_train_bytes)
    validation = pack(corpus_files(Split.VALIDATION, root))
    if train.numel() <= config.seq_len + 1:
        raise ValueError("the training stream is shorter than one window; lower seq_len")
    return train, validation


def run_pretraining(config: PretrainConfig, run_dir: str | Path, *, max_seconds: float | None = None,
                    max_steps: int | None = None, root: Path | None = None,
                    progress: bool = True, device: torch.device | str = "cpu") -> PretrainResult:
    """Train (or resume) in ``run_dir``; stops at ``total_steps``, ``max_steps`` or ``max_seconds``.

    ``run_dir/checkpoint.pt`` holds everything needed to resume exactly; ``run_dir/best.pt`` the
    weights with the best validation bits per byte so far. The model and its optimiser state live
    on ``device``; the batches are sampled on the CPU and moved there.
    """
    run_dir = Path(run_dir)
    checkpoint_path = run_dir / "checkpoint.pt"
    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(config.model.config()).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate,
                                  weight_decay=config.weight_decay, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(config.seed)
    step, bytes_seen, elapsed, best, history = 0, 0, 0.0, math.inf, []
    if checkpoint_path.exists():
        state = load_checkpoint(checkpoint_path, CHECKPOINT_KIND)
        saved = PretrainConfig.from_dict(state["config"])
        if replace(saved, **{name: getattr(config, name) for name in RESUMABLE_CHANGES}) != config:
            raise CheckpointError(f"{checkpoint_path} was written with a different configuration; "
                                  "use a new run directory or the same settings (only "
                                  f"{', '.join(RESUMABLE_CHANGES)} may change on resume)")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        step, bytes_seen, elapsed = state["step"], state["bytes_seen"], state["elapsed"]
        best, history = state["best"], state["history"]
        if saved.total_steps != config.total_steps:
            history.append({"step": step, "schedule_total_steps": config.total_steps,
                            "previous_total_steps": saved.total_steps})
    train, validation = _streams(config, root)
    model.train()
    limit = config.total_steps if max_steps is None else min(config.total_steps, max_steps)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=limit, initial=step, desc="pretrain", unit="step", dynamic_ncols=True)
    started, last_save = time.perf_counter(), time.perf_counter()
    session_start_elapsed = elapsed
    evaluations = [h for h in history if "validation_bits_per_byte" in h]
    latest_val = evaluations[-1]["validation_bits_per_byte"] if evaluations else math.nan

    def save() -> None:
        save_checkpoint(checkpoint_path, CHECKPOINT_KIND, {
            "config": config.to_dict(), "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "generator": generator.get_state(),
            "step": step, "bytes_seen": bytes_seen, "elapsed": elapsed, "best": best,
            "history": history})

    while step < limit:
        if max_seconds is not None and time.perf_counter() - started >= max_seconds:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        starts = torch.randint(0, train.numel() - config.seq_len - 1, (config.batch_size,),
                               generator=generator)
        windows = torch.stack([train[s:s + config.seq_len + 1] for s in starts.tolist()]).to(device)
        loss = next_token_loss(model, windows, config.bf16)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        step += 1
        bytes_seen += config.batch_size * config.seq_len
        elapsed = session_start_elapsed + time.perf_counter() - started
        if step % config.eval_every == 0 or step == limit:
            latest_val = bits_per_byte(model, validation, config.seq_len, config.eval_windows)
            history.append({"step": step, "bytes_seen": bytes_seen, "elapsed": elapsed,
                            "train_loss": float(loss), "validation_bits_per_byte": latest_val})
            if latest_val < best:
                best = latest_val
                save_checkpoint(run_dir / "best.pt", CHECKPOINT_KIND + ".best", {
                    "config": config.to_dict(), "model": model.state_dict(), "step": step,
                    "validation_bits_per_byte": latest_val})
            save()
            last_save = time.perf_counter()
        elif time.perf_counter() - last_save >= config.checkpoint_every_s:
            save()
            last_save = time.perf_counter()
        if bar is not None:
            rate = (bytes_seen / elapsed) if elapsed > 0 else 0.0
            bar.set_postfix(loss=f"{float(loss):.3f}", val_bpb=f"{latest_val:.3f}",
                            bytes_s=f"{rate:,.0f}")
            bar.update(1)
    save()
    if bar is not None:
        bar.close()
    return PretrainResult(step, bytes_seen, latest_val, best, elapsed)


def export_model(run_dir: str | Path, out_dir: str | Path, root: Path | None = None,
                 test_windows: int | None = None,
                 device: torch.device | str = "cpu") -> dict[str, object]:
    """Write the best checkpoint as a Hugging Face model (safetensors) plus ``training.json``.

    The held-out test split's bits per byte is measured here, on ``device`` (on all of it unless
    ``test_windows`` limits the number of 256-byte windows) and recorded; the weights are written
    from the CPU. The directory is built next to ``out_dir`` and swapped in with ``os.replace``.
    """
    best = load_checkpoint(Path(run_dir) / "best.pt", CHECKPOINT_KIND + ".best")
    config = PretrainConfig.from_dict(best["config"])
    model = LlamaForCausalLM(config.model.config())
    model.load_state_dict(best["model"])
    test = pack(corpus_files(Split.TEST, root))
    every_window = (test.numel() - 1) // config.seq_len
    test_windows = every_window if test_windows is None else min(test_windows, every_window)
    test_bpb = bits_per_byte(model.to(device), test, config.seq_len, test_windows)
    model = model.cpu()
    last = load_checkpoint(Path(run_dir) / "checkpoint.pt", CHECKPOINT_KIND)
    card = {
        "architecture": "LlamaForCausalLM", "vocab": "bytes 0..255 + BOS=256, EOS=257, PAD=258",
        "parameters": sum(p.numel() for p in model.parameters()),
        "training_steps": best["step"], "training_bytes": best["step"] * config.batch_size * config.seq_len,
        "validation_bits_per_byte": best["validation_bits_per_byte"],
        "test_bits_per_byte": test_bpb, "test_windows": test_windows,
        "test_bytes": test_windows * config.seq_len, "seq_len": config.seq_len,
        "history": last["history"], "config": config.to_dict(),
        "data": "CPython standard library sources (PSF licence), split by path hash",
    }
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    model.save_pretrained(staging, safe_serialization=True)
    (staging / "training.json").write_text(json.dumps(card, indent=2))
    staging.chmod(0o755)  # mkdtemp makes 0700 directories; the model ships inside the package
    for item in staging.iterdir():
        item.chmod(0o644)
    if out_dir.exists():
        retired = out_dir.with_name(f".{out_dir.name}.old")
        os.replace(out_dir, retired)
        os.replace(staging, out_dir)
        for item in retired.iterdir():
            item.unlink()
        retired.rmdir()
    else:
        os.replace(staging, out_dir)
    return card
