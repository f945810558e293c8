"""The shipped drafters on code the project never trained on: other packages' Python sources.

Run ``python -m experiments.third_party_code [--package transformers] [--prompts 4]
[--new-tokens 96] [--precision auto] [--threads 1] [--out PATH]``.

The corpus behind every shipped drafter is CPython's standard library; issue 44 measured the
heads on third-party code at 0.89-1.02x plain decoding greedy. Here the prompts are the first 128
tokens of the first ``--prompts`` files (sorted by path, at least 1,024 characters) of an installed
package's sources (default ``transformers``, a dependency, so always present offline). Decoders,
every one on the same model in the chosen precision
(:class:`~circuits_llm.app.verify_packing.Precision`), in the demo's settings: plain decoding, the
FF and BTree heads (confident drafts, the copy of the context), and the recursive draft block (5
drafts, the copy). Each decodes every prompt once after a warm-up, greedy and at T = 1 (seed = the
prompt's index); throughput is tokens over the loop's seconds; ratios are against plain decoding
in the same run; greedy outputs must all be identical. The record goes to
``experiments/results/third_party_code.json`` through the project's one writer.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

import torch

from benchmarks.spec_tools import compare_on_prompts
from circuits_llm.runtime.timing import machine_info, publish

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {"greedy": 0.0, "T = 1": 1.0}
PROMPT_TOKENS = 128


def package_prompts(package: str, tokenizer: Any, count: int) -> tuple[list[torch.Tensor],
                                                                        list[str]]:
    """The first ``PROMPT_TOKENS`` tokens of the first ``count`` source files of ``package``
    (sorted by path, at least 1,024 characters), and the files' paths within the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"--package {package}: not an installed package; give another")
    root = Path(next(iter(spec.submodule_search_locations)))
    prompts, names = [], []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) < 1024:
            continue
        ids = tokenizer.encode(text)[:PROMPT_TOKENS]
        prompts.append(torch.tensor(ids))
        names.append(str(path.relative_to(root.parent)))
        if len(prompts) == count:
            break
    if len(prompts) < count:
        raise SystemExit(f"--package {package} has {len(prompts)} source files of 1,024 "
                         f"characters or more, fewer than --prompts {count}")
    return prompts, names


def run(package: str, count: int, new_tokens: int, precision_name: str,
        log: Any = print) -> dict[str, Any]:
    """Decode the prompts with each decoder in both modes; the record."""
    from circuits_llm.app.demo import ComparisonConfig
    from circuits_llm.app.head_cache import shipped_head
    from circuits_llm.app.shipping import shipped_drafter
    from circuits_llm.app.verify_packing import Precision, decode_model
    from circuits_llm.backbone import HFBackbone
    from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
    from circuits_llm.decoding.draft_length import DraftLength
    from circuits_llm.decoding.lookup import ContextLookup
    from circuits_llm.text.models import load_model

    cpu = torch.device("cpu")
    loaded = load_model("smollm2")
    demo = ComparisonConfig.demo()
    block = shipped_drafter(loaded, "block")
    heads = {name: shipped_head("smollm2", name, device=cpu).eval() for name in ("ff", "btree")}
    precision = Precision(precision_name).resolve(cpu)
    model, line = decode_model(loaded.model, precision, demo.window, cpu)
    log(line)
    prompts, files = package_prompts(package, loaded.tokenizer, count)
    lookup = ContextLookup(tuple(demo.lookup or ()))
    rule = DraftLength.confident(demo.draft_confidence or 0.0, minimum=demo.draft_minimum)
    makers = {"autoregressive": lambda: AutoregressiveDecoder(HFBackbone(model)),
              **{name: (lambda head=head: SpeculativeDecoder(
                  HFBackbone(model), head, draft_length=rule, lookup=lookup, compile=True))
                 for name, head in heads.items()},
              "block": lambda: SpeculativeDecoder(HFBackbone(model), block, lookup=lookup,
                                                  compile=True)}
    rows = compare_on_prompts(makers, prompts, new_tokens, MODES, log)
    return {"package": package, "files": files, "prompts": count, "new_tokens": new_tokens,
            "precision": precision.value, "linear_layers": line, "rows": rows}


def format_table(record: dict[str, Any]) -> str:
    lines = [f"{record['package']} sources ({record['prompts']} x {record['new_tokens']} tokens, "
             f"{record['precision']})", "| mode, decoder | tok/s | tokens a round | x AR |",
             "|---|---|---|---|"]
    for name, row in record["rows"].items():
        lines.append(f"| {name} | {row['tokens_per_second']:.2f} | {row['tokens_per_round']:.2f} "
                     f"| {row['speedup_vs_autoregressive']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="transformers")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "third_party_code.json")
    args = parser.parse_args(argv)
    if min(args.prompts, args.new_tokens) < 1:
        parser.error("--prompts and --new-tokens must be >= 1")
    torch.set_num_threads(args.threads)
    record = run(args.package, args.prompts, args.new_tokens, args.precision)
    record["machine"] = machine_info(threads=args.threads)
    publish(format_table(record), record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
