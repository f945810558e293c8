"""How much a trained draft block accepts, beside the shipped BTree head, on held-out code.

Run ``python -m experiments.block_acceptance RUN_DIR [--prompts 6] [--new-tokens 96]
[--threads 1] [--out PATH]`` with ``RUN_DIR`` a ``circuits-llm train-head --draft-block`` run on
SmolLM2 (``scripts/train_draft_block.sh``).

Every decoder continues the same held-out prompts (prefixes of the corpus's test files) with the
same budget, greedy and at T = 1, every round verifying every draft (no draft-length rule, no copy
of the context: the drafters' own acceptance):

* ``block``: ``SpeculativeDecoder(model, BlockDrafter(block))``, recursive drafts of the block;
* ``btree``: the shipped BTree head (window 8), the drafter the block is meant to beat.

Reported per decoder and mode: tokens per round, the fraction of rounds whose k-th draft was
accepted, and (greedy) whether every output equals plain greedy decoding. The exact law needs no
check here (tests/test_draft_block_law.py); this measures acceptance only, no timing. The record
goes to ``experiments/results/block_acceptance.json`` through the project's one writer.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from circuits_llm.app.head_cache import shipped_head
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.metrics import DecodeResult, aggregate
from circuits_llm.draft_block import BlockDrafter
from circuits_llm.runtime.timing import machine_info, publish
from circuits_llm.text.corpus import evaluation_prompts
from circuits_llm.text.models import load_model
from circuits_llm.training.block_trainer import load_trained_block

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "block_acceptance.json"
MODES = {"greedy": 0.0, "sampling": 1.0}


def decode_all(decoder: Any, prompts: list[list[int]], new_tokens: int, temperature: float,
               seed: int) -> list[DecodeResult]:
    """``decoder`` on every prompt, each with its own seeded generator."""
    return [decoder.generate(prompt, new_tokens, temperature=temperature, eos_token_id=(),
                             generator=torch.Generator().manual_seed(seed + index))
            for index, prompt in enumerate(prompts)]


def describe(results: list[DecodeResult]) -> dict[str, Any]:
    """Tokens per round and acceptance by position over ``results``."""
    summary = aggregate(results)
    return {"tokens_per_round": summary.tokens_per_round, "rounds": summary.rounds,
            "acceptance_by_position": list(summary.acceptance_by_position)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a train-head --draft-block run directory")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    loaded = load_model(args.model)
    model = loaded.model
    block = load_trained_block(args.run_dir, model)
    drafters = {"block": BlockDrafter(block), "btree": shipped_head(loaded, "btree")}
    prompts = [p.tolist() for p in evaluation_prompts(loaded.tokenizer, args.prompts,
                                                      args.prompt_tokens)]
    plain = decode_all(AutoregressiveDecoder(model), prompts, args.new_tokens, 0.0, args.seed)
    rows: dict[str, dict[str, Any]] = {}
    lines = [f"{'mode':9} {'drafter':7} {'tok/round':>9}  accepted by position"]
    for mode, temperature in MODES.items():
        for name, drafter in drafters.items():
            results = decode_all(SpeculativeDecoder(model, drafter), prompts, args.new_tokens,
                                 temperature, args.seed)
            row = describe(results)
            if temperature == 0.0:
                row["greedy_equals_plain"] = all(
                    torch.equal(r.tokens, p.tokens) for r, p in zip(results, plain, strict=True))
            rows[f"{mode} {name}"] = row
            accepted = " ".join(f"{100 * a:.0f}" for a in row["acceptance_by_position"])
            lines.append(f"{mode:9} {name:7} {row['tokens_per_round']:9.2f}  {accepted} %")
    record = {"benchmark": "block_acceptance", "run_dir": str(args.run_dir),
              "model": args.model, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "machine": machine_info(), "results": rows}
    publish("\n".join(lines), record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
