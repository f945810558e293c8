"""Saving and loading a draft block (circuits_llm.draft_block.io): the block's own tensors round
trip (decoding with the loaded block is the saved one's, and ``model.generate``'s), float16
storage, and every corrupt, foreign or mismatched file refused with one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draft_block_models import perturbed_block, tiny_llama
from safetensors.torch import load_file, save_file

from circuits.files import sha256_file
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.draft_block import BlockDrafter, BlockInit, DraftBlock
from circuits_llm.draft_block.io import (
    BLOCK_CONFIG_FILE,
    BLOCK_TENSORS_FILE,
    DraftBlockFileError,
    block_tensors,
    load_draft_block,
    read_block_config,
    save_draft_block,
)

MODEL = tiny_llama(scale=8.0)
VOCAB = list(range(0, 48, 2))
PROMPTS = [([1, 5, 7, 9, 3], 15), ([4, 2, 2], 9)]


def _decode(block: DraftBlock) -> list[list[int]]:
    decoder = SpeculativeDecoder(MODEL, BlockDrafter(block))
    return [decoder.generate(prompt, count, eos_token_id=()).tokens.tolist()
            for prompt, count in PROMPTS]


def _generate() -> list[list[int]]:
    return [MODEL.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=count,
                           pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
            for prompt, count in PROMPTS]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[DraftBlock, Path]:
    block = perturbed_block(MODEL, layers=2, draft_vocab=VOCAB)
    return block, save_draft_block(block, tmp_path / "block", MODEL)


def test_round_trip_keeps_every_tensor_and_decodes_alike(saved: tuple[DraftBlock, Path]) -> None:
    block, directory = saved
    assert sorted(p.name for p in directory.iterdir()) == [BLOCK_TENSORS_FILE, BLOCK_CONFIG_FILE]
    loaded = load_draft_block(directory, MODEL)
    assert not loaded.training and loaded.init is BlockInit.LAST_LAYER
    assert (loaded.steps, len(loaded.layers), loaded.draft_size) == (3, 2, len(VOCAB))
    mine, theirs = block_tensors(block), block_tensors(loaded)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[name], theirs[name]) for name in mine)
    # only the block's own weights are stored: nothing of the target's embedding or LM head
    stored = load_file(str(directory / BLOCK_TENSORS_FILE))
    assert not any(name.startswith("target") or "embed" in name or "lm_head" in name
                   for name in stored)
    assert sum(v.numel() for k, v in stored.items() if k != "draft_tokens") == \
        sum(p.numel() for p in block.parameters())
    assert _decode(loaded) == _decode(block) == _generate()
    record = read_block_config(directory)
    assert record["format_version"] == 1 and record["draft_vocab_size"] == len(VOCAB)


def test_float16_storage_halves_the_file_and_stays_exact(tmp_path: Path) -> None:
    block = perturbed_block(MODEL, steps=2, draft_vocab=None)
    wide = save_draft_block(block, tmp_path / "wide", MODEL)
    narrow = save_draft_block(block, tmp_path / "narrow", MODEL, storage_dtype=torch.float16)
    assert (narrow / BLOCK_TENSORS_FILE).stat().st_size < \
        0.3 * (wide / BLOCK_TENSORS_FILE).stat().st_size  # float64 -> float16
    loaded = load_draft_block(narrow, MODEL)
    assert loaded.fuse.weight.dtype == torch.float64 and loaded.draft_tokens is None
    torch.testing.assert_close(loaded.fuse.weight, block.fuse.weight.half().double())
    assert _decode(loaded) == _generate()  # the decoder's law is exact for any block
    with pytest.raises(DraftBlockFileError, match="storage_dtype must be"):
        save_draft_block(block, tmp_path / "bad", MODEL, storage_dtype=torch.int8)


def _rewrite_config(directory: Path, **changes: object) -> None:
    path = directory / BLOCK_CONFIG_FILE
    values = json.loads(path.read_text())
    values.update(changes)
    path.write_text(json.dumps(values))


def _rewrite_tensors(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the tensor file and record its checksum (a consistent but wrong pair)."""
    save_file(tensors, str(directory / BLOCK_TENSORS_FILE))
    _rewrite_config(directory, tensors_sha256=sha256_file(directory / BLOCK_TENSORS_FILE))


def test_corrupt_and_mismatched_files_are_clear_errors(saved: tuple[DraftBlock, Path]) -> None:
    _, directory = saved
    tensors = load_file(str(directory / BLOCK_TENSORS_FILE))
    config = (directory / BLOCK_CONFIG_FILE).read_text()
    original = (directory / BLOCK_TENSORS_FILE).read_bytes()

    def refused(match: str) -> None:
        with pytest.raises(DraftBlockFileError, match=match):
            load_draft_block(directory, MODEL)
        (directory / BLOCK_CONFIG_FILE).write_text(config)
        (directory / BLOCK_TENSORS_FILE).write_bytes(original)

    data = bytearray((directory / BLOCK_TENSORS_FILE).read_bytes())
    data[-3] ^= 0xFF
    (directory / BLOCK_TENSORS_FILE).write_bytes(bytes(data))
    refused("does not match the checksum")
    (directory / BLOCK_CONFIG_FILE).write_text(config[:40])
    refused("cannot be read as JSON")
    _rewrite_config(directory, format_version=99)
    refused("format version 99.*reads version 1")
    _rewrite_config(directory, format="something else")
    refused("is not a draft block config")
    _rewrite_config(directory, layers=0)
    refused(r"\['layers'\] must be ints >= 1")
    _rewrite_config(directory, init="random")
    refused("unknown init 'random'")
    _rewrite_config(directory, extra=1)
    refused(r"unknown keys \['extra'\]")
    _rewrite_tensors(directory, {**tensors, "surplus": torch.zeros(2, dtype=torch.float64)})
    refused(r"unexpected tensors \['surplus'\]")
    _rewrite_tensors(directory, {**tensors, "fuse.weight": torch.zeros(3, 3, dtype=torch.float64)})
    refused(r"wrong shapes \['fuse.weight'\]")
    _rewrite_tensors(directory, {**tensors, "draft_tokens": torch.arange(len(VOCAB))})
    refused("draft vocabulary does not match")
    _rewrite_tensors(directory, {k: v for k, v in tensors.items() if k != "draft_tokens"})
    refused("lacks draft_tokens")
    _rewrite_config(directory, storage_dtype="float16")
    refused("are not float16 as the config records")
    (directory / BLOCK_TENSORS_FILE).unlink()
    refused(f"{BLOCK_TENSORS_FILE} does not exist")
    assert load_draft_block(directory, MODEL).draft_size == len(VOCAB)  # restored: it loads


def test_a_block_for_another_model_is_refused(saved: tuple[DraftBlock, Path],
                                              tmp_path: Path) -> None:
    block, directory = saved
    with pytest.raises(DraftBlockFileError, match="another configuration"):
        load_draft_block(directory, tiny_llama(vocab=64))
    with pytest.raises(DraftBlockFileError, match="other LM head weights"):
        load_draft_block(directory, tiny_llama(seed=5, scale=8.0))
    with pytest.raises(DraftBlockFileError, match="not built on this model"):
        save_draft_block(block, tmp_path / "other", tiny_llama(seed=5))
    with pytest.raises(DraftBlockFileError, match="does not exist"):
        load_draft_block(tmp_path / "nowhere", MODEL)
