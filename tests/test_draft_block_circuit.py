"""A circuit on the draft block (circuits_llm.draft_block.circuit_drafter): greedy decoding is
``model.generate`` for FF and BTree heads over the full and a compressed vocabulary; the exact law
by enumeration on a tiny-vocabulary Llama equals the target's (and a wrong ``q`` is detected); the
sampled ``generate`` follows it; the block's cache equals a fresh prefill after several rounds;
bad inputs raise one clear error; and training the head on the frozen block's outputs with the MTP
loss (circuits_llm.training.block_circuit) lowers it."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch
from cuda_graph_double import CudaGraphDouble
from draft_block_models import (
    NextTokenLogits,
    greedy_continuation_features,
    greedy_generate,
    perturbed_block,
    tiny_llama,
)
from toy import add_outcomes, continuation_law, law_p_value, stand_in_marginal, target_law, total_variation

from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.acceptance import CorrectionPolicy, round_law
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.warping import DecoderError, SamplingConfig, target_probs
from circuits_llm.draft_block import (
    BlockCacheFollower,
    BlockCircuitDrafter,
    BlockCircuitRoundProgram,
    DraftBlock,
    DraftBlockError,
)
from circuits_llm.draft_block.training import BlockFeatures, prefill_features
from circuits_llm.heads import MTPHead
from circuits_llm.protocols import context_drafter_problem, draft_head_problem
from circuits_llm.runtime.compiling import use_compiler
from circuits_llm.training.block_circuit import block_head_data, block_head_loss, train_block_head

MODEL = tiny_llama(scale=8.0)
#: (prompt, max_new_tokens): a one-token prompt takes the autoregressive first step
CASES = [([1], 12), ([1, 5], 9), ([1, 5, 7, 9, 3], 15), ([4, 2, 2], 1)]
Law = dict[tuple[int, ...], float]


def _head(model: torch.nn.Module, kind: str, window: int, vocab: list[int] | None, *,
          rank: int = 2, token: bool = False, hidden: int | None = None, size: int | None = None,
          seed: int = 0) -> MTPHead:
    """A float64 head on the block's outputs, its sums moved off the context-free start."""
    embedding = model.get_input_embeddings().weight
    size = embedding.shape[0] if size is None else size
    hidden = embedding.shape[1] if hidden is None else hidden
    weight = model.lm_head.weight if (size, hidden) == tuple(embedding.shape) else None
    head = MTPHead.from_name(kind, window, 1 if kind == "ff" else rank, hidden, size,
                             lm_head_weight=weight, draft_vocab=vocab or "full",
                             dtype=torch.float64, sum_init_std=0.5, init_noise=0.3, seed=seed,
                             token_embedding=embedding if token else None)
    return head.eval()


def _generate(prompt: list[int], count: int) -> list[int]:
    return greedy_generate(MODEL, prompt, count)


@pytest.fixture(scope="module")
def greedy_features() -> BlockFeatures:
    """Prefill features of the model's own greedy continuations of random prompts."""
    return greedy_continuation_features(MODEL)


@pytest.mark.parametrize("kind", ["ff", "btree"])
@pytest.mark.parametrize("vocab", [None, list(range(0, 48, 2))], ids=["full", "compressed"])
def test_greedy_equals_hf_generate(kind: str, vocab: list[int] | None,
                                   greedy_features: BlockFeatures) -> None:
    # the block's own draft vocabulary differs from the head's: only the head's is drafted over
    block = perturbed_block(MODEL, draft_vocab=None if vocab else list(range(0, 48, 3)))
    head = _head(MODEL, kind, 4, vocab, token=vocab is not None)
    # trained on the model's greedy text, so that rounds accept drafts too
    train_block_head(block, head, greedy_features, steps=40, lr=1e-2,
                     generator=torch.Generator().manual_seed(1))
    decoder = SpeculativeDecoder(MODEL, BlockCircuitDrafter(block, head))
    accepted = 0
    for prompt, count in CASES:
        result = decoder.generate(prompt, count, eos_token_id=())
        assert result.tokens.tolist() == _generate(prompt, count)
        assert decoder.backbone.length == len(prompt) + count - 1
        accepted += sum(round_.accepted for round_ in result.rounds)
    assert accepted > 0


def _prefill(block: DraftBlock, sequence: list[int]) -> BlockCacheFollower:
    """A block cache holding a fresh prefill over ``sequence``'s pairs ``(h_j, x_{j+1})``,
    ``j = 0..len - 3`` (what a decode's cache holds between rounds)."""
    _, hidden = HFBackbone(MODEL).hidden_states(torch.tensor([sequence[:-1]]))
    fresh = BlockCacheFollower(block)
    fresh.begin(hidden[:, :-1], torch.tensor(sequence[1:-1], dtype=torch.long))
    fresh.flush()
    return fresh


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
def test_cache_equals_a_fresh_prefill_after_rounds(temperature: float) -> None:
    block = perturbed_block(MODEL, layers=2)
    drafter = BlockCircuitDrafter(block, _head(MODEL, "btree", 4, list(range(0, 48, 3))))
    decoder = SpeculativeDecoder(MODEL, drafter)
    for prompt in ([3], [3, 8, 1, 4]):
        result = decoder.generate(prompt, 17, temperature=temperature, eos_token_id=(),
                                  generator=torch.Generator().manual_seed(2))
        assert len(result.rounds) > 3
        sequence = prompt + result.tokens.tolist()
        assert drafter.cache.get_seq_length() == drafter.length  # nothing speculative is cached
        drafter.flush()
        fresh = _prefill(block, sequence)
        held = min(drafter.length, fresh.length)
        assert held >= len(sequence) - 2 - (drafter.window - 1)
        for mine, theirs in zip(drafter.cache.layers, fresh.cache.layers, strict=True):
            torch.testing.assert_close(mine.keys[..., :held, :], theirs.keys[..., :held, :],
                                       rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(mine.values[..., :held, :], theirs.values[..., :held, :],
                                       rtol=1e-9, atol=1e-11)


def test_compiled_under_cuda_graph_semantics_draws_what_eager_draws() -> None:
    """Backbone steps, the head's draft program and the accept program run through the CUDA-graph
    replay double (static outputs, poisoned at every later call): greedy is ``generate``, sampling
    draws eager's tokens, and the cache still equals a fresh prefill."""
    block = perturbed_block(MODEL)
    head = _head(MODEL, "btree", 4, list(range(0, 48, 2)), token=True)
    eager = SpeculativeDecoder(MODEL, BlockCircuitDrafter(block, head))
    drafter = BlockCircuitDrafter(block, head)
    double = CudaGraphDouble()
    with use_compiler(double):
        compiled = SpeculativeDecoder(MODEL, drafter, compile=True)
    prompt = [1, 5, 7, 9, 3]
    assert compiled.generate(prompt, 10, eos_token_id=()).tokens.tolist() == _generate(prompt, 10)
    for seed in range(2):
        want = eager.generate(prompt, 12, temperature=1.0, eos_token_id=(),
                              generator=torch.Generator().manual_seed(seed))
        got = compiled.generate(prompt, 12, temperature=1.0, eos_token_id=(),
                                generator=torch.Generator().manual_seed(seed))
        assert got.tokens.tolist() == want.tokens.tolist()
        assert [r.accepted for r in got.rounds] == [r.accepted for r in want.rounds]
    sequence = prompt + got.tokens.tolist()
    drafter.flush()
    fresh = _prefill(block, sequence)
    held = min(drafter.length, fresh.length)
    for mine, theirs in zip(drafter.cache.layers, fresh.cache.layers, strict=True):
        torch.testing.assert_close(mine.keys[..., :held, :], theirs.keys[..., :held, :],
                                   rtol=1e-9, atol=1e-11)
    for kind in ("draft program", "accept program", "backbone step"):  # the compiled path ran
        assert sum(n for name, n in double.calls.items() if name.startswith(kind)) > 0, kind


# --------------------------------------------------------------------------- the exact law
VOCAB = 4
SMALL = tiny_llama(vocab=VOCAB, scale=3.0)
PROMPT = [1, 2]
DRAFT_VOCAB = [0, 2, 3]  # c = 1 lies outside: the round drafts after a stand-in for it


def _small_drafter() -> BlockCircuitDrafter:
    block = perturbed_block(SMALL, steps=2, noise=0.3)
    return BlockCircuitDrafter(block, _head(SMALL, "btree", 3, DRAFT_VOCAB, token=True, seed=3))


def _target_law(length: int, config: SamplingConfig) -> Law:
    return target_law(NextTokenLogits(SMALL), PROMPT, length, config)  # type: ignore[arg-type]


def _seed(drafter: BlockCircuitDrafter, sequence: tuple[int, ...]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o_1, h)``: the block's output for the round after ``sequence`` from a fresh prefill of
    the block (independent of the decoder's cache following), and the backbone's seed feature."""
    _, hidden = HFBackbone(SMALL).hidden_states(torch.tensor([sequence[:-1]]))
    fresh = BlockCacheFollower(drafter.block)
    fresh.begin(hidden[:, :-1], torch.tensor(sequence[1:-1], dtype=torch.long))
    with torch.no_grad():
        return fresh.first_step(hidden[:, -1], torch.tensor([sequence[-1]])), hidden[:, -1]


def _decoder_law(drafter: BlockCircuitDrafter, length: int, config: SamplingConfig,
                 wrong_q: bool = False) -> Law:
    """The decoder's law, enumerated: every draft weighted by the head's exact conditionals on
    the block's output (``wrong_q``: accepted with those of the head on the backbone's feature)."""
    program = drafter.round_program(config)
    assert isinstance(program, BlockCircuitRoundProgram) and drafter.draft_tokens is not None
    ids = drafter.draft_tokens
    drafts = torch.tensor(list(itertools.product(range(len(ids)), repeat=drafter.window - 1)))

    def round_outcomes(sequence: tuple[int, ...]) -> Law:
        outcomes: Law = defaultdict(float)
        output, feature = _seed(drafter, sequence)
        c = sequence[-1]
        branches = [(None, 1.0)] if c in ids.tolist() else \
            list(enumerate(stand_in_marginal(program, output, c).tolist()))
        for stand_in, prior in branches:
            compact = program.conditionals(output, c, drafts, stand_in=stand_in)
            accept = program.conditionals(feature, c, drafts, stand_in=stand_in) if wrong_q \
                else compact
            weights = compact.gather(2, drafts[:, :, None])[:, :, 0].prod(1) * prior
            for index, q_rows, weight in zip(drafts, accept, weights.tolist(), strict=True):
                if weight <= 0:
                    continue
                draft = ids[index]
                q = torch.zeros(len(draft), VOCAB, dtype=torch.float64)
                q[:, ids] = q_rows
                with torch.no_grad():
                    logits = SMALL(torch.tensor([[*sequence, *draft.tolist()]])).logits[0]
                p = target_probs(logits[-len(draft) - 1:], config)
                add_outcomes(outcomes, round_law(p, q, draft), draft, CorrectionPolicy.EXACT,
                             weight)
        return outcomes

    return continuation_law(round_outcomes, PROMPT, length)


@pytest.mark.parametrize("config", [SamplingConfig(1.0), SamplingConfig(0.7, top_k=2)],
                         ids=["temperature", "top_k"])
def test_enumerated_law_equals_target_and_a_wrong_q_is_detected(config: SamplingConfig) -> None:
    drafter = _small_drafter()
    target = _target_law(3, config)
    exact = _decoder_law(drafter, 3, config)
    assert abs(sum(exact.values()) - 1) < 1e-12
    assert total_variation(exact, target) <= 1e-9
    assert total_variation(_decoder_law(drafter, 3, config, wrong_q=True), target) > 1e-3


def test_the_rounds_q_is_the_heads_law_on_the_blocks_output() -> None:
    """What the decoder's round hands to the accept program is what the enumeration uses."""
    drafter = _small_drafter()
    program = drafter.round_program(SamplingConfig(1.0))
    generator = torch.Generator().manual_seed(5)
    for sequence in ((1, 2, 0), (1, 2, 3, 3, 0, 2), (2, 0, 3, 2)):
        _, hidden = HFBackbone(SMALL).hidden_states(torch.tensor([sequence[:-1]]))
        drafter.begin(hidden[:, :-1], torch.tensor(sequence[1:-1], dtype=torch.long))
        c = torch.tensor([sequence[-1]])
        result = program.draft(hidden[:, -1], c, program.draw_uniforms(generator))
        assert drafter.length == len(sequence) - 1
        output, _ = _seed(drafter, sequence)
        index = program.position[result.tokens] if program.position is not None else result.tokens
        expected = program.conditionals(output, sequence[-1], index[None])[0]
        assert result.q is not None
        torch.testing.assert_close(result.q, expected, rtol=1e-9, atol=1e-12)


def test_sampled_generate_follows_the_target_law() -> None:
    decoder = SpeculativeDecoder(SMALL, _small_drafter())
    generator = torch.Generator().manual_seed(0)
    samples = [tuple(decoder.generate(PROMPT, 2, temperature=1.0, generator=generator,
                                      eos_token_id=()).tokens.tolist()) for _ in range(600)]
    assert law_p_value(samples, _target_law(2, SamplingConfig(1.0))) > 1e-3


# --------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise_one_clear_error() -> None:
    block = perturbed_block(MODEL)
    drafter = BlockCircuitDrafter(block, _head(MODEL, "ff", 3, None))
    assert context_drafter_problem(drafter) is None
    assert draft_head_problem(drafter) is not None  # the decoder takes it as a context drafter
    with pytest.raises(DraftBlockError, match="reads hidden states of size 16 but the block's "
                                              "outputs are 32 wide"):
        BlockCircuitDrafter(block, _head(MODEL, "ff", 3, None, hidden=16))
    with pytest.raises(DraftBlockError, match="vocabulary of 40 ids but the block's target has 48"):
        BlockCircuitDrafter(block, _head(MODEL, "ff", 3, None, size=40))
    with pytest.raises(DraftBlockError, match="drafts with a circuit head"):
        BlockCircuitDrafter(block, block)
    with pytest.raises(DraftBlockError, match="a BlockCircuitDrafter drafts with a DraftBlock"):
        BlockCircuitDrafter(MODEL, _head(MODEL, "ff", 3, None))  # type: ignore[arg-type]
    with pytest.raises(DecoderError, match=r"DraftLength.fixed\(3\) asks for more drafts"):
        SpeculativeDecoder(MODEL, drafter, draft_length=DraftLength.fixed(3))
    with pytest.raises(DraftBlockError, match=r"features must be \(1, m, 32\)"):
        drafter.begin(torch.zeros(1, 2, 31, dtype=torch.float64), torch.tensor([1, 2]))


# --------------------------------------------------------------------------- training
TRAIN_MODEL = tiny_llama(vocab=16, scale=4.0)


def test_training_rows_are_the_drafters_block_outputs() -> None:
    block = perturbed_block(TRAIN_MODEL, layers=2)
    ids = torch.tensor([[1, 4, 9, 3, 7, 2, 5, 11, 6], [2, 2, 8, 0, 15, 3, 3, 1, 9]])
    backbone = HFBackbone(TRAIN_MODEL)
    data = block_head_data(block, prefill_features(backbone, ids))
    one_by_one = block_head_data(block, prefill_features(backbone, ids), chunk=1)
    torch.testing.assert_close(one_by_one.hidden, data.hidden, rtol=1e-9, atol=1e-10)
    ids, data = ids[:1], data.rows(torch.tensor([0]))
    assert data.hidden.shape == (1, ids.shape[1], 32) and bool(data.mask.all())
    assert data.tokens[0, 1:].tolist() == ids[0, 1:].tolist()
    _, hidden = backbone.hidden_states(ids)
    for j in range(ids.shape[1] - 1):  # the round after x_0..x_{j+1}: o at position j
        follower = BlockCacheFollower(block)
        follower.begin(hidden[:, :j], ids[0, 1:j + 1])
        with torch.no_grad():
            output = follower.first_step(hidden[:, j], ids[0, j + 1:j + 2])
        torch.testing.assert_close(output[0], data.hidden[0, j], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(("kind", "teacher"), [("ff", False), ("btree", True)])
def test_training_lowers_the_loss(kind: str, teacher: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (6, 13), generator=generator)
    features = prefill_features(HFBackbone(TRAIN_MODEL), ids)
    block = perturbed_block(TRAIN_MODEL)
    frozen = {name: value.clone() for name, value in block.state_dict().items()}
    head = _head(TRAIN_MODEL, kind, 3, list(range(0, 16, 2)) if teacher else None, token=teacher)
    data = block_head_data(block, features, teacher=teacher)
    with torch.no_grad():
        before = float(block_head_loss(head, data).loss)
    history = train_block_head(block, head, features, steps=30, lr=1e-2, teacher=teacher,
                               generator=generator)
    with torch.no_grad():
        after = float(block_head_loss(head, data).loss)
    assert len(history) == 30 and history[0] == pytest.approx(before)
    assert after < before - 0.1
    assert all(torch.equal(frozen[name], value) for name, value in block.state_dict().items())
    assert all(p.grad is None for p in TRAIN_MODEL.parameters())
    with pytest.raises(DraftBlockError, match="steps must be an int >= 1"):
        train_block_head(block, head, features, steps=0)
