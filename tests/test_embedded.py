"""The shipped byte-level model loads offline, matches its card, and is actually trained."""

from __future__ import annotations

import torch

from circuits_llm.embedded import EMBEDDED_MODEL_DIR, embedded_model_card, load_embedded_model
from circuits_llm.text.byte_level import VOCAB_SIZE, Split, corpus_files, pack
from circuits_llm.training.pretrain import bits_per_byte


def test_embedded_model_loads_and_matches_its_card() -> None:
    card = embedded_model_card()
    model = load_embedded_model()
    assert model.config.vocab_size == VOCAB_SIZE
    assert sum(p.numel() for p in model.parameters()) == card["parameters"]
    size = sum(f.stat().st_size for f in EMBEDDED_MODEL_DIR.iterdir())
    assert size <= 20 * 2**20, f"the embedded model must stay <= 20 MB, it is {size / 2**20:.1f} MB"
    assert float(card["test_bits_per_byte"]) <= 1.8


def test_embedded_model_predicts_held_out_python_far_better_than_chance() -> None:
    model = load_embedded_model()
    test = pack(corpus_files(Split.TEST)[:3])
    with torch.no_grad():
        measured = bits_per_byte(model, test, seq_len=256, max_windows=4)
    assert measured < 3.0  # an untrained model scores about log2(260) = 8 bits per byte
