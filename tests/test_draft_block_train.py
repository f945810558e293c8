"""``train-head --draft-block`` (circuits_llm.training.block_trainer): the block trains in the
head-training loop on cached features towards the target's own law, lowers the validation loss,
resumes exactly, exports a block that decodes greedy like ``model.generate``, and the loss rows
are aligned with the law of the token after next."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_run_safety import assert_same_training, cli
from test_run_safety_processes import saved_step, wait_for
from test_training import config, make_corpus, tiny_llama, train

from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.draft_block import BlockDrafter, BlockInit, DraftBlock
from circuits_llm.draft_block.training import depth_outputs
from circuits_llm.runtime.checkpoint import load_checkpoint
from circuits_llm.training import (
    CHECKPOINT_FILE,
    CheckpointError,
    TrainingConfigError,
    load_trained_head,
    read_record,
)
from circuits_llm.training import features as feats
from circuits_llm.training.block_trainer import BLOCK_DIR, BlockDraftModel, load_trained_block
from circuits_llm.training.cli import add_train_head_command, config_from_args
from circuits_llm.training.teacher import LanguageModelTeacher

#: a block run on the tiny byte Llama: 3 depths, cached features of a capped corpus
BLOCK = {"draft_block": True, "target_law": "model", "cache_features": "on",
         "max_train_bytes": 1500, "learning_rate": 3e-3, "steps": 8, "eval_every": 4}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(autouse=True)
def _private_feature_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(feats.FEATURE_CACHE_ENV, str(tmp_path / "feature-cache"))


def _greedy_like_generate(model: torch.nn.Module, block: DraftBlock) -> None:
    prompt = [256, *b"def f(x):\n    return"]
    expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20,
                              pad_token_id=258, eos_token_id=None)[0, len(prompt):]
    result = SpeculativeDecoder(model, BlockDrafter(block)).generate(prompt, 20, eos_token_id=())
    assert result.tokens.tolist() == expected.tolist()


def test_command_trains_a_block_that_decodes_like_generate(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from circuits_llm.app.cli import main
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    run = tmp_path / "run"
    argv = cli(model_dir, run, corpus, "--draft-block", "--target-law", "model",
               "--teacher-top-k", "8", "--cache-features", "--max-train-bytes", "1500",
               "--lr", "0.003", "--steps", "12", "--eval-every", "6", "--block-init",
               "last_layer")
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 12 and summary["finished"]
    assert len(summary["validation_bits_per_position"]) == 3  # one loss per depth
    record = read_record(run)
    assert record["config"]["draft_block"] and record["config"]["block_init"] == "last_layer"
    assert record["validation"]["loss"] < record["initial_validation"]["loss"]
    assert all(after < before for before, after in zip(
        record["initial_validation"]["nll"], record["validation"]["nll"], strict=True))
    assert len(record["feature_cache"]) == 2 and record["block_parameters"] > 0
    model = tiny_llama()
    block = load_trained_block(run, model)
    assert block.init is BlockInit.LAST_LAYER and block.steps == 3
    trained = load_checkpoint(run / CHECKPOINT_FILE, "circuits_llm.train_head")["head"]
    assert trained.keys() == block.state_dict().keys()
    assert all(torch.equal(value, trained[name]) for name, value in block.state_dict().items())
    _greedy_like_generate(model, block)
    with pytest.raises(CheckpointError, match="another model"):
        load_trained_block(run, tiny_llama(seed=3))
    with pytest.raises(CheckpointError, match="load_trained_block"):
        load_trained_head(run, model)


@pytest.mark.filterwarnings("ignore::circuits_llm.heads.sizing.HeadBudgetWarning")
def test_interrupted_then_resumed_equals_uninterrupted(tmp_path: Path, corpus: Path) -> None:
    cfg = config(**BLOCK)
    whole = train(tmp_path / "whole", corpus, cfg)
    first = train(tmp_path / "split", corpus, cfg, max_steps=3)
    assert not first.finished and first.step == 3
    second = train(tmp_path / "split", corpus, cfg)
    assert second.finished and second.session_steps == 5
    a = load_checkpoint(tmp_path / "whole" / CHECKPOINT_FILE, "circuits_llm.train_head")
    b = load_checkpoint(tmp_path / "split" / CHECKPOINT_FILE, "circuits_llm.train_head")
    assert a["head"].keys() == b["head"].keys() and len(a["head"]) > 0
    for name, value in a["head"].items():
        assert torch.equal(value, b["head"][name]), name
    assert torch.equal(a["data_generator"], b["data_generator"])
    assert whole.validation == second.validation and whole.train_loss == second.train_loss
    assert whole.validation.loss < whole.initial_validation.loss
    # a head run's directory is not resumed as a block run, and the other way round
    with pytest.raises(CheckpointError, match="draft_block"):
        train(tmp_path / "whole", corpus, dataclasses.replace(cfg, draft_block=False))


def test_live_steps_train_towards_the_tokens(tmp_path: Path, corpus: Path) -> None:
    cfg = config(**{**BLOCK, "cache_features": "off", "target_law": "tokens", "steps": 6,
                    "eval_every": 6, "learning_rate": 1e-2})
    result = train(tmp_path, corpus, cfg)
    assert result.validation.loss < result.initial_validation.loss
    assert read_record(tmp_path)["feature_cache"] == []
    assert (tmp_path / BLOCK_DIR / "block_config.json").is_file()


def test_a_run_starts_from_a_saved_block(tmp_path: Path, corpus: Path) -> None:
    """``init_from`` a run's ``block/``: the new run starts at the saved block's validation (its
    weights and draft vocabulary), whatever its own data would choose."""
    cfg = config(**{**BLOCK, "steps": 4, "draft_vocab": 64})
    first = train(tmp_path / "first", corpus, cfg)
    again = dataclasses.replace(cfg, init_from=str(tmp_path / "first" / BLOCK_DIR),
                                max_train_bytes=1200, learning_rate=1e-3)
    second = train(tmp_path / "second", corpus, again, max_steps=0)
    assert second.initial_validation.nll == first.validation.nll
    model = tiny_llama()
    a, b = load_trained_block(tmp_path / "first", model), load_trained_block(tmp_path / "second",
                                                                            model)
    assert torch.equal(a.draft_tokens, b.draft_tokens) and a.draft_size == 64
    with pytest.raises(TrainingConfigError, match="--block-layers 1"):
        train(tmp_path / "third", corpus, dataclasses.replace(again, block_layers=2))
    with pytest.raises(TrainingConfigError, match=r"init_from: .*does not exist"):
        train(tmp_path / "fourth", corpus, dataclasses.replace(again, init_from=str(tmp_path)))


def test_a_run_with_fused_layers_continues_a_block_without_them(tmp_path: Path,
                                                                corpus: Path) -> None:
    """``fused_layers`` (EAGLE-3): the cached features hold layer 0's output too (their own
    cache entry), a block without fused layers continues into one with them exactly where it
    stood (the same initial validation), training moves the fusion, the exported block keeps
    its layers, and it decodes greedy like ``model.generate``."""
    cfg = config(**{**BLOCK, "steps": 4, "draft_vocab": 64})
    first = train(tmp_path / "first", corpus, cfg)
    fused = dataclasses.replace(cfg, init_from=str(tmp_path / "first" / BLOCK_DIR),
                                fused_layers=(0,), steps=6)
    start = train(tmp_path / "start", corpus, fused, max_steps=0)
    assert start.initial_validation.nll == first.validation.nll
    second = train(tmp_path / "second", corpus, fused)
    assert second.validation.loss < second.initial_validation.loss
    optimizer = load_checkpoint(tmp_path / "second" / CHECKPOINT_FILE,
                                "circuits_llm.train_head")["optimizer"]
    assert [group["lr"] for group in optimizer["param_groups"]] == [
        fused.learning_rate, 10 * fused.learning_rate]  # the fusion's own, larger rate
    record = read_record(tmp_path / "second")
    assert record["config"]["fused_layers"] == [0]
    assert set(record["feature_cache"]).isdisjoint(read_record(tmp_path / "first")["feature_cache"])
    model = tiny_llama()
    block = load_trained_block(tmp_path / "second", model)
    assert block.fused_layers == (0,) and block.feature_size == 2 * block.hidden_size
    assert block.layer_fusion.project.weight.abs().sum() > 0
    _greedy_like_generate(model, block)
    with pytest.raises(TrainingConfigError, match="--fused-layers 0"):
        train(tmp_path / "third", corpus, dataclasses.replace(
            fused, init_from=str(tmp_path / "second" / BLOCK_DIR), fused_layers=()))


def test_self_distilled_rows_train_on_their_responses(tmp_path: Path, corpus: Path) -> None:
    """Self-distilled rows (features cached by default) score only the rows whose token read and
    target are both in the response: 8 of the 14 rows of a 16-token row with an 8-token prompt,
    at every depth."""
    cfg = config(draft_block=True, target_law="model", data="self-distilled", seq_len=16,
                 distill_prompt_len=8, distill_samples=6, eval_windows=2, steps=3, eval_every=3)
    result = train(tmp_path, corpus, cfg)
    assert result.finished and len(read_record(tmp_path)["feature_cache"]) == 2
    counts = result.validation.tokens
    assert len(counts) == 3 and len(set(counts)) == 1 and counts[0] > 0 and counts[0] % 8 == 0


def test_loss_rows_read_the_law_of_the_token_after_next() -> None:
    """Row j reads (h_j, x_{j+1}) and is scored on the model's law of x_{j+2} (its logits after
    x_{j+1}); cached features and a live forward give the same loss."""
    model = tiny_llama().double()
    backbone = HFBackbone(model)
    block = DraftBlock(model, steps=2)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, dtype=parameter.dtype))
    teacher = LanguageModelTeacher(model, None, top_k=260, temperature=1.0, weight=1.0)
    module = BlockDraftModel(backbone, block, gamma=0.5, depths=2, bf16=False, teacher=teacher)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :4] = False
    loss, sums, counts = module(ids, mask, None)
    _, hidden = backbone.hidden_states(ids)
    cached, cached_sums, _ = module(ids, mask, hidden)
    torch.testing.assert_close(cached, loss)
    torch.testing.assert_close(cached_sums, sums)
    law = torch.softmax(model(ids).logits.double(), -1)  # law[:, t]: of x_{t+1}
    expected = []
    for depth, output in enumerate(depth_outputs(block, hidden[:, :-2], ids[:, 1:-1], 2), 1):
        log_q = torch.log_softmax(block.logits(output).double(), -1)
        rows = -(law[:, 1:-1] * log_q).sum(-1)  # row j: the law of x_{j+2}
        valid = mask[:, 1:-1] & mask[:, 2:]
        valid[:, :depth - 1] = False
        expected.append((rows * valid).sum())
        assert int(counts[depth - 1]) == int(valid.sum())
    torch.testing.assert_close(sums, torch.stack(expected).to(sums.dtype))
    torch.testing.assert_close(loss, (expected[0] / counts[0] + 0.5 * expected[1] / counts[1])
                               .to(loss.dtype))


@pytest.mark.parametrize(("changes", "message"), [
    ({"lora_layers": 1}, "drop lora_layers"),
    ({"token_input": True}, "drop token_input"),
    ({"circuit_file": "c.json", "architecture": None}, "drop circuit_file"),
    ({"block_layers": 0}, "block_layers must be an int >= 1"),
    ({"block_init": "random"}, "unknown block_init 'random'"),
    ({"fused_layers": (0, 0)}, "fused_layers must be distinct layer indices"),
    ({"fused_layers": (-1,)}, "fused_layers must be distinct layer indices"),
    ({"fused_layers": "2"}, "fused_layers must be distinct layer indices"),
    ({"fused_layers": (1,), "fusion_learning_rate": 0.0}, "fusion_learning_rate must be"),
])
def test_bad_block_settings_are_clear_errors(changes: dict, message: str) -> None:
    with pytest.raises(TrainingConfigError, match=message):
        config(draft_block=True, **changes)


def test_flags_reach_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_train_head_command(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args([
        "train-head", "--run-dir", "r", "--draft-block", "--block-layers", "2",
        "--block-init", "last_layer", "--window", "5"]))
    assert cfg.draft_block and cfg.block_layers == 2 and cfg.block_init is BlockInit.LAST_LAYER
    default = config_from_args(parser.parse_args(["train-head", "--run-dir", "r"]))
    assert not default.draft_block and default.block_init is BlockInit.IDENTITY
    assert default.fused_layers == ()
    fused = config_from_args(parser.parse_args([
        "train-head", "--run-dir", "r", "--draft-block", "--fused-layers", "2,14,26"]))
    assert fused.fused_layers == (2, 14, 26) and fused.fusion_rate == 10 * fused.learning_rate
    assert config_from_args(parser.parse_args([
        "train-head", "--run-dir", "r", "--draft-block", "--fused-layers", "1", "--fusion-lr",
        "0.02"])).fusion_rate == 0.02
    with pytest.raises(TrainingConfigError, match="pass --draft-block too"):
        config_from_args(parser.parse_args(["train-head", "--run-dir", "r", "--fused-layers",
                                            "1"]))


def test_torchrun_two_processes_match_a_single_process_run(tmp_path: Path, corpus: Path) -> None:
    """Under torchrun the replicas stay bitwise equal and match a 1-process run with the same
    global batch to float tolerance (see tests/test_training_ddp.py for why not bitwise)."""
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    argv = cli(model_dir, tmp_path / "ddp", corpus, "--draft-block", "--target-law", "model",
               "--cache-features", "--max-train-bytes", "1500", "--lr", "0.003", "--steps", "4",
               "--eval-every", "1", "--threads", "1")[1:]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "circuits_llm", "train-head", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = read_record(tmp_path / "ddp")
    assert record["world_size"] == 2 and record["finished"]
    assert all(h["replica_max_abs_diff"] == 0.0 for h in record["history"])
    cfg = config(**{**BLOCK, "steps": 4, "eval_every": 1})
    assert record["config"] == cfg.to_dict()
    single = train(tmp_path / "single", corpus, cfg)
    a = load_checkpoint(tmp_path / "ddp" / CHECKPOINT_FILE, "circuits_llm.train_head")["head"]
    b = load_checkpoint(tmp_path / "single" / CHECKPOINT_FILE, "circuits_llm.train_head")["head"]
    assert a.keys() == b.keys()
    for name, value in a.items():
        torch.testing.assert_close(value, b[name], atol=1e-4, rtol=1e-3, msg=name)
    for ddp_entry, single_entry in zip(record["history"], single.history, strict=True):
        torch.testing.assert_close(torch.tensor(ddp_entry["validation"]["nll"]),
                                   torch.tensor(single_entry["validation"]["nll"]),
                                   atol=1e-4, rtol=1e-4)
    assert record["validation"]["loss"] < record["initial_validation"]["loss"]


def test_sigterm_then_resume_equals_an_uninterrupted_run(tmp_path: Path, corpus: Path) -> None:
    """A real process stopped by SIGTERM mid-run (a checkpoint every step) resumes to exactly the
    parameters, data order, losses and validations of one uninterrupted run."""
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    run = tmp_path / "run"
    checkpoint = run / CHECKPOINT_FILE
    long = ("--draft-block", "--target-law", "model", "--cache-features", "--max-train-bytes",
            "1500", "--lr", "0.003", "--steps", "100000", "--eval-every", "100000",
            "--threads", "1")
    command = [sys.executable, "-m", "circuits_llm", *cli(model_dir, run, corpus, *long)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for(lambda: saved_step(checkpoint) >= 2, process, "its second checkpoint")
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143 and "Traceback" not in err, err
    stopped = saved_step(checkpoint)
    cfg = config(**{**BLOCK, "steps": 100000, "eval_every": 100000})
    resumed = train(run, corpus, cfg, max_steps=stopped + 2)
    assert resumed.step == stopped + 2 and resumed.session_steps == 2
    whole = train(tmp_path / "whole", corpus, cfg, max_steps=stopped + 2)
    assert_same_training(checkpoint, tmp_path / "whole" / CHECKPOINT_FILE)
    assert resumed.validation == whole.validation and resumed.train_loss == whole.train_loss
