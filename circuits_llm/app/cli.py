"""The ``circuits-llm`` command line: pretrain, export-model, train-head, demo, bench, generate, ship.

Every subcommand that runs a model takes ``--device auto|cpu|cuda[:N]`` (:mod:`circuits_llm.runtime.devices`).
``train-head``, ``demo``, ``bench`` and ``generate`` take ``--model``: ``embedded``, a Hugging Face
model directory, a ``.gguf`` file or a hub id in the local cache
(:func:`circuits_llm.text.references.parse_model_reference`; nothing is downloaded), and read text through
that model's own tokenizer (:mod:`circuits_llm.text.tokens`). ``pretrain`` and ``export-model`` make the
embedded byte-level model, so they have none. ``ship`` writes a finished ``train-head`` run into the
package's shipped heads (:func:`circuits_llm.app.shipping.add_ship_command`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from circuits_llm.runtime.devices import DeviceError, add_device_argument, resolve_device

#: Where ``export-model`` writes by default: the packaged model (:mod:`circuits_llm.embedded`,
#: not imported here: it loads transformers, which ``--help`` does not need).
_EMBEDDED_DIR = Path(__file__).resolve().parents[1] / "embedded" / "byte-llama"


def _resolved(command: str, args: argparse.Namespace) -> torch.device | None:
    """``args.device`` resolved, or None after printing the one-line error of ``command``."""
    try:
        return resolve_device(args.device)
    except DeviceError as error:
        print(f"circuits-llm {command}: error: {error}", file=sys.stderr)
        return None


def _pretrain(args: argparse.Namespace) -> int:
    from circuits_llm.training.pretrain import ModelShape, PretrainConfig, run_pretraining
    device = _resolved("pretrain", args)
    if device is None:
        return 2
    torch.set_num_threads(args.threads)
    config = PretrainConfig(
        model=ModelShape(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
                         intermediate_size=args.intermediate_size),
        seq_len=args.seq_len, batch_size=args.batch_size, learning_rate=args.lr,
        total_steps=args.total_steps, seed=args.seed, eval_every=args.eval_every,
        max_train_bytes=args.max_train_bytes)
    minutes = args.minutes
    result = run_pretraining(config, args.run_dir, max_seconds=None if minutes is None else minutes * 60,
                             device=device)
    print(json.dumps(result.__dict__, indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    from circuits_llm.training.pretrain import export_model
    device = _resolved("export-model", args)
    if device is None:
        return 2
    card = export_model(args.run_dir, args.out, test_windows=args.test_windows, device=device)
    card.pop("history", None)
    print(json.dumps(card, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="circuits-llm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("pretrain", help="pretrain the byte-level Llama on the stdlib (resumable)")
    pre.add_argument("--run-dir", type=Path, default=Path("runs/pretrain"))
    pre.add_argument("--minutes", type=float, default=None, help="stop after this long (resume later)")
    pre.add_argument("--total-steps", type=int, default=4000)
    pre.add_argument("--batch-size", type=int, default=16)
    pre.add_argument("--seq-len", type=int, default=256)
    pre.add_argument("--lr", type=float, default=2e-3)
    pre.add_argument("--hidden-size", type=int, default=256)
    pre.add_argument("--layers", type=int, default=4)
    pre.add_argument("--heads", type=int, default=8)
    pre.add_argument("--intermediate-size", type=int, default=688)
    pre.add_argument("--eval-every", type=int, default=200)
    pre.add_argument("--max-train-bytes", type=int, default=None)
    pre.add_argument("--seed", type=int, default=0)
    pre.add_argument("--threads", type=int, default=2)
    add_device_argument(pre, default="cpu", note="The embedded model's recipe was tuned on the CPU.")
    pre.set_defaults(run=_pretrain)
    exp = sub.add_parser("export-model", help="write the best pretraining checkpoint as an HF model")
    exp.add_argument("--run-dir", type=Path, default=Path("runs/pretrain"))
    exp.add_argument("--out", type=Path, default=_EMBEDDED_DIR)
    exp.add_argument("--test-windows", type=int, default=None,
                     help="limit the test measurement to this many 256-byte windows (default: all)")
    add_device_argument(exp, default="cpu", note="Where the test measurement runs; the weights are "
                        "written from the CPU either way.")
    exp.set_defaults(run=_export)
    from circuits_llm.training.cli import add_train_head_command
    add_train_head_command(sub)
    from circuits_llm.app.commands import add_commands  # demo, bench, generate
    add_commands(sub)
    from circuits_llm.app.ship_command import add_ship_command
    add_ship_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
