"""Heads that read the verified token ``c`` (``MTPHead(token_embedding=...)``, ``TokenInput``).

* the head: its parameters depend on ``c``; a fresh token input leaves the head's law unchanged;
  the training pass (``observed_log_parameters``) equals the circuit's query at the head's
  parameters for ``X_0``'s category (float64, every variant, compressed or not); clear errors;
* the decoder: the enumerated output law equals the target law (greedy, sampling, a compressed
  draft vocabulary, a draft-length rule), also under a regex constraint with the head x
  automaton product; greedy output equals autoregressive decoding eager and compiled;
* the loss gives slot 1 (the head's own input) weight 0; saving, loading, shipping and
  ``init_from`` keep the head.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_constrained_decoding import AUTOMATON, PRODUCT
from test_constrained_decoding import lm as constrained_lm
from test_training import config as training_config
from test_training import make_corpus, tiny_llama, train
from toy import (
    ToyLM,
    decoder_law,
    target_law,
    total_variation,
)
from toy_constrained import constrained_decoder_law, constrained_target_law

from circuits.errors import InvalidInputError
from circuits_llm.decoding.acceptance import CorrectionPolicy
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.heads import HeadConfigError, MTPHead, load_head, save_head
from circuits_llm.heads.config import FORMAT_VERSION
from circuits_llm.training import HeadTrainingConfig, TrainingConfigError, load_trained_head
from circuits_llm.training.loss import mtp_loss

RANKS = {"ff": 1, "hmm": 2, "btree": 2}
# the tiny training runs are far above 5% of a 35k-parameter model, by design
pytestmark = pytest.mark.filterwarnings("ignore::circuits_llm.heads.sizing.HeadBudgetWarning")
SAMPLING, GREEDY = SamplingConfig(1.0), SamplingConfig(0.0)


def token_head(hidden: int, vocab: int, architecture: str = "btree", window: int = 3,
               draft_tokens: tuple[int, ...] | None = None, variant: str = "full",
               seed: int = 0, scale: float = 1.0) -> MTPHead:
    """A float64 head that reads the token, every parameter random (the token input's output map
    included, so the head's law really depends on ``c``)."""
    generator = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64)
    embedding = torch.randn(vocab, 5, generator=generator, dtype=torch.float64)
    head = MTPHead.from_name(architecture, window, RANKS[architecture], hidden, vocab, variant,
                             lm_head, token_embedding=embedding, token_width=7,
                             draft_vocab=draft_tokens, dtype=torch.float64, seed=seed)
    with torch.no_grad():
        for parameter in head.parameters():
            if parameter.requires_grad:
                parameter.copy_(scale * torch.randn(parameter.shape, generator=generator,
                                                    dtype=parameter.dtype))
    return head.eval()


# ---------------------------------------------------------------------- the head
@pytest.mark.parametrize("draft_tokens", [None, (5, 1, 0, 7, 2)], ids=["full", "compressed"])
@pytest.mark.parametrize("variant", ["full", "lean"])
@pytest.mark.parametrize("architecture", list(RANKS))
def test_training_pass_equals_the_query_at_the_heads_parameters(
        architecture: str, variant: str, draft_tokens: tuple[int, ...] | None) -> None:
    head = token_head(6, 9, architecture, 4, draft_tokens, variant, seed=3)
    categories = head.draft_vocab_size
    hidden = torch.randn(7, 6, dtype=torch.float64)
    x = torch.randint(0, categories, (7, 4), generator=torch.Generator().manual_seed(1))
    observed = torch.rand(7, 4) < 0.7
    observed[:, 0] = True
    want = head.circuit.log_marginal(x, observed, params=head(hidden, x[:, 0]))
    got = head.circuit.log_marginal(torch.zeros_like(x), observed,
                                    params=head.observed_log_parameters(hidden, x))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # the law depends on c: another X_0 category gives other parameters
    other = head(hidden, (x[:, 0] + 1) % categories)
    assert any(not torch.allclose(other[k], v) for k, v in head(hidden, x[:, 0]).items())
    assert head.num_parameters() == head.expected_num_parameters()


@pytest.mark.parametrize("architecture", list(RANKS))
def test_a_fresh_token_input_leaves_the_head_unchanged(architecture: str) -> None:
    lm_head = torch.randn(11, 8, dtype=torch.float64)
    plain = MTPHead.from_name(architecture, 4, RANKS[architecture], 8, 11, "lean", lm_head,
                              dtype=torch.float64, sum_init_std=0.3, seed=4)
    reading = MTPHead.from_name(architecture, 4, RANKS[architecture], 8, 11, "lean", lm_head,
                                token_embedding=torch.randn(11, 3), dtype=torch.float64,
                                sum_init_std=0.3, seed=4)
    hidden = torch.randn(5, 8, dtype=torch.float64)
    with torch.no_grad():
        plain.load_state_dict(reading.state_dict(), strict=False)
        for key, value in plain(hidden).items():
            assert torch.equal(reading(hidden, torch.arange(5))[key], value), key
    assert reading.reads_token and not plain.reads_token
    assert reading.num_parameters() - plain.num_parameters() == 8 * (2 * 8 + 3 + 1)


def test_a_token_outside_the_categories_reads_as_no_token() -> None:
    """Category -1 (a verified token outside a compressed draft vocabulary: the round drafts
    after a stand-in) leaves that row's context unchanged, as a head without the token input
    would read it, while the other rows still mix their token in."""
    head = token_head(6, 9)
    hidden = torch.randn(2, 6, dtype=torch.float64)
    assert head.token_input is not None
    with torch.no_grad():
        mixed = head.token_input(hidden, torch.tensor([-1, 3]))
        assert torch.equal(mixed[0], hidden[0])
        assert not torch.allclose(mixed[1], hidden[1])
        ours = head(hidden, torch.tensor([-1, 3]))
        head.token_input.out.zero_()
        without = head(hidden, torch.tensor([0, 0]))
    for key, value in ours.items():
        torch.testing.assert_close(value[0], without[key][0], rtol=0, atol=0)


def test_token_errors_are_clear() -> None:
    head = token_head(6, 9)
    hidden = torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match="reads the verified token: pass token"):
        head(hidden)
    with pytest.raises(InvalidInputError, match=r"shape \(2,\)"):
        head(hidden, torch.zeros(3, dtype=torch.long))
    plain = MTPHead.from_name("ff", 3, 1, 6, 9, "full", dtype=torch.float64)
    with pytest.raises(InvalidInputError, match="reads the hidden state only"):
        plain(hidden, torch.zeros(2, dtype=torch.long))
    with pytest.raises(HeadConfigError, match=r"token_embedding must be a float tensor of shape "
                                              r"\(vocab_size, embedding size\) = \(9, d_e\)"):
        MTPHead.from_name("ff", 3, 1, 6, 9, "full", token_embedding=torch.zeros(8, 4))
    with pytest.raises(HeadConfigError, match="token_width must be None or an int >= 1"):
        MTPHead.from_name("ff", 3, 1, 6, 9, "full", token_embedding=torch.zeros(9, 4),
                          token_width=0)


# ---------------------------------------------------------------------- the decoder's law
@pytest.mark.parametrize(("architecture", "draft_tokens", "config"), [
    ("btree", None, "sampling"), ("ff", None, "sampling"), ("hmm", None, "top_k"),
    ("btree", (2, 0, 3), "sampling"), ("ff", (2, 0, 3), "greedy"), ("btree", None, "greedy"),
])
def test_enumerated_law_is_the_target_law(architecture: str,
                                          draft_tokens: tuple[int, ...] | None,
                                          config: str) -> None:
    cfg = {"sampling": SAMPLING, "greedy": GREEDY,
           "top_k": SamplingConfig(0.8, top_k=2)}[config]
    lm = ToyLM(4, draft_branch=True, seed=3)
    head = token_head(lm.hidden_size, 4, architecture, 3, draft_tokens, seed=1)
    for prompt in ([0, 2], [3, 1]):  # [3, 1]: c = 1 lies outside the compressed vocabulary
        exact = decoder_law(lm, head, prompt, 3, cfg)
        assert abs(sum(exact.values()) - 1) < 1e-12
        assert total_variation(exact, target_law(lm, prompt, 3, cfg)) <= 1e-9
    if not cfg.greedy:  # the negative control sees the token-reading head's drafts
        biased = decoder_law(lm, head, [0, 2], 3, cfg, CorrectionPolicy.DROP_AFTER_ACCEPT)
        assert total_variation(biased, target_law(lm, [0, 2], 3, cfg)) > 1e-3


def test_a_draft_length_rule_keeps_the_law() -> None:
    lm = ToyLM(3, draft_branch=True, seed=2)
    head = token_head(lm.hidden_size, 3, "btree", 4, seed=2, scale=2.0)
    rule = DraftLength.confident(0.5)
    exact = decoder_law(lm, head, [0, 1], 4, SAMPLING, draft_length=rule)
    assert total_variation(exact, target_law(lm, [0, 1], 4, SAMPLING)) <= 1e-9


def test_the_draft_reads_c_and_matches_the_conditionals() -> None:
    lm = ToyLM(4, draft_branch=True, seed=3)
    head = token_head(lm.hidden_size, 4, "btree", 3, (2, 0, 3), seed=1)
    program = RoundProgram(head, SAMPLING)
    hidden = torch.randn(1, lm.hidden_size, dtype=torch.float64)
    laws = []
    for c in (2, 3):
        uniforms = program.draw_uniforms(torch.Generator().manual_seed(0))
        draft = program.draft(hidden, torch.tensor([c]), uniforms)
        index = program.position[draft.tokens]  # type: ignore[index]
        expected = program.conditionals(hidden, c, index[None])[0]
        torch.testing.assert_close(draft.q, expected, rtol=0, atol=1e-12)
        laws.append(expected[0])
    assert not torch.allclose(laws[0], laws[1])  # the first draft's law depends on c


@pytest.mark.parametrize("config", ["sampling", "greedy"])
def test_the_constrained_product_law_is_the_constrained_law(config: str) -> None:
    cfg = SAMPLING if config == "sampling" else GREEDY
    model = constrained_lm()
    head = token_head(6, 5, "btree", 3, seed=2)
    want = constrained_target_law(model, AUTOMATON, [1, 2], 4, cfg)
    got = constrained_decoder_law(model, head, AUTOMATON, [1, 2], 4, cfg, PRODUCT)
    assert total_variation(got, want) < 1e-9


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_greedy_equals_autoregressive(compile: bool) -> None:
    from test_constrained_decoding import aot_eager

    from circuits_llm.runtime.compiling import use_compiler
    lm = ToyLM(4, draft_branch=True, order=2, seed=5, logit_scale=3.0)
    head = token_head(lm.hidden_size, 4, "btree", 3, seed=5, scale=3.0)
    with use_compiler(aot_eager):
        decoder = SpeculativeDecoder(lm, head, compile=compile)
        baseline = AutoregressiveDecoder(ToyLM(4, draft_branch=True, order=2, seed=5,
                                               logit_scale=3.0))
        accepted = 0
        for prompt in ([1, 2], [0, 3], [2, 2, 1, 0]):
            got = decoder.generate(prompt, 15)
            assert got.tokens.tolist() == baseline.generate(prompt, 15).tokens.tolist()
            accepted += got.summary.accepted
    assert accepted > 0


# ---------------------------------------------------------------------- loss, files, training
@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def test_the_loss_does_not_train_the_heads_own_input() -> None:
    head = token_head(6, 9, "btree", 3, seed=4)
    hidden = torch.randn(2, 8, 6, dtype=torch.float64)
    tokens = torch.randint(0, 9, (2, 8))
    out = mtp_loss(head, hidden, tokens)
    assert out.weights[0] == 0 and out.weights[1] == 0.8
    assert out.nll[0] > 0  # still reported
    out.loss.backward()
    assert head.token_input is not None and head.token_input.out.grad is not None
    assert head.token_input.out.grad.abs().sum() > 0
    reference = mtp_loss(head, hidden, tokens, materialise=True)
    torch.testing.assert_close(reference.loss, out.loss, rtol=0, atol=1e-10)


@pytest.mark.parametrize("draft_tokens", [None, (5, 1, 0, 7, 2)], ids=["full", "compressed"])
def test_save_and_load_keep_the_token_input(tmp_path: Path,
                                            draft_tokens: tuple[int, ...] | None) -> None:
    head = token_head(6, 9, "btree", 3, draft_tokens, "lean", seed=6)
    save_head(head, tmp_path)
    loaded = load_head(tmp_path)
    assert loaded.reads_token and loaded.token_input is not None
    assert loaded.token_input.width == 7 and loaded.token_input.embedding_size == 5
    hidden, token = torch.randn(3, 6, dtype=torch.float64), torch.tensor([0, 2, 4])
    for key, value in head(hidden, token).items():
        assert torch.equal(loaded(hidden, token)[key], value)
    assert f'"format_version": {FORMAT_VERSION}' in (tmp_path / "head_config.json").read_text()


def test_training_with_the_token_input_and_init_from(tmp_path: Path, corpus: Path) -> None:
    model = tiny_llama(seed=2)
    plain = training_config(architecture="btree", draft_vocab=64, steps=3, eval_every=3)
    first = train(tmp_path / "plain", corpus, plain, model)
    reading = dataclasses.replace(plain, token_input=True,
                                  init_from=str(tmp_path / "plain" / "head"))
    second = train(tmp_path / "reading", corpus, reading, model)
    # the token input starts at zero: the run starts where the first one ended
    assert second.initial_validation.nll[1:] == pytest.approx(first.validation.nll[1:], abs=1e-5)
    head, _ = load_trained_head(tmp_path / "reading", model)
    assert head.reads_token
    record = json.loads((tmp_path / "reading" / "training.json").read_text())
    assert record["head_size"]["parameters"] == record["head_parameters"] == \
        head.num_parameters()  # the token input counts against the budget
    assert not torch.equal(head.token_input.out, torch.zeros_like(head.token_input.out))
    assert HeadTrainingConfig.from_json(reading.to_json()) == reading
    wrong = dataclasses.replace(reading, rank=2)
    with pytest.raises(TrainingConfigError, match="does not fit this run's head"):
        train(tmp_path / "wrong", corpus, wrong, model)


def test_init_from_keeps_the_saved_heads_draft_vocabulary(tmp_path: Path, corpus: Path) -> None:
    """A fine-tune on other data (here another corpus, in practice added chat rows) drafts over
    the vocabulary of the head it starts from; a head of another vocabulary size is refused."""
    model = tiny_llama(seed=2)
    plain = training_config(architecture="ff", rank=1, draft_vocab=64, steps=2, eval_every=2)
    train(tmp_path / "plain", corpus, plain, model)
    saved, _ = load_trained_head(tmp_path / "plain", model)
    other = tmp_path / "other-corpus"
    other.mkdir()
    for path in corpus.iterdir():  # the same files (so the same splits), other text
        (other / path.name).write_text(path.read_text().upper())
    fresh = train(tmp_path / "fresh", other, plain, model)
    fine_tune = dataclasses.replace(plain, init_from=str(tmp_path / "plain" / "head"))
    tuned = train(tmp_path / "tuned", other, fine_tune, model)
    fresh_head, _ = load_trained_head(tmp_path / "fresh", model)
    tuned_head, _ = load_trained_head(tmp_path / "tuned", model)
    assert fresh_head.draft_tokens is not None and saved.draft_tokens is not None
    assert not torch.equal(fresh_head.draft_tokens, saved.draft_tokens)  # the data differ
    assert tuned_head.draft_tokens is not None
    assert torch.equal(tuned_head.draft_tokens, saved.draft_tokens)
    assert fresh.step == tuned.step == 2
    smaller = dataclasses.replace(fine_tune, draft_vocab=32)
    with pytest.raises(TrainingConfigError, match="drafts over 64 tokens, this run over 32"):
        train(tmp_path / "smaller", other, smaller, model)
