"""The user-facing subcommands of ``circuits-llm``: ``demo``, ``bench`` and ``generate``.

:func:`add_commands` registers them on the ``circuits-llm`` subparsers (:mod:`circuits_llm.app.cli`).
``--model`` names the model the way :func:`circuits_llm.text.references.parse_model_reference` reads it
(``embedded``, an HF directory, a GGUF file, a hub id in the local cache), and ``generate`` reads
and writes text through that model's own tokenizer (:mod:`circuits_llm.text.tokens`; bytes for a byte
model), applies the chat template with ``--chat`` and stops where ``model.generate`` would
(:mod:`circuits_llm.decoding.stopping`: the model's EOS ids, ``--stop`` strings, ``--max-new-tokens``).
Every input problem ends the command with one line ``circuits-llm <command>: error: ...`` on
stderr and exit status 2 (argparse's convention), never a traceback. ``--device`` (default
``auto``: CUDA when available) decides where the model, the heads, the prompts and the sampling
generators live (:mod:`circuits_llm.runtime.devices`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from circuits_llm.app.batch_generate import (
    add_batch_arguments,
    check_batch_arguments,
    run_prompts_file,
)
from circuits_llm.app.demo import (
    ComparisonConfig,
    DemoError,
    run_comparison,
)
from circuits_llm.app.head_cache import default_cache_dir
from circuits_llm.app.named_decoders import AUTOREGRESSIVE_NAMES, decoder_for
from circuits_llm.app.verify_packing import Precision
from circuits_llm.draft_block import BatchDepth, DraftWeights
from circuits_llm.heads.shipped import is_block_kind
from circuits_llm.runtime.devices import DeviceError, add_device_argument, resolve_device
from circuits_llm.text.chat_requests import PromptSet
from circuits_llm.text.models import EMBEDDED, ModelLoadError, load_model


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type accepting integers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _head_names(text: str) -> tuple[str, ...]:
    return tuple(name.strip().lower() for name in text.split(",") if name.strip())


def _lookup_weights(text: str) -> tuple[float, ...]:
    """``--lookup W1,W2,..``: the copy component's weight per matched n-gram length; ``none``:
    no lookup (an empty tuple)."""
    if text.strip().lower() in ("none", "off", "0"):
        return ()
    try:
        weights = tuple(float(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected weights in [0, 1] separated by commas (one per "
                                         f"n-gram length, e.g. 0.2,0.4,0.6) or 'none', got "
                                         f"{text!r}") from None
    if not all(0 <= w <= 1 for w in weights):
        raise argparse.ArgumentTypeError(f"expected weights in [0, 1], got {text}")
    return weights


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text}")
    return value


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "bad input" (reported in one line) rather than a bug."""
    from circuits.errors import CircuitError
    from circuits_llm.app.report import ReportError
    from circuits_llm.constraints import ConstraintError
    from circuits_llm.decoding.warping import DecoderError
    from circuits_llm.heads import HeadConfigError
    from circuits_llm.runtime.checkpoint import CheckpointError
    from circuits_llm.text.corpus import CorpusError
    from circuits_llm.text.tokens import TokenizerError
    errors: list[type[BaseException]] = [DemoError, ModelLoadError, DecoderError, HeadConfigError,
                                         ReportError, CircuitError, CheckpointError, DeviceError,
                                         TokenizerError, CorpusError, ConstraintError]
    try:
        from circuits_llm import training
        errors += [value for value in vars(training).values()
                   if isinstance(value, type) and issubclass(value, Exception)
                   and value.__module__.startswith(training.__name__)]
    except ImportError:
        pass
    return tuple(errors)


def _guarded(command: str, body: Callable[[argparse.Namespace], int]
             ) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        torch.set_num_threads(args.threads)
        try:
            return body(args)
        except _user_errors() as error:
            print(f"circuits-llm {command}: error: {error}", file=sys.stderr)
            return 2
    return run


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=EMBEDDED,
                        help="'embedded' (the packaged byte-level Llama), a Hugging Face model "
                             "directory, a .gguf file, or a hub id already in the local Hugging "
                             "Face cache (nothing is downloaded; default: embedded)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"trained-head cache (default: {default_cache_dir()})")
    parser.add_argument("--threads", type=_positive_int, default=1,
                        help="torch threads (default 1: the small model's ops gain little from "
                             "more, and lose a lot when the cores are shared)")
    parser.add_argument("--seed", type=_non_negative_int, default=0, help="decoding seed")
    add_device_argument(parser)


def _comparison_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    _common(parser)
    parser.add_argument("--quick", action="store_true", help="window 8, short training, few prompts")
    parser.add_argument("--out", type=Path, default=Path(out), help=f"output directory ({out})")
    parser.add_argument("--retrain", action="store_true", help="ignore cached heads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--compile", action="store_true",
                        help="every decoder, the autoregressive baseline included, with a static "
                             "KV cache, compiled forwards and compiled rounds (torch.compile)")
    parser.add_argument("--compile-rounds", action="store_true",
                        help="compile only the speculative rounds (draft and accept programs); "
                             "every backbone stays eager (the fastest setting on a CPU)")
    tuning = parser.add_argument_group("overrides of the --quick / default settings")
    tuning.add_argument("--blocks", type=_head_names, metavar="BLOCKS",
                        help="comma-separated shipped draft blocks to compare too (block: "
                             "recursive drafts; btree-block: a BTree head on the block's output; "
                             "'' for none); a model none ships for has no such row")
    tuning.add_argument("--window", type=_positive_int)
    tuning.add_argument("--rank", type=_positive_int)
    tuning.add_argument("--variant", choices=("lean", "full"))
    tuning.add_argument("--lora-layers", type=_non_negative_int)
    tuning.add_argument("--token-input", type=_head_names, metavar="HEADS",
                        help="comma-separated head kinds whose heads also read the verified "
                             "token's embedding (e.g. ff,btree; '' for none)")
    tuning.add_argument("--block-draft-confidence", type=_probability, metavar="TAU",
                        help="the draft blocks' rounds verify only the drafts the block is at "
                             "least TAU confident in (default, 0: every draft)")
    tuning.add_argument("--draft-confidence", type=_probability, metavar="TAU",
                        help="verify only the drafts the head is this confident in (exact; "
                             "0: every draft)")
    tuning.add_argument("--draft-minimum", type=_non_negative_int, metavar="L",
                        help="with --draft-confidence: verify at least L drafts every round "
                             "(0: a round unsure of its first draft is a plain step)")
    tuning.add_argument("--lookup", type=_lookup_weights, metavar="WEIGHTS",
                        help="mix a copy of the context's last repeated n-gram's continuation "
                             "into the drafts, with these weights per n-gram length (exact; "
                             "e.g. 0.2,0.4,0.6; 'none': the heads alone)")
    tuning.add_argument("--train-steps", type=_positive_int)
    tuning.add_argument("--train-seconds", type=_positive_float,
                        help="training budget of all heads together (FF gets 1/5 of a BTree's)")
    tuning.add_argument("--train-seq-len", type=_positive_int)
    tuning.add_argument("--train-batch-size", type=_positive_int)
    tuning.add_argument("--learning-rate", type=_positive_float)
    tuning.add_argument("--prompts", type=_positive_int, help="held-out prompts per mode")
    tuning.add_argument("--prompt-set", type=PromptSet, metavar="{code,chat}",
                        help="decode held-out code (code, the default) or held-out chat requests "
                             "in the model's chat template (chat)")
    tuning.add_argument("--prompt-bytes", type=_positive_int)
    tuning.add_argument("--new-tokens", type=_positive_int, help="bytes generated per prompt")
    tuning.add_argument("--temperature", type=_positive_float, help="of the sampling mode (1.0)")
    tuning.add_argument("--precision", type=Precision, metavar="{auto,float32,bfloat16}",
                        help="the precision the decoders run the model in: bfloat16 is made "
                             "row-invariant (greedy output identical to plain decoding of the "
                             "same model); auto (default): bfloat16 where the CPU computes it "
                             "natively (AVX512-BF16 / AMX), float32 elsewhere")
    tuning.add_argument("--plain-linear", action="store_true",
                        help="keep torch's default linear kernels and weight layout on a CPU "
                             "(by default the weights are stored in the layout and packed with "
                             "the backend, MKL or oneDNN, measured fastest on this machine)")


def comparison_config(args: argparse.Namespace, base: ComparisonConfig) -> ComparisonConfig:
    """``base`` with every override given on the command line."""
    names = ("blocks", "window", "rank", "variant", "lora_layers", "token_input",
             "draft_confidence", "draft_minimum", "block_draft_confidence", "lookup",
             "train_steps", "train_seconds",
             "train_seq_len", "train_batch_size", "learning_rate", "prompts", "prompt_set",
             "prompt_bytes",
             "new_tokens", "temperature", "precision")
    changes: dict[str, Any] = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    for rule in ("draft_confidence", "block_draft_confidence"):
        if changes.get(rule) == 0:  # 0: every round verifies the whole window
            changes[rule] = None
    if changes.get("lookup") == ():
        changes["lookup"] = None
    if args.plain_linear:
        changes["packed_linear"] = False
    if getattr(args, "batch_size", 1) > 1:  # bench --batch-size: batches need the dynamic cache
        if args.compile:
            raise DemoError("--batch-size decodes batches, which need the dynamic KV cache: "
                            "leave --compile out")
        changes["batch_size"] = args.batch_size
    config = replace(base, seed=args.seed, compile=base.compile or args.compile,
                     compile_rounds=base.compile_rounds or args.compile_rounds, **changes)
    if config.window < 2:
        raise DemoError(f"--window must be >= 2 (one known token plus drafts), got {config.window}")
    if not all(is_block_kind(name) for name in config.blocks):
        raise DemoError(f"--blocks names draft blocks (block, <kind>-block such as btree-block), "
                        f"got {', '.join(config.blocks)}")
    unknown = sorted(set(config.token_input) - set(config.heads))
    if unknown:
        raise DemoError(f"--token-input names {', '.join(unknown)}, which this command does not "
                        f"train; choose among {', '.join(config.heads)}")
    if config.prompt_bytes < 2:
        raise DemoError(f"--prompt-bytes must be >= 2, got {config.prompt_bytes}")
    if config.draft_confidence is not None and config.draft_minimum > config.window - 1:
        raise DemoError(f"--draft-minimum {config.draft_minimum} asks for more drafts than a "
                        f"window of {config.window} makes ({config.window - 1}); lower it")
    if args.draft_minimum is not None and config.draft_confidence is None:
        raise DemoError("--draft-minimum applies to --draft-confidence rounds, and every round "
                        "verifies the whole window here; give --draft-confidence TAU > 0 too")
    return config


def _run_comparison(command: str, base: Callable[[bool], ComparisonConfig]
                    ) -> Callable[[argparse.Namespace], int]:
    def body(args: argparse.Namespace) -> int:
        config = comparison_config(args, base(args.quick))
        device = resolve_device(args.device)
        run_comparison(config, args.model, args.out, args.cache_dir or default_cache_dir(),
                       command=command + (" --quick" if args.quick else ""), retrain=args.retrain,
                       progress=not args.no_progress, show_sample=command == "demo", device=device)
        return 0
    return body


# ---------------------------------------------------------------------------- generate
def _constraint(args: argparse.Namespace) -> Any:
    """The ``--regex`` / ``--json-schema FILE`` constraint of ``generate``, or None."""
    from circuits_llm.constraints import ConstraintError, JsonSchema, Regex
    if args.regex is not None:
        return Regex(args.regex)
    if args.json_schema is None:
        return None
    path = Path(args.json_schema)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConstraintError(f"cannot read the JSON schema file {path}: "
                              f"{error.strerror or error}") from None
    return JsonSchema(text)


def _generate(args: argparse.Namespace) -> int:
    from circuits_llm.decoding.stopping import StopCondition, unescape_stop
    device = resolve_device(args.device)
    batch = check_batch_arguments(args)
    loaded = load_model(args.model, device)
    if batch:  # many requests, decoded in batches (circuits_llm.app.batch_generate)
        # a recursive block drafts less in bigger batches where that was measured faster,
        # unless --draft-steps fixes its depth
        depth = BatchDepth.for_device(device) if args.draft_steps is None else None
        decoder, description = decoder_for(args.head, loaded, args.cache_dir or default_cache_dir(),
                                            lookup=args.lookup, packed=not args.plain_linear,
                                            model_name=str(args.model),
                                            draft_steps=args.draft_steps, batch_depth=depth,
                                            draft_weights=DraftWeights(args.draft_weights),
                                            precision=args.precision)
        return run_prompts_file(args, decoder, description, loaded)
    tokenizer = loaded.tokenizer
    prompt = tokenizer.encode_prompt(args.prompt, chat=args.chat, system=args.system)
    stop = StopCondition.for_model(loaded.model, args.max_new_tokens,
                                   [unescape_stop(s) for s in args.stop], tokenizer)
    constraint = _constraint(args)
    walk = args.constraint_walk
    if walk and (constraint is None or args.head.lower() in AUTOREGRESSIVE_NAMES):
        raise DemoError("--constraint-walk mixes the constraint's walk into a head's drafts: give "
                        "--regex or --json-schema and a --head other than ar, or leave it out")
    decoder, description = decoder_for(args.head, loaded, args.cache_dir or default_cache_dir(),
                                        args.compile, args.lookup, packed=not args.plain_linear,
                                        walk=walk, model_name=str(args.model),
                                        draft_steps=args.draft_steps,
                                        draft_weights=DraftWeights(args.draft_weights),
                                        precision=args.precision)
    generator = torch.Generator(device=decoder.device).manual_seed(args.seed)
    start = time.perf_counter()
    result = decoder.generate(torch.tensor(prompt), stop.max_new_tokens, args.temperature,
                              args.top_k, args.top_p, generator=generator,
                              stop=stop, constraint=constraint, tokenizer=tokenizer.tokenizer)
    wall = time.perf_counter() - start
    tokens = result.tokens.tolist()
    text = tokenizer.decode(tokens)
    print(args.prompt + text if args.echo else text)
    s = result.summary
    print(f"[{description} on {decoder.device}] {len(tokens)} tokens in {wall:.2f} s "
          f"({s.throughput:.1f} tokens/s decoding), {s.rounds} rounds, "
          f"{s.tokens_per_round:.2f} tokens/round, acceptance {s.acceptance_rate:.1%}, "
          f"{s.mean_latency_s * 1e3:.2f} ms/round",
          file=sys.stderr)
    return 0


def add_commands(sub: Any) -> None:
    """Register ``demo``, ``bench`` and ``generate`` on an argparse subparsers object."""
    demo = sub.add_parser("demo", help="train/load FF and BTree heads; compare AR, FF, BTree and "
                                       "the shipped draft blocks' decoding (table, JSON, "
                                       "trade-off plot, sample)")
    _comparison_arguments(demo, "runs/demo")
    demo.set_defaults(run=_guarded("demo", _run_comparison("demo", ComparisonConfig.demo)))
    bench = sub.add_parser("bench", help="the decoder comparison of demo on more prompts")
    _comparison_arguments(bench, "runs/bench")
    bench.add_argument("--batch-size", type=_positive_int, default=1, metavar="B",
                       help="decode the prompts B at a time, one batch per call (eager backbones; "
                            "tokens/s over the batch; default 1)")
    bench.set_defaults(run=_guarded("bench", _run_comparison("bench", ComparisonConfig.bench)))
    gen = sub.add_parser("generate", help="continue a prompt with (speculative) decoding")
    _common(gen)
    source = gen.add_mutually_exclusive_group(required=True)  # --prompt or --prompts-file
    source.add_argument("--prompt", default=None,
                     help="text to continue, encoded with the model's tokenizer (UTF-8 bytes and "
                          "BOS for a byte model); or many requests with --prompts-file")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the model's chat template (an "
                          "instruct model's) and answer it")
    gen.add_argument("--system", default=None, help="a system message (with --chat)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop after the token that completes TEXT (repeatable; backslash "
                          "escapes such as \\n are decoded); the model's EOS ids always stop")
    gen.add_argument("--head", default="btree",
                     help="a head kind: ff | btree (the package's shipped head for the model, or "
                          "one you trained for it with `demo` or `train-head` into --cache-dir) "
                          "| block | btree-block (the package's shipped draft block for the "
                          "model: recursive drafts, or a BTree head on the block's output) "
                          "| ar (no head) | a head or block directory (train-head's --run-dir, "
                          "save_head's or save_draft_block's)")
    gen.add_argument("--draft-steps", type=_positive_int, default=None, metavar="K",
                     help="recursive drafts a round for a draft block (--head block or a "
                          "block's directory; default: its shipped depth, 5 for SmolLM2's, and "
                          "with --prompts-file on a CPU 2 while 4 or more rows draft, measured "
                          "faster there: docs/results.md)")
    gen.add_argument("--draft-weights", choices=[w.value for w in DraftWeights],
                     default=DraftWeights.AUTO.value,
                     help="how a draft block's projections are held while drafting: int8 (a "
                          "quarter of the bytes read; the output is unchanged, acceptance moves "
                          "a little), as-trained, or auto (default: int8 on a CPU, where it was "
                          "measured faster: docs/results.md)")
    gen.add_argument("--max-new-tokens", type=_non_negative_int, default=128,
                     help="the most tokens to generate (fewer at EOS or a --stop string)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    gen.add_argument("--compile", action="store_true",
                     help="static KV cache, compiled forwards and a compiled round (torch.compile)")
    gen.add_argument("--precision", type=Precision, default=Precision.AUTO,
                     metavar="{auto,float32,bfloat16}",
                     help="the precision the model runs in: bfloat16 is made row-invariant (a "
                          "verify block's logits equal those of the same positions decoded one "
                          "by one, so the output is plain decoding's of the same model); auto "
                          "(default): bfloat16 on a CPU that computes it natively (AVX512-BF16 / "
                          "AMX) without --compile, float32 elsewhere")
    gen.add_argument("--plain-linear", action="store_true",
                     help="keep torch's default linear kernels and weight layout on a CPU (by "
                          "default a head's decoder stores the weights in the layout and packs "
                          "them with the backend, MKL or oneDNN, measured fastest on this "
                          "machine)")
    gen.add_argument("--lookup", type=_lookup_weights, default=(), metavar="WEIGHTS",
                     help="mix a copy of the context's last repeated n-gram's continuation into "
                          "the head's drafts, with these weights per n-gram length (exact; e.g. "
                          "0.2,0.4,0.6; default none)")
    gen.add_argument("--constraint-walk", type=_probability, default=0.0, metavar="W",
                     help="under --regex or --json-schema, mix into a head's drafts, with weight "
                          "W, the text the constraint fixes and the output's own choices where "
                          "it leaves one, in rounds where --lookup proposes nothing (exact; "
                          "default 0: off)")
    constrained = gen.add_mutually_exclusive_group()
    constrained.add_argument("--regex", default=None, metavar="PATTERN",
                             help="generate only text that matches PATTERN (the model's law "
                                  "masked by it; drafts satisfy it by construction)")
    constrained.add_argument("--json-schema", default=None, metavar="FILE",
                             help="generate only JSON that validates against the schema in FILE")
    add_batch_arguments(gen, source)
    gen.set_defaults(run=_guarded("generate", _generate))
