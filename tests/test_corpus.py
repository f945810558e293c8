"""Tokenised corpora: the model's own tokens, streamed to a memory-mapped cache, reused, checked.

The caches go to a temporary directory (``cache_dir=`` or ``$CIRCUITS_LLM_CORPUS_CACHE``); the
corpora are small directories written here.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from test_tokens import tiny_subword_model, tiny_tokenizer

from circuits_llm.text import corpus as corpus_module
from circuits_llm.text.byte_level import Split, corpus_files, pack, split_of
from circuits_llm.text.byte_level import evaluation_prompts as byte_prompts
from circuits_llm.text.corpus import (
    CACHE_ENV,
    CorpusError,
    TokenStream,
    corpus_cache_dir,
    evaluation_prompts,
    tokenized_split,
)
from circuits_llm.text.tokens import TextTokenizer, TokenizerKind
from circuits_llm.training import HeadTrainingConfig, TrainingConfigError
from circuits_llm.training.datasets import (
    StreamWindows,
    corpus_sets,
    training_sets,
    training_streams,
)


def write_corpus(root: Path, per_split: int = 3, repeat: int = 30) -> Path:
    """``per_split`` training and validation files of Python-ish text under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    wanted = {Split.TRAIN: per_split, Split.VALIDATION: per_split}
    index = 0
    while any(wanted.values()):
        name = f"module_{index}.py"
        split = split_of(name)
        if wanted.get(split, 0) > 0:
            (root / name).write_text(f"def f_{index}(x):\n    return x * {index}  # é\n" * repeat)
            wanted[split] -= 1
        index += 1
    return root


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture(scope="module")
def subword() -> TextTokenizer:
    return TextTokenizer.wrap(tiny_tokenizer(), "tiny")


def test_byte_stream_is_the_packed_corpus(root: Path, tmp_path: Path) -> None:
    stream = tokenized_split(TextTokenizer.byte_level(), Split.TRAIN, root, tmp_path / "cache")
    assert isinstance(stream.ids, np.memmap) and stream.ids.dtype == np.uint16  # mapped, not loaded
    assert torch.equal(torch.from_numpy(stream.ids.astype(np.int64)),
                       pack(corpus_files(Split.TRAIN, root)))
    assert stream.documents == len(corpus_files(Split.TRAIN, root))
    # the windows of the old byte path (unfold, stride 1), in the same order
    config = HeadTrainingConfig(window=4, rank=4, seq_len=16, eval_windows=2)
    train, _ = corpus_sets(config, stream, stream)
    packed = pack(corpus_files(Split.TRAIN, root))
    index = torch.tensor([0, 5, len(train) - 1])
    assert torch.equal(train.rows(index)[0], packed.unfold(0, 16, 1)[index])


def test_subword_stream_is_each_file_tokenised_then_eos(root: Path, tmp_path: Path,
                                                       subword: TextTokenizer) -> None:
    stream = tokenized_split(subword, Split.VALIDATION, root, tmp_path / "cache")
    expected = []
    for path in corpus_files(Split.VALIDATION, root):
        ids = subword.tokenizer(path.read_text(), add_special_tokens=True).input_ids
        expected += [*ids, subword.eos_token_id]
    assert stream.ids.tolist() == expected
    assert subword.decode(stream.ids[:40]).startswith("def f_")
    assert stream.window(3, 5).tolist() == expected[3:8]
    with pytest.raises(IndexError, match="leave the stream"):
        stream.windows([len(stream) - 2], 5)


def test_cache_is_reused_and_keyed_by_files_and_tokenizer(root: Path, tmp_path: Path,
                                                          subword: TextTokenizer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    first = tokenized_split(subword, Split.TRAIN, root, cache)
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 2 and {Path(e).suffix for e in entries} == {".json", ".tokens"}

    def no_tokenising(self: TextTokenizer, contents: list[bytes]) -> list[np.ndarray]:
        raise AssertionError("a cached corpus was tokenised again")

    with monkeypatch.context() as patch:
        patch.setattr(TextTokenizer, "documents", no_tokenising)
        again = tokenized_split(subword, Split.TRAIN, root, cache)
    assert again.path == first.path and np.array_equal(again.ids, first.ids)
    # a changed file or another tokenizer is another entry; nothing is overwritten
    bytes_stream = tokenized_split(TextTokenizer.byte_level(), Split.TRAIN, root, cache)
    assert bytes_stream.path != first.path
    path = corpus_files(Split.TRAIN, root)[0]
    path.write_text(path.read_text() + "y = 2\n")
    changed = tokenized_split(subword, Split.TRAIN, root, cache)
    assert changed.path != first.path and len(changed) > len(first)
    assert len(list(cache.iterdir())) == 6
    # a damaged token file is rebuilt, not read
    changed.path.write_bytes(b"\0" * changed.path.stat().st_size)
    rebuilt = tokenized_split(subword, Split.TRAIN, root, cache)
    assert rebuilt.ids.tolist() != [0] * len(rebuilt) and len(rebuilt) == len(changed)


def test_a_failed_tokenisation_leaves_nothing(root: Path, tmp_path: Path, subword: TextTokenizer,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    original = TextTokenizer.documents
    calls = []

    def failing(self: TextTokenizer, contents: list[bytes]) -> list[np.ndarray]:
        calls.append(len(contents))
        if len(calls) == 2:
            raise OSError("disk full")
        return original(self, contents)

    monkeypatch.setattr(corpus_module, "_BATCH_FILES", 1)  # one file per batch: fail mid-way
    monkeypatch.setattr(TextTokenizer, "documents", failing)
    cache = tmp_path / "cache"
    with pytest.raises(OSError, match="disk full"):
        tokenized_split(subword, Split.TRAIN, root, cache)
    assert calls == [1, 1] and list(cache.iterdir()) == []


def test_corpus_errors(tmp_path: Path, subword: TextTokenizer) -> None:
    with pytest.raises(CorpusError, match="does not exist; give --corpus-root"):
        tokenized_split(subword, Split.TRAIN, tmp_path / "missing", tmp_path / "cache")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusError, match="has no training files"):
        tokenized_split(subword, Split.TRAIN, empty, tmp_path / "cache")


def test_too_short_corpora_and_foreign_tokenizers_are_training_errors(
        root: Path, tmp_path: Path, subword: TextTokenizer) -> None:
    config = HeadTrainingConfig(window=4, rank=4, seq_len=16, eval_windows=2)
    cache = tmp_path / "cache"
    train, validation = training_streams(config, subword, root, cache)
    assert len(validation) >= 32 and len(train) > 17
    for change, message in (({"seq_len": 4000}, "fewer than one sequence of seq_len + 1 = 4001"),
                            ({"eval_windows": 500}, "fewer than eval_windows * seq_len = 8000")):
        with pytest.raises(TrainingConfigError, match=re.escape(message)):
            training_streams(dataclasses.replace(config, **change), subword, root, cache)
    model = tiny_subword_model(subword.vocab_size)
    with pytest.raises(TrainingConfigError, match=r"byte tokenizer .* is for byte models"):
        training_sets(model, config, tmp_path / "run", writer=True, root=root, cache_dir=cache,
                      tokenizer=TextTokenizer.byte_level())
    with pytest.raises(TrainingConfigError, match="its tokenizer is unknown"):
        training_sets(model, config, tmp_path / "run", writer=True, root=root, cache_dir=cache)
    with pytest.raises(TrainingConfigError, match="tokenizer vocabulary vs model vocabulary"):
        training_sets(tiny_subword_model(200), config, tmp_path / "run", writer=True, root=root,
                      cache_dir=cache, tokenizer=subword)
    assert not (tmp_path / "run").exists()


def test_training_windows_come_from_the_cached_stream(root: Path, tmp_path: Path,
                                                      subword: TextTokenizer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env-cache"))
    assert corpus_cache_dir() == tmp_path / "env-cache"
    config = HeadTrainingConfig(window=4, rank=4, seq_len=16, eval_windows=2, max_train_bytes=100)
    model = tiny_subword_model(subword.vocab_size)
    train, validation = training_sets(model, config, tmp_path / "run", writer=True, root=root,
                                      tokenizer=subword)
    stream = tokenized_split(subword, Split.TRAIN, root)
    assert isinstance(train, StreamWindows) and len(train) == 100 - 16 + 1  # capped in tokens
    tokens, mask = train.rows(torch.tensor([0, 84]))
    assert mask is None and tokens.dtype == torch.long
    assert tokens[1].tolist() == stream.ids[84:100].tolist()
    val_tokens, _ = validation.rows(torch.arange(2))
    val_stream = tokenized_split(subword, Split.VALIDATION, root)
    assert val_tokens.reshape(-1).tolist() == val_stream.ids[:32].tolist()  # disjoint windows
    with pytest.raises(ValueError, match="do not fit"):
        StreamWindows(TokenStream(stream.ids[:10], 1, stream.path), 16, 1, 1)


def test_evaluation_prompts_in_the_models_tokens(subword: TextTokenizer) -> None:
    assert [p.tolist() for p in evaluation_prompts(TextTokenizer.byte_level(), 3, 40)] == \
        [p.tolist() for p in byte_prompts(3, 40)]
    prompts = evaluation_prompts(subword, 2, 30)
    assert all(p.shape == (30,) and p.dtype == torch.long for p in prompts)
    with pytest.raises(CorpusError, match="test files are long enough"):
        evaluation_prompts(subword, 2, 10**7)


def test_dtype_follows_the_vocabulary() -> None:
    @dataclasses.dataclass
    class Wide:
        max_token_id: int
        kind: TokenizerKind = TokenizerKind.SUBWORD

    assert corpus_module._dtype(Wide(65535)) == np.uint16  # type: ignore[arg-type]
    assert corpus_module._dtype(Wide(65536)) == np.int32  # type: ignore[arg-type]
