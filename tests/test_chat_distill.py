"""Chat requests and self-distilled chat rows (``train-head --distill-chat-samples``).

The requests are seeded and split-disjoint (code snippets from the split's own files, held-out
subjects for validation and test); a chat row is the model's own reply to its prompt, generated in
batches of one prompt length and stopped once every row of a batch has ended; the loss covers each
reply through its first end-of-sequence id; chat rows join the corpus rows in one training set
whose cached features come from one cache entry per part. A tiny config-built Llama over the tiny
BPE tokenizer (with a chat template) of ``test_tokens``, in float64.
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
from circuits_llm.text.byte_level import Split, corpus_files, split_of
from circuits_llm.text.chat_requests import (
    SUBJECTS,
    ChatRequestError,
    chat_prompts,
    chat_requests,
    code_snippets,
    subjects_of,
)
from circuits_llm.text.corpus import CACHE_ENV
from circuits_llm.text.tokens import ChatTemplateError, TextTokenizer
from circuits_llm.training import HeadTrainingConfig
from circuits_llm.training import chat_distill as cd
from circuits_llm.training.config import TrainingConfigError
from circuits_llm.training.datasets import (
    JoinedSequences,
    TensorSequences,
    training_sets,
    training_token_counts,
)
from circuits_llm.training.self_distill import continue_rows

CONFIG = HeadTrainingConfig(window=4, rank=4, seq_len=200, distill_prompt_len=8, distill_samples=6,
                            distill_chat_samples=5, eval_windows=2, distill_temperature=0.8,
                            data="self-distilled", seed=3, steps=2, batch_size=4, eval_every=2,
                            checkpoint_every_s=0.0, distill_batch=2)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.wrap(tiny_tokenizer(), "tiny")


@pytest.fixture(scope="module")
def model(tokenizer: TextTokenizer) -> PreTrainedModel:
    return tiny_subword_model(tokenizer.vocab_size, seed=2).double()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_corpus(tmp_path_factory.mktemp("chat-corpus"))
    index = 0
    while not corpus_files(Split.TEST, root):  # one test file too
        name = f"held_{index}.py"
        if split_of(name) is Split.TEST:
            (root / name).write_text("class Held:\n    def g(self):\n        return 1\n")
        index += 1
    return root


def test_requests_are_seeded_and_split_disjoint(corpus: Path) -> None:
    train = chat_requests(Split.TRAIN, 40, 0, corpus)
    assert train == chat_requests(Split.TRAIN, 40, 0, corpus) != chat_requests(Split.TRAIN, 40, 1,
                                                                                corpus)
    held_out = set(subjects_of(Split.TEST))
    assert held_out == set(subjects_of(Split.VALIDATION)) and len(held_out) == len(SUBJECTS) // 5
    assert held_out.isdisjoint(subjects_of(Split.TRAIN))
    snippets = {Split.TRAIN: code_snippets(Split.TRAIN, corpus),
                Split.TEST: code_snippets(Split.TEST, corpus)}
    assert snippets[Split.TEST] == ["class Held:\n    def g(self):\n        return 1",
                                    "def g(self):\n    return 1"]
    for split, requests in ((Split.TRAIN, train), (Split.TEST, chat_requests(Split.TEST, 40, 0,
                                                                              corpus))):
        for index, request in enumerate(requests):
            if index % 2 == 0:  # about a snippet of the split's own files
                assert any(s in request for s in snippets[split]), request
            else:  # about a subject of the split
                named = [s for s in SUBJECTS if s in request]
                assert named and set(named) <= set(subjects_of(split)), request


def test_bad_requests_are_one_error(corpus: Path, tmp_path: Path, tokenizer: TextTokenizer) -> None:
    with pytest.raises(ChatRequestError, match="count must be >= 1"):
        chat_requests(Split.TRAIN, 0, 0, corpus)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.py").write_text("x = 1\n")
    split = split_of("notes.py")
    with pytest.raises(ChatRequestError, match="no def/class snippet"):
        chat_requests(split, 3, 0, empty)
    with pytest.raises(ChatRequestError, match="fit in 5 tokens"):
        chat_prompts(tokenizer, Split.TRAIN, 3, 0, max_tokens=5, root=corpus)
    plain = TextTokenizer.wrap(tiny_tokenizer(chat=False), "plain")
    with pytest.raises(ChatTemplateError):
        chat_prompts(plain, Split.TRAIN, 3, 0, root=corpus)


def test_prompts_are_requests_in_the_chat_template(corpus: Path, tokenizer: TextTokenizer) -> None:
    prompts = chat_prompts(tokenizer, Split.TRAIN, 6, 0, max_tokens=150, root=corpus)
    requests = chat_requests(Split.TRAIN, 24, 0, corpus)
    fitting = [r for r in requests if len(tokenizer.encode_prompt(r, chat=True)) <= 150][:6]
    assert [p.tolist() for p in prompts] == [tokenizer.encode_prompt(r, chat=True)
                                             for r in fitting]
    for prompt in prompts:
        text = tokenizer.decode(prompt, skip_special_tokens=False)
        assert text.endswith("<s>assistant: ") and prompt.dtype == torch.long  # tiny template


@pytest.fixture(scope="module")
def plan(model: PreTrainedModel, tokenizer: TextTokenizer, corpus: Path) -> cd.ChatPlan:
    return cd.chat_plan(model, tokenizer, CONFIG, corpus)


def test_chat_rows_are_the_models_own_replies(model: PreTrainedModel, plan: cd.ChatPlan) -> None:
    lengths = plan.prompt_lengths()
    assert plan.rows == 7 and plan.train_rows == 5 and int(lengths.max()) <= \
        cd.max_prompt_tokens(200, 4)
    assert len(set(lengths.tolist())) > 1  # prompts of several lengths
    for k in range(plan.batches):  # batches hold one prompt length
        assert len({int(lengths[i]) for i in plan.batch(k)}) == 1
        assert len(plan.batch(k)) <= CONFIG.distill_batch
    rows = cd.generate_rows(model, plan, None)
    assert tuple(rows.shape) == (7, 200)
    decoder = AutoregressiveDecoder(model)
    mask = cd.reply_mask(rows, lengths, plan.stop_ids)
    for i in range(plan.rows):  # in the plan's row order, whatever the batches
        length = int(lengths[i])
        assert torch.equal(rows[i, :length], plan.prompts[i])
        again = decoder.generate(plan.prompts[i], 200 - length, temperature=0.8,
                                 generator=torch.Generator().manual_seed(plan.row_seed(i)),
                                 eos_token_id=[])
        reply = int(mask[i].sum()) - 1  # the reply through its first end
        assert again.tokens.tolist()[:reply] == rows[i, length:length + reply].tolist(), i
    assert plan.row_seed(0) == CONFIG.seed + cd.CHAT_SEED_OFFSET


def test_a_batch_stops_once_every_row_has_ended(model: PreTrainedModel) -> None:
    prompts = torch.randint(3, 200, (3, 6), generator=torch.Generator().manual_seed(0))

    def generators() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(i) for i in range(3)]

    free = continue_rows(model, prompts, 12, 0.8, generators())
    stops = (int(free[0, 8]), int(free[1, 7]), int(free[2, 6]))  # row 0 ends last, at step 3
    ended = [min(j for j in range(6, 18) if int(free[r, j]) in stops) for r in range(3)]
    stopped = continue_rows(model, prompts, 12, 0.8, generators(), stop_ids=stops)
    last = max(ended)
    assert torch.equal(stopped[:, :last + 1], free[:, :last + 1])  # the same until every row ended
    assert (stopped[:, last + 1:] == stops[0]).all()  # then filled


def test_reply_mask_covers_each_reply_through_its_end() -> None:
    rows = torch.tensor([[5, 2, 6, 7, 2, 8, 9],    # prompt 2 (an EOS inside it), reply ends at 4
                         [5, 5, 5, 6, 7, 8, 9],    # prompt 3, no end: to the row's end
                         [5, 5, 2, 2, 2, 2, 2]])   # prompt 2, ends at once
    mask = cd.reply_mask(rows, torch.tensor([2, 3, 2]), (2,))
    assert mask.tolist() == [[False, True, True, True, True, False, False],
                             [False, False, True, True, True, True, True],
                             [False, True, True, False, False, False, False]]
    assert cd.reply_mask(rows, torch.tensor([2, 3, 2]), ())[0].tolist() == [False] + [True] * 6


def test_chat_rows_join_the_corpus_rows(model: PreTrainedModel, tokenizer: TextTokenizer,
                                        corpus: Path, tmp_path: Path) -> None:
    train, validation = training_sets(model, CONFIG, tmp_path / "run", writer=True, root=corpus,
                                      tokenizer=tokenizer, cache_dir=tmp_path / "cache")
    assert isinstance(train, JoinedSequences) and len(train) == 6 + 5 and len(validation) == 2 + 2
    corpus_rows, chat_rows = train.parts
    assert isinstance(chat_rows, TensorSequences) and chat_rows.loss_mask is not None
    tokens, mask = train.rows(torch.tensor([7, 0, 10, 3]))
    assert mask is not None
    for position, (part, local) in enumerate(((chat_rows, 1), (corpus_rows, 0), (chat_rows, 4),
                                              (corpus_rows, 3))):
        own_tokens, own_mask = part.rows(torch.tensor([local]))
        assert torch.equal(tokens[position], own_tokens[0])
        assert own_mask is not None and torch.equal(mask[position], own_mask[0])
    cached = load_checkpoint(tmp_path / "run" / cd.CHAT_DISTILL_FILE, cd.CHAT_KIND)
    assert torch.equal(cached["rows"][:5], chat_rows.sequences)
    counts = training_token_counts(train, tokenizer.vocab_size).counts
    assert int(counts.sum()) == int(corpus_rows.loss_mask.sum() + chat_rows.loss_mask.sum())
    # a cache made with other settings is refused, never overwritten
    other = dataclasses.replace(CONFIG, distill_chat_samples=4)
    with pytest.raises(CheckpointError, match="generated with other settings"):
        training_sets(model, other, tmp_path / "run", writer=True, root=corpus,
                      tokenizer=tokenizer, cache_dir=tmp_path / "cache")


def test_chat_rows_need_self_distillation() -> None:
    with pytest.raises(TrainingConfigError, match="pass --self-distill"):
        HeadTrainingConfig(distill_chat_samples=3)
    with pytest.raises(TrainingConfigError, match="distill_chat_samples"):
        dataclasses.replace(CONFIG, distill_chat_samples=-1)


def test_train_head_with_chat_rows_from_the_command_line(
        model: PreTrainedModel, tokenizer: TextTokenizer, corpus: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "corpus-cache"))
    model_dir = save_model_dir(tmp_path / "model", copy.deepcopy(model).float(), tokenizer.tokenizer)
    run = tmp_path / "run"
    argv = ["train-head", "--model", str(model_dir), "--run-dir", str(run), "--corpus-root",
            str(corpus), "--no-progress", "--self-distill", "--arch", "ff", "--window", "4",
            "--seq-len", "200", "--batch-size", "4", "--steps", "2", "--eval-every", "2",
            "--eval-windows", "2", "--distill-samples", "6", "--distill-prompt-len", "8",
            "--checkpoint-every", "0", "--threads", "1", "--distill-batch", "4",
            "--distill-chat-samples", "3"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    record = json.loads((run / "training.json").read_text())
    assert record["config"]["distill_chat_samples"] == 3
    # one feature entry per part: corpus and chat rows, training and validation
    assert len(record["feature_cache"]) == 4 and len(set(record["feature_cache"])) == 4
    cached = load_checkpoint(run / cd.CHAT_DISTILL_FILE, cd.CHAT_KIND)
    assert tuple(cached["rows"].shape) == (3 + 2, 200)
