"""The draft-block rows of ``demo`` and ``bench`` (issue 44): the shipped recursive block and the
circuit head on the block, beside the AR, FF and BTree rows.

A comparison's ``blocks`` (:class:`~circuits_llm.app.demo.ComparisonConfig`: ``block``,
``btree-block`` in the demo's settings) name shipped draft blocks (layouts ``block`` and
``block_head`` of :mod:`circuits_llm.heads.shipped`). :func:`find_blocks` finds those trained for
the model (by its identity; a model with none gets no such row, and the log says so);
:func:`load_blocks` verifies and loads them (:func:`circuits_llm.app.shipping.load_shipped_drafter`);
:func:`block_decoders` wraps each drafter in a
:class:`~circuits_llm.decoding.decoder.SpeculativeDecoder` with the comparison's copy of the
context (``lookup``) and draft-length rule when the decoder takes them for a draft block, else
without them (every draft verified, no copy), which the log and the row's record say.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from circuits_llm.app.head_cache import HeadOrigin, find_shipped_drafter
from circuits_llm.app.rows import TokenUnit
from circuits_llm.app.shipping import ShippedDrafter, load_shipped_drafter
from circuits_llm.app.verify_packing import Precision
from circuits_llm.heads.shipped import BLOCK_FILES, ShippedHead, ShippedHeadError, ShippedLayout

__all__ = ["ReadyBlock", "block_decoders", "block_window", "describe_block", "find_blocks",
           "load_blocks"]


@dataclass
class ReadyBlock:
    """A shipped draft block loaded for the model, with the record the report shows.

    Attributes:
        name: the row's decoder name (the shipped kind: ``block``, ``btree-block``).
        drafter: what the decoder takes in place of a head.
        record: where it came from, its training run and how the comparison decodes with it.
    """

    name: str
    drafter: ShippedDrafter
    record: dict[str, Any]


def block_window(shipped: ShippedHead) -> int:
    """The verify block a shipped drafter's rounds run (the recursive block's window, or the
    circuit head's), read from its manifest before anything is loaded."""
    if shipped.layout is ShippedLayout.BLOCK_HEAD:
        return int(shipped.manifest["head"]["window"])
    if shipped.manifest.get("draft_steps") is not None:  # the depth it shipped to draft at
        return int(shipped.manifest["draft_steps"]) + 1
    try:  # the block's recursive steps, and the verified token
        config = json.loads((shipped.directory / BLOCK_FILES[0]).read_text(encoding="utf-8"))
        return int(config["steps"]) + 1
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ShippedHeadError(f"cannot read {shipped.directory / BLOCK_FILES[0]} ({error}); "
                               "reinstall circuits-llm") from None


def find_blocks(model: Any, names: Sequence[str], root: Path | None = None,
                log: Callable[[str], None] = print) -> list[ShippedHead]:
    """The shipped draft blocks ``names`` trained for ``model``, in that order; each name without
    one is logged and left out."""
    found = []
    for name in names:
        shipped = find_shipped_drafter(model, name, root)
        if shipped is None:
            log(f"draft block {name}: none ships for this model, so the comparison has no "
                f"{name} row (train one with `circuits-llm train-head --draft-block`)")
        else:
            found.append(shipped)
    return found


def _record(shipped: ShippedHead, parameters: int, fingerprint: str) -> dict[str, Any]:
    """The report's record of a shipped block (the fields a head's record has, and the head's)."""
    record = shipped.record
    validation, initial = record.get("validation", {}), record.get("initial_validation", {})
    return {"architecture": shipped.kind, "layout": shipped.layout.value,
            "model_fingerprint": fingerprint, "training_config": shipped.training,
            "train_wall_s": float(record.get("elapsed_s", 0.0)), "steps": record.get("step"),
            "finished": record.get("finished"), "tokens_seen": record.get("tokens_seen"),
            "validation_bits_before": initial.get("mean_bits"),
            "validation_bits_after": validation.get("mean_bits"),
            "validation_bits_by_position": list(validation.get("bits", [])),
            "max_seconds": None, "origin": HeadOrigin.SHIPPED.value, "shipped_as": shipped.name,
            "cached": True, "run_dir": str(shipped.directory), "parameters": parameters,
            "circuit_head": shipped.manifest.get("head")}


def load_blocks(found: Sequence[ShippedHead], loaded: Any, precision: Precision | None = None,
                stop_when_unsure: bool = True) -> list[ReadyBlock]:
    """Each shipped block of ``found`` verified and loaded on ``loaded``'s model (a recursive one
    drafting as deep as :func:`~circuits_llm.app.verify_packing.recursive_depths` says for the
    resolved ``precision`` the decoders run in, and on a CPU with ``stop_when_unsure`` stopping
    after an unsure draft: False for compiled backbones)."""
    ready = []
    for shipped in found:
        drafter = load_shipped_drafter(shipped, loaded.model, precision=precision,
                                       stop_when_unsure=stop_when_unsure)
        record = _record(shipped, int(shipped.manifest["parameters"]), loaded.fingerprint)
        record["window"] = drafter.window  # the verify block its rounds run
        ready.append(ReadyBlock(shipped.kind, drafter, record))
    return ready


def block_decoders(blocks: Sequence[ReadyBlock], backbone: Callable[[Any], Any], *,
                   draft_length: Any, lookup: Any, compile: bool,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """A speculative decoder per block, on ``backbone(drafter)`` (a fresh or shared backbone that
    hands the drafter what it reads), with the
    blocks' ``draft_length`` rule (``None``: every draft verified;
    :attr:`~circuits_llm.app.demo.ComparisonConfig.block_draft_confidence`) and the comparison's
    ``lookup`` when the decoder takes them for a draft block; refused, the block's decoder goes
    without them (logged, and recorded in the block's record as ``decoding``)."""
    from circuits_llm.decoding.decoder import SpeculativeDecoder
    from circuits_llm.decoding.warping import DecoderError
    decoders: dict[str, Any] = {}
    for ready in blocks:
        options = {"draft_length": draft_length, "lookup": lookup}
        try:
            decoders[ready.name] = SpeculativeDecoder(backbone(ready.drafter), ready.drafter,
                                                      compile=compile, **options)
            ready.record["decoding"] = {"lookup": lookup is not None,
                                        "draft_length": "fixed" if draft_length is None
                                        else draft_length.describe(), "refused": None}
        except DecoderError as error:
            decoders[ready.name] = SpeculativeDecoder(backbone(ready.drafter), ready.drafter,
                                                      compile=compile)
            ready.record["decoding"] = {"lookup": False, "draft_length": "fixed",
                                        "refused": str(error)}
            log(f"draft block {ready.name}: decoded without the copy of the context and with "
                f"every draft verified (the decoder refuses the comparison's options for a "
                f"draft block: {error})")
    return decoders


def describe_block(ready: ReadyBlock, unit: TokenUnit) -> str:
    """One line on a loaded block: where from, its size and training, and its circuit head."""
    r = ready.record
    per = "byte" if unit is TokenUnit.BYTES else "token"
    before, after = r["validation_bits_before"], r["validation_bits_after"]
    bits = "" if before is None or after is None else \
        f"; validation bits/{per} by depth {before:.2f} -> {after:.2f}"
    head = r["circuit_head"]
    on_top = ""
    if head is not None:
        trained = head.get("record") or {}
        steps = "" if trained.get("step") is None else \
            f", trained {trained['step']} steps in {float(trained.get('elapsed_s', 0.0)):.0f} s"
        on_top = f", a {head['kind']} head of window {head['window']} on its output{steps}"
    else:
        on_top = f", {r['window'] - 1} recursive drafts a round"
        exits = [f"a {mode} round stops after a draft it gives under {value:.0%}"
                 for mode, value in (("greedy", getattr(ready.drafter, "greedy_exit", None)),
                                     ("sampled", getattr(ready.drafter, "sampled_exit", None)))
                 if value is not None]
        if exits:
            on_top += f" ({'; '.join(exits)})"
    layers = tuple(getattr(ready.drafter, "feature_layers", ()))
    if layers:  # EAGLE-3's fused features
        on_top += f"; it reads layers {list(layers)}' outputs besides the last hidden state"
    return (f"draft block {ready.name}: shipped ({r['shipped_as']}), {r['parameters']:,} "
            f"parameters{on_top} (the block: {r['steps']} steps, {r['train_wall_s']:.0f} s of "
            f"training{bits}) in {r['run_dir']}")
