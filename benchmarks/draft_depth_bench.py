"""The recursive draft block at a fixed depth against the depth chosen each round from earlier rounds.

Run ``python -m benchmarks.draft_depth_bench [--prompt-set code|chat] [--prompts N]
[--new-tokens N] [--fixed K] [--most K] [--threads T] [--out PATH]``.

SmolLM2 with the shipped block (int8 drafting on the CPU), the copy of the context as ``make
demo`` mixes it (weights 0.1, 0.3, 0.5), round programs compiled, linear weights packed for verify
blocks of up to ``most + 1`` tokens. Three decoders per mode (greedy, and T = 1 with one seed per
prompt): plain autoregressive decoding; the block verifying ``fixed`` drafts every round (the
shipped depth, 5); and the block drafting up to ``most`` with
:class:`~circuits_llm.decoding.draft_depth.AdaptiveDepth` (``RoundCosts.for_device``). Each
decoder decodes every prompt once after a warm-up; throughput is tokens over the whole loop's
seconds (prefill included), and the ratios are against plain decoding in the same run. The
adaptive rows also count the rounds at each depth. Greedy outputs must be identical for all
three. Results are printed and written as JSON (default
``benchmarks/results/draft_depth_bench_<prompt set>.json``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from benchmarks.spec_tools import compare_on_prompts
from circuits_llm.runtime.timing import machine_info, publish

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {"greedy": 0.0, "T = 1": 1.0}


def prompts_for(prompt_set: str, tokenizer: Any, count: int) -> list[torch.Tensor]:
    """``count`` held-out prompts of the set: code prefixes of 128 tokens, or chat requests."""
    if prompt_set == "chat":
        from circuits_llm.text.chat_requests import evaluation_chat_prompts
        return evaluation_chat_prompts(tokenizer, count)
    from circuits_llm.text.corpus import evaluation_prompts
    return evaluation_prompts(tokenizer, count, 128)


def run(prompt_set: str, count: int, new_tokens: int, fixed: int, most: int,
        log: Any = print) -> dict[str, Any]:
    """Decode the prompts with each decoder in both modes; the record's rows."""
    from circuits_llm.app.shipping import shipped_drafter
    from circuits_llm.app.verify_packing import pack_for_verify_blocks
    from circuits_llm.backbone import HFBackbone
    from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
    from circuits_llm.decoding.draft_depth import AdaptiveDepth
    from circuits_llm.decoding.lookup import ContextLookup
    from circuits_llm.draft_block import BlockDrafter
    from circuits_llm.text.models import load_model
    loaded = load_model("smollm2")
    block = shipped_drafter(loaded, "block").block
    log(pack_for_verify_blocks(loaded.model, max(fixed, most) + 1, torch.device("cpu")))
    texts = prompts_for(prompt_set, loaded.tokenizer, count)
    lookup = ContextLookup((0.1, 0.3, 0.5))
    rule = AdaptiveDepth.for_device(torch.device("cpu"))
    makers = {
        "autoregressive": lambda: AutoregressiveDecoder(HFBackbone(loaded.model)),
        f"block, {fixed} drafts": lambda: SpeculativeDecoder(
            HFBackbone(loaded.model, feature_layers=block.fused_layers), BlockDrafter(block, fixed),
            compile=True, lookup=lookup),
        f"block, adaptive up to {most}": lambda: SpeculativeDecoder(
            HFBackbone(loaded.model, feature_layers=block.fused_layers), BlockDrafter(block, most),
            compile=True, lookup=lookup, draft_depth=rule)}
    depths: dict[str, list[int]] = {}

    def read_depths(mode: str, name: str, decoder: Any, _: object) -> None:
        tracker = getattr(decoder, "depths", None)  # the adaptive decoder's, per decode
        if tracker is not None:
            depths.setdefault(f"{mode}, {name}", []).extend(tracker.depths)

    rows: dict[str, Any] = compare_on_prompts(makers, texts, new_tokens, MODES, log, read_depths)
    for key, seen in depths.items():
        if seen:
            rows[key]["rounds_by_depth"] = {str(d): seen.count(d) for d in sorted(set(seen))}
    return rows


def format_table(record: dict[str, Any]) -> str:
    lines = [f"{record['prompt_set']} prompts ({record['prompts']} x {record['new_tokens']} "
             "tokens)", "| mode, decoder | tok/s | tokens a round | x AR | rounds by depth |",
             "|---|---|---|---|---|"]
    for name, row in record["rows"].items():
        depths = ", ".join(f"{d}: {n}" for d, n in row.get("rounds_by_depth", {}).items())
        lines.append(f"| {name} | {row['tokens_per_second']:.2f} | {row['tokens_per_round']:.2f}"
                     f" | {row['speedup_vs_autoregressive']:.3f} | {depths} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-set", choices=("code", "chat"), default="code")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--fixed", type=int, default=5, help="the fixed depth compared")
    parser.add_argument("--most", type=int, default=7, help="the adaptive rule's deepest round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.prompts, args.new_tokens, args.fixed, args.most) < 1:
        parser.error("--prompts, --new-tokens, --fixed and --most must be >= 1")
    torch.set_num_threads(args.threads)
    rows = run(args.prompt_set, args.prompts, args.new_tokens, args.fixed, args.most)
    record = {"machine": machine_info(threads=args.threads), "prompt_set": args.prompt_set,
              "prompts": args.prompts, "new_tokens": args.new_tokens, "fixed": args.fixed,
              "most": args.most, "rows": rows}
    out = args.out or RESULTS / f"draft_depth_bench_{args.prompt_set}.json"
    publish(format_table(record), record, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
