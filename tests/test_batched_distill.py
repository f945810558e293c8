"""Self-distillation at scale (issue 25, item 2): many prompts per forward give exactly the
one-at-a-time continuations (greedy) and the same law (sampling, per-row generators).

The tiny config-built Llama of ``test_self_distill`` runs in float64, so a batched forward and a
one-row forward agree to the last bit that matters for an argmax or a draw.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from test_self_distill import CONFIG
from test_tokens import tiny_subword_model, tiny_tokenizer
from transformers import PreTrainedModel

from circuits_llm.decoding.decoder import AutoregressiveDecoder
from circuits_llm.runtime.checkpoint import CheckpointError
from circuits_llm.text.tokens import TextTokenizer
from circuits_llm.training import self_distill as sd
from circuits_llm.training.datasets import training_streams


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.wrap(tiny_tokenizer(), "tiny")


@pytest.fixture(scope="module")
def model(tokenizer: TextTokenizer) -> PreTrainedModel:
    return tiny_subword_model(tokenizer.vocab_size, seed=2).double()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_corpus import write_corpus
    return write_corpus(tmp_path_factory.mktemp("batched-corpus"))


def plan_for(model: PreTrainedModel, tokenizer: TextTokenizer, corpus: Path, cache: Path,
             **changes: object) -> sd.DistillPlan:
    cfg = dataclasses.replace(CONFIG, **changes)
    train, validation = training_streams(cfg, tokenizer, corpus, cache)
    return sd.plan(model, tokenizer, cfg, train, validation)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_rows_equal_one_at_a_time_rows(model: PreTrainedModel, tokenizer: TextTokenizer,
                                               corpus: Path, tmp_path: Path,
                                               temperature: float) -> None:
    rows = {}
    for batch in (1, 5, 16, 22):
        plan = plan_for(model, tokenizer, corpus, tmp_path, distill_batch=batch,
                        distill_temperature=temperature)
        assert plan.batch_rows == batch and plan.key["batch_rows"] == batch
        assert plan.batches == math.ceil(22 / batch)
        rows[batch] = sd.generate_rows(model, plan, None)
    assert all(torch.equal(rows[1], other) for other in rows.values())
    decoder = AutoregressiveDecoder(model)
    for i in range(22):  # every row, training and validation: the one-row decoder's
        generator = torch.Generator().manual_seed(CONFIG.seed + i)
        again = decoder.generate(rows[1][i, :8], 8, temperature=temperature, generator=generator)
        assert again.tokens.tolist() == rows[16][i, 8:].tolist(), i
    if temperature == 0.0:  # greedy rows use no randomness: any generators give them
        other = [torch.Generator().manual_seed(1000 + i) for i in range(4)]
        again = sd.continue_rows(model, rows[1][:4, :8], 8, 0.0, other)
        assert torch.equal(again, rows[1][:4])


def test_each_row_is_distributed_as_the_model(model: PreTrainedModel, tokenizer: TextTokenizer,
                                              corpus: Path, tmp_path: Path) -> None:
    """One prompt repeated in one batch, row ``i`` seeded ``i``: the first sampled tokens are
    draws from the model's law at the temperature (Pearson's chi-square over the whole
    vocabulary, within 5 standard deviations of its mean), and not from the law at temperature 1
    (the check has the power to tell them apart)."""
    plan = plan_for(model, tokenizer, corpus, tmp_path)
    prompt, temperature, draws = plan.prompts[0], 0.3, 20000
    logits = model(input_ids=prompt[None]).logits[0, -1].detach()
    generators = [torch.Generator().manual_seed(i) for i in range(draws)]
    rows = sd.continue_rows(model, prompt.repeat(draws, 1), 1, temperature, generators)
    counts = torch.bincount(rows[:, -1], minlength=logits.shape[0]).double()

    def chi_square(law: torch.Tensor) -> float:
        expected = draws * law
        return float(((counts - expected) ** 2 / expected).sum())

    law = torch.softmax(logits / temperature, dim=-1)
    assert float(draws * law.min()) >= 5  # every cell large enough for the chi-square law
    freedom = logits.shape[0] - 1
    bound = freedom + 5 * math.sqrt(2 * freedom)
    assert chi_square(law) < bound
    assert chi_square(torch.softmax(logits, dim=-1)) > bound


def test_the_batch_size_is_part_of_the_cache_key(model: PreTrainedModel, tokenizer: TextTokenizer,
                                                  corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    plan = plan_for(model, tokenizer, corpus, tmp_path, distill_batch=8)
    sd.self_distilled_rows(model, plan, run, writer=True)
    other = plan_for(model, tokenizer, corpus, tmp_path, distill_batch=4)
    with pytest.raises(CheckpointError, match="generated with other settings"):
        sd.self_distilled_rows(model, other, run, writer=True)
    default = plan_for(model, tokenizer, corpus, tmp_path)  # 16: the key of earlier caches
    assert default.key["batch_rows"] == sd.BATCH_ROWS == 16


def test_progress_bar_shows_tokens_per_second(model: PreTrainedModel, tokenizer: TextTokenizer,
                                              corpus: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_for(model, tokenizer, corpus, tmp_path, distill_batch=11)
    sd.generate_rows(model, plan, tmp_path / "loud", progress=True)
    err = capsys.readouterr().err
    assert "self-distil" in err and "tokens_s=" in err and "22/22" in err
