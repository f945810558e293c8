"""``benchmarks/expected_acceptance_block.py``, the expected acceptance of draft blocks: the
recursive block's ``alpha1``, ``beta2`` and ``beta3`` (T = 1 and greedy), from one causal pass and
the masked recursive passes, equal the drafter driven step by step with explicit caches; a circuit
head on the block equals its joint law enumerated on the drafter's ``o_1``; greedy drafts are the
decoder's own; and a drafter that reads the wrong state at step 2 is told apart (float64, to
1e-9)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from draft_block_models import block_circuit_head, perturbed_block, tiny_llama
from toy import ToyHead

from benchmarks.acceptance_measures import (
    collect_positions,
    greedy_drafts,
    own_continuations,
    position_acceptance,
)
from benchmarks.expected_acceptance import table
from benchmarks.expected_acceptance_block import (
    BLOCK_LOAD_ERRORS,
    block_acceptance,
    block_features,
    block_measures,
    collect_block_positions,
    load_block_drafters,
    measure_block,
    measure_block_drafters,
    measure_head_on_block,
)
from circuits.compiled.queries import log_marginal
from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.draft_block import BlockCacheFollower, BlockDrafter, DraftBlock
from circuits_llm.draft_block.io import save_draft_block
from circuits_llm.heads import save_head

MODEL = tiny_llama(scale=4.0)
VOCAB = 48
NAN = float("nan")


def _texts(tokens: list[int], count: int = 3, length: int = 10, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    pool = torch.tensor(tokens)
    return [pool[torch.randint(0, len(tokens), (length,), generator=generator)]
            for _ in range(count)]


def _law(ids: list[int]) -> torch.Tensor:
    """The model's next-token logits after ``ids`` (a fresh forward, no cache)."""
    with torch.no_grad():
        return MODEL(torch.tensor([ids])).logits[0, -1].double()


def _close(measured: torch.Tensor, expected: list[float]) -> None:
    want = torch.tensor(expected, dtype=torch.float64)
    assert measured.shape == want.shape
    assert torch.equal(measured.isnan(), want.isnan())
    known = ~want.isnan()
    assert float((measured[known] - want[known]).abs().max()) <= 1e-9


def _brute_force_block(block: DraftBlock, texts: list[torch.Tensor], greedy: bool,
                       wrong_step: bool = False) -> tuple[list[float], list[float], list[float]]:
    """Per position: the drafter's own steps with an explicit cache (the text's verified pairs),
    steps 2 and 3 reading (previous output, the text's token); ``wrong_step``: step 2 reads the
    backbone's feature instead of the block's output (a drafter the measure must tell apart)."""
    draft = None if block.draft_tokens is None else block.draft_tokens.tolist()
    ids_of = list(range(VOCAB)) if draft is None else draft
    columns: tuple[list[float], list[float], list[float]] = ([], [], [])
    for text in texts:
        ids = text.tolist()
        _, hidden = HFBackbone(MODEL).hidden_states(text[None])
        for t in range(len(ids) - 3):
            drafter = BlockDrafter(block)
            drafter.begin(hidden[:, :t], text[1:t + 1])
            known = True
            with torch.no_grad():
                output = drafter.first_step(hidden[:, t], text[t + 1:t + 2])
                for a in range(1, 4):
                    if a >= 2:
                        known = known and ids[t + a] in ids_of
                        state = hidden[:, t + 1] if wrong_step and a == 2 else output
                        output = drafter.next_step(state, text[t + a:t + a + 1])
                    logits = block.logits(output)[0].double()
                    target = _law(ids[:t + a + 1])
                    if greedy:
                        value = float(ids_of[int(logits.argmax())] == int(target.argmax()))
                    else:
                        p = torch.softmax(target, -1)[ids_of]
                        value = float(torch.minimum(p, torch.softmax(logits, -1)).sum())
                    columns[a - 1].append(value if known else NAN)
    return columns


@pytest.mark.parametrize("greedy", [False, True], ids=["t1", "greedy"])
@pytest.mark.parametrize("draft", [None, list(range(0, VOCAB, 2))], ids=["full", "compressed"])
def test_the_recursive_block_equals_its_drafter_step_by_step(greedy: bool,
                                                             draft: list[int] | None) -> None:
    block = perturbed_block(MODEL, steps=3, layers=2, draft_vocab=draft)
    texts = _texts(list(range(VOCAB)))
    measured = block_acceptance(block, HFBackbone(MODEL), texts, greedy=greedy)
    alpha1, beta2, beta3 = _brute_force_block(block, texts, greedy)
    assert measured.alpha1.numel() == sum(len(t) - 3 for t in texts)
    _close(measured.alpha1, alpha1)
    _close(measured.beta2, beta2)
    assert measured.beta3 is not None
    _close(measured.beta3, beta3)
    assert bool(measured.peak.isnan().all()) == greedy
    if draft is not None:  # some positions condition on a token the block cannot draft
        assert bool(measured.beta2.isnan().any()) and not bool(measured.beta2.isnan().all())
    if not greedy:  # negative control: a step 2 that reads the feature, not o_1, is told apart
        _, wrong, _ = _brute_force_block(block, texts, greedy, wrong_step=True)
        known = ~measured.beta2.isnan()
        gap = (measured.beta2[known] - torch.tensor(wrong, dtype=torch.float64)[known]).abs()
        assert float(gap.max()) > 1e-3


def test_a_one_step_block_has_only_a_first_draft() -> None:
    block = perturbed_block(MODEL, steps=1)
    record = measure_block(block, HFBackbone(MODEL), _texts(list(range(VOCAB)), 2), greedy=True)
    for summary in (record["by_temperature"]["1"], record["greedy"]):
        assert summary["positions"] == 14 and summary["positions_beta2"] == 0
        assert summary["beta3"] is None and 0 <= summary["alpha1"] <= 1


def _joint(head: ToyHead, hidden: torch.Tensor) -> torch.Tensor:
    """The head's normalised joint over its window, (K,) * n, by enumeration."""
    with torch.no_grad():
        raw = head(hidden)
    k, n = head.circuit.category_sizes[0], head.window
    x = torch.tensor(list(itertools.product(range(k), repeat=n)))
    params = {name: value.expand(x.shape[0], *value.shape[1:]) for name, value in raw.items()}
    p = log_marginal(head.circuit, x, None, params).double().exp().view(*([k] * n))
    return p / p.sum()


#: the head's draft vocabulary, and the tokens the texts are drawn from (two outside it)
HEAD_VOCAB = [3, 7, 11, 20, 31, 47]
TEXT_TOKENS = [*HEAD_VOCAB, 5, 40]


def _brute_force_head(block: DraftBlock, head: ToyHead, texts: list[torch.Tensor], greedy: bool
                      ) -> tuple[list[float], list[float], list[float], int]:
    """Per position with ``c`` in the head's vocabulary: the joint enumerated on the drafter's
    ``o_1`` (greedy: its argmax given the evidence; exact MAP = max-product for a factorised
    head), against the model's law; and how many positions were skipped."""
    index = {token: i for i, token in enumerate(HEAD_VOCAB)}
    columns: tuple[list[float], list[float], list[float]] = ([], [], [])
    skipped = 0
    for text in texts:
        ids = text.tolist()
        _, hidden = HFBackbone(MODEL).hidden_states(text[None])
        for t in range(len(ids) - 3):
            if ids[t + 1] not in index:
                skipped += 1
                continue
            follower = BlockCacheFollower(block)
            follower.begin(hidden[:, :t], text[1:t + 1])
            with torch.no_grad():
                o1 = follower.first_step(hidden[:, t], text[t + 1:t + 2])
            joint = _joint(head, o1)[index[ids[t + 1]]]  # (K, K, K): X_1, X_2, X_3 given c
            for a in range(1, 4):
                known = all(token in index for token in ids[t + 2:t + a + 1])
                if not known:
                    columns[a - 1].append(NAN)
                    continue
                given = joint[tuple(index[token] for token in ids[t + 2:t + a + 1])]
                target = _law(ids[:t + a + 1])
                if greedy:
                    slot = int(given.argmax()) // (given.numel() // given.shape[0])
                    columns[a - 1].append(float(HEAD_VOCAB[slot] == int(target.argmax())))
                else:
                    q = given.flatten(1).sum(1) if given.dim() > 1 else given
                    q = q / q.sum()
                    p = torch.softmax(target, -1)[HEAD_VOCAB]
                    columns[a - 1].append(float(torch.minimum(p, q).sum()))
    return (*columns, skipped)


@pytest.mark.parametrize(("kind", "greedy"), [("btree", False), ("ff", False), ("ff", True)])
def test_a_head_on_the_block_equals_its_enumerated_joint(kind: str, greedy: bool) -> None:
    block = perturbed_block(MODEL, steps=3)
    head = ToyHead(kind, 4, 1 if kind == "ff" else 2, 32, VOCAB, seed=5, scale=2.0,
                   draft_tokens=HEAD_VOCAB)
    texts = _texts(TEXT_TOKENS, 3, 12)
    program = RoundProgram(head, SamplingConfig(temperature=1.0))
    positions, skipped = collect_block_positions(HFBackbone(MODEL), texts, program, block)
    measured = position_acceptance(program, positions, greedy=greedy)
    alpha1, beta2, beta3, expected_skipped = _brute_force_head(block, head, texts, greedy)
    assert skipped == expected_skipped > 0 and len(positions) == len(alpha1)
    _close(measured.alpha1, alpha1)
    _close(measured.beta2, beta2)
    assert measured.beta3 is not None
    _close(measured.beta3, beta3)
    assert int((~measured.beta3.isnan()).sum()) > 0


def test_greedy_drafts_are_the_decoders_max_product_completion() -> None:
    block = perturbed_block(MODEL, steps=3)
    head = ToyHead("btree", 4, 2, 32, VOCAB, seed=9, scale=3.0, draft_tokens=HEAD_VOCAB)
    greedy = RoundProgram(head, SamplingConfig(temperature=0.0))
    positions, _ = collect_block_positions(HFBackbone(MODEL), _texts(TEXT_TOKENS, 2, 12), greedy,
                                           block)
    position_of = {token: i for i, token in enumerate(HEAD_VOCAB)}
    for position in positions:
        decoded = greedy.draft(position.hidden, torch.tensor([position.c]), None).tokens
        evidence = torch.tensor([position_of[int(token)] for token in decoded[:2]])
        # given the decoder's own first drafts as evidence, every slot is the decoder's draft
        assert greedy_drafts(greedy, position.hidden, position.c, evidence).tolist() == \
            decoded.tolist()


def test_the_table_lists_blocks_and_heads_by_mode() -> None:
    block = perturbed_block(MODEL, steps=3)
    head = ToyHead("btree", 4, 2, 32, VOCAB, seed=5, draft_tokens=HEAD_VOCAB)
    backbone, texts = HFBackbone(MODEL), _texts(TEXT_TOKENS, 2, 12)
    rows = {"recursive block": measure_block(block, backbone, texts, greedy=True),
            "btree on block": measure_head_on_block(head, block, backbone, texts, [1.0],
                                                    greedy=True)}
    lines = table(rows).splitlines()
    assert len(lines) == 2 + 4
    assert lines[2].startswith("| recursive block | T = 1 | 18 |")
    assert lines[3].startswith("| recursive block | greedy | 18 |")
    assert lines[4].startswith("| btree on block | T = 1 |")
    for summary in (rows["recursive block"]["greedy"], rows["btree on block"]["greedy"]):
        assert math.isclose(summary["alpha1"] * summary["positions"],
                            round(summary["alpha1"] * summary["positions"]), abs_tol=1e-9)


def test_the_cli_loads_the_block_and_its_head_and_measures_both(tmp_path: Path) -> None:
    """``--block DIR --head HEAD_DIR``: the saved block and head load back (a head that cannot
    read the block, or no head at all, is one of the errors the CLI reports), and the rows are
    the block's and the head-on-block's measures of the originals."""
    block = perturbed_block(MODEL, steps=3)
    head = block_circuit_head(MODEL, "btree", 4, HEAD_VOCAB, seed=5)
    save_draft_block(block, tmp_path / "block", MODEL)
    save_head(head, tmp_path / "head")
    loaded_block, loaded_head = load_block_drafters(tmp_path / "block", tmp_path / "head", MODEL)
    assert load_block_drafters(tmp_path / "block", None, MODEL)[1] is None
    texts, logged = _texts(TEXT_TOKENS, 2, 12), []
    rows = measure_block_drafters(loaded_block, loaded_head, MODEL, texts, [1.0], greedy=True,
                                  log=logged.append)
    name = f"{head.architecture or 'head'} on block"
    assert list(rows) == ["recursive block", name]
    assert logged == ["recursive block: done", f"{name}: done"]
    backbone = HFBackbone(MODEL)
    expected = {"recursive block": measure_block(block, backbone, texts, greedy=True),
                name: measure_head_on_block(head, block, backbone, texts, [1.0], greedy=True)}
    for drafter, row in expected.items():
        for mode in ("greedy", "1"):
            want = row["greedy"] if mode == "greedy" else row["by_temperature"][mode]
            got = rows[drafter]["greedy"] if mode == "greedy" else \
                rows[drafter]["by_temperature"][mode]
            assert got.keys() == want.keys()
            for key, value in want.items():
                assert (got[key] is None) == (value is None), key
                assert value is None or math.isclose(got[key], value, abs_tol=1e-12), key
    # --int8: the same rows again for the block's int8 copy, measured on that copy
    from circuits_llm.draft_block.weights import int8_block
    both = measure_block_drafters(loaded_block, loaded_head, MODEL, texts, [1.0], greedy=True,
                                  int8=True)
    assert list(both) == ["recursive block", name, "recursive block, int8", f"{name}, int8"]
    assert both["recursive block"] == rows["recursive block"]
    int8_row = measure_block(int8_block(block), backbone, texts, greedy=True)
    assert both["recursive block, int8"] == int8_row
    assert int8_row != rows["recursive block"]  # the copy's laws differ (a little)
    with pytest.raises(BLOCK_LOAD_ERRORS):  # no head in the directory
        load_block_drafters(tmp_path / "block", tmp_path / "nothing", MODEL)
    narrow = block_circuit_head(tiny_llama(vocab=VOCAB + 2), "btree", 4, None)
    save_head(narrow, tmp_path / "other")
    with pytest.raises(BLOCK_LOAD_ERRORS, match="vocabulary"):  # a head for another target
        load_block_drafters(tmp_path / "block", tmp_path / "other", MODEL)


@pytest.mark.parametrize("first", [0, 4])
def test_the_measures_from_a_row_on_are_each_texts_tail(first: int) -> None:
    """``first``: the recursive block's per-position measures are each text's own from row
    ``first`` on, in text order; a circuit head's positions are the rows ``t >= first`` whose
    ``c`` is in its vocabulary, with the values they have when every row is measured."""
    block = perturbed_block(MODEL, steps=3)
    head = ToyHead("btree", 4, 2, 32, VOCAB, seed=5, draft_tokens=HEAD_VOCAB)
    backbone, texts = HFBackbone(MODEL), _texts(TEXT_TOKENS, 3, 12)
    for mode, measured in enumerate(block_measures(block, backbone, texts, first=first)):
        alone = [block_measures(block, backbone, [text])[mode] for text in texts]
        for field in ("alpha1", "beta2", "beta3", "peak"):
            got = getattr(measured, field)
            want = torch.cat([getattr(one, field)[first:] for one in alone])
            assert got.shape == (3 * (9 - first),)
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
    program = RoundProgram(head, SamplingConfig(temperature=1.0))
    features = block_features(block)
    positions, skipped = collect_positions(backbone, texts, program, features, first=first)
    every, _ = collect_positions(backbone, texts, program, features)
    rows = [t for text in texts for t in range(9) if int(text[t + 1]) in HEAD_VOCAB]
    kept = torch.tensor(rows) >= first
    assert len(every) == len(rows) and len(positions) == int(kept.sum())
    assert skipped == sum(int(text[t + 1]) not in HEAD_VOCAB
                          for text in texts for t in range(first, 9))
    tail = position_acceptance(program, positions)
    whole = position_acceptance(program, every)
    assert torch.equal(tail.alpha1, whole.alpha1[kept])
    assert torch.equal(tail.beta2.nan_to_num(), whole.beta2[kept].nan_to_num())


def test_own_continuations_are_the_models_plain_decoding() -> None:
    """Greedy: every appended token is the model's argmax after the text before it; sampled: the
    prompt kept, the same draws for the same seed, other draws for another text index."""
    texts = _texts(list(range(VOCAB)), 2, 6, seed=3)
    for text, extended in zip(texts, own_continuations(MODEL, texts, 5, 0.0), strict=True):
        assert extended.shape == (11,) and torch.equal(extended[:6], text)
        for k in range(6, 11):
            assert int(extended[k]) == int(_law(extended[:k].tolist()).argmax())
    twice = [texts[0], texts[0]]
    sampled = own_continuations(MODEL, twice, 8, 1.0, seed=7)
    assert all(torch.equal(s[:6], texts[0]) and s.shape == (14,) for s in sampled)
    assert torch.equal(sampled[0], own_continuations(MODEL, twice, 8, 1.0, seed=7)[0])
    assert not torch.equal(sampled[0], sampled[1])  # text 1 draws with seed 8
    assert torch.equal(sampled[1], own_continuations(MODEL, twice[:1], 8, 1.0, seed=8)[0])
