"""A head built by name drafts over a compressed vocabulary by default on a large vocabulary
(``MTPHead.from_name``, :func:`circuits_llm.heads.vocab.resolve_draft_vocab`): the first
``DEFAULT_DRAFT_VOCAB`` ids and the EOS ids, chosen without data; ``draft_vocab="full"`` opts out,
a size or ids are kept, ``repr`` says which, and the decoder's law stays exact."""

from __future__ import annotations

import pytest
import torch
from toy import ToyLM, decoder_law, target_law, total_variation

from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.heads import HeadConfigError, HeadVariant, MTPHead, load_head, save_head
from circuits_llm.heads import vocab as vocab_module
from circuits_llm.heads.vocab import (
    COMPRESS_ABOVE,
    DEFAULT_DRAFT_VOCAB,
    DraftVocab,
    DraftVocabSource,
    leading_tokens,
    resolve_draft_vocab,
)

HIDDEN = 4


def lean(vocab: int, **options: object) -> MTPHead:
    """A small LEAN BTree head over ``vocab`` ids (hidden size 4)."""
    return MTPHead.from_name("btree", 3, 2, HIDDEN, vocab, "lean", torch.randn(vocab, HIDDEN),
                             **options)


def test_the_default_compresses_above_the_threshold_only() -> None:
    assert COMPRESS_ABOVE == 16384 and DEFAULT_DRAFT_VOCAB < COMPRESS_ABOVE
    at = lean(COMPRESS_ABOVE)
    assert at.draft_tokens is None and at.draft_vocab_size == COMPRESS_ABOVE
    assert at.draft_vocab_source is DraftVocabSource.FULL
    above = lean(COMPRESS_ABOVE + 1)
    assert above.draft_vocab_size == DEFAULT_DRAFT_VOCAB
    assert above.draft_tokens.tolist() == list(range(DEFAULT_DRAFT_VOCAB))
    assert above.draft_vocab_source is DraftVocabSource.DEFAULT
    assert above.inputs.lm_head.shape == (DEFAULT_DRAFT_VOCAB, HIDDEN)  # K rows only
    text = repr(above)
    assert f"draft_vocab={DEFAULT_DRAFT_VOCAB} of {COMPRESS_ABOVE + 1} ids (default" in text
    assert "draft_vocab='full' opts out" in text
    assert "draft_vocab=full (16384 ids)" in repr(at)


def test_full_size_and_ids_override_the_default() -> None:
    vocab = 20000
    for full in ("full", "FULL", DraftVocab.FULL, None):
        head = lean(vocab, draft_vocab=full)
        assert head.draft_tokens is None and head.draft_vocab_size == vocab
        assert "draft_vocab=full (20000 ids)" in head.extra_repr()
    sized = lean(vocab, draft_vocab=100)
    assert sized.draft_tokens.tolist() == list(range(100))
    assert sized.draft_vocab_source is DraftVocabSource.LEADING
    assert "draft_vocab=100 of 20000 ids (leading ids)" in sized.extra_repr()
    given = lean(vocab, draft_vocab=[7, 19999, 3])
    assert given.draft_tokens.tolist() == [7, 19999, 3]
    assert "(given ids)" in given.extra_repr()
    # a small vocabulary is never compressed by default, but a size still is
    assert lean(300).draft_tokens is None
    assert lean(300, draft_vocab=50).draft_vocab_size == 50


def test_eos_ids_are_always_drafted() -> None:
    head = lean(30000, eos_ids=[29999, 2])
    tokens = head.draft_tokens.tolist()
    assert len(tokens) == DEFAULT_DRAFT_VOCAB and tokens[-1] == 29999 and 2 in tokens
    assert tokens[:-1] == list(range(DEFAULT_DRAFT_VOCAB - 1))
    sized = lean(30000, draft_vocab=10, eos_ids=[20000])
    assert sized.draft_tokens.tolist() == [*range(9), 20000]
    assert leading_tokens(5, 3, always=[4]).tolist() == [0, 1, 4]


@pytest.mark.parametrize(("draft_vocab", "options", "message"), [
    ("fast", {}, "draft_vocab must be 'auto', 'full', a size K"),
    (True, {}, "draft_vocab must be a size K"),
    (0, {}, "must be an int in 1..30000"),
    (30001, {}, "must be an int in 1..30000"),
    (DraftVocab.AUTO, {"eos_ids": [30000]}, r"must lie in 0\.\.29999"),
    (DraftVocab.AUTO, {"compress_above": 0}, "compress_above must be an int >= 1"),
])
def test_bad_draft_vocabularies_are_one_clear_error(draft_vocab: object, options: dict,
                                                    message: str) -> None:
    with pytest.raises(HeadConfigError, match=message):
        resolve_draft_vocab(draft_vocab, 30000, **options)  # type: ignore[arg-type]


def test_a_default_head_saves_and_loads_its_draft_vocabulary(tmp_path) -> None:
    head = lean(COMPRESS_ABOVE + 5, eos_ids=[COMPRESS_ABOVE + 4])
    save_head(head, tmp_path)
    loaded = load_head(tmp_path)
    assert torch.equal(loaded.draft_tokens, head.draft_tokens)
    hidden = torch.randn(2, HIDDEN)
    for fold, value in head(hidden).items():
        assert torch.equal(loaded(hidden)[fold], value)


def test_the_default_compressed_head_keeps_the_decoders_law(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """The default path on the toy LM: the threshold lowered by argument, the default size by
    its module constant, EOS (id 3) kept; prompts end inside and outside the draft vocabulary."""
    monkeypatch.setattr(vocab_module, "DEFAULT_DRAFT_VOCAB", 2)
    lm = ToyLM(4, draft_branch=True, seed=3)
    for variant, architecture in ((HeadVariant.LEAN, "btree"), (HeadVariant.FULL, "cp")):
        head = MTPHead.from_name(architecture, 3, 2, lm.hidden_size, lm.vocab_size, variant,
                                 lm.lm_head, eos_ids=[3], compress_above=3,
                                 dtype=torch.float64, sum_init_std=0.7, init_noise=0.5)
        assert head.draft_tokens.tolist() == [0, 3]
        assert head.draft_vocab_source is DraftVocabSource.DEFAULT
        generator = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in head.parameters():
                if p.requires_grad:
                    p.add_(0.5 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
        head.eval()
        config = SamplingConfig(1.0)
        for prompt in ([0, 3], [3, 1]):  # the second ends outside the draft vocabulary
            exact = decoder_law(lm, head, prompt, 3, config)
            assert total_variation(exact, target_law(lm, prompt, 3, config)) <= 1e-9
    greedy = SpeculativeDecoder(lm, head).generate([0, 2], 10)
    reference = AutoregressiveDecoder(ToyLM(4, draft_branch=True, seed=3)).generate([0, 2], 10)
    assert torch.equal(greedy.tokens, reference.tokens)
