"""The byte-level stdlib corpus: deterministic disjoint splits, packing, windows, prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from circuits_llm.text.byte_level import (
    VOCAB_SIZE,
    SpecialToken,
    Split,
    WindowSpec,
    batches,
    corpus_files,
    decode,
    encode,
    evaluation_prompts,
    pack,
    split_of,
    windows,
)


@pytest.fixture()
def tiny_root(tmp_path: Path) -> Path:
    for i in range(60):
        (tmp_path / f"module_{i}.py").write_text(f"x = {i}\n" * (20 + i))
    (tmp_path / "empty.py").write_text("")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third_party.py").write_text("print('excluded')\n")
    return tmp_path


def test_splits_are_disjoint_cover_everything_and_exclude_site_packages(tiny_root: Path) -> None:
    parts = {split: set(corpus_files(split, tiny_root)) for split in Split}
    union = set().union(*parts.values())
    assert len(union) == sum(len(p) for p in parts.values())
    assert len(union) == 61
    assert all("site-packages" not in p.parts for p in union)
    assert parts[Split.TRAIN] and parts[Split.TRAIN] != union


def test_split_depends_only_on_the_relative_path() -> None:
    assert split_of("json/decoder.py") is split_of("json/decoder.py")
    counts = {split: 0 for split in Split}
    for i in range(2000):
        counts[split_of(f"pkg/file_{i}.py")] += 1
    assert 1700 < counts[Split.TRAIN] < 1900 and counts[Split.TEST] > 50


def test_encode_decode_round_trip_and_specials() -> None:
    text = "def f(x):\n    return 'é'\n"
    tokens = encode(text.encode())
    assert tokens.dtype == torch.long and int(tokens.max()) < 256
    with_specials = torch.cat([torch.tensor([SpecialToken.BOS]), tokens, torch.tensor([SpecialToken.EOS])])
    assert decode(with_specials) == text
    assert encode(b"").numel() == 0
    assert max(SpecialToken) < VOCAB_SIZE


def test_pack_and_overlapping_windows(tiny_root: Path) -> None:
    stream = pack(corpus_files(Split.TRAIN, tiny_root))
    assert int(stream[0]) == SpecialToken.BOS
    assert int((stream == SpecialToken.BOS).sum()) == int((stream == SpecialToken.EOS).sum())
    table = windows(stream, WindowSpec(length=16, stride=8))
    assert torch.equal(table[0, 8:], table[1, :8])  # consecutive windows overlap by length - stride
    limited = pack(corpus_files(Split.TRAIN, tiny_root), max_bytes=100)
    assert limited.numel() == 100
    generator = torch.Generator().manual_seed(0)
    seen = list(batches(stream, WindowSpec(16, 8), batch_size=4, generator=generator))
    assert seen and all(b.shape == (4, 16) for b in seen)


def test_bad_inputs_are_explained(tiny_root: Path) -> None:
    with pytest.raises(ValueError, match="stride"):
        WindowSpec(length=8, stride=9)
    with pytest.raises(ValueError, match="shorter than one window"):
        windows(torch.arange(5), WindowSpec(8, 4))
    with pytest.raises(FileNotFoundError, match="no standard library sources"):
        corpus_files(Split.TRAIN, tiny_root / "missing")
    with pytest.raises(ValueError, match="empty"):
        pack([])


def test_evaluation_prompts_come_from_held_out_files() -> None:
    prompts = evaluation_prompts(4, 48)
    test_files = corpus_files(Split.TEST)
    heads = {path.read_bytes()[:47] for path in test_files}
    for prompt in prompts:
        assert prompt.numel() == 48 and int(prompt[0]) == SpecialToken.BOS
        assert bytes(prompt[1:].tolist()) in heads


def test_evaluation_prompts_in_a_tokenizers_ids() -> None:
    """The byte tokenizer gives the byte prompts; a subword tokenizer gives record prefixes."""
    from test_tokens import tiny_tokenizer

    from circuits_llm.text.corpus import evaluation_prompts as prompts_in_ids
    from circuits_llm.text.tokens import TextTokenizer
    assert [p.tolist() for p in prompts_in_ids(TextTokenizer.byte_level(), 3, 48)] \
        == [p.tolist() for p in evaluation_prompts(3, 48)]
    subword = TextTokenizer.wrap(tiny_tokenizer(), "tiny")
    prompts = [p.tolist() for p in prompts_in_ids(subword, 2, 20)]
    heads = []
    for path in corpus_files(Split.TEST):  # the prompts are the first long files' record heads
        if len(path.read_bytes()) >= 512:
            heads.append(subword.documents([path.read_bytes()])[0][:20].tolist())
        if len(heads) == 2:
            break
    assert prompts == heads
