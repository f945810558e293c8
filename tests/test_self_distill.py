"""Self-distilled training data (``train-head --self-distill``): the model's own continuations,
cached, resumed exactly after an interruption, reused, refused when made otherwise.

A tiny config-built Llama over the tiny BPE tokenizer of ``test_tokens`` (float64, so a batched
forward and a one-row forward give the same samples) continues prompts of a small corpus.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_corpus import write_corpus
from test_tokens import save_model_dir, tiny_subword_model, tiny_tokenizer
from transformers import PreTrainedModel

from circuits_llm.app.cli import main
from circuits_llm.decoding.decoder import AutoregressiveDecoder
from circuits_llm.runtime.checkpoint import CheckpointError, load_checkpoint
from circuits_llm.text.corpus import CACHE_ENV
from circuits_llm.text.tokens import TextTokenizer
from circuits_llm.training import HeadTrainingConfig
from circuits_llm.training import self_distill as sd
from circuits_llm.training.datasets import TensorSequences, training_sets, training_streams

CONFIG = HeadTrainingConfig(window=4, rank=4, seq_len=16, distill_prompt_len=8, distill_samples=20,
                            eval_windows=2, distill_temperature=0.8, data="self-distilled", seed=3,
                            steps=2, batch_size=4, eval_every=2, checkpoint_every_s=0.0)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.wrap(tiny_tokenizer(), "tiny")


@pytest.fixture(scope="module")
def model(tokenizer: TextTokenizer) -> PreTrainedModel:
    return tiny_subword_model(tokenizer.vocab_size, seed=2).double()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("distill-corpus"))


@pytest.fixture()
def plan(model: PreTrainedModel, tokenizer: TextTokenizer, corpus: Path, tmp_path: Path
         ) -> sd.DistillPlan:
    train, validation = training_streams(CONFIG, tokenizer, corpus, tmp_path / "corpus-cache")
    return sd.plan(model, tokenizer, CONFIG, train, validation)


def test_rows_are_the_models_own_continuations(model: PreTrainedModel, plan: sd.DistillPlan) -> None:
    rows = sd.generate_rows(model, plan, None)
    assert plan.rows == 22 and plan.batches == 2 and tuple(rows.shape) == (22, 16)
    assert torch.equal(rows[:, :8], plan.prompts)
    decoder = AutoregressiveDecoder(model)
    for i in (0, 15, 16, 20, 21):  # both batches, training and validation rows
        again = decoder.generate(plan.prompts[i], 8, temperature=0.8,
                                 generator=torch.Generator().manual_seed(CONFIG.seed + i))
        assert again.tokens.tolist() == rows[i, 8:].tolist(), i
    greedy = dataclasses.replace(plan, temperature=0.0)
    first = sd.generate_rows(model, dataclasses.replace(greedy, prompts=greedy.prompts[:2]), None)
    assert first[0, 8:].tolist() == decoder.generate(plan.prompts[0], 8).tokens.tolist()


def test_interrupted_generation_resumes_to_the_same_rows(
        model: PreTrainedModel, plan: sd.DistillPlan, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    whole = sd.self_distilled_rows(model, plan, tmp_path / "whole", writer=True)
    (tmp_path / "split").mkdir()

    def interrupt(index: int) -> None:
        raise KeyboardInterrupt  # as SIGINT after the first batch was saved

    with pytest.raises(KeyboardInterrupt):
        sd.self_distilled_rows(model, plan, tmp_path / "split", writer=True, on_batch=interrupt)
    parts = sorted(p.name for p in (tmp_path / "split" / sd.PARTS_DIR).iterdir())
    assert parts == ["part-00000.pt"] and not (tmp_path / "split" / sd.DISTILL_FILE).exists()
    calls = []
    original = sd.continue_rows

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(args[1].shape[0])  # type: ignore[union-attr]
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sd, "continue_rows", counted)
    resumed = sd.self_distilled_rows(model, plan, tmp_path / "split", writer=True)
    assert calls == [6]  # only the missing second batch (rows 16..21)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))
    assert not (tmp_path / "split" / sd.PARTS_DIR).exists()
    cached = load_checkpoint(tmp_path / "split" / sd.DISTILL_FILE, sd.DISTILL_KIND)
    assert torch.equal(cached["train"], whole[0]) and torch.equal(cached["validation"], whole[1])
    calls.clear()
    reused = sd.self_distilled_rows(model, plan, tmp_path / "split", writer=True)
    assert calls == [] and torch.equal(reused[0], whole[0])


def test_caches_made_otherwise_are_refused(model: PreTrainedModel, plan: sd.DistillPlan,
                                           tmp_path: Path) -> None:
    sd.self_distilled_rows(model, plan, tmp_path / "done", writer=True)
    other = dataclasses.replace(plan, key={**plan.key, "distill_temperature": 0.5})
    with pytest.raises(CheckpointError, match="generated with other settings"):
        sd.self_distilled_rows(model, other, tmp_path / "done", writer=True)

    def interrupt(index: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sd.self_distilled_rows(model, plan, tmp_path / "part", writer=True, on_batch=interrupt)
    before = (tmp_path / "part" / sd.PARTS_DIR / "part-00000.pt").read_bytes()
    with pytest.raises(CheckpointError, match=r"part-00000\.pt was generated with other settings"):
        sd.self_distilled_rows(model, other, tmp_path / "part", writer=True)
    assert (tmp_path / "part" / sd.PARTS_DIR / "part-00000.pt").read_bytes() == before
    # a reader that is not the writer (a DDP rank > 0) generates but writes nothing
    sd.self_distilled_rows(model, plan, tmp_path / "reader", writer=False)
    assert not (tmp_path / "reader").exists()


def test_progress_bar_only_when_asked(model: PreTrainedModel, plan: sd.DistillPlan, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    sd.generate_rows(model, plan, tmp_path / "quiet")
    assert capsys.readouterr().err == ""
    sd.generate_rows(model, plan, tmp_path / "loud", progress=True)
    assert "self-distil" in capsys.readouterr().err


def test_training_sets_mask_the_prompts(model: PreTrainedModel, tokenizer: TextTokenizer,
                                        corpus: Path, tmp_path: Path) -> None:
    train, validation = training_sets(model, CONFIG, tmp_path / "run", writer=True, root=corpus,
                                      tokenizer=tokenizer, cache_dir=tmp_path / "cache")
    assert isinstance(train, TensorSequences) and len(train) == 20 and len(validation) == 2
    tokens, mask = train.rows(torch.tensor([0, 3]))
    assert tokens.shape == mask.shape == (2, 16)
    assert not mask[:, :7].any() and mask[:, 7:].all()  # windows start at the last prompt token


def test_train_head_self_distill_from_the_command_line(
        model: PreTrainedModel, tokenizer: TextTokenizer, corpus: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "corpus-cache"))
    model_dir = save_model_dir(tmp_path / "model", copy.deepcopy(model).float(), tokenizer.tokenizer)
    run = tmp_path / "run"
    argv = ["train-head", "--model", str(model_dir), "--run-dir", str(run), "--corpus-root",
            str(corpus), "--no-progress", "--self-distill", "--arch", "btree", "--window", "4",
            "--rank", "4", "--seq-len", "16", "--batch-size", "4", "--steps", "2",
            "--eval-every", "2", "--eval-windows", "2", "--distill-samples", "6",
            "--distill-prompt-len", "8", "--checkpoint-every", "0", "--threads", "1",
            "--distill-batch", "4"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step"] == 2
    assert "self-distil" not in captured.err and "tokenise" not in captured.err  # no bars
    cached = load_checkpoint(run / sd.DISTILL_FILE, sd.DISTILL_KIND)
    assert tuple(cached["train"].shape) == (6, 16)
    assert cached["key"]["tokenizer"] == tokenizer.fingerprint
    assert max(int(cached["train"].max()), int(cached["validation"].max())) < tokenizer.vocab_size
    record = json.loads((run / "training.json").read_text())
    assert record["config"]["data"] == "self-distilled"
    assert cached["key"]["batch_rows"] == record["config"]["distill_batch"] == 4
    # self-distilled rows are a fixed set: their features are cached by default (train, validation)
    assert record["config"]["cache_features"] == "auto" and len(record["feature_cache"]) == 2
    assert all(Path(path).is_relative_to(tmp_path / "corpus-cache" / "features")
               for path in record["feature_cache"])
