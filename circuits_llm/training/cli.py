"""``circuits-llm train-head``: train a circuit MTP head on a frozen model from the command line.

Example (resumable; run it again with the same arguments to continue)::

    circuits-llm train-head --model embedded --arch btree --window 16 --rank 32 --variant lean \\
        --lora-layers 0 --steps 2000 --run-dir runs/btree --minutes 30

``--model`` is ``embedded``, an HF directory, a ``.gguf`` file or a hub id in the local cache
(:func:`circuits_llm.text.references.parse_model_reference`); the corpus is tokenised with that model's own
tokenizer and cached on disk (:mod:`circuits_llm.text.corpus`; ``$CIRCUITS_LLM_CORPUS_CACHE`` moves the
cache), so a resumed run tokenises nothing. ``--self-distill`` trains on the model's own
continuations of corpus prompts (FastMTP; :mod:`circuits_llm.training.self_distill`), generated
``--distill-batch`` rows at a time, once, with a progress bar into the run directory and resumed
if interrupted. ``--cache-features`` (the default for ``--self-distill``) computes the backbone's
features once into a disk cache and trains only the head and the LoRA layers
(:mod:`circuits_llm.training.features`; ``--no-cache-features`` runs the backbone every step).

``--draft-block`` trains FastMTP's recursive MTP block instead of a circuit head
(:mod:`circuits_llm.training.block_trainer`; ``--window n``: ``n - 1`` recursive depths,
``--block-layers``, ``--block-init``), on the same data and cached features, towards the model's
own law with ``--target-law model``; the run exports ``RUN_DIR/block/``. ``--on-block DIR`` trains
a circuit head (any ``--arch``, window and draft vocabulary) on the outputs of a frozen block
(:mod:`circuits_llm.training.block_head_trainer`), for ``BlockCircuitDrafter``; the run exports
``RUN_DIR/head/`` and records the block it read.

Data-parallel on CPU: ``torchrun --nproc_per_node=2 -m circuits_llm train-head ...`` (the global
``--batch-size`` is split across the processes). ``--device`` takes the shared forms of
:mod:`circuits_llm.runtime.devices` (default ``cpu``, as before: resumable runs and CPU data-parallel runs
keep their device unless asked); under torchrun ``cuda`` and ``auto`` mean ``cuda:LOCAL_RANK``, one
GPU per process.

Every failure ends the command with one line ``circuits-llm train-head: error: ...`` on stderr
that says what was wrong and what to do: exit status 2 for input problems (arguments, a model or
corpus that does not fit, a corrupt or foreign checkpoint, a run directory locked by a live run)
and 1 when training itself fails (non-finite loss, a write that failed, e.g. on a full disk). The
first SIGINT / SIGTERM finishes the step, writes a checkpoint, prints how to resume and exits 130
/ 143; a second one exits at once with the same status. ``--resume-from FILE`` resumes from
another checkpoint of the run (e.g. ``checkpoint.prev.pt`` when the latest fails its checksum).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from circuits_llm.draft_block.block import BlockInit
from circuits_llm.runtime.devices import DeviceError, DeviceSpec, add_device_argument, resolve_device
from circuits_llm.text.models import EMBEDDED, ModelLoadError, load_model
from circuits_llm.training.config import (
    DataSource,
    FeatureCaching,
    FeatureDtype,
    HeadTrainingConfig,
    TargetLaw,
    TrainingConfigError,
)

_PROGRAM = "circuits-llm train-head"
#: Exit status of a run that failed while training (input problems exit 2).
TRAINING_FAILED = 1


def load_training_model(spec: str, device: torch.device) -> Any:
    """The ``--model`` causal LM on ``device``, with its tokenizer attached and checked
    (:func:`circuits_llm.text.models.load_model`; training reads the tokenizer from there)."""
    from circuits_llm.text.tokens import TokenizerError
    try:
        return load_model(spec, device).model
    except (ModelLoadError, TokenizerError) as error:
        raise TrainingConfigError(str(error)) from None


def _layer_list(text: str) -> tuple[int, ...]:
    """``--fused-layers 2,14,26`` -> (2, 14, 26) (argparse turns the error into a usage line)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices such as "
                                         f"2,14,26, got {text!r}") from None


def _device(spec: DeviceSpec | str) -> torch.device:
    """The resolved ``--device``: ``cuda`` / ``auto`` use ``cuda:LOCAL_RANK`` (0 without torchrun)."""
    return resolve_device(spec, default_index=int(os.environ.get("LOCAL_RANK", "0")))


def config_from_args(args: argparse.Namespace) -> HeadTrainingConfig:
    """The :class:`HeadTrainingConfig` the command line describes."""
    return HeadTrainingConfig(
        architecture=None if args.circuit_file else args.arch,
        circuit_file=str(args.circuit_file) if args.circuit_file else None,
        window=args.window, rank=args.rank, variant=args.variant, lean_rank=args.lean_rank,
        token_input=args.token_input, init_from=args.init_from,
        draft_vocab=args.draft_vocab, head_budget=args.head_budget,
        lora_layers=args.lora_layers, lora_rank=args.lora_rank, seq_len=args.seq_len,
        batch_size=args.batch_size, learning_rate=args.lr, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip if args.grad_clip > 0 else None, steps=args.steps,
        gamma=args.gamma, data=DataSource.SELF_DISTILLED if args.self_distill else args.data,
        seed=args.seed, eval_every=args.eval_every,
        eval_windows=args.eval_windows, checkpoint_every_s=args.checkpoint_every,
        max_train_bytes=args.max_train_bytes, distill_samples=args.distill_samples,
        distill_prompt_len=args.distill_prompt_len,
        distill_temperature=args.distill_temperature, bf16=args.bf16,
        distill_batch=args.distill_batch, distill_chat_samples=args.distill_chat_samples,
        cache_features=args.cache_features,
        feature_dtype=args.feature_dtype, target_law=args.target_law,
        teacher_top_k=args.teacher_top_k, teacher_temperature=args.teacher_temperature,
        teacher_weight=args.teacher_weight, draft_block=args.draft_block,
        block_layers=args.block_layers, block_init=args.block_init,
        fused_layers=tuple(args.fused_layers), fusion_learning_rate=args.fusion_lr,
        on_block=None if args.on_block is None else str(args.on_block))


def _train_head(args: argparse.Namespace) -> int:
    from circuits.errors import CircuitError
    from circuits_llm.runtime.checkpoint import CheckpointError, CheckpointWriteError
    from circuits_llm.training.lock import RunDirectoryBusy
    from circuits_llm.training.loop import CHECKPOINT_FILE, train_head
    from circuits_llm.training.signals import TrainingInterrupted
    from circuits_llm.training.trainer import NonFiniteTrainingError
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        config = config_from_args(args)
        model = load_training_model(args.model, _device(args.device))
        minutes = args.minutes
        result = train_head(model, config, args.run_dir,
                            max_seconds=None if minutes is None else minutes * 60,
                            max_steps=args.max_steps, progress=not args.no_progress,
                            corpus_root=args.corpus_root, resume_from=args.resume_from,
                            handle_signals=True)
    except TrainingInterrupted as stop:
        print(f"{_PROGRAM}: {stop}", file=sys.stderr)
        return stop.exit_status
    except KeyboardInterrupt:  # before training installed its handlers: nothing was written
        print(f"{_PROGRAM}: interrupted by SIGINT while starting; nothing was written",
              file=sys.stderr)
        return 128 + int(signal.SIGINT)
    except (NonFiniteTrainingError, CheckpointWriteError, OSError) as error:
        print(f"{_PROGRAM}: error: {error}", file=sys.stderr)
        return TRAINING_FAILED
    except (TrainingConfigError, CheckpointError, CircuitError, DeviceError,
            RunDirectoryBusy) as error:
        print(f"{_PROGRAM}: error: {error}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        summary = {"run_dir": str(result.run_dir), "step": result.step,
                   "finished": result.finished, "tokens_seen": result.tokens_seen,
                   "seconds_per_step": result.seconds_per_step,
                   "validation_mean_bits": {"initial": result.initial_validation.mean_bits,
                                            "final": result.validation.mean_bits},
                   # the drafted positions 2..n (a head that reads the token is not trained on 1)
                   "validation_draft_mean_bits": {
                       "initial": result.initial_validation.draft_mean_bits,
                       "final": result.validation.draft_mean_bits},
                   "validation_bits_per_position": list(result.validation.bits)}
        print(json.dumps(summary, indent=2))
    if result.interrupted_by is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{_PROGRAM}: stopped by {result.interrupted_by.name} after step {result.step}; "
                  f"the checkpoint is in {result.run_dir / CHECKPOINT_FILE}; run the same command "
                  "again to resume", file=sys.stderr)
        return 128 + int(result.interrupted_by)
    return 0


def add_train_head_command(sub: Any) -> None:
    """Register ``train-head`` on the ``circuits-llm`` subparsers object."""
    d = HeadTrainingConfig()
    p = sub.add_parser("train-head", help="train a circuit MTP head (+ LoRA) on a frozen model "
                                          "(resumable, torchrun-ready)")
    p.add_argument("--model", default=EMBEDDED,
                   help="'embedded', a Hugging Face model directory, a .gguf file, or a hub id in "
                        "the local Hugging Face cache (its own tokenizer tokenises the corpus)")
    p.add_argument("--run-dir", type=Path, required=True, help="checkpoint + export directory")
    head = p.add_mutually_exclusive_group()
    head.add_argument("--arch", default="btree", help="ff, cp, hmm or btree (default btree)")
    head.add_argument("--circuit-file", type=Path, default=None, help="a JSON circuit file")
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--rank", type=int, default=d.rank,
                   help="the template's rank (default: the largest of 32..1 within --head-budget)")
    p.add_argument("--variant", choices=("lean", "full"), default=d.variant.value)
    p.add_argument("--lean-rank", type=int, default=d.lean_rank)
    p.add_argument("--token-input", action="store_true",
                   help="the head also reads the verified token's embedding (EAGLE / Hydra style)")
    p.add_argument("--init-from", default=None, metavar="HEAD_DIR",
                   help="start the head from a saved head's tensors (e.g. RUN_DIR/head); tensors "
                        "it lacks, such as a new --token-input, keep their initialisation; with "
                        "--draft-block, a saved block (e.g. RUN_DIR/block): its weights and "
                        "draft vocabulary")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help="draft over the K most frequent tokens of the training data (default: the "
                        "whole vocabulary up to 8192 tokens, else 8192 or 4096 within the budget)")
    p.add_argument("--head-budget", type=float, default=d.head_budget,
                   help="default head size, as a fraction of the backbone's parameters "
                        f"(default {d.head_budget})")
    p.add_argument("--lora-layers", type=int, default=d.lora_layers)
    p.add_argument("--lora-rank", type=int, default=d.lora_rank)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch")
    p.add_argument("--lr", type=float, default=d.learning_rate)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="0 = no clipping")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--gamma", type=float, default=None, help="default 0.8 (n <= 8) or 0.9")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--data", choices=[s.value for s in DataSource], default=d.data.value)
    data.add_argument("--self-distill", action="store_true",
                      help="train on the model's own continuations of corpus prompts, sampled at "
                           "--distill-temperature (= --data self-distilled)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-windows", type=int, default=d.eval_windows)
    p.add_argument("--checkpoint-every", type=float, default=d.checkpoint_every_s,
                   help="seconds between checkpoints")
    p.add_argument("--max-train-bytes", type=int, default=None,
                   help="cap on the training split, in tokens of the model's tokenizer (bytes for a "
                        "byte model)")
    p.add_argument("--distill-samples", type=int, default=d.distill_samples)
    p.add_argument("--distill-prompt-len", type=int, default=d.distill_prompt_len)
    p.add_argument("--distill-temperature", type=float, default=d.distill_temperature,
                   help="temperature of the self-distilled continuations: the one the head will "
                        "decode at (0 = greedy)")
    p.add_argument("--distill-batch", type=int, default=d.distill_batch,
                   help="self-distilled rows generated together, one batched forward per token "
                        f"(default {d.distill_batch})")
    p.add_argument("--distill-chat-samples", type=int, default=d.distill_chat_samples,
                   help="also train on the model's replies to this many chat requests (about "
                        "code and everyday subjects, in its chat template; with --self-distill)")
    p.add_argument("--target-law", choices=[t.value for t in TargetLaw],
                   default=d.target_law.value,
                   help="what each window slot learns: the data's tokens (default), or the "
                        "model's own law at that position, read from the hidden states the step "
                        "already has (self-distillation with the whole law, not one sample)")
    p.add_argument("--teacher-top-k", type=int, default=d.teacher_top_k,
                   help=f"--target-law model: the model's most likely tokens per position the "
                        f"head is scored on (default {d.teacher_top_k})")
    p.add_argument("--teacher-temperature", type=float, default=None,
                   help="--target-law model: the temperature of the model's law (0 = its argmax; "
                        "default: --distill-temperature for --self-distill, else 1)")
    p.add_argument("--teacher-weight", type=float, default=d.teacher_weight,
                   help="--target-law model: the loss is (1 - w) token loss + w cross-entropy to "
                        f"the model's law (default {d.teacher_weight})")
    p.add_argument("--draft-block", action="store_true",
                   help="train a draft block (FastMTP's recursive MTP module: one decoder layer "
                        "over the model's last hidden state and the next token, with its own KV "
                        "cache) instead of a circuit head; --window n gives n - 1 recursive "
                        "depths, each later one reading the block's own outputs; exported to "
                        "RUN_DIR/block")
    p.add_argument("--block-layers", type=int, default=d.block_layers,
                   help=f"--draft-block: decoder layers of the block (default {d.block_layers})")
    p.add_argument("--block-init", choices=[i.value for i in BlockInit],
                   default=d.block_init.value,
                   help="--draft-block: start the layers fresh (identity) or from a copy of the "
                        "model's last layer (last_layer, Llama models); either way the block "
                        "starts as the identity on its input")
    p.add_argument("--fused-layers", type=_layer_list, default=(), metavar="I,J,...",
                   help="--draft-block: the model's layers whose outputs the block reads besides "
                        "its last hidden state (EAGLE-3's fused features, e.g. 2,14,26 of "
                        "SmolLM2's 30); with --init-from a block without them, the fusion starts "
                        "at zero, where that block stood (default: none)")
    p.add_argument("--fusion-lr", type=float, default=None,
                   help="--fused-layers: the fusion's learning rate (default: 10x --lr; it "
                        "starts at zero while a continued block's weights start trained)")
    p.add_argument("--on-block", type=Path, default=None, metavar="BLOCK_DIR",
                   help="train the circuit head on a frozen draft block's outputs (a "
                        "save_draft_block directory or a --draft-block run directory), as "
                        "BlockCircuitDrafter drafts: the head reads the block's output after the "
                        "verified token instead of the model's hidden state; any --arch, "
                        "--window and --draft-vocab; exported to RUN_DIR/head")
    features = p.add_mutually_exclusive_group()
    features.add_argument(
        "--cache-features", dest="cache_features", action="store_const",
        const=FeatureCaching.ON.value, default=d.cache_features.value,
        help="compute the backbone features the head reads (with --lora-layers k: the input of "
             "layer N-k) once, store them on disk and train only the head and the LoRA layers; "
             "disk: rows x seq-len x hidden-size x 2 bytes (float16; e.g. 147 KiB per row for "
             "SmolLM2-135M at --seq-len 128), in $CIRCUITS_LLM_FEATURE_CACHE or features/ beside "
             "the corpus cache; corpus data are then its disjoint --seq-len windows (default: on "
             "for --self-distill, off for corpus data)")
    features.add_argument("--no-cache-features", dest="cache_features", action="store_const",
                          const=FeatureCaching.OFF.value,
                          help="run the backbone at every step (see --cache-features)")
    p.add_argument("--feature-dtype", choices=[t.value for t in FeatureDtype],
                   default=d.feature_dtype.value,
                   help="how cached features are stored: float16 (default), or exact (the "
                        "model's dtype: the live values, up to the last bits a batch's size can change; "
                        "twice the disk for float32)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the backbone forward")
    p.add_argument("--minutes", type=float, default=None, help="stop after this long (resume later)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps in total")
    p.add_argument("--resume-from", type=Path, default=None,
                   help="resume from this checkpoint file instead of RUN_DIR/checkpoint.pt (e.g. "
                        "RUN_DIR/checkpoint.prev.pt when the latest fails its checksum)")
    add_device_argument(p, default="cpu",
                        note="Under torchrun, cuda and auto mean cuda:LOCAL_RANK (one GPU per process).")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process")
    p.add_argument("--corpus-root", type=Path, default=None, help="corpus directory (default: stdlib)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=_train_head)
