"""Shipping drafters inside the package, and loading the shipped draft blocks.

``circuits-llm ship RUN_DIR --name NAME --model MODEL`` (:func:`ship_run`; the subcommand is
:mod:`circuits_llm.app.ship_command`) writes a finished ``train-head`` run into
``circuits_llm/heads_shipped/NAME/`` (:mod:`circuits_llm.heads.shipped` describes the directories):

* a run that trained a circuit head: the head (:func:`ship_head`, layout ``head``);
* a ``train-head --draft-block`` run: its draft block in float16 (:func:`ship_block`, layout
  ``block``, kind ``block``); with ``--circuit-head DIR`` (a ``save_head`` directory, or a run
  directory holding one, of a head trained on the block's outputs:
  :func:`circuits_llm.training.block_circuit.train_block_head`), the block and that head side by
  side (layout ``block_head``, kind ``<head kind>-block``, e.g. ``btree-block``).

A draft block is rebuilt around the model's embedding, final norm and LM head, so shipping one
loads the model (``--model``: the name it is served under, read by
:func:`~circuits_llm.text.models.load_model`), and so does reading one:
:func:`load_shipped_drafter` verifies every file of the directory (one
:class:`~circuits_llm.heads.shipped.ShippedHeadError` saying to reinstall when a byte differs) and
returns the drafter the decoder takes: :class:`~circuits_llm.draft_block.BlockDrafter` (recursive)
or :class:`~circuits_llm.draft_block.BlockCircuitDrafter` (the circuit head on the block).
:func:`find_shipped_drafter` finds a model's shipped block of a kind by the model's identity and
:func:`shipped_drafter` loads it (``circuits_llm.shipped_drafter``; both are re-exported by
:mod:`circuits_llm.app.head_cache`, which finds the circuit heads).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from circuits_llm.app.verify_packing import (
    CPU_GREEDY_EXIT,
    CPU_SAMPLED_EXIT,
    Precision,
    recursive_depths,
)
from circuits_llm.draft_block import (
    BlockCircuitDrafter,
    BlockDrafter,
    DraftBlock,
    DraftBlockError,
    DraftWeights,
    load_draft_block,
    save_draft_block,
)
from circuits_llm.draft_block.circuit_drafter import check_block_head
from circuits_llm.heads import HeadConfigError, MTPHead, load_head, save_head
from circuits_llm.heads.io import CONFIG_FILE
from circuits_llm.heads.shipped import (
    BLOCK_FILES,
    BLOCK_KIND,
    SHIPPED_STORAGE,
    ShippedHead,
    ShippedHeadError,
    ShippedLayout,
    block_kind,
    check_draft_steps,
    prepare_shipped_dir,
    shipped_heads,
    write_shipped_head,
    write_shipped_manifest,
)
from circuits_llm.text.models import LoadedModel, backbone_identity

#: where a ``train-head --draft-block`` run exports its block (the value of
#: :data:`circuits_llm.training.block_trainer.BLOCK_DIR`, which is imported only when a run is
#: shipped; tests/test_shipped_blocks.py checks that the two agree)
BLOCK_DIR = "block"

__all__ = ["BLOCK_LAYOUTS", "NoHeadError", "ShippedDrafter", "find_shipped_drafter",
           "load_shipped_drafter", "no_drafter_message", "ship_block", "ship_head", "ship_run",
           "shipped_drafter", "write_shipped_block"]

#: A drafter that a shipped draft block gives (what ``SpeculativeDecoder`` takes as its head).
ShippedDrafter = BlockDrafter | BlockCircuitDrafter


class NoHeadError(ShippedHeadError):
    """No head of the kind asked for serves the model: none shipped, none trained by the user."""


#: The layouts that ship a draft block (alone, or under a circuit head).
BLOCK_LAYOUTS = (ShippedLayout.BLOCK, ShippedLayout.BLOCK_HEAD)


def _hf_model(model: Any) -> Any:
    """The Hugging Face model of a :class:`LoadedModel` or of a model given as it is."""
    return model.model if isinstance(model, LoadedModel) else model


# ---------------------------------------------------------------------------- writing
def ship_head(run_dir: Path, out: Path, model_name: str) -> ShippedHead:
    """Write the exported head of a finished ``train-head`` run as a shipped head in ``out``
    (:func:`circuits_llm.heads.shipped.write_shipped_head`), serving ``model_name``.

    Raises:
        ShippedHeadError: the run has no exported head, trained LoRA layers (only heads that
            read the final hidden state are shipped), or ``out`` holds something else.
        circuits_llm.runtime.checkpoint.CheckpointError: the run's record is missing or corrupt.
    """
    from circuits_llm.training import read_record
    from circuits_llm.training.results import HEAD_DIR
    run_dir, out = Path(run_dir), Path(out)
    record = read_record(run_dir)
    if int(record["config"].get("lora_layers", 0)):
        raise ShippedHeadError(f"cannot ship {run_dir}: it trained LoRA layers, and only heads "
                               "that read the final hidden state (--lora-layers 0) are shipped")
    identity = _identity(record, run_dir)
    try:
        head = load_head(run_dir / HEAD_DIR)
    except HeadConfigError as error:
        raise ShippedHeadError(f"cannot ship {run_dir}: {error}") from None
    return write_shipped_head(head, out, model_name=model_name, model_identity=identity,
                              record=record)


def _identity(record: Mapping[str, Any], run_dir: Path) -> dict[str, str]:
    identity = record.get("model_fingerprint")
    if not isinstance(identity, dict):
        raise ShippedHeadError(f"cannot ship {run_dir}: its record names no model identity")
    return dict(identity)


def _head_summary(head: MTPHead, record: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a ``block_head`` manifest says of its circuit head."""
    return {"kind": head.architecture, "window": head.window,
            "parameters": int(head.num_parameters()), "draft_vocab": head.draft_vocab_size,
            "reads_token": bool(head.reads_token),
            "record": None if record is None else dict(record)}


def write_shipped_block(block: DraftBlock, model: PreTrainedModel, out: str | Path, *,
                        model_name: str, record: Mapping[str, Any], head: MTPHead | None = None,
                        head_record: Mapping[str, Any] | None = None,
                        draft_steps: int | None = None) -> ShippedHead:
    """Write ``block`` (and ``head``, a circuit head on its outputs) as a shipped drafter in
    ``out``: the block's files and the head's (float16, :data:`SHIPPED_STORAGE`), then
    ``shipped.json`` with every file's checksum.

    Args:
        block: a draft block built on ``model``.
        model: the model it drafts for (its identity is recorded).
        model_name: the ``--model`` name it serves (e.g. ``smollm2``).
        record: the ``train-head --draft-block`` run's record (``training.json``).
        head: a circuit head that reads the block's outputs (of a registered kind), or None.
        head_record: how ``head`` was trained (any JSON object), kept in the manifest.
        draft_steps: without ``head``, the recursive drafts per round the shipped drafter takes by
            default (``None``: the block's trained depth): the weights are shared across steps,
            and the depth that decodes fastest can exceed the trained one (docs/results.md).

    Raises:
        ShippedHeadError: a head of no registered kind or that cannot read the block, ``out``
            holds something else, the directory would exceed 20 MB, or ``draft_steps`` is given
            with a head or is not a positive integer.
    """
    out = Path(out)
    if draft_steps is not None and head is not None:
        raise ShippedHeadError("draft_steps sets the recursion's depth; a circuit head on the "
                               "block drafts its own window in one pass: leave it out")
    if head is not None:
        if head.architecture is None:
            raise ShippedHeadError("only heads of a registered kind are shipped; this one has a "
                                   "custom circuit")
        try:
            check_block_head(block, head)
        except DraftBlockError as error:
            raise ShippedHeadError(f"the circuit head cannot read the block: {error}") from None
    layout = ShippedLayout.BLOCK if head is None else ShippedLayout.BLOCK_HEAD
    check_draft_steps(draft_steps, layout)  # before anything is written
    prepare_shipped_dir(out, layout)
    save_draft_block(block, out, model, storage_dtype=SHIPPED_STORAGE)
    parameters = sum(p.numel() for p in block.parameters())
    summary = None
    if head is not None:
        save_head(head, out, storage_dtype=SHIPPED_STORAGE)
        summary = _head_summary(head, head_record)
        parameters += summary["parameters"]
    return write_shipped_manifest(
        out, layout, kind=block_kind(None if head is None else head.architecture),
        model_name=model_name, model_identity=backbone_identity(model), record=record,
        parameters=parameters, head=summary, draft_steps=draft_steps)


def _circuit_head(source: Path, model: PreTrainedModel, head_record: Path | None
                  ) -> tuple[MTPHead, dict[str, Any] | None]:
    """The circuit head of ``--circuit-head`` (a ``save_head`` directory, or a run directory
    with ``head/``) and its record (``--head-record``, else the run's ``training.json``)."""
    from circuits_llm.training.results import HEAD_DIR, RECORD_FILE
    directory = source if (source / CONFIG_FILE).is_file() else source / HEAD_DIR
    config = model.config
    try:
        head = load_head(directory, config.hidden_size, config.vocab_size)
    except HeadConfigError as error:
        raise ShippedHeadError(f"cannot ship the circuit head {source}: {error}") from None
    path = head_record if head_record is not None else source / RECORD_FILE
    if head_record is None and not path.is_file():
        return head, None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ShippedHeadError(f"cannot read the circuit head's record {path} ({error})") from None
    if not isinstance(record, dict):
        raise ShippedHeadError(f"the circuit head's record {path} must be a JSON object")
    return head, record


def _check_trained_on(record: Mapping[str, Any] | None, run_dir: Path) -> None:
    """Refuse a circuit head whose record says it was trained on another block than the run's
    (its ``on_block``: inside ``run_dir``, or a block directory with the same tensors)."""
    config = (record or {}).get("config")
    source = config.get("on_block") if isinstance(config, dict) else None
    if not source:
        return  # a head with no record of its block: nothing to check against
    source = Path(source).resolve()
    run = run_dir.resolve()
    if source == run or run in source.parents:
        return
    theirs = source / BLOCK_FILES[0] if (source / BLOCK_FILES[0]).is_file() else \
        source / BLOCK_DIR / BLOCK_FILES[0]
    if not theirs.is_file():
        return  # trained on a block that is not on this machine
    ours = run_dir / BLOCK_DIR / BLOCK_FILES[0]
    try:
        same = json.loads(theirs.read_text())["tensors_sha256"] == \
            json.loads(ours.read_text())["tensors_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        same = False
    if not same:
        raise ShippedHeadError(f"the circuit head was trained on the block in {source}, not on "
                               f"{run_dir}'s; ship it with the block it was trained on")


def ship_block(run_dir: Path, out: Path, model_name: str, *, circuit_head: Path | None = None,
               head_record: Path | None = None, model: PreTrainedModel | None = None,
               draft_steps: int | None = None) -> ShippedHead:
    """Write the block of a finished ``train-head --draft-block`` run (and, with
    ``circuit_head``, a circuit head trained on it) as a shipped drafter in ``out``.

    Args:
        run_dir: the block's run directory (``training.json``, ``block/``).
        model_name: the ``--model`` name it serves; the model is loaded by it unless ``model``
            is given.
        circuit_head: a ``save_head`` directory (or a run directory with ``head/``).
        head_record: a JSON file saying how the circuit head was trained (default: the run
            directory's ``training.json`` when ``circuit_head`` is one).
        draft_steps: the recursive drafts per round of the shipped drafter by default
            (:func:`write_shipped_block`).

    Raises:
        ShippedHeadError: the run is not a draft-block run, or what :func:`write_shipped_block`
            raises.
        circuits_llm.runtime.checkpoint.CheckpointError: the run's files are missing or corrupt,
            or its block was trained for another model.
    """
    from circuits_llm.text.models import load_model
    from circuits_llm.training import read_record
    from circuits_llm.training.block_trainer import load_trained_block
    run_dir, out = Path(run_dir), Path(out)
    record = read_record(run_dir)
    if not record["config"].get("draft_block"):
        raise ShippedHeadError(f"cannot ship {run_dir} as a draft block: it trained a circuit "
                               "head (ship it without --circuit-head)")
    _identity(record, run_dir)
    model = load_model(model_name).model if model is None else model
    block = load_trained_block(run_dir, model)
    head, trained = (None, None) if circuit_head is None else \
        _circuit_head(Path(circuit_head), model, head_record)
    _check_trained_on(trained, run_dir)
    return write_shipped_block(block, model, out, model_name=model_name, record=record,
                               head=head, head_record=trained, draft_steps=draft_steps)


def ship_run(run_dir: Path, out: Path, model_name: str, *, circuit_head: Path | None = None,
             head_record: Path | None = None, draft_steps: int | None = None) -> ShippedHead:
    """:func:`ship_block` for a draft-block run, else :func:`ship_head`."""
    from circuits_llm.training import read_record
    if read_record(run_dir)["config"].get("draft_block"):
        return ship_block(run_dir, out, model_name, circuit_head=circuit_head,
                          head_record=head_record, draft_steps=draft_steps)
    if circuit_head is not None or head_record is not None or draft_steps is not None:
        raise ShippedHeadError(f"--circuit-head, --head-record and --draft-steps go with a "
                               f"draft-block run; {run_dir} trained a circuit head")
    return ship_head(run_dir, out, model_name)


# ---------------------------------------------------------------------------- reading
def load_shipped_drafter(shipped: ShippedHead, model: PreTrainedModel,
                         steps: int | None = None,
                         weights: DraftWeights = DraftWeights.AUTO,
                         precision: Precision | None = None, *,
                         stop_when_unsure: bool = True) -> ShippedDrafter:
    """The drafter of a shipped ``block`` or ``block_head`` directory, on ``model`` (the model
    it was trained for; its device), every file verified first.

    A recursive block drafts ``steps`` per round (``None``: the manifest's ``draft_steps``, the
    depth measured fastest when it was shipped, else the block's trained depth; with the resolved
    ``precision`` the decoders run in, that depth as
    :func:`~circuits_llm.app.verify_packing.recursive_depths` sets it for greedy and sampled
    rounds). With ``stop_when_unsure`` on a CPU its rounds, greedy and sampled, stop drafting
    after an unsure draft (:data:`~circuits_llm.app.verify_packing.CPU_GREEDY_EXIT`,
    :data:`~circuits_llm.app.verify_packing.CPU_SAMPLED_EXIT`; exact either way); pass False for
    a compiled backbone, which would otherwise compile every verify length. The drafter holds
    the block's projections as ``weights`` says
    (:class:`~circuits_llm.draft_block.weights.DraftWeights`).

    Raises:
        ShippedHeadError: a directory that ships no block, damaged files (reinstall), or
            ``steps`` for a circuit head on a block (whose head drafts its own window) or not a
            positive integer.
    """
    if not shipped.layout.has_block:
        raise ShippedHeadError(f"the shipped {shipped.name} is a circuit head, not a draft "
                               "block; load it with circuits_llm.shipped_head")
    shipped.verify()
    try:
        block = load_draft_block(shipped.directory, model)
    except DraftBlockError as error:
        raise ShippedHeadError(f"the shipped draft block {shipped.name} cannot be loaded "
                               f"({error}); reinstall circuits-llm") from None
    if shipped.layout is ShippedLayout.BLOCK:
        sampled = greedy_exit = sampled_exit = None
        if steps is None:
            steps = shipped.manifest.get("draft_steps") or block.steps
            if precision is not None:
                steps, sampled = recursive_depths(precision, int(steps))
        if stop_when_unsure and model.device.type == "cpu":
            greedy_exit, sampled_exit = CPU_GREEDY_EXIT, CPU_SAMPLED_EXIT
        try:
            return BlockDrafter(block, steps, weights=weights, sampled_steps=sampled,
                                greedy_exit=greedy_exit, sampled_exit=sampled_exit)
        except DraftBlockError as error:
            raise ShippedHeadError(str(error)) from None
    if steps is not None:
        raise ShippedHeadError(f"steps sets a recursive block's depth; the shipped {shipped.name} "
                               f"is a circuit head on a block, which drafts its window of "
                               f"{shipped.manifest['head']['window']} in one pass: leave it out")
    head = shipped.load(block.device)
    try:
        return BlockCircuitDrafter(block, head, weights=weights)
    except DraftBlockError as error:
        raise ShippedHeadError(f"the shipped {shipped.name}'s head cannot read its block "
                               f"({error}); reinstall circuits-llm") from None


# ---------------------------------------------------------------------------- finding
def find_shipped_drafter(model: Any, kind: str, root: Path | None = None) -> ShippedHead | None:
    """The shipped draft block of ``kind`` (``block``, ``btree-block``...) trained for
    ``model`` (a :class:`LoadedModel` or Hugging Face model, matched by its identity), or None."""
    identity, kind = backbone_identity(_hf_model(model)), str(kind).lower()
    return next((found for found in shipped_heads(root, BLOCK_LAYOUTS)
                 if found.kind == kind and found.trained_for(identity)), None)


def no_drafter_message(kind: str, model: str, root: Path | None = None) -> str:
    """The one message for a model without a shipped ``kind`` draft block: what ships, and how
    to train and ship one."""
    served = sorted({f"{h.kind} for {h.model_name}" for h in shipped_heads(root, BLOCK_LAYOUTS)})
    shipped = f"the shipped draft blocks are {', '.join(served)}" if served else \
        "no draft block is shipped"
    ship = "circuits-llm ship"
    if kind == BLOCK_KIND:
        return (f"no shipped {kind} draft block for this model ({shipped}); train one with "
                f"`circuits-llm train-head --model {model} --draft-block --run-dir DIR` "
                "(scripts/train_draft_block.sh), then decode with SpeculativeDecoder(model, "
                f"BlockDrafter(load_trained_block(DIR, model))), or ship it with `{ship} DIR "
                f"--name NAME --model {model}`")
    head = kind.removesuffix(f"-{BLOCK_KIND}")
    return (f"no shipped {kind} draft block for this model ({shipped}); train a block with "
            f"`circuits-llm train-head --model {model} --draft-block --run-dir BLOCK_RUN`, a "
            f"{head} head on it with `circuits-llm train-head --model {model} --arch {head} "
            f"--on-block BLOCK_RUN --run-dir HEAD_RUN`, then ship both with `{ship} BLOCK_RUN "
            f"--circuit-head HEAD_RUN --name NAME --model {model}`")


def shipped_drafter(model: str | Path | Any, kind: str = "block", *,
                    root: Path | None = None, steps: int | None = None,
                    weights: DraftWeights = DraftWeights.AUTO,
                    stop_when_unsure: bool = True) -> ShippedDrafter:
    """The package's shipped draft block of ``kind`` for ``model``, as the drafter
    :class:`~circuits_llm.decoding.decoder.SpeculativeDecoder` takes in place of a head::

        loaded = circuits_llm.load_model("smollm2")
        drafter = circuits_llm.shipped_drafter(loaded, "btree-block")
        circuits_llm.SpeculativeDecoder(loaded.model, drafter).generate(ids, 64)

    Args:
        model: a :class:`~circuits_llm.text.models.LoadedModel` or Hugging Face model (matched
            by its identity; the block is built on it, on its device), or a name
            :func:`~circuits_llm.text.models.load_model` reads (``"smollm2"``: checked before
            anything is loaded; the model is then loaded for the block, so pass the model you
            decode with to hold one copy).
        kind: ``block`` (recursive drafting, FastMTP) or ``<head kind>-block`` (a circuit head
            on the block's output, e.g. ``btree-block``).
        root: the shipped-heads directory (default: the package's).
        steps: ``block`` only: recursive drafts per round (default: what the block shipped with,
            :func:`load_shipped_drafter`).
        weights: how the drafter holds the block's projections
            (:class:`~circuits_llm.draft_block.weights.DraftWeights`; default: int8 on a CPU).
        stop_when_unsure: on a CPU, a recursive block's rounds stop drafting after a draft it
            gives its argmax less than 30% (exact; chat 1.05x -> 1.15x plain decoding greedy
            and 1.02x -> 1.14x at T = 1 in float32, journal section 21). False for a backbone
            you compile yourself, which would otherwise meet verify blocks of every length.

    Raises:
        NoHeadError: no such block ships for this model (the message says how to train one).
        ShippedHeadError: its files are damaged (reinstall), or ``steps`` does not fit the kind.
    """
    kind = str(kind).lower()
    if isinstance(model, (str, Path)):
        named = [h for h in shipped_heads(root, BLOCK_LAYOUTS) if h.model_name == str(model)]
        if named and not any(h.kind == kind for h in named):
            raise NoHeadError(no_drafter_message(kind, str(model), root))
        from circuits_llm.text.models import load_model
        model = load_model(model)
    found = find_shipped_drafter(model, kind, root)
    if found is None:
        name = model.source if isinstance(model, LoadedModel) else "MODEL"
        raise NoHeadError(no_drafter_message(kind, name, root))
    return load_shipped_drafter(found, _hf_model(model), steps, weights,
                                stop_when_unsure=stop_when_unsure)
