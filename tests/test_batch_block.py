"""A draft block in a batch of prompts (circuits_llm/draft_block/batch.py): each row keeps its own
block state and decodes exactly as if alone, for recursive drafting (BlockDrafter) and a circuit
on the block (BlockCircuitDrafter).

* greedy: every row of a batch of rows of different lengths (one of one token) is
  ``model.generate`` on that row alone, and rows accept different numbers of drafts;
* per-row generators: every row draws exactly the tokens the single-prompt decoder draws;
* each row's every draft (block and ``q``) is what a FRESH drafter, begun on that row's history,
  drafts from the same uniforms, so the law the rows sample is the single-prompt law, which is
  enumerated here per prompt (rows of different lengths) and equals the target's; a wrong ``q``
  is detected, and so is a row drafting from another row's history;
* a chi-square of the batch's sampled rows (one shared generator) against the target law, and the
  biased correction policy decoded the same way is rejected (negative control);
* each row's block cache equals a fresh prefill of the block over that row's sequence after
  several rounds, and the batched prefill's features each row's cache begins with are that
  row's own;
* a context drafter that is not a draft block's is refused with one clear error.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from draft_block_models import (
    NextTokenLogits,
    greedy_continuation_features,
    greedy_generate,
    perturbed_block,
    tiny_llama,
)
from toy import add_outcomes, continuation_law, law_p_value, target_law, total_variation

from circuits_llm.backbone import HFBackbone
from circuits_llm.backbone.ragged_cache import RaggedCache
from circuits_llm.decoding.acceptance import CorrectionPolicy, round_law
from circuits_llm.decoding.batch import RowState, SpeculativeRows
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.metrics import BatchResult
from circuits_llm.decoding.warping import DecoderError, SamplingConfig, target_probs, warp_logits
from circuits_llm.draft_block import (
    BatchDepth,
    BlockCacheFollower,
    BlockCircuitDrafter,
    BlockDrafter,
    DraftBlock,
    DraftBlockError,
)
from circuits_llm.draft_block import batch as block_batch
from circuits_llm.draft_block.training import BlockFeatures, train_block
from circuits_llm.heads import MTPHead
from circuits_llm.training.block_circuit import train_block_head

MODEL = tiny_llama(scale=8.0)
PROMPTS = [[1, 5, 7, 9, 3], [1], [4, 2, 2], [1, 5]]
LIMITS = [15, 12, 6, 9]
KINDS = ["recursive", "circuit"]
WARPS = {"temperature": SamplingConfig(1.0), "top_k": SamplingConfig(0.7, top_k=5)}


def _generate(prompt: list[int], count: int) -> list[int]:
    return greedy_generate(MODEL, prompt, count)


@pytest.fixture(scope="module")
def greedy_features() -> BlockFeatures:
    """Prefill features of the model's own greedy continuations of random prompts."""
    return greedy_continuation_features(MODEL)


@pytest.fixture(scope="module")
def drafters(greedy_features: BlockFeatures) -> dict[str, BlockDrafter | BlockCircuitDrafter]:
    """Each kind's drafter, trained once (every generate begins its drafter anew)."""
    return {kind: _drafter(kind, greedy_features) for kind in KINDS}


def _drafter(kind: str, features: BlockFeatures) -> BlockDrafter | BlockCircuitDrafter:
    """A block (and, for ``circuit``, a BTree head on it) trained briefly on the model's greedy
    text, so that rounds accept drafts and rows accept different numbers of them."""
    block = perturbed_block(MODEL, layers=2, draft_vocab=list(range(0, 48, 2)))
    generator = torch.Generator().manual_seed(1)
    train_block(block, features, depths=3, steps=60, lr=1e-2, generator=generator)
    if kind == "recursive":
        return BlockDrafter(block)
    embedding = MODEL.get_input_embeddings().weight
    head = MTPHead.from_name("btree", 4, 2, 32, 48, lm_head_weight=MODEL.lm_head.weight,
                             draft_vocab=list(range(0, 48, 3)), dtype=torch.float64,
                             sum_init_std=0.5, init_noise=0.3, seed=0,
                             token_embedding=embedding).eval()
    train_block_head(block, head, features, steps=40, lr=1e-2, generator=generator)
    return BlockCircuitDrafter(block, head)


def _fresh(drafter: BlockCacheFollower, sequence: list[int]) -> tuple[BlockCacheFollower, Any]:
    """A new drafter of ``drafter``'s kind begun on ``sequence``'s prefill (as the single-prompt
    decoder begins it), and the backbone's feature at its last cached token (``None`` for one
    token)."""
    fresh = BlockDrafter(drafter.block) if isinstance(drafter, BlockDrafter) else \
        BlockCircuitDrafter(drafter.block, drafter.head)  # type: ignore[attr-defined]
    if len(sequence) < 2:
        fresh.begin(torch.zeros(1, 0, 32, dtype=torch.float64), torch.zeros(0, dtype=torch.long))
        return fresh, None
    _, hidden = HFBackbone(MODEL).hidden_states(torch.tensor([sequence[:-1]]))
    fresh.begin(hidden[:, :-1], torch.tensor(sequence[1:-1], dtype=torch.long))
    return fresh, hidden[:, -1]


@pytest.fixture(params=["one-call", "per-row"])
def steps(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How a round's block steps run: every row's in one block call (the default), or one call
    per row (circuits_llm.draft_block.batch.ONE_BLOCK_CALL)."""
    monkeypatch.setattr(block_batch, "ONE_BLOCK_CALL", request.param == "one-call")
    return str(request.param)


def _record_drafts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], Any]]:
    """Record every row's history (prompt + output: its last token is ``c``) with its draft."""
    records: list[tuple[list[int], Any]] = []
    draft = SpeculativeRows.draft

    def recording(self: SpeculativeRows, rows: list[RowState], config: SamplingConfig) -> Any:
        made = draft(self, rows, config)
        records.extend((row.prompt + row.output, made_row) for row, made_row in zip(rows, made, strict=True))
        return made

    monkeypatch.setattr(SpeculativeRows, "draft", recording)
    return records


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_rows_equal_generate(kind: str, steps: str, drafters: dict[str, Any]) -> None:
    drafter = drafters[kind]
    decoder = SpeculativeDecoder(MODEL, drafter)
    result = decoder.generate(PROMPTS, LIMITS, eos_token_id=())
    assert isinstance(result, BatchResult)
    assert result.tokens == [_generate(prompt, count) for prompt, count in zip(PROMPTS, LIMITS, strict=True)]
    assert result.summary.backbone_calls == result.summary.rounds + 1
    accepted = [[round_.accepted for round_ in row.rounds] for row in result.rows]
    assert sum(map(sum, accepted)) > 0
    assert any(len({row[r] for row in accepted if r < len(row)}) > 1
               for r in range(max(map(len, accepted))))  # rows accept different counts
    for prompt, count, row in zip(PROMPTS, LIMITS, result.rows, strict=True):
        alone = decoder.generate(prompt, count, eos_token_id=())
        assert [r.accepted for r in alone.rounds] == [r.accepted for r in row.rounds]


@pytest.mark.parametrize("warp", list(WARPS))
@pytest.mark.parametrize("kind", KINDS)
def test_each_row_draws_what_it_draws_alone(kind: str, warp: str, steps: str,
                                            drafters: dict[str, Any]) -> None:
    decoder = SpeculativeDecoder(MODEL, drafters[kind])
    config, seeds = WARPS[warp], [11, 12, 13, 14]
    alone = [decoder.generate(prompt, count, config.temperature, config.top_k,
                              generator=torch.Generator().manual_seed(seed),
                              eos_token_id=()).tokens.tolist()
             for prompt, count, seed in zip(PROMPTS, LIMITS, seeds, strict=True)]
    result = decoder.generate(PROMPTS, LIMITS, config.temperature, config.top_k,
                              generator=[torch.Generator().manual_seed(seed) for seed in seeds],
                              eos_token_id=())
    assert result.tokens == alone
    assert result.summary.accepted > 0


OPTIONS = {"copy": {"lookup": ContextLookup((0.3, 0.6))},
           "confident": {"draft_length": DraftLength.confident(0.3, minimum=0)},
           "both": {"lookup": ContextLookup((0.5,)),
                    "draft_length": DraftLength.confident(0.2, minimum=1)}}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kind", KINDS)
def test_rows_with_the_copy_and_a_rule_decode_as_alone(kind: str, option: str, steps: str,
                                                       drafters: dict[str, Any]) -> None:
    """With the context copy and/or a confident-drafts rule, every row of a batch makes the
    single-prompt decoder's rounds (the same drafts verified and accepted) and tokens: greedy,
    and sampling with per-row generators; greedy is ``generate`` on the row alone."""
    decoder = SpeculativeDecoder(MODEL, drafters[kind], **OPTIONS[option])
    plain = SpeculativeDecoder(MODEL, drafters[kind])
    seeds = [21, 22, 23, 24]
    for temperature in (0.0, 1.0):
        alone = [decoder.generate(prompt, count, temperature,
                                  generator=torch.Generator().manual_seed(seed), eos_token_id=())
                 for prompt, count, seed in zip(PROMPTS, LIMITS, seeds, strict=True)]
        result = decoder.generate(PROMPTS, LIMITS, temperature,
                                  generator=[torch.Generator().manual_seed(s) for s in seeds],
                                  eos_token_id=())
        assert result.tokens == [a.tokens.tolist() for a in alone]
        for row, single in zip(result.rows, alone, strict=True):
            assert [(r.drafted, r.accepted) for r in row.rounds] == \
                [(r.drafted, r.accepted) for r in single.rounds]
        if temperature == 0:
            assert result.tokens == [_generate(prompt, count)
                                     for prompt, count in zip(PROMPTS, LIMITS, strict=True)]
        # the option changed the rounds (a rule verified fewer drafts, or the copy was drafted)
        without = plain.generate(PROMPTS, LIMITS, temperature,
                                 generator=[torch.Generator().manual_seed(s) for s in seeds],
                                 eos_token_id=())
        assert [[(r.drafted, r.accepted) for r in row.rounds] for row in result.rows] != \
            [[(r.drafted, r.accepted) for r in row.rounds] for row in without.rows]


@pytest.mark.parametrize("kind", KINDS)
def test_every_draft_is_a_fresh_drafters_on_the_rows_history(
        kind: str, steps: str, drafters: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The q each row's drafts are drawn from is the one its own history gives (what the
    enumeration below weights paths with); a row drafting from another row's history would be
    caught (negative control)."""
    drafter = drafters[kind]
    decoder = SpeculativeDecoder(MODEL, drafter)
    records = _record_drafts(monkeypatch)
    config = SamplingConfig(1.0)
    generator = torch.Generator().manual_seed(5)
    decoder.generate(PROMPTS, LIMITS, 1.0, generator=generator, eos_token_id=())
    assert len(records) > 12
    swapped = 0
    for b, (history, made) in enumerate(records):
        fresh, hidden = _fresh(drafter, history)
        program = fresh.round_program(config)  # type: ignore[attr-defined]
        want = program.draft(hidden, torch.tensor([history[-1]]), made.uniforms)
        assert torch.equal(made.draft.block, want.block)
        torch.testing.assert_close(made.draft.q, want.q, rtol=0, atol=1e-12)
        other = records[(b + 1) % len(records)][0]
        if other[:-1] != history[:-1] and len(other) > 1:  # another row's history, same tape
            fresh, hidden = _fresh(drafter, other[:-1] + history[-1:])
            wrong = fresh.round_program(config).draft(  # type: ignore[attr-defined]
                hidden, torch.tensor([history[-1]]), made.uniforms)
            swapped += int(not torch.allclose(wrong.q, made.draft.q, rtol=0, atol=1e-6))
    assert swapped > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
def test_each_rows_cache_equals_a_fresh_prefill(kind: str, temperature: float, steps: str,
                                                drafters: dict[str, Any],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    drafter = drafters[kind]
    before = (drafter.length, drafter.cache.get_seq_length())
    decoder = SpeculativeDecoder(MODEL, drafter)
    started: list[tuple[Any, Any]] = []  # (the batch's block rows, a row's state)
    start = SpeculativeRows.start

    def recording(self: SpeculativeRows, row: RowState, features: Any) -> None:
        start(self, row, features)
        started.append((self.block_rows, row.context))

    monkeypatch.setattr(SpeculativeRows, "start", recording)
    result = decoder.generate(PROMPTS, LIMITS, temperature, eos_token_id=(),
                              generator=torch.Generator().manual_seed(2))
    assert len(started) == len(PROMPTS)
    assert (drafter.length, drafter.cache.get_seq_length()) == before  # the decoder's own
    for prompt, (rows, row), tokens in zip(PROMPTS, started, result.tokens, strict=True):
        sequence = prompt + tokens
        cache, length = rows.flushed(row)
        fresh, _ = _fresh(drafter, sequence)
        fresh.flush()
        held = min(length, fresh.length)
        assert held >= len(sequence) - 2 - (drafter.window - 1)  # type: ignore[attr-defined]
        assert held > len(prompt)
        for ours, theirs in zip(cache.layers, fresh.cache.layers, strict=True):
            torch.testing.assert_close(ours.keys[..., :held, :], theirs.keys[..., :held, :],
                                       rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(ours.values[..., :held, :], theirs.values[..., :held, :],
                                       rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------- the law, by enumeration
VOCAB = 4
SMALL = tiny_llama(vocab=VOCAB, scale=3.0)
SMALL_PROMPTS = [[1, 2, 0], [2], [0, 1]]  # each of whose laws a wrong q changes, both warps


def _decoder_law(block: DraftBlock, prompt: list[int], length: int, config: SamplingConfig,
                 wrong_q: bool = False) -> dict[tuple[int, ...], float]:
    """The single-prompt decoder's law of ``length`` tokens after ``prompt`` (two recursive
    drafts a round), each history's q from a fresh block prefill."""
    ids = block.draft_tokens
    assert block.window == 3 and ids is not None
    backbone = HFBackbone(SMALL)

    def law_of(logits: torch.Tensor) -> torch.Tensor:  # over the draft vocabulary, V columns
        full = torch.zeros(VOCAB, dtype=torch.float64)
        full[ids] = torch.softmax(warp_logits(logits[0], config).double(), -1)
        return full

    def round_outcomes(sequence: tuple[int, ...]) -> dict[tuple[int, ...], float]:
        outcomes: dict[tuple[int, ...], float] = defaultdict(float)
        if len(sequence) == 1:  # a one-token prompt: an autoregressive first round
            p = target_probs(SMALL(torch.tensor([sequence])).logits[0, -1], config)
            for token in range(VOCAB):
                outcomes[(token,)] += float(p[token])
            return outcomes
        _, hidden = backbone.hidden_states(torch.tensor([sequence[:-1]]))
        drafter = BlockDrafter(block)
        drafter.begin(hidden[:, :-1], torch.tensor(sequence[1:-1], dtype=torch.long))
        with torch.no_grad():
            first = drafter.first_step(hidden[:, -1], torch.tensor([sequence[-1]]))
            q1 = law_of(block.logits(first))
            for d1 in ids.tolist():
                drafter.drop_speculative()
                q2 = law_of(block.logits(drafter.next_step(first, torch.tensor([d1]))))
                for d2 in ids.tolist():
                    weight = float(q1[d1] * q2[d2])
                    if weight <= 0:
                        continue
                    logits = SMALL(torch.tensor([[*sequence, d1, d2]])).logits[0, -3:]
                    q = torch.stack([q1, q1 if wrong_q else q2])
                    add_outcomes(outcomes, round_law(target_probs(logits, config), q,
                                                     torch.tensor([d1, d2])),
                                 torch.tensor([d1, d2]), CorrectionPolicy.EXACT, weight)
        return outcomes

    return continuation_law(round_outcomes, prompt, length)


def _small_block() -> DraftBlock:
    return perturbed_block(SMALL, steps=2, draft_vocab=[0, 2, 3], noise=0.3)


@pytest.mark.parametrize("warp", list(WARPS))
def test_enumerated_row_laws_equal_the_targets_and_a_wrong_q_is_detected(
        warp: str, steps: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = SamplingConfig(1.0) if warp == "temperature" else SamplingConfig(0.7, top_k=2)
    block = _small_block()
    for prompt in SMALL_PROMPTS:
        target = target_law(NextTokenLogits(SMALL), prompt, 3, config)  # type: ignore[arg-type]
        exact = _decoder_law(block, prompt, 3, config)
        assert abs(sum(exact.values()) - 1) < 1e-12
        assert total_variation(exact, target) <= 1e-9
        assert total_variation(_decoder_law(block, prompt, 3, config, wrong_q=True), target) > 1e-3
    # the batch's rows (of these lengths) draft from exactly the q this enumeration uses
    decoder = SpeculativeDecoder(SMALL, BlockDrafter(block))
    records = _record_drafts(monkeypatch)
    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        decoder.generate(SMALL_PROMPTS, 3, config.temperature, config.top_k, generator=generator,
                         eos_token_id=())
    assert len(records) >= 10
    for history, made in records:
        fresh, hidden = _fresh_small(block, history)
        want = fresh.round_program(config).draft(hidden, torch.tensor([history[-1]]),
                                                 made.uniforms)
        assert torch.equal(made.draft.block, want.block)
        torch.testing.assert_close(made.draft.q, want.q, rtol=0, atol=1e-12)


def _fresh_small(block: DraftBlock, sequence: list[int]) -> tuple[BlockDrafter, torch.Tensor]:
    _, hidden = HFBackbone(SMALL).hidden_states(torch.tensor([sequence[:-1]]))
    fresh = BlockDrafter(block)
    fresh.begin(hidden[:, :-1], torch.tensor(sequence[1:-1], dtype=torch.long))
    return fresh, hidden[:, -1]


def test_sampled_rows_follow_the_target_law_and_reject_the_biased_variant() -> None:
    """Batch 3 (rows of 3, 1 and 2 tokens), one shared generator: each row's first two tokens
    against the target law; the biased correction policy is rejected."""
    config, length = SamplingConfig(1.0), 2
    laws = [target_law(NextTokenLogits(SMALL), prompt, length, config)  # type: ignore[arg-type]
            for prompt in SMALL_PROMPTS]
    block = _small_block()
    p_values: dict[CorrectionPolicy, list[float]] = {}
    for policy in CorrectionPolicy:
        decoder = SpeculativeDecoder(SMALL, BlockDrafter(block), policy=policy)
        generator = torch.Generator().manual_seed(1234)
        samples: list[list[tuple[int, ...]]] = [[] for _ in SMALL_PROMPTS]
        for _ in range(500):
            result = decoder.generate(SMALL_PROMPTS, length, temperature=1.0,
                                      generator=generator, eos_token_id=())
            for row, tokens in zip(samples, result.tokens, strict=True):
                row.append(tuple(tokens))
        p_values[policy] = [law_p_value(row, law) for row, law in zip(samples, laws, strict=True)]
    assert min(p_values[CorrectionPolicy.EXACT]) > 1e-3
    assert min(p_values[CorrectionPolicy.DROP_AFTER_ACCEPT]) < 1e-4


def test_a_batch_depth_drafts_fewer_and_keeps_every_row_exact(steps: str,
                                                               drafters: dict[str, Any]) -> None:
    """``BatchDepth(((2, 1),))``: while 2 or more rows draft, each draws and verifies 1 draft a
    round (one row alone: all 3). Greedy rows are ``generate``; sampled rows with per-row
    generators are the same whether the rows' block steps run in one call or one per row (the
    depth is the batch's, not the path's)."""
    trained = drafters["recursive"]
    drafter = BlockDrafter(trained.block, batch_depth=BatchDepth(((2, 1),)))
    decoder = SpeculativeDecoder(MODEL, drafter)
    result = decoder.generate(PROMPTS, LIMITS, eos_token_id=())
    assert result.tokens == [_generate(prompt, count)
                             for prompt, count in zip(PROMPTS, LIMITS, strict=True)]
    drafted = [r.drafted for row in result.rows for r in row.rounds]
    assert max(drafted) == 3 and 1 in drafted  # deep while alone, shallow in company
    assert result.summary.accepted > 0
    sampled = {}
    for one_call in (True, False):
        block_batch.ONE_BLOCK_CALL = one_call
        try:
            sampled[one_call] = decoder.generate(
                PROMPTS, LIMITS, 1.0, generator=[torch.Generator().manual_seed(s) for s in
                                                 (31, 32, 33, 34)], eos_token_id=()).tokens
        finally:
            block_batch.ONE_BLOCK_CALL = steps == "one-call"
    assert sampled[True] == sampled[False]


def test_sampled_rows_under_a_batch_depth_follow_the_target_law(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 3, one draft a round while 2 or more rows draft: each row's first two tokens against
    the target law (500 batches); the negative control hands the accept test a wrong ``q`` (the
    drawn law squared and renormalised; 1,000 batches) and is rejected, so the test can fail."""
    config, length = SamplingConfig(1.0), 2
    laws = [target_law(NextTokenLogits(SMALL), prompt, length, config)  # type: ignore[arg-type]
            for prompt in SMALL_PROMPTS]
    block = _small_block()
    draw_step = block_batch.draw_step

    def wrong_q(*args: Any, **kwargs: Any) -> Any:
        index, token, law = draw_step(*args, **kwargs)
        if law is not None:
            law = law ** 2 / (law ** 2).sum(-1, keepdim=True)
        return index, token, law

    p_values = {}
    for control in (False, True):
        if control:
            monkeypatch.setattr(block_batch, "draw_step", wrong_q)
        decoder = SpeculativeDecoder(SMALL, BlockDrafter(block, batch_depth=BatchDepth(((2, 1),))))
        generator = torch.Generator().manual_seed(99)
        samples: list[list[tuple[int, ...]]] = [[] for _ in SMALL_PROMPTS]
        for _ in range(1000 if control else 500):
            result = decoder.generate(SMALL_PROMPTS, length, temperature=1.0,
                                      generator=generator, eos_token_id=())
            for row, tokens in zip(samples, result.tokens, strict=True):
                row.append(tuple(tokens))
        p_values[control] = [law_p_value(row, law) for row, law in zip(samples, laws, strict=True)]
    assert min(p_values[False]) > 1e-3
    assert min(p_values[True]) < 1e-4


def test_a_bad_batch_depth_says_what_was_wrong() -> None:
    for steps in ((), ((4, 0),), ((4, 2), (2, 1)), ((True, 2),), [(4, 2)]):
        with pytest.raises(DraftBlockError, match="BatchDepth takes"):
            BatchDepth(steps)  # type: ignore[arg-type]
    with pytest.raises(DraftBlockError, match="batch_depth must be a BatchDepth"):
        BlockDrafter(_small_block(), batch_depth=((4, 2),))  # type: ignore[arg-type]
    program = BlockDrafter(_small_block()).round_program(SamplingConfig(0.0))
    with pytest.raises(DraftBlockError, match=r"depth must be an int in 1..2"):
        program.draft(torch.zeros(1, 32, dtype=torch.float64), torch.tensor([1]), None, depth=3)
    assert BatchDepth(((4, 2), (8, 1))).drafts(9, 5) == 1
    assert BatchDepth(((4, 2),)).drafts(3, 5) == 5 and BatchDepth(((4, 7),)).drafts(4, 5) == 5
    assert BatchDepth.for_device(torch.device("cpu")) == BatchDepth(((4, 2),))
    assert BatchDepth.for_device(torch.device("cuda")) is None


def test_a_subclassed_drafter_drafts_row_by_row(drafters: dict[str, Any]) -> None:
    """A subclass's round program is its own: the batch runs it on per-row copies."""
    block = drafters["recursive"].block

    class Subclassed(BlockDrafter):
        pass

    assert isinstance(block_batch.block_rows(BlockDrafter(block)), block_batch.RaggedBlockRows)
    assert isinstance(block_batch.block_rows(Subclassed(block)), block_batch.BlockRows)
    decoder = SpeculativeDecoder(MODEL, Subclassed(block))
    result = decoder.generate(PROMPTS[:2], LIMITS[:2], eos_token_id=())
    assert result.tokens == [_generate(p, n) for p, n in zip(PROMPTS[:2], LIMITS[:2], strict=True)]


def test_a_context_drafter_without_block_state_is_refused(drafters: dict[str, Any]) -> None:
    block = drafters["recursive"].block

    class Stateless:  # a ContextDrafter the batch cannot give one state per row
        window, vocab_size, hidden_size = 3, 48, 32

        def begin(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None: ...

        def follow(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None: ...

        def round_program(self, config: object, **options: object) -> object:
            return BlockDrafter(block).round_program(config)  # type: ignore[arg-type]

    decoder = SpeculativeDecoder(MODEL, Stateless())  # type: ignore[arg-type]
    with pytest.raises(DecoderError, match=r"drafts with a draft block's BlockDrafter or "
                                           r"BlockCircuitDrafter .* not Stateless"):
        decoder.generate([[1, 2], [3]], 2)


def test_prefill_features_are_each_rows_own_prefill() -> None:
    """RaggedCache.prefill_features: each row's draft hidden states of a left-padded batched
    prefill equal a prefill of that row alone; read after an extend, it says what to do."""
    backbone = HFBackbone(MODEL)
    ragged = RaggedCache(backbone)
    rows = [[1, 5, 7, 9], [4], [], [2, 2]]
    ragged.start(rows)
    for b, row in enumerate(rows):
        features = ragged.prefill_features(b)
        assert features.shape == (1, len(row), 32)
        if row:
            _, alone = HFBackbone(MODEL).hidden_states(torch.tensor([row]))
            torch.testing.assert_close(features, alone, rtol=1e-9, atol=1e-11)
    ragged.extend(torch.ones(len(rows), 1, dtype=torch.long))
    with pytest.raises(ValueError, match="between start"):
        ragged.prefill_features(0)
