"""Drafting from the context (:mod:`circuits_llm.decoding.lookup`): the head's circuit mixed with a
copy of the continuation of the output's last repeated n-gram, and the law stays the target's.

* :class:`LookupIndex` against a brute-force search (hypothesis); :func:`copy_component` and the
  errors of :class:`ContextLookup`;
* the mixture's conditionals along a path are the brute-force conditionals of the mixture law
  (hypothesis, float64);
* exact laws by enumeration (``toy.decoder_law`` with ``lookup``: each draft weighted by the
  mixture law written out from its definition, verified with the round program's conditionals
  and cut) for FF, CP, HMM and BTree heads, three warps, fixed and confident draft lengths, the
  whole and a compressed draft vocabulary; the copy component really fires;
* negative control: verifying lookup drafts with the head's own conditionals is biased;
* greedy = autoregressive, eager and compiled (the CUDA-graph double, inductor) and on a tiny
  GPT-2 against ``model.generate``; compiled sampling draws what eager sampling draws; a
  chi-square check of real sampled decodes;
* on a toy LM whose greedy output cycles, the copy makes rounds accept more (tokens per round);
* the draft program with a copy component is one graph; clear errors.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from cuda_graph_double import CudaGraphDouble
from hypothesis import given, settings
from hypothesis import strategies as st
from toy import (
    ToyHead,
    ToyLM,
    decoder_law,
    law_p_value,
    target_law,
    total_variation,
)
from toy_constrained import constrained_decoder_law, constrained_target_law
from transformers import GPT2Config, GPT2LMHeadModel

from circuits_llm.constraints import Regex, TokenAutomaton
from circuits_llm.decoding.constrained import ProductDrafter
from circuits_llm.decoding.decoder import (
    AutoregressiveDecoder,
    ConstrainedDrafting,
    DecoderError,
    SpeculativeDecoder,
)
from circuits_llm.decoding.draft_length import Confidence, DraftLength
from circuits_llm.decoding.lookup import (
    ContextLookup,
    LookupIndex,
    copy_component,
    mixed_conditionals,
    overlay,
)
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.heads import MTPHead
from circuits_llm.runtime.compiling import use_compiler

EXACT_TV = 1e-9
BIASED_TV = 1e-3
VOCAB = 4
DRAFT_TOKENS = (2, 0, 3)  # token 1 is outside the draft vocabulary
LOOKUP = ContextLookup((0.3, 0.6))
WARPS = {
    "temperature": SamplingConfig(1.0),
    "top_k": SamplingConfig(0.7, top_k=2),
    "top_p": SamplingConfig(1.3, top_p=0.75),
}
#: prompts whose ends repeat earlier n-grams, so that the copy component fires
PROMPT3 = [0, 1, 2, 0, 1]
PROMPT4 = [3, 0, 2, 3, 0]


# ---------------------------------------------------------------------- the index
def _brute_proposal(tokens: list[int], max_ngram: int, limit: int) -> tuple[list[int], int]:
    for length in range(min(max_ngram, len(tokens)), 0, -1):
        suffix = tokens[len(tokens) - length:]
        for start in range(len(tokens) - length - 1, -1, -1):  # the last earlier occurrence
            if tokens[start:start + length] == suffix:  # copied with overlap
                extended = list(tokens)
                for i in range(start + length, start + length + limit):
                    extended.append(extended[i])
                return extended[start + length:start + length + limit], length
    return [], 0


@settings(max_examples=200)
@given(tokens=st.lists(st.integers(0, 3), max_size=30), max_ngram=st.integers(1, 4),
       limit=st.integers(1, 6), split=st.integers(0, 30))
def test_the_index_proposes_what_a_brute_force_search_finds(
        tokens: list[int], max_ngram: int, limit: int, split: int) -> None:
    index = LookupIndex(max_ngram, tokens[:split])
    index.extend(tokens[split:])  # built in two pieces: the same index
    assert index.propose(limit) == _brute_proposal(tokens, max_ngram, limit)


def test_copy_component_maps_cuts_and_weighs_the_proposal() -> None:
    lookup = ContextLookup((0.1, 0.7))
    position = [1, -1, 0, 2]  # model id -> draft index: id 1 is outside
    component = copy_component([3, 2, 1, 0], 2, lookup, position, 5, torch.device("cpu"))
    assert component.tolist() == [2, 0, 0, 0, 0, 2, 0.7]  # cut before id 1
    component = copy_component([1, 3], 1, lookup, position, 3, torch.device("cpu"))
    assert component.tolist() == [0, 0, 0, 0, 0.0]  # nothing to copy: weight 0
    component = copy_component([3, 2, 1, 0, 2], 1, lookup, None, 3, torch.device("cpu"))
    assert component.tolist() == [3, 2, 1, 3, 0.1]  # the window's drafts at most


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), count=st.integers(0, 3), weight=st.floats(0, 1))
def test_mixed_conditionals_are_the_mixture_laws_conditionals(
        seed: int, count: int, weight: float) -> None:
    """Brute force over every path of a window of 3 drafts over 3 categories: the mixture
    ``(1 - w) H(d) + w [d_{<=m} = s] H(d_{>m})`` and its conditionals along each path, at the
    positions the round may verify (all off the proposal, ``<= m`` on it)."""
    generator = torch.Generator().manual_seed(seed)
    drafts, size = 3, 3
    joint = torch.rand(size, size, size, dtype=torch.float64, generator=generator) ** 3
    joint /= joint.sum()
    proposal = torch.randint(0, size, (drafts,), generator=generator)
    component = torch.cat([proposal.double(),
                           torch.tensor([float(count), weight], dtype=torch.float64)])
    paths = list(itertools.product(range(size), repeat=drafts))

    def head_prob(prefix: tuple[int, ...]) -> float:
        return float(joint[prefix].sum())

    copied = tuple(proposal[:count].tolist())
    active = count > 0 and weight > 0
    tails = joint.sum(tuple(range(count))) if count else joint  # H's marginal after the proposal

    def mixture_prob(prefix: tuple[int, ...]) -> float:
        if not active:
            return head_prob(prefix)
        inside = prefix[:count] == copied[:len(prefix)]
        tail = float(tails[prefix[count:]].sum()) if len(prefix) > count else 1.0
        return (1 - weight) * head_prob(prefix) + (weight * tail if inside else 0.0)

    for path in paths:
        head = torch.tensor([[head_prob((*path[:k], v)) / max(head_prob(path[:k]), 1e-300)
                              for v in range(size)] for k in range(drafts)], dtype=torch.float64)
        q = mixed_conditionals(head, torch.tensor(path), component)
        on_path = active and path[:count] == copied
        for k in range(count if on_path else drafts):
            before = mixture_prob(path[:k])
            if before <= 1e-12:
                continue
            want = torch.tensor([mixture_prob((*path[:k], v)) / before for v in range(size)],
                                dtype=torch.float64)
            torch.testing.assert_close(q[k], want, rtol=1e-9, atol=1e-12)


def test_overlay_copies_with_the_weights_probability_and_cuts_on_the_proposal() -> None:
    drafted = torch.tensor([2, 2, 2])
    component = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.4])  # copy [0, 1], weight 0.4
    assert [t.tolist() for t in overlay(drafted, component, torch.tensor(0.3))] == [[0, 1, 2], 2]
    assert [t.tolist() for t in overlay(drafted, component, torch.tensor(0.5))] == [[2, 2, 2], 3]
    assert [t.tolist() for t in overlay(drafted, component, None)] == [[0, 1, 2], 2]  # greedy
    # the head's own draw that starts with the whole proposal is cut there too
    assert overlay(torch.tensor([0, 1, 1]), component, torch.tensor(0.9))[1].tolist() == 2
    nothing = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])
    assert [t.tolist() for t in overlay(drafted, nothing, None)] == [[2, 2, 2], 3]


# ---------------------------------------------------------------------- exact laws
RULES = {"fixed": None, "confident": DraftLength.confident(0.3),
         "peak-min0": DraftLength.confident(0.4, Confidence.PEAK, minimum=0)}


def _fires(lookup: ContextLookup, prompt: list[int], length: int, vocab: int) -> bool:
    """Whether some state the enumeration visits has a non-empty proposal."""
    for tail in itertools.product(range(vocab), repeat=length):
        for cut in range(length + 1):
            if LookupIndex(lookup.max_ngram, [*prompt, *tail[:cut]]).propose(3)[0]:
                return True
    return False


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize(("architecture", "rank"), [("ff", 1), ("cp", 2), ("hmm", 2), ("btree", 2)])
def test_lookup_law_is_exact(architecture: str, rank: int, rule: str) -> None:
    """Every warp (temperature, top-k, top-p), with the copy firing along the way."""
    assert _fires(LOOKUP, PROMPT3, 3, 3)
    head = ToyHead(architecture, 3, rank, 6, 3, seed=0)
    for config in WARPS.values():
        lm = ToyLM(3, draft_branch=True, seed=0)
        law = decoder_law(lm, head, PROMPT3, 3, config, draft_length=RULES[rule], lookup=LOOKUP)
        assert abs(sum(law.values()) - 1) < 1e-12
        assert total_variation(law, target_law(lm, PROMPT3, 3, config)) <= EXACT_TV, config


@pytest.mark.parametrize("rule", [None, DraftLength.confident(0.3)], ids=["fixed", "confident"])
@pytest.mark.parametrize(("architecture", "rank"), [("cp", 2), ("btree", 2)])
def test_lookup_law_is_exact_with_a_compressed_vocabulary(
        architecture: str, rank: int, rule: DraftLength | None) -> None:
    """Window 4 (three drafts) over 3 of the 4 tokens: proposals are cut at token 1."""
    lm = ToyLM(VOCAB, draft_branch=True, seed=2)
    head = ToyHead(architecture, 4, rank, lm.hidden_size, VOCAB, seed=2, draft_tokens=DRAFT_TOKENS)
    config = SamplingConfig(1.0, top_k=3)
    lookup = ContextLookup((0.5, 0.9, 1.0))
    law = decoder_law(lm, head, PROMPT4, 3, config, draft_length=rule, lookup=lookup)
    assert total_variation(law, target_law(lm, PROMPT4, 3, config)) <= EXACT_TV


@pytest.mark.parametrize(("architecture", "rank"), [("ff", 1), ("btree", 2)])
def test_verifying_lookup_drafts_with_the_heads_conditionals_is_biased(
        architecture: str, rank: int) -> None:
    """Negative control: the same draws, accepted against the head's ``q`` instead of the
    mixture's, give another law (the enumeration sees it)."""
    lm = ToyLM(3, draft_branch=True, seed=0)
    head = ToyHead(architecture, 3, rank, lm.hidden_size, 3, seed=0)
    config = SamplingConfig(1.0)
    law = decoder_law(lm, head, PROMPT3, 3, config, lookup=LOOKUP, mixed_q=False)
    assert abs(sum(law.values()) - 1) < 1e-12
    assert total_variation(law, target_law(lm, PROMPT3, 3, config)) > BIASED_TV


# ---------------------------------------------------------------------- the decoder
@pytest.mark.parametrize("draft_tokens", [None, DRAFT_TOKENS], ids=["full", "compressed"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph-double"])
def test_greedy_with_lookup_is_autoregressive(compiled: bool,
                                              draft_tokens: tuple[int, ...] | None) -> None:
    head = ToyHead("btree", 4, 2, 6, VOCAB, seed=1, draft_tokens=draft_tokens)
    reference = AutoregressiveDecoder(ToyLM(VOCAB, draft_branch=True, seed=1))
    double = CudaGraphDouble()
    for rule in (None, DraftLength.confident(0.3), DraftLength.fixed(1)):
        with use_compiler(double):
            decoder = SpeculativeDecoder(ToyLM(VOCAB, draft_branch=True, seed=1), head,
                                         compile=compiled, draft_length=rule, lookup=LOOKUP)
        for prompt in ([0, 2], [1], [2, 1, 3, 2, 1]):
            result = decoder.generate(prompt, 20)
            assert result.tokens.tolist() == reference.generate(prompt, 20).tokens.tolist()
            assert decoder.backbone.length == len(prompt) + 20 - 1
    if compiled:
        assert double.calls and all(n > 0 for n in double.calls.values())


def test_copying_a_cycle_makes_rounds_longer() -> None:
    """A peaky order-2 toy LM's greedy output falls into a cycle of period 4; with the copy a
    round accepts most of its window, the random head alone almost never (tokens per round, no
    timing)."""
    lm = ToyLM(6, order=2, draft_branch=True, seed=1, logit_scale=6.0)
    head = ToyHead("ff", 5, 1, lm.hidden_size, 6, seed=1)
    plain = SpeculativeDecoder(lm, head).generate([0, 1], 60)
    copied = SpeculativeDecoder(lm, head, lookup=ContextLookup()).generate([0, 1], 60)
    assert copied.tokens.tolist() == plain.tokens.tolist()
    assert plain.summary.tokens_per_round < 1.1 and copied.summary.tokens_per_round > 3


@pytest.mark.parametrize(("architecture", "rule"), [
    ("btree", DraftLength.confident(0.3)), ("hmm", None)])
def test_compiled_sampling_with_lookup_draws_what_eager_draws(
        architecture: str, rule: DraftLength | None) -> None:
    head = ToyHead(architecture, 4, 2, 6, VOCAB, seed=5, draft_tokens=DRAFT_TOKENS)
    eager = SpeculativeDecoder(ToyLM(VOCAB, draft_branch=True, seed=5), head, draft_length=rule,
                               lookup=LOOKUP)
    double = CudaGraphDouble()
    with use_compiler(double):
        compiled = SpeculativeDecoder(ToyLM(VOCAB, draft_branch=True, seed=5), head, compile=True,
                                      draft_length=rule, lookup=LOOKUP)
    for seed in range(3):
        want = eager.generate(PROMPT4, 16, 1.0, top_k=3,
                              generator=torch.Generator().manual_seed(seed))
        got = compiled.generate(PROMPT4, 16, 1.0, top_k=3,
                                generator=torch.Generator().manual_seed(seed))
        assert got.tokens.tolist() == want.tokens.tolist()
        assert [(r.drafted, r.accepted) for r in got.rounds] == \
            [(r.drafted, r.accepted) for r in want.rounds]
    assert double.calls


def test_torch_compiled_lookup_rounds_draw_what_eager_draws() -> None:
    head = ToyHead("cp", 3, 2, 6, VOCAB, seed=6, draft_tokens=DRAFT_TOKENS)
    eager = SpeculativeDecoder(ToyLM(VOCAB, draft_branch=True, seed=6), head, lookup=LOOKUP)
    compiled = SpeculativeDecoder(ToyLM(VOCAB, draft_branch=True, seed=6), head, compile=True,
                                  lookup=LOOKUP)
    for seed in range(2):
        for temperature in (0.0, 1.0):
            want = eager.generate(PROMPT4, 12, temperature,
                                  generator=torch.Generator().manual_seed(seed))
            got = compiled.generate(PROMPT4, 12, temperature,
                                    generator=torch.Generator().manual_seed(seed))
            assert got.tokens.tolist() == want.tokens.tolist()
    assert all(not program._draft.fallbacks and not program._accept.fallbacks  # type: ignore[union-attr]
               for program in compiled._programs.values())


def test_sampled_generate_with_lookup_matches_the_target_law() -> None:
    """Chi-square of 400 real two-token decodes against the brute-force target law."""
    lm = ToyLM(VOCAB, draft_branch=True, seed=5)
    head = ToyHead("btree", 4, 2, lm.hidden_size, VOCAB, seed=5, draft_tokens=DRAFT_TOKENS)
    decoder = SpeculativeDecoder(lm, head, lookup=ContextLookup((0.5, 0.8)))
    law = target_law(ToyLM(VOCAB, draft_branch=True, seed=5), PROMPT4, 2, SamplingConfig(1.0))
    generator = torch.Generator().manual_seed(7)
    samples = [tuple(decoder.generate(PROMPT4, 2, 1.0, generator=generator).tokens.tolist())
               for _ in range(400)]
    assert law_p_value(samples, law) > 1e-3


def test_greedy_lookup_on_a_hugging_face_model_is_generate() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=48, n_embd=32, n_layer=2, n_head=4,
                                       n_positions=128, bos_token_id=0, eos_token_id=47,
                                       pad_token_id=0)).double().eval()
    head = MTPHead.from_name("btree", 4, 2, 32, 48,
                             lm_head_weight=model.get_output_embeddings().weight.detach(),
                             dtype=torch.float64, sum_init_std=0.5)
    decoder = SpeculativeDecoder(model, head, lookup=ContextLookup(),
                                 draft_length=DraftLength.confident(0.2))
    for prompt in (torch.tensor([[5, 9, 5, 9, 3, 5, 9]]), torch.tensor([[4, 4]])):
        want = model.generate(prompt, do_sample=False, max_new_tokens=24, pad_token_id=0)
        result = decoder.generate(prompt, 24)
        assert result.tokens.tolist() == want[0, prompt.shape[1]:].tolist()


# ---------------------------------------------------------------------- programs and errors
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling"])
def test_the_draft_program_with_a_copy_component_is_one_graph(greedy: bool) -> None:
    head = ToyHead("btree", 4, 2, 6, VOCAB, seed=2, draft_tokens=DRAFT_TOKENS)
    program = RoundProgram(head, SamplingConfig(0.0 if greedy else 1.0),
                           draft_length=DraftLength.confident(0.3), lookup=LOOKUP)
    hidden = torch.randn(1, 6, dtype=torch.float64)
    uniforms = None if greedy else program.draw_uniforms(torch.Generator().manual_seed(0))
    component = copy_component([0, 3, 2], 2, LOOKUP, [1, -1, 0, 2], 3, torch.device("cpu"))
    with torch.no_grad():
        explained = torch._dynamo.explain(program._draft_program)(
            hidden, torch.tensor([2]), uniforms, component)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_lookup_errors_are_clear() -> None:
    for bad in ((), (0.5, 1.5), (True,), [0.5]):
        with pytest.raises(DecoderError, match=r"ContextLookup\.weights"):
            ContextLookup(bad)  # type: ignore[arg-type]
    with pytest.raises(DecoderError, match="max_ngram"):
        LookupIndex(0)
    lm = ToyLM(3)
    head = ToyHead("cp", 3, 2, lm.hidden_size, 3)
    with pytest.raises(DecoderError, match="ContextLookup"):
        SpeculativeDecoder(lm, head, lookup=(0.5,))  # type: ignore[arg-type]
    program = RoundProgram(head, SamplingConfig(0.0), lookup=LOOKUP)
    with pytest.raises(DecoderError, match="copy component"):
        program.draft(torch.zeros(1, lm.hidden_size, dtype=torch.float64), torch.tensor([0]), None)


def _regex_world() -> tuple[TokenAutomaton, int]:
    """The automaton of ``(a|bc)*d`` over a 5-word tokenizer (``<eos>`` a b c d = 0..4)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    words = {"<eos>": 0, "a": 1, "b": 2, "c": 3, "d": 4}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>")),
        eos_token="<eos>")
    return TokenAutomaton.build(Regex("(a|bc)*d"), tokenizer), len(words)


AUTOMATON, WORDS = _regex_world()


@pytest.mark.parametrize("draft_tokens", [None, (1, 2, 4)], ids=["full", "no-c"])
@pytest.mark.parametrize("config", [SamplingConfig(1.0), SamplingConfig(1.0, top_k=2)],
                         ids=["sampling", "top_k"])
@pytest.mark.parametrize(("architecture", "rank"), [("ff", 1), ("hmm", 2), ("btree", 2)])
def test_the_copy_mixed_into_the_constraint_product_is_exact(
        architecture: str, rank: int, config: SamplingConfig,
        draft_tokens: tuple[int, ...] | None) -> None:
    """The head x automaton product with the copy mixed into its sequential draw: the output law
    is constrained AR's (enumerated); the copy fires (the prompt ends with a repeated n-gram
    whose continuation the automaton allows), and with ``c`` outside the draft vocabulary the
    copy is cut there."""
    lm = ToyLM(WORDS, seed=1, draft_branch=True)
    head = ToyHead(architecture, 3, rank, 6, WORDS, seed=2, draft_tokens=draft_tokens)
    lookup = ContextLookup((0.4, 0.7))
    for prompt in ([2, 3, 2, 3], [1, 1, 1]):
        law = constrained_decoder_law(lm, head, AUTOMATON, prompt, 3, config,
                                      ConstrainedDrafting.PRODUCT, lookup=lookup)
        want = constrained_target_law(lm, AUTOMATON, prompt, 3, config)
        assert total_variation(law, want) <= EXACT_TV


def test_the_product_verifies_past_a_short_copy() -> None:
    """Drawn one variable at a time, the mixture continues after the copy with the product's own
    conditionals, so a draft that starts with a one-token copy still verifies the whole window
    (the joint draw of the head alone stops at the copy's end), and its ``q`` after the copy is
    the product's conditional given the copied token."""
    lm = ToyLM(WORDS, seed=1, draft_branch=True)
    head = ToyHead("btree", 4, 2, 6, WORDS, seed=2)
    drafter = ProductDrafter(head, AUTOMATON)
    hidden = lm.extend(torch.tensor([[1, 1]])).draft_hidden[:, -1]
    with torch.no_grad():
        params = head.circuit.log_parameters(head(hidden))
    state = AUTOMATON.advance(AUTOMATON.initial_state, 1)  # after c = "a"
    component = torch.tensor([2.0, 0.0, 0.0, 1.0, 0.9], dtype=torch.float64)  # copy "b", w 0.9
    draft, _ = drafter.draft(params, 1, state, None, None, component)
    assert int(draft.tokens[0]) == 2 and int(draft.length) == head.window - 1
    rows = drafter.product.draw(params, drafter.table.restart(drafter.local[state]),
                                torch.tensor([1, 2]), consume_from=1,
                                uniforms=torch.full((2,), 0.5, dtype=torch.float64))
    sampled, _ = drafter.draft(params, 1, state, torch.full((3,), 0.5, dtype=torch.float64),
                               None, component)
    assert int(sampled.tokens[0]) == 2 and int(sampled.length) == head.window - 1
    torch.testing.assert_close(sampled.q[1:, :-1], rows.conditionals, rtol=0, atol=1e-12)
    assert not sampled.q[:, -1].any()  # a proposal inside the draft vocabulary: no extra column


def test_the_copy_in_the_product_verified_with_the_products_conditionals_is_biased() -> None:
    """Negative control: the same mixture draws, accepted against the product's own ``q``."""
    lm = ToyLM(WORDS, seed=1, draft_branch=True)
    head = ToyHead("btree", 3, 2, 6, WORDS, seed=2)
    config = SamplingConfig(1.0)
    law = constrained_decoder_law(lm, head, AUTOMATON, [2, 3, 2, 3], 3, config,
                                  ConstrainedDrafting.PRODUCT, lookup=ContextLookup((0.4, 0.7)),
                                  mixed_q=False)
    want = constrained_target_law(lm, AUTOMATON, [2, 3, 2, 3], 3, config)
    assert abs(sum(law.values()) - 1) < 1e-12 and total_variation(law, want) > BIASED_TV


@pytest.mark.parametrize("drafting", list(ConstrainedDrafting), ids=lambda d: d.value)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph-double"])
def test_greedy_with_lookup_under_a_constraint_is_constrained_autoregressive(
        drafting: ConstrainedDrafting, compiled: bool) -> None:
    head = ToyHead("btree", 4, 2, 6, WORDS, seed=2)
    reference = AutoregressiveDecoder(ToyLM(WORDS, seed=1, draft_branch=True))
    double = CudaGraphDouble()
    with use_compiler(double):
        decoder = SpeculativeDecoder(ToyLM(WORDS, seed=1, draft_branch=True), head, lookup=LOOKUP,
                                     constrained_drafting=drafting, compile=compiled,
                                     draft_length=DraftLength.confident(0.2))
    for prompt in ([1, 1, 1], [2, 3, 2, 3], [1, 2, 3, 1, 2, 3]):
        got = decoder.generate(prompt, 16, constraint=AUTOMATON).tokens.tolist()
        assert got == reference.generate(prompt, 16, constraint=AUTOMATON).tokens.tolist()


def test_sampled_constrained_generate_with_lookup_matches_the_law() -> None:
    """Chi-square of 400 real decodes through the product with the copy against constrained
    AR's enumerated law."""
    lm = ToyLM(WORDS, seed=1, draft_branch=True)
    head = ToyHead("hmm", 3, 2, 6, WORDS, seed=2)
    decoder = SpeculativeDecoder(lm, head, lookup=ContextLookup((0.5, 0.8)))
    law = constrained_target_law(ToyLM(WORDS, seed=1, draft_branch=True), AUTOMATON,
                                 [2, 3, 2, 3], 3, SamplingConfig(1.0))
    generator = torch.Generator().manual_seed(11)
    samples = [tuple(decoder.generate([2, 3, 2, 3], 3, 1.0, generator=generator,
                                      constraint=AUTOMATON).tokens.tolist())
               for _ in range(400)]
    assert law_p_value(samples, law) > 1e-3
