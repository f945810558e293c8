"""``circuits-llm ship``: write a finished ``train-head`` run into the package's shipped heads.

The subcommand's arguments (:func:`add_ship_command`, registered by :mod:`circuits_llm.app.cli`)
and its one-line errors; the work is :func:`circuits_llm.app.shipping.ship_run`. :func:`main` is
the former spelling, ``python -m circuits_llm.app.head_cache ship ...``, kept for scripts written
against it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from circuits_llm.app import shipping
from circuits_llm.heads.shipped import SHIPPED_DIR, ShippedHeadError

__all__ = ["add_ship_command", "main"]

_PROGRAM = "circuits-llm ship"

#: What ``ship --name`` accepts: one directory name inside ``--root`` (no path, not hidden), so a
#: shipped directory is always one that :func:`~circuits_llm.heads.shipped.shipped_heads` lists.
_SHIPPED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _ship(args: argparse.Namespace) -> int:
    """``circuits-llm ship``: :func:`ship_run` of ``RUN_DIR`` into ``ROOT/NAME``; every input
    problem (a bad name, a missing or foreign run, a model that does not load) is one line
    ``circuits-llm ship: error: ...`` on stderr and exit status 2, never a traceback."""
    from circuits_llm.runtime.checkpoint import CheckpointError
    from circuits_llm.text.models import ModelLoadError
    try:
        if not _SHIPPED_NAME.fullmatch(args.name):
            raise ShippedHeadError(f"--name must be a directory name of letters, digits, '.', '_' "
                                   f"and '-' that starts with a letter or digit (e.g. "
                                   f"smollm2-btree), got {args.name!r}")
        shipped = shipping.ship_run(args.run_dir, args.root / args.name, args.model,
                           circuit_head=args.circuit_head, head_record=args.head_record,
                           draft_steps=args.draft_steps)
    except (ShippedHeadError, CheckpointError, ModelLoadError) as error:
        print(f"{_PROGRAM}: error: {error}", file=sys.stderr)
        return 2
    print(f"shipped {args.run_dir} as {shipped.directory} ({shipped.kind}, "
          f"{shipped.size_bytes / 1e6:.1f} MB, {shipped.manifest['parameters']:,} parameters)")
    return 0


def add_ship_command(sub: Any) -> argparse.ArgumentParser:
    """Register ``ship RUN_DIR --name NAME --model MODEL [--circuit-head DIR [--head-record
    FILE]] [--root DIR]`` on an argparse subparsers object: ``circuits-llm``'s
    (:mod:`circuits_llm.app.cli`), and the one :func:`main` builds for the former spelling.
    Its own module rather than :mod:`circuits_llm.app.commands`, which imports ``head_cache``,
    so that ``head_cache``'s :func:`main` can reuse it without an import loop."""
    ship = sub.add_parser("ship", help="write a finished train-head run as a shipped head inside "
                                       "the package (a --draft-block run: a shipped draft block)",
                          description="Write a finished train-head run into the package's shipped "
                                      "heads: its circuit head, or a --draft-block run's block "
                                      "(with --circuit-head, a head trained on it beside it), in "
                                      "float16, every file checksummed and verified on load.")
    ship.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                      help="a finished train-head run directory (training.json, and head/ or "
                           "block/)")
    ship.add_argument("--name", required=True, help="the shipped directory's name inside --root")
    ship.add_argument("--model", required=True,
                      help="the --model name of the model it was trained for (e.g. smollm2): "
                           "shipped_head(MODEL, kind) and shipped_drafter find it by it; a draft "
                           "block loads that model")
    ship.add_argument("--circuit-head", type=Path, default=None, metavar="DIR",
                      help="with a --draft-block run: a circuit head trained on the block's "
                           "outputs (a save_head directory, or a run directory holding head/), "
                           "shipped beside the block as <kind>-block")
    ship.add_argument("--head-record", type=Path, default=None, metavar="FILE",
                      help="a JSON file saying how the circuit head was trained (kept in "
                           "shipped.json)")
    ship.add_argument("--draft-steps", type=int, default=None,
                      help="a recursive draft block only: its drafts per round by default "
                           "(default: the depth it was trained for)")
    ship.add_argument("--root", type=Path, default=SHIPPED_DIR,
                      help=f"shipped-heads directory (default: {SHIPPED_DIR})")
    ship.set_defaults(run=_ship)
    return ship


def main(argv: list[str] | None = None) -> int:
    """``python -m circuits_llm.app.head_cache ship ...``, the former spelling of ``circuits-llm
    ship``, kept so that scripts written against it still run: the same arguments and the same
    function (:func:`add_ship_command`). Prefer ``circuits-llm ship``: ``-m`` on a module the
    package has already imported makes runpy warn."""
    parser = argparse.ArgumentParser(prog="python -m circuits_llm.app.head_cache",
                                     description="the former spelling of `circuits-llm ship`")
    add_ship_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.run(args))
