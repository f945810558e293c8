"""What ``circuits-llm generate --head NAME`` decodes with: the autoregressive decoder, a circuit
head (a head kind, a saved head or a ``train-head`` run) or a draft block (issue 44).

``--head`` reads:

* ``ar`` / ``none``: plain autoregressive decoding;
* a head kind (``ff``, ``btree``...): the head the user trained for the model into the head cache,
  else the package's shipped head (:func:`~circuits_llm.app.head_cache.find_head`);
* ``block`` / ``<kind>-block`` (``btree-block``): the package's shipped draft block for the model
  (:func:`~circuits_llm.app.head_cache.find_shipped_drafter`): recursive drafting (FastMTP), or a
  circuit head on the block's output; one :class:`~circuits_llm.app.head_cache.NoHeadError` when
  none ships for the model;
* a directory: a saved head (``save_head``), a shipped directory (head or block), a
  ``train-head`` run (a head's, or a ``--draft-block`` run's block), or a ``save_draft_block``
  directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from circuits_llm.app.demo import ComparisonConfig, DemoError, training_config
from circuits_llm.app.head_cache import (
    NoHeadError,
    find_head,
    find_shipped_drafter,
    no_drafter_message,
)
from circuits_llm.app.shipping import ShippedDrafter, load_shipped_drafter
from circuits_llm.app.verify_packing import Precision, decode_model, pack_for_verify_blocks
from circuits_llm.backbone.row_invariant import priced_rows
from circuits_llm.draft_block import BatchDepth, DraftWeights
from circuits_llm.heads.shipped import (
    BLOCK_FILES,
    SHIPPED_MANIFEST,
    ShippedHeadError,
    is_block_kind,
    read_shipped_head,
)

__all__ = ["AUTOREGRESSIVE_NAMES", "block_drafter", "decoder_for"]

#: ``--head`` values that mean plain autoregressive decoding.
AUTOREGRESSIVE_NAMES = ("ar", "none")


def block_drafter(head: str, loaded: Any, model_name: str = "MODEL", steps: int | None = None,
                  weights: DraftWeights = DraftWeights.AUTO, precision: Precision | None = None,
                  stop_when_unsure: bool = True) -> tuple[ShippedDrafter, str] | None:
    """The draft block ``--head`` names, as the drafter the decoder takes, and where it came
    from; None when ``head`` names no block (a head kind, ``ar``, a head's directory). A
    recursive block drafts ``steps`` a round (``None``: its shipped or trained depth, a shipped
    one's as :func:`~circuits_llm.app.verify_packing.recursive_depths` sets it for the resolved
    ``precision``; a shipped one's rounds stop after an unsure draft on a CPU with
    ``stop_when_unsure``, False for a compiled backbone); the drafter holds the block's
    projections as ``weights`` says.

    Raises:
        NoHeadError: a block kind that no shipped block of the model has.
        ShippedHeadError: a shipped block for another model, or damaged (reinstall).
        DemoError: a block directory that cannot be read, or ``steps`` that the block refuses
            (the message says why).
        circuits_llm.runtime.checkpoint.CheckpointError: a run directory's files are damaged.
    """
    from circuits_llm.draft_block import BlockDrafter, DraftBlockError, load_draft_block
    from circuits_llm.text.models import backbone_identity
    from circuits_llm.training.block_trainer import load_trained_block
    from circuits_llm.training.results import RECORD_FILE, read_record
    path = Path(head)
    if is_block_kind(head) and not path.is_dir():
        found = find_shipped_drafter(loaded, head.lower())
        if found is None:
            raise NoHeadError(no_drafter_message(head.lower(), model_name))
        return load_shipped_drafter(found, loaded.model, steps, weights, precision,
                                    stop_when_unsure=stop_when_unsure), \
            f"shipped {found.kind} {found.name}"
    if (path / SHIPPED_MANIFEST).is_file():
        shipped = read_shipped_head(path)
        if not shipped.layout.has_block:
            return None
        if not shipped.trained_for(backbone_identity(loaded.model)):
            raise ShippedHeadError(f"the draft block in {path} serves {shipped.model_name}, "
                                   "another model than this one; give its --model")
        return load_shipped_drafter(shipped, loaded.model, steps, weights,
                                    stop_when_unsure=stop_when_unsure), str(path)
    try:
        if (path / RECORD_FILE).is_file() and read_record(path)["config"].get("draft_block"):
            return BlockDrafter(load_trained_block(path, loaded.model), steps,
                                weights=weights), str(path)
        if (path / BLOCK_FILES[0]).is_file():  # a save_draft_block directory
            return BlockDrafter(load_draft_block(path, loaded.model), steps,
                                weights=weights), str(path)
    except DraftBlockError as error:
        raise DemoError(f"--head {head}: {error}") from None
    return None


def _model_for(loaded: Any, precision: Precision, packed: bool, window: int) -> Any:
    """The model the decoder's backbone wraps: a row-invariant bfloat16 copy
    (:func:`~circuits_llm.app.verify_packing.decode_model`; ``precision`` already resolved), or
    the loaded model, its linear weights packed for verify blocks of ``window`` with ``packed``
    (a CPU)."""
    device = loaded.model.device
    if precision is Precision.BFLOAT16:
        return decode_model(loaded.model, precision, window, device)[0]
    if packed:
        pack_for_verify_blocks(loaded.model, window, device)
    return loaded.model


def _with_backbone(head: Any, loaded: Any, compile: bool, packed: bool,
                   precision: Precision) -> tuple[Any, Any]:
    """``head`` in eval mode and a backbone (without LoRA layers) on :func:`_model_for`'s model."""
    from circuits_llm.backbone import HFBackbone
    model = _model_for(loaded, precision, packed, head.window)
    lengths = sorted({1, head.window}) if compile else None
    return head.eval(), HFBackbone(model, compile=compile, compiled_lengths=lengths)


def _load_named_head(head: str, loaded: Any, cache: Path, model_name: str, compile: bool,
                     packed: bool, precision: Precision, explicit: bool = False
                     ) -> tuple[Any, Any, str]:
    """The head ``--head`` names, its backbone, and where it came from: a head kind (one the user
    trained into ``cache`` for this model, else the package's shipped head:
    :func:`~circuits_llm.app.head_cache.find_head`), a saved head's directory (``save_head``'s
    files, a shipped head's included) or a ``train-head`` run directory (which decodes on its own
    float32 backbone; an error when bfloat16 was asked for ``explicit``-ly)."""
    from circuits_llm.heads import head_kind_names, load_head
    from circuits_llm.heads.io import CONFIG_FILE
    from circuits_llm.text.models import config_fingerprint
    from circuits_llm.training import load_trained_head
    run_dir, device = Path(head), loaded.model.device
    if head.lower() in head_kind_names():
        preferred = [training_config(ComparisonConfig.demo(quick), head.lower())
                     for quick in (False, True)]
        found = find_head(loaded, head.lower(), cache, preferred, model_name)
        if found.shipped is not None:
            return *_with_backbone(found.shipped.load(device), loaded, compile, packed,
                                   precision), \
                found.describe()
        assert found.run_dir is not None
        run_dir = found.run_dir
    elif not run_dir.is_dir():
        raise DemoError(f"--head {head}: expected a head kind ({', '.join(head_kind_names())}), "
                        f"a draft block (block, <kind>-block), {', '.join(AUTOREGRESSIVE_NAMES)}, "
                        "or a directory of a trained head or block")
    elif (run_dir / CONFIG_FILE).is_file():  # a saved (or shipped) head
        config = loaded.model.config
        saved = load_head(run_dir, config.hidden_size, config.vocab_size, device=device,
                          expected_fingerprint=config_fingerprint(loaded.model))
        return *_with_backbone(saved, loaded, compile, packed, precision), str(run_dir)
    if precision is Precision.BFLOAT16 and explicit:  # a run builds its own (LoRA) backbone
        raise DemoError(f"--head {head}: a train-head run decodes on its own float32 backbone; "
                        "give --precision float32, or save the head (save_head) and give its "
                        "directory")
    if packed:  # a train-head run
        from circuits_llm.training.results import RECORD_FILE, read_record, record_config
        window = record_config(read_record(run_dir), run_dir / RECORD_FILE).window
        pack_for_verify_blocks(loaded.model, window, device)
    return *load_trained_head(run_dir, loaded.model, compile=compile), str(run_dir)


def decoder_for(head: str, loaded: Any, cache: Path, compile: bool = False,
                 lookup: tuple[float, ...] = (), packed: bool = False,
                 walk: float = 0.0, model_name: str = "MODEL", draft_steps: int | None = None,
                 batch_depth: BatchDepth | None = None,
                 draft_weights: DraftWeights = DraftWeights.AUTO,
                 precision: Precision = Precision.FLOAT32) -> tuple[Any, str]:
    """The decoder ``--head`` names (compiled alike on both sides with ``compile``; mixing a copy
    of the context into the drafts with ``lookup``'s weights, and under a constraint its walk
    with weight ``walk``; a speculative decoder on a CPU with ``packed``: the model's linear
    weights packed for its verify blocks; a recursive draft block drafting ``draft_steps`` a
    round, ``None``: its own depth, and in a batch as ``batch_depth`` says, a
    :class:`~circuits_llm.draft_block.BatchDepth`; a draft block's projections held as
    ``draft_weights`` says, :class:`~circuits_llm.draft_block.DraftWeights`; the backbone on the
    model in ``precision``, :class:`~circuits_llm.app.verify_packing.Precision`), and a
    description of it.

    Raises:
        DemoError: a bad combination of options, named with what to do instead.
    """
    from circuits_llm.backbone import HFBackbone
    from circuits_llm.decoding.backbones import drafter_backbone
    from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
    try:
        chosen = precision.resolve(loaded.model.device, compile=compile)
    except ValueError as error:
        raise DemoError(str(error)) from None
    if head.lower() in AUTOREGRESSIVE_NAMES:
        if lookup:
            raise DemoError("--lookup mixes a copy of the context into a head's drafts: choose a "
                            "--head other than ar, or leave --lookup out")
        model = _model_for(loaded, chosen, False, 1)
        return AutoregressiveDecoder(HFBackbone(model, compile=compile)), "autoregressive"
    # a compiled backbone drafts without exits, which would make it compile every verify length
    found = block_drafter(head, loaded, model_name, draft_steps, draft_weights, chosen,
                          stop_when_unsure=not compile)
    drafter: Any
    if found is None and draft_steps is not None:
        raise DemoError(f"--draft-steps sets a recursive draft block's depth; --head {head} is "
                        f"not a draft block: give --head block (or a block's directory), or "
                        f"leave --draft-steps out")
    if found is None and draft_weights is not DraftWeights.AUTO:
        raise DemoError(f"--draft-weights sets how a draft block's projections are held; --head "
                        f"{head} is not a draft block: give --head block (or a block's "
                        f"directory), or leave --draft-weights out")
    if found is not None:  # a draft block: its drafter takes the head's place
        drafter, where = found
        if drafter.weights is DraftWeights.INT8:
            where += "; projections in int8"
        model = _model_for(loaded, chosen, packed, drafter.window)
        rows = priced_rows(model)
        if batch_depth is not None and rows is not None:  # bfloat16: verify calls sized by their price
            batch_depth = BatchDepth.within(rows, getattr(drafter, "batch_most",
                                                          drafter.window - 1))
        if batch_depth is not None and hasattr(drafter, "batch_depth"):  # a recursive block
            drafter.batch_depth = batch_depth
            where += f"; in a batch {batch_depth.describe()}"
        backbone = drafter_backbone(model, drafter, compile=compile, compiled_lengths=sorted(
            {1, drafter.window}) if compile else None)
    else:
        mtp_head, backbone, where = _load_named_head(head, loaded, cache, model_name, compile,
                                                     packed, chosen,
                                                     precision is Precision.BFLOAT16)
        drafter = mtp_head.eval()
    from circuits_llm.decoding.lookup import ContextLookup
    # a weight of 0 never copies: the walk alone when only it is asked for
    copy = ContextLookup(lookup or (0.0,), constraint_weight=walk) if lookup or walk else None
    return (SpeculativeDecoder(backbone, drafter, compile=compile, lookup=copy),
            f"speculative ({where}{', ' + copy.describe() if copy else ''})")
