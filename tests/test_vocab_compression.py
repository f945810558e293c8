"""Compressed draft vocabularies (FR-Spec / FastMTP) for MTP heads, and the default head size.

* ``frequent_tokens`` / ``token_counts``: order, ties, always-included ids, streams, errors;
* a compressed head computes exactly the full head's logits at its K ids (FULL and LEAN), has K
  categories, K-sized parameters, and its loss skips windows whose prefix leaves the vocabulary
  (against a brute-force loop);
* the decoder with a compressed ``MTPHead`` keeps the LM's law exactly (enumeration, sampling
  and greedy), the biased correction as the negative control;
* save/load keeps and verifies the draft vocabulary and refuses another model in one error;
* default sizes within 5% of the backbone (SmolLM2-135M numbers), a warning naming the numbers
  for explicit sizes beyond it; ``train-head`` builds the vocabulary from its data, resumes
  exactly and records the size, the coverage and a step's peak memory.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from test_training import make_corpus, tiny_llama
from toy import ToyLM, decoder_law, target_law, total_variation

from circuits import StructureError, templates
from circuits_llm.decoding.decoder import AutoregressiveDecoder, CorrectionPolicy, SpeculativeDecoder
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.heads import HeadConfigError, HeadVariant, MTPHead, load_head, parameter_count, save_head
from circuits_llm.heads import vocab as vocab_module
from circuits_llm.heads.io import head_tensors
from circuits_llm.heads.sizing import HeadBudgetWarning, fit_head_size, kind_parameters
from circuits_llm.heads.vocab import TokenCounts, check_draft_tokens, frequent_tokens, token_counts
from circuits_llm.runtime.checkpoint import load_checkpoint
from circuits_llm.training import CHECKPOINT_FILE, HeadTrainingConfig, read_record, train_head
from circuits_llm.training.build import always_drafted
from circuits_llm.training.loss import mtp_loss

VARIANTS = [HeadVariant.FULL, HeadVariant.LEAN]
V, D = 11, 6
DRAFT = (4, 9, 0, 7, 2)


# ------------------------------------------------------------------------------ frequent tokens
def test_frequent_tokens_orders_by_count_then_id() -> None:
    counts = TokenCounts(torch.tensor([5, 0, 9, 5, 1, 9, 0, 2]))
    assert frequent_tokens(counts, 8).tolist() == [2, 5, 0, 3, 7, 4, 1, 6]
    assert frequent_tokens(counts, 3).tolist() == [2, 5, 0]
    # always-included ids take places, the rest are the most frequent others, order kept
    assert frequent_tokens(counts, 3, always=[6]).tolist() == [2, 5, 6]
    assert frequent_tokens(counts, 4, always=[3, 1]).tolist() == [2, 5, 3, 1]
    assert counts.coverage(torch.tensor([2, 5])) == pytest.approx(18 / 31)
    assert TokenCounts(torch.zeros(3, dtype=torch.long)).coverage(torch.tensor([0])) == 1.0


def test_token_counts_of_streams_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vocab_module, "COUNT_CHUNK", 7)  # many chunks per part
    generator = np.random.default_rng(0)
    ids = generator.integers(0, 50, size=1000).astype(np.uint16)
    path = tmp_path / "ids.bin"
    ids.tofile(path)
    mapped = np.memmap(path, dtype=np.uint16, mode="r")
    expected = np.bincount(ids, minlength=50)
    for source in (mapped, torch.from_numpy(ids.astype(np.int64)).view(10, 100),
                   [ids[:333], torch.tensor(ids[333:].astype(np.int64)), []]):
        assert token_counts(source, 50).counts.tolist() == expected.tolist()
    stream = frequent_tokens(mapped, 10, vocab_size=50)
    assert stream.tolist() == frequent_tokens(TokenCounts(torch.from_numpy(expected)), 10).tolist()


@pytest.mark.parametrize(("call", "message"), [
    (lambda: token_counts(torch.tensor([0, 5]), 5), "token id 5 is outside the vocabulary 0..4"),
    (lambda: token_counts(torch.tensor([-1]), 5), "token id -1 is outside"),
    (lambda: token_counts(torch.tensor([0.5]), 5), "token ids must be integers"),
    (lambda: frequent_tokens(torch.tensor([1, 2]), 2), "needs vocab_size"),
    (lambda: frequent_tokens(TokenCounts(torch.ones(4, dtype=torch.long)), 5), "int in 1..4"),
    (lambda: frequent_tokens(TokenCounts(torch.ones(4, dtype=torch.long)), 0), "int in 1..4"),
    (lambda: frequent_tokens(TokenCounts(torch.ones(4, dtype=torch.long)), 1, always=[0, 1]),
     "2 always-included ids do not fit in K = 1"),
    (lambda: frequent_tokens(TokenCounts(torch.ones(4, dtype=torch.long)), 2, always=[4]),
     "must lie in 0..3"),
    (lambda: TokenCounts(torch.tensor([1, -2])), "must be >= 0"),
    (lambda: check_draft_tokens([1, 1], 4), "distinct"),
    (lambda: check_draft_tokens([0, 4], 4), r"lie in 0\.\.3"),
    (lambda: check_draft_tokens([], 4), "non-empty"),
    (lambda: check_draft_tokens(torch.tensor([[0, 1]]), 4), "non-empty \\(K,\\) integer"),
])
def test_bad_vocabulary_inputs_are_clear_errors(call: object, message: str) -> None:
    with pytest.raises(HeadConfigError, match=message):
        call()  # type: ignore[operator]


# ------------------------------------------------------------------------------ the head
def heads(name: str, variant: HeadVariant, seed: int = 0) -> tuple[MTPHead, MTPHead]:
    """A full-vocabulary head with random parameters and the compressed head holding exactly its
    rows for the ids in DRAFT."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, D, generator=generator, dtype=torch.float64)
    rank = 1 if name == "ff" else 2
    full = MTPHead.from_name(name, 3, rank, D, V, variant, weight, dtype=torch.float64,
                             sum_init_std=0.5, seed=seed)
    with torch.no_grad():
        for p in full.parameters():
            if p.requires_grad:
                p.add_(0.5 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    small = MTPHead.from_name(name, 3, rank, D, V, variant, weight, draft_vocab=DRAFT,
                              dtype=torch.float64, seed=seed)
    ids = torch.tensor(DRAFT)
    state = {}
    for key, value in full.state_dict().items():
        if key.startswith("circuit."):
            continue
        if key.startswith(("inputs.weight.", "inputs.bias.")):
            value = value.index_select(2, ids)  # (F, K, V[, d]) -> the draft rows
        elif key == "inputs.lm_head":
            value = value.index_select(0, ids)
        state[key] = value
    small.load_state_dict({**state, "draft_tokens": ids}, strict=False)
    return full, small


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["ff", "cp", "hmm", "btree"])
def test_compressed_head_is_the_full_head_at_its_ids(name: str, variant: HeadVariant) -> None:
    full, small = heads(name, variant)
    assert (small.vocab_size, small.draft_vocab_size) == (V, len(DRAFT))
    assert small.draft_tokens is not None and small.draft_tokens.tolist() == list(DRAFT)
    assert full.draft_tokens is None and full.draft_vocab_size == V
    assert set(small.circuit.category_sizes) == {len(DRAFT)}
    assert "draft_tokens" in head_tensors(small) and "draft_tokens" not in head_tensors(full)
    states = torch.randn(4, D, dtype=torch.float64)
    big, compact = full(states), small(states)
    for fold, value in compact.items():
        expected = big[fold].index_select(3, torch.tensor(DRAFT)) if fold.startswith("input") \
            else big[fold]
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-12)
    assert small.num_parameters() == small.expected_num_parameters() == parameter_count(
        variant, small.input_units, small.sum_weights, D, len(DRAFT), True, small.lean_rank)
    per_category = D + 1 if variant is HeadVariant.FULL else 1  # unembedding row + bias, or bias
    assert full.num_parameters() - small.num_parameters() == \
        full.input_units * (V - len(DRAFT)) * per_category
    assert small.double().draft_tokens.dtype == torch.long  # dtype casts leave the ids alone


def test_compressed_head_needs_a_circuit_over_its_draft_vocabulary() -> None:
    circuit = templates.build("cp", num_variables=3, num_categories=V, rank=2)
    with pytest.raises(StructureError, match=r"Categorical\(5\) \(the draft vocabulary size\)"):
        MTPHead(circuit, D, V, draft_vocab=DRAFT)
    with pytest.raises(HeadConfigError, match="distinct"):
        MTPHead.from_name("cp", 3, 2, D, V, draft_vocab=[1, 1])


def brute_force_nll(head: MTPHead, hidden: torch.Tensor, tokens: torch.Tensor,
                    ) -> tuple[list[float], list[int]]:
    """Per slot: summed NLL and count over windows whose targets up to the slot are all inside
    the draft vocabulary, one marginal query per (window, slot)."""
    ids = head.draft_tokens.tolist()
    n = head.window
    sums, counts = [0.0] * n, [0] * n
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            params = head(hidden[b, t][None])
            x = torch.zeros(1, n, dtype=torch.long)
            for j in range(1, n + 1):
                if t + j >= tokens.shape[1] or int(tokens[b, t + j]) not in ids:
                    break
                x[0, j - 1] = ids.index(int(tokens[b, t + j]))
                upto, before = torch.arange(n) < j, torch.arange(n) < j - 1
                joint = head.circuit.log_marginal(x, upto, params)
                prefix = head.circuit.log_marginal(x, before, params) if j > 1 else 0.0
                sums[j - 1] += float((prefix - joint).detach())
                counts[j - 1] += 1
    return sums, counts


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_of_a_compressed_head_skips_windows_leaving_the_vocabulary(variant: HeadVariant) -> None:
    _, head = heads("btree", variant, seed=3)
    generator = torch.Generator().manual_seed(4)
    tokens = torch.tensor(DRAFT)[torch.randint(0, len(DRAFT), (2, 8), generator=generator)]
    tokens[0, 3], tokens[1, 6], tokens[1, 0] = 1, 10, 3  # outside (the first only as a context)
    hidden = torch.randn(2, 8, D, generator=generator, dtype=torch.float64)
    out = mtp_loss(head, hidden, tokens)
    sums, counts = brute_force_nll(head, hidden, tokens)
    assert out.count.tolist() == counts and counts[0] < 2 * 7  # some windows were skipped
    torch.testing.assert_close(out.nll_sum, torch.tensor(sums, dtype=torch.float64), rtol=0,
                               atol=1e-10)
    # a batch whose every target is outside: loss 0 (not an input error), still differentiable
    outside = torch.tensor([[1, 3, 5, 6]])
    empty = mtp_loss(head, hidden[:1, :4], outside)
    assert float(empty.loss) == 0 and empty.loss.requires_grad and int(empty.count.sum()) == 0


# ------------------------------------------------------------------------------ exact decoding
def toy_head(lm: ToyLM, variant: HeadVariant, architecture: str, draft: tuple[int, ...],
             window: int = 3, seed: int = 0) -> MTPHead:
    head = MTPHead.from_name(architecture, window, 1 if architecture == "ff" else 2,
                             lm.hidden_size, lm.vocab_size, variant, lm.lm_head,
                             draft_vocab=draft, dtype=torch.float64, sum_init_std=0.7,
                             init_noise=0.5, seed=seed)
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.5 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return head.eval()


@pytest.mark.parametrize(("variant", "architecture"), [(HeadVariant.LEAN, "btree"),
                                                       (HeadVariant.FULL, "cp")])
def test_decoding_with_a_compressed_mtp_head_keeps_the_law(variant: HeadVariant,
                                                           architecture: str) -> None:
    lm = ToyLM(4, draft_branch=True, seed=3)
    head = toy_head(lm, variant, architecture, (2, 0, 3))  # token 1 is never drafted
    config = SamplingConfig(1.0)
    for prompt in ([0, 2], [3, 1]):  # the second ends outside the draft vocabulary
        exact = decoder_law(lm, head, prompt, 3, config)
        assert total_variation(exact, target_law(lm, prompt, 3, config)) <= 1e-9
    biased = decoder_law(lm, head, [0, 2], 3, config, CorrectionPolicy.DROP_AFTER_ACCEPT)
    assert total_variation(biased, target_law(lm, [0, 2], 3, config)) > 1e-3
    greedy = SpeculativeDecoder(lm, head).generate([0, 2], 12)
    reference = AutoregressiveDecoder(ToyLM(4, draft_branch=True, seed=3)).generate([0, 2], 12)
    assert torch.equal(greedy.tokens, reference.tokens)


# ------------------------------------------------------------------------------ save / load
@pytest.mark.parametrize("variant", VARIANTS)
def test_save_load_keeps_and_verifies_the_draft_vocabulary(tmp_path: Path,
                                                           variant: HeadVariant) -> None:
    _, head = heads("hmm", variant)
    head.model_fingerprint = "ab" * 32
    directory = tmp_path / "head"
    save_head(head, directory)
    config = json.loads((directory / "head_config.json").read_text())
    assert config["draft_vocab_size"] == len(DRAFT) and config["model_fingerprint"] == "ab" * 32
    loaded = load_head(directory, expected_hidden_size=D, expected_vocab_size=V,
                       expected_fingerprint="ab" * 32)
    assert loaded.draft_tokens.tolist() == list(DRAFT) and loaded.model_fingerprint == "ab" * 32
    states = torch.randn(3, D, dtype=torch.float64)
    for fold, value in head(states).items():
        assert torch.equal(loaded(states)[fold], value)
    with pytest.raises(HeadConfigError, match="built for a model with another configuration"):
        load_head(directory, expected_fingerprint="cd" * 32)
    with pytest.raises(HeadConfigError, match="vocabulary has 12"):
        load_head(directory, expected_vocab_size=12)


def _rewrite_tensors(directory: Path, change: dict[str, torch.Tensor | None]) -> None:
    """Replace tensors of a saved head and re-record the file's checksum (a consistent file)."""
    from safetensors.torch import load_file, save_file

    from circuits.files import sha256_file
    path = directory / "head.safetensors"
    tensors = load_file(str(path))
    for name, value in change.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    save_file(tensors, str(path))
    config_path = directory / "head_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "tensors_sha256": sha256_file(path)}))


@pytest.mark.parametrize(("change", "message"), [
    ({"draft_tokens": torch.tensor([4, 9, 0, 7, 7])}, "invalid: draft_vocab ids must be distinct"),
    ({"draft_tokens": torch.tensor([9, 4, 0, 7, 2])}, "does not match the 5 int64 ids and checksum"),
    ({"draft_tokens": torch.tensor([4, 9, 0, 7, 2], dtype=torch.int32)}, "does not match"),
    ({"draft_tokens": torch.tensor([4, 9, 0, 7, 11])}, r"lie in 0\.\.10"),
    ({"draft_tokens": None}, "lacks the draft_tokens its config records"),
])
def test_tampered_draft_vocabulary_is_refused(tmp_path: Path, change: dict, message: str) -> None:
    _, head = heads("cp", HeadVariant.LEAN)
    save_head(head, tmp_path)
    _rewrite_tensors(tmp_path, change)
    with pytest.raises(HeadConfigError, match=message):
        load_head(tmp_path)


def test_version_1_heads_still_load_and_extra_tokens_are_refused(tmp_path: Path) -> None:
    full, _ = heads("cp", HeadVariant.FULL)
    save_head(full, tmp_path)
    config_path = tmp_path / "head_config.json"
    config = json.loads(config_path.read_text())
    old = {k: v for k, v in config.items()
           if k not in ("draft_vocab_size", "draft_tokens_sha256", "model_fingerprint")}
    config_path.write_text(json.dumps({**old, "format_version": 1}))
    assert load_head(tmp_path).draft_tokens is None
    _rewrite_tensors(tmp_path, {"draft_tokens": torch.tensor([0, 1])})
    with pytest.raises(HeadConfigError, match="config records no draft vocabulary"):
        load_head(tmp_path)


# ------------------------------------------------------------------------------ default sizes
SMOLLM2 = {"hidden": 576, "vocab": 49152, "parameters": 134_515_008}


@pytest.mark.parametrize("kind", ["ff", "cp", "hmm", "btree"])
@pytest.mark.parametrize("window", [4, 6, 8, 16])
def test_default_heads_for_smollm2_are_within_five_percent(kind: str, window: int) -> None:
    size = fit_head_size(kind, window, SMOLLM2["hidden"], SMOLLM2["vocab"], HeadVariant.LEAN,
                         SMOLLM2["parameters"])
    assert size.within_budget and size.parameters <= 0.05 * SMOLLM2["parameters"]
    assert size.draft_vocab in (8192, 4096) and "draft_vocab" in size.automatic
    assert size.rank == 1 if kind == "ff" else size.rank in (32, 16, 8)
    assert size.parameters == kind_parameters(kind, window, size.rank, SMOLLM2["hidden"],
                                              size.draft_vocab, HeadVariant.LEAN)
    # the choice is the first fitting one: the previous candidate in the ladders does not fit
    if size.rank == 16 and size.draft_vocab == 8192:
        bigger = kind_parameters(kind, window, 32, SMOLLM2["hidden"], 4096, HeadVariant.LEAN)
        assert bigger > size.budget


def test_sizes_are_those_of_the_built_heads() -> None:
    for kind in ("ff", "cp", "hmm", "btree"):
        for variant in VARIANTS:
            rank = 1 if kind == "ff" else 3
            head = MTPHead.from_name(kind, 5, rank, D, V, variant, torch.randn(V, D),
                                     draft_vocab=DRAFT, lean_rank=3)
            assert kind_parameters(kind, 5, rank, D, len(DRAFT), variant, 3) == head.num_parameters()


def test_explicit_sizes_are_kept_and_small_vocabularies_not_compressed() -> None:
    big = fit_head_size("btree", 16, 576, 49152, HeadVariant.LEAN, 134_515_008, rank=32,
                        draft_vocab=8192)
    assert (big.rank, big.draft_vocab, big.within_budget) == (32, 8192, False)
    message = big.over_budget_message("the btree head")
    assert re.search(r"17,2\d\d,\d\d\d trainable parameters, more than 5% of the backbone's "
                     r"134,515,008 \(6,725,750\); explicitly chosen: rank=32, draft_vocab=8192",
                     message), message
    assert fit_head_size("cp", 4, 64, 49152, HeadVariant.LEAN, 10 ** 9,
                         draft_vocab=10 ** 6).draft_vocab is None  # K >= V: the whole vocabulary
    byte = fit_head_size("btree", 16, 256, 260, HeadVariant.LEAN, 3_300_000)
    assert byte.draft_vocab is None and byte.within_budget and byte.rank in (1, 2)
    tiny = fit_head_size("btree", 16, 256, 260, HeadVariant.FULL, 10_000)
    assert not tiny.within_budget and tiny.rank == 1  # none fits: the smallest default
    assert "even the smallest default size" in tiny.over_budget_message("x")
    with pytest.raises(HeadConfigError, match="fraction in \\(0, 1\\]"):
        fit_head_size("cp", 4, 8, 10, HeadVariant.LEAN, 100, fraction=1.5)


# ------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def config(**changes: object) -> HeadTrainingConfig:
    base = HeadTrainingConfig(architecture="cp", window=3, rank=2, seq_len=20, batch_size=3,
                              learning_rate=1e-2, steps=5, eval_every=5, eval_windows=3,
                              checkpoint_every_s=0.0, seed=2, draft_vocab=48)
    return dataclasses.replace(base, **changes)


def test_train_head_drafts_over_the_frequent_tokens_and_resumes_exactly(tmp_path: Path,
                                                                        corpus: Path) -> None:
    cfg = config()
    with pytest.warns(HeadBudgetWarning, match="explicitly chosen: rank=2, draft_vocab=48"):
        whole = train_head(tiny_llama(), cfg, tmp_path / "whole", progress=False,
                           corpus_root=corpus)
    record = read_record(tmp_path / "whole")
    head = load_head(tmp_path / "whole" / "head")
    tokens = head.draft_tokens.tolist()
    assert len(tokens) == 48 and 257 in tokens  # EOS is always drafted
    assert head.draft_vocab_size == 48 and head.vocab_size == 260
    text = b"".join(p.read_bytes() for p in sorted(corpus.glob("*.py")))
    counts = np.bincount(np.frombuffer(text, np.uint8), minlength=256)
    assert int(np.argmax(counts)) in tokens  # the most frequent byte of the corpus
    assert record["head_size"]["draft_vocab"] == 48 and not record["head_size"]["within_budget"]
    assert 0.5 < record["draft_vocab_coverage"] <= 1.0
    peak = record["peak_step_memory"]
    assert peak["bytes"] > 0 and peak["kind"] in ("cpu_peak_rss", "cpu_peak_rss_lifetime")
    assert all(entry["peak_step_memory_bytes"] > 0 for entry in record["history"][1:])
    assert record["history"][0]["peak_step_memory_bytes"] is None  # before the first step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeadBudgetWarning)
        train_head(tiny_llama(), cfg, tmp_path / "split", progress=False, corpus_root=corpus,
                   max_steps=2)
        second = train_head(tiny_llama(), cfg, tmp_path / "split", progress=False,
                            corpus_root=corpus)
    a = load_checkpoint(tmp_path / "whole" / CHECKPOINT_FILE, "circuits_llm.train_head")["head"]
    b = load_checkpoint(tmp_path / "split" / CHECKPOINT_FILE, "circuits_llm.train_head")["head"]
    assert a.keys() == b.keys() and "draft_tokens" in a
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert whole.validation == second.validation


def test_eos_ids_come_from_the_generation_and_model_configs() -> None:
    model = tiny_llama()
    model.generation_config.eos_token_id = [257, 3]
    assert always_drafted(model) == [3, 257]
