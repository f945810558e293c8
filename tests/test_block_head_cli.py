"""``train-head --on-block`` (circuits_llm.training.block_head_trainer): a circuit head trains in
the head-training loop on a frozen draft block's outputs, exports a head that drafts with
``BlockCircuitDrafter`` exactly (greedy equals ``model.generate``), reads the block's outputs where
the drafter does, refuses to resume against another block, and bad combinations are one clear
error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_run_safety import cli, one_error_line
from test_training import config, make_corpus, tiny_llama, train

from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.draft_block import (
    BlockCacheFollower,
    BlockCircuitDrafter,
    BlockInit,
    DraftBlock,
    DraftWeights,
)
from circuits_llm.draft_block.io import save_draft_block
from circuits_llm.heads import load_head
from circuits_llm.runtime.checkpoint import load_checkpoint
from circuits_llm.training import (
    CHECKPOINT_FILE,
    CheckpointError,
    TrainingConfigError,
    load_trained_head,
    read_record,
)
from circuits_llm.training import features as feats
from circuits_llm.training.block_head_trainer import (
    block_outputs,
    block_sha256,
    load_block,
    load_trained_block_head,
)

pytestmark = pytest.mark.filterwarnings("ignore::circuits_llm.heads.sizing.HeadBudgetWarning")

#: the head run's own options: cached features of a capped corpus, 12 steps towards the tokens
#: (the validation scores the tokens; the random model's own law is far from them)
ON_BLOCK = ("--cache-features", "--max-train-bytes", "1500", "--steps", "12", "--eval-every", "6")
#: the model's own law as the target (the teacher reads the features, not the block's outputs)
TEACHER = ("--target-law", "model", "--teacher-top-k", "8")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(autouse=True)
def _private_feature_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(feats.FEATURE_CACHE_ENV, str(tmp_path / "feature-cache"))


def _block(model: torch.nn.Module, seed: int = 1) -> DraftBlock:
    """A block on ``model`` moved off its identity start (its attention and token input
    matter)."""
    block = DraftBlock(model, steps=3, init=BlockInit.LAST_LAYER)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return block.eval()


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, Path]:
    """(the tiny model's directory, a saved block for it)."""
    model = tiny_llama()
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model", save_draft_block(_block(model), tmp_path / "block", model)


def test_command_trains_a_head_on_the_block_that_drafts_exactly(
        tmp_path: Path, corpus: Path, saved: tuple[Path, Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    from circuits_llm.app.cli import main
    model_dir, block_dir = saved
    run = tmp_path / "run"
    assert main(cli(model_dir, run, corpus, "--on-block", str(block_dir), *ON_BLOCK)) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 12 and summary["finished"]
    assert len(summary["validation_bits_per_position"]) == 4  # the head's window
    record = read_record(run)
    assert record["config"]["on_block"] == str(block_dir)
    model = tiny_llama()
    block = load_block(block_dir, model)
    assert record["on_block"]["sha256"] == block_sha256(block)
    assert record["on_block"]["path"] == str(block_dir.resolve()) and record["on_block"]["steps"] == 3
    assert record["validation"]["loss"] < record["initial_validation"]["loss"]
    # a head of the same seed on the model's own features starts elsewhere: the block is read
    plain = tmp_path / "plain"
    assert main(cli(model_dir, plain, corpus, *ON_BLOCK, "--max-steps", "0")) == 0
    capsys.readouterr()
    assert read_record(plain)["initial_validation"]["nll"] != record["initial_validation"]["nll"]
    # the export: RUN_DIR/head loads and drafts on the block exactly (greedy = generate)
    head = load_head(run / "head", block.hidden_size, block.vocab_size).eval()
    loaded_block, loaded_head = load_trained_block_head(run, model)
    assert block_sha256(loaded_block) == block_sha256(block)
    for name, value in head.state_dict().items():
        assert torch.equal(value, loaded_head.state_dict()[name]), name
    prompt = [256, *b"def f(x):\n    return"]
    expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20,
                              pad_token_id=258, eos_token_id=None)[0, len(prompt):]
    result = SpeculativeDecoder(model, BlockCircuitDrafter(loaded_block, loaded_head)).generate(
        prompt, 20, eos_token_id=())
    assert result.tokens.tolist() == expected.tolist()
    with pytest.raises(CheckpointError, match="not on a draft block"):
        load_trained_block_head(plain, model)


def test_the_backbone_loader_refuses_a_head_trained_on_a_block(
        tmp_path: Path, corpus: Path, saved: tuple[Path, Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    """``load_trained_head`` would hand the head the backbone's hidden states where it was trained
    on the block's outputs: it refuses with one error naming the loader that pairs the head with
    its block, and that loader takes the run (mirroring ``load_trained_block_head``'s refusal of
    a head trained on the backbone's features)."""
    from circuits_llm.app.cli import main
    model_dir, block_dir = saved
    run = tmp_path / "run"
    assert main(cli(model_dir, run, corpus, "--on-block", str(block_dir), *ON_BLOCK,
                    "--max-steps", "0")) == 0
    capsys.readouterr()
    model = tiny_llama()
    with pytest.raises(CheckpointError) as refused:
        load_trained_head(run, model)
    message = str(refused.value)
    assert "circuits_llm.training.block_head_trainer.load_trained_block_head" in message
    assert f"{run} trained its head on a draft block's outputs" in message
    assert f"--on-block {block_dir}" in message and "\n" not in message
    block, head = load_trained_block_head(run, model)
    assert block_sha256(block) == block_sha256(load_block(block_dir, model))
    assert head.window == 4


def test_the_head_reads_the_block_output_the_drafter_gives() -> None:
    model = tiny_llama()
    block = _block(model)
    ids = torch.tensor([[256, 100, 101, 40, 41, 10, 32, 32, 120]])
    _, hidden = HFBackbone(model).hidden_states(ids)
    outputs = block_outputs(block, hidden, ids)
    assert outputs.shape == hidden.shape and not outputs[0, -1].any()
    for t in range(ids.shape[1] - 1):  # the round after the verified token x_{t+1}
        # the block as trained (a drafter's default on a CPU is its int8 copy)
        follower = BlockCacheFollower(block, weights=DraftWeights.AS_TRAINED)
        follower.begin(hidden[:, :t], ids[0, 1:t + 1])
        with torch.no_grad():
            expected = follower.first_step(hidden[:, t], ids[0, t + 1:t + 2])
        torch.testing.assert_close(outputs[0, t], expected[0].float(), rtol=1e-5, atol=1e-6)


def test_resuming_against_another_block_is_refused(tmp_path: Path, corpus: Path,
                                                   saved: tuple[Path, Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from circuits_llm.app.cli import main
    model_dir, block_dir = saved
    run = tmp_path / "run"
    argv = cli(model_dir, run, corpus, "--on-block", str(block_dir), *ON_BLOCK, *TEACHER)
    assert main([*argv, "--max-steps", "2"]) == 0
    model = tiny_llama()
    save_draft_block(_block(model, seed=2), block_dir, model)  # the block retrained in place
    capsys.readouterr()
    assert main(argv) == 2
    assert "another draft block" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(("extra", "message"), [
    (("--draft-block",), "give one of them"),
    (("--lora-layers", "1"), "drop --lora-layers"),
])
def test_bad_combinations_are_one_clear_error(tmp_path: Path, corpus: Path,
                                              saved: tuple[Path, Path], extra: tuple[str, ...],
                                              message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from circuits_llm.app.cli import main
    model_dir, block_dir = saved
    assert main(cli(model_dir, tmp_path / "run", corpus, "--on-block", str(block_dir),
                    *extra)) == 2
    assert message in one_error_line(capsys.readouterr().err)


def test_a_block_for_another_model_or_no_block_is_one_clear_error(
        tmp_path: Path, corpus: Path, saved: tuple[Path, Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    from circuits_llm.app.cli import main
    model_dir, _ = saved
    other = tiny_llama(seed=3)
    foreign = save_draft_block(_block(other), tmp_path / "foreign", other)
    for where, message in ((foreign, "trained for a model with the same configuration but "
                                     "other LM head weights"),
                           (tmp_path / "nothing", "holds no draft block")):
        assert main(cli(model_dir, tmp_path / "run", corpus, "--on-block", str(where))) == 2
        assert message in one_error_line(capsys.readouterr().err)
    with pytest.raises(TrainingConfigError, match="holds no draft block"):
        load_block(tmp_path, tiny_llama())


def test_the_python_api_trains_on_the_block_and_resumes_exactly(
        tmp_path: Path, corpus: Path, saved: tuple[Path, Path]) -> None:
    """``train_head`` with ``on_block`` (the shared loop makes a BlockHeadTrainer): a run to 6
    steps and a run to 3 steps resumed to 6 give the same head."""
    _, block_dir = saved
    cfg = config(on_block=str(block_dir), cache_features="on", max_train_bytes=1500,
                 target_law="model", teacher_top_k=8)
    whole = train(tmp_path / "whole", corpus, cfg)
    first = train(tmp_path / "split", corpus, cfg, max_steps=3)
    assert not first.finished and first.step == 3
    second = train(tmp_path / "split", corpus, cfg)
    assert second.finished and second.session_steps == 3
    a = load_checkpoint(tmp_path / "whole" / CHECKPOINT_FILE, "circuits_llm.train_head")
    b = load_checkpoint(tmp_path / "split" / CHECKPOINT_FILE, "circuits_llm.train_head")
    assert a["on_block"] == b["on_block"] and a["head"].keys() == b["head"].keys()
    for name, value in a["head"].items():
        assert torch.equal(value, b["head"][name]), name
    assert whole.validation == second.validation
    assert read_record(tmp_path / "whole")["on_block"]["sha256"] == a["on_block"]["sha256"]
