"""What the draft block's own step (:mod:`circuits_llm.draft_block.step`) saves: one step's
milliseconds, and a round's draft side against its verify, on SmolLM2 with the shipped block.

Four ways to run the block's calls, the first three on the same weights:

* ``hf layers``: Hugging Face's decoder layer over a ``DynamicCache`` (what drafting ran before
  the step existed; what training and the padded batch still run);
* ``eager step``: :class:`~circuits_llm.draft_block.step.BlockStep` over its preallocated cache,
  attending to the held slots only;
* ``compiled step``: the same, compiled with static shapes (``torch.compile``; CUDA graphs on
  CUDA), attending to every slot of the cache under a mask.

Part 1 times one recursive step (a one-position block call after ``--context`` cached positions),
the readout over the draft vocabulary, and a first step of ``window + 1`` positions, interleaved
(medians). Part 2 decodes held-out prompts (the demo's, packed verify weights, round programs
compiled as ``make demo`` compiles them) with each way and with plain autoregressive decoding, and
splits each round's time as the decoder's round records do (``RoundStats``: drafting, and the
backbone's forward): the draft side is their ratio. Greedy outputs must be identical for every
way (checked). Printed as tables and saved as JSON::

    python -m benchmarks.block_step_bench [--prompts 4 --new-tokens 64 --threads 1]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from benchmarks.spec_tools import decode_prompts
from circuits_llm.backbone.cache_slots import drop_last_positions
from circuits_llm.draft_block import BlockDrafter, BlockStepMode, DraftBlock, DraftWeights
from circuits_llm.runtime.timing import interleaved, machine_info, medians, publish

RESULTS = Path(__file__).resolve().parent / "results"
WAYS = ("hf layers", "eager step", "compiled step", "int8 eager step")


class HFLayersCache:
    """A ``DynamicCache`` with the interface drafting reads (``length``, ``truncate``)."""

    def __init__(self) -> None:
        self.cache = DynamicCache()
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        drop_last_positions(self.cache, self.length - length)
        self.length = length


class HFLayersStep:
    """The block's calls through :meth:`DraftBlock.extend` (Hugging Face's layers)."""

    def __init__(self, block: DraftBlock) -> None:
        self.block = block

    def new_cache(self) -> HFLayersCache:
        return HFLayersCache()

    def __call__(self, cache: HFLayersCache, hidden: Tensor, tokens: Tensor) -> Tensor:
        with torch.no_grad():
            output = self.block.extend(hidden, tokens, cache.cache)
        cache.length += hidden.shape[1]
        return output


def drafter_for(way: str, block: DraftBlock, steps: int) -> BlockDrafter:
    """A recursive drafter on ``block`` whose calls run ``way`` (its round programs compiled or
    not)."""
    mode = BlockStepMode.COMPILED if way == "compiled step" else BlockStepMode.EAGER
    weights = DraftWeights.INT8 if way.startswith("int8") else DraftWeights.AS_TRAINED
    drafter = BlockDrafter(block, steps, step_mode=mode, weights=weights)
    if way == "hf layers":
        drafter.step = HFLayersStep(block)  # type: ignore[assignment]
        drafter.cache = drafter.step.new_cache()  # type: ignore[assignment]
    return drafter


def step_timings(block: DraftBlock, window: int, context: int, rounds: int) -> dict[str, float]:
    """Milliseconds (medians) of one recursive step, a first step of ``window + 1`` positions
    and the readout, each way, after ``context`` cached positions."""
    d = block.hidden_size
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, context + window + 1, d, generator=generator).to(block.device, block.dtype)
    tokens = torch.randint(0, 1000, (1, context + window + 1), generator=generator)
    candidates: dict[str, Callable[[], object]] = {}
    for way in WAYS:
        drafter = drafter_for(way, block, window - 1)
        if way == "compiled step":
            drafter.step.compile(window + 1)
        cache = drafter.step.new_cache()
        drafter.step(cache, hidden[:, :context], tokens[:, :context])

        def one(step: Any = drafter.step, cache: Any = cache) -> None:
            step(cache, hidden[:, context:context + 1], tokens[:, context:context + 1])
            cache.truncate(context)

        def first(step: Any = drafter.step, cache: Any = cache) -> None:
            step(cache, hidden[:, context:], tokens[:, context:])
            cache.truncate(context)

        candidates[f"{way}: one position"] = one
        candidates[f"{way}: first step of {window + 1}"] = first
    output = torch.randn(1, d, generator=generator).to(block.device, block.dtype)
    candidates["readout"] = lambda: block.logits(output)
    with torch.no_grad():
        timed = medians(interleaved(candidates, rounds, warmup=3))
    return {name: 1000 * seconds for name, seconds in timed.items()}


def decode_rounds(model_name: str, prompts: int, new_tokens: int, log: Callable[[str], None]
                  ) -> dict[str, Any]:
    """Part 2: the held-out prompts decoded greedy and at T = 1 by AR and by each way."""
    from circuits_llm.app.shipping import shipped_drafter
    from circuits_llm.app.verify_packing import pack_for_verify_blocks
    from circuits_llm.backbone import HFBackbone
    from circuits_llm.decoding.backbones import drafter_backbone
    from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
    from circuits_llm.text.corpus import evaluation_prompts
    from circuits_llm.text.models import load_model
    loaded = load_model(model_name)
    shipped = shipped_drafter(loaded, "block", weights=DraftWeights.AS_TRAINED)  # the trained one
    block, window = shipped.block, shipped.window
    log(pack_for_verify_blocks(loaded.model, window, torch.device("cpu")))
    texts = evaluation_prompts(loaded.tokenizer, prompts, 128)
    rows: dict[str, Any] = {}
    for temperature in (0.0, 1.0):
        mode = "greedy" if temperature == 0 else "T = 1"
        outputs: dict[str, list[list[int]]] = {}
        for way in ("autoregressive", *WAYS):
            drafter = None if way == "autoregressive" else drafter_for(way, block, window - 1)
            decoder = AutoregressiveDecoder(HFBackbone(loaded.model)) if drafter is None else \
                SpeculativeDecoder(drafter_backbone(loaded.model, drafter), drafter, compile=True)
            decoded = decode_prompts(decoder, texts, new_tokens, temperature)
            outputs[way] = decoded.outputs
            tokens, rounds, seconds = decoded.tokens, decoded.rounds, decoded.seconds
            every = [r for result in decoded.results for r in result.rounds]
            totals = {"draft": sum(r.head_s + r.draft_s for r in every),
                      "verify": sum(r.verify_s for r in every)}
            rows[f"{mode}, {way}"] = {
                "tokens_per_second": tokens / seconds, "tokens_per_round": tokens / rounds,
                "draft_ms_per_round": 1000 * totals["draft"] / rounds,
                "verify_ms_per_round": 1000 * totals["verify"] / rounds,
                "draft_share_of_verify": totals["draft"] / totals["verify"]}
            log(f"{mode:>6} {way:<15} {tokens / seconds:6.1f} tok/s  "
                f"{rows[f'{mode}, {way}']['draft_share_of_verify']:.1%} draft/verify")
        base = rows[f"{mode}, autoregressive"]["tokens_per_second"]
        for way in WAYS:
            rows[f"{mode}, {way}"]["speedup_vs_autoregressive"] = \
                rows[f"{mode}, {way}"]["tokens_per_second"] / base
        if temperature == 0:
            same = all(outputs[way] == outputs["autoregressive"] for way in WAYS)
            if not same:
                raise AssertionError("greedy outputs differ between the ways: a step is wrong")
    return {"window": window, "rows": rows, "block": block}


def format_tables(record: dict[str, Any]) -> str:
    lines = ["one block call (ms, medians)", ""]
    lines += [f"  {name:<40} {ms:7.3f}" for name, ms in record["steps_ms"].items()]
    lines += ["", f"{'decode':<28} {'tok/s':>7} {'x AR':>6} {'tok/rd':>7} {'draft ms':>9} "
                  f"{'verify ms':>10} {'draft/verify':>13}"]
    for name, row in record["decode"].items():
        lines.append(f"{name:<28} {row['tokens_per_second']:7.1f} "
                     f"{row.get('speedup_vs_autoregressive', 1.0):6.2f} "
                     f"{row['tokens_per_round']:7.2f} {row['draft_ms_per_round']:9.2f} "
                     f"{row['verify_ms_per_round']:10.2f} {row['draft_share_of_verify']:13.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=200,
                        help="cached positions before the timed block calls (part 1)")
    parser.add_argument("--rounds", type=int, default=30, help="timing rounds (part 1)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "block_step_bench.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    decoded = decode_rounds(args.model, args.prompts, args.new_tokens, print)
    steps = step_timings(decoded["block"], decoded["window"], args.context, args.rounds)
    record = {"machine": machine_info(threads=args.threads), "model": args.model,
              "prompts": args.prompts, "new_tokens": args.new_tokens,
              "window": decoded["window"], "context": args.context, "steps_ms": steps,
              "decode": decoded["rows"]}
    publish(format_tables(record), record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
