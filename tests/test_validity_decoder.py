"""Decoding never drafts or samples from garbage, and one decoder is used by one call at a time.

* invalid head outputs (NaN, +inf, a row without mass) are a DecoderError naming the output;
* token laws with no possible token (all -inf logits, zero probabilities) or NaN/inf are an
  InvalidDistributionError, from ``target_probs`` and ``sample_token`` and through the decoders;
* when the draft gives the known next token probability zero the round is an autoregressive
  one: the same tokens as the autoregressive decoder, from the same randomness;
* a second ``generate`` on a busy decoder or backbone (another thread, or re-entrant) is a clear
  "not thread-safe" DecoderError, and the first call is unharmed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from toy import ToyHead, ToyLM

from circuits.errors import ParameterProblem
from circuits_llm.decoding.decoder import AutoregressiveDecoder, DecoderError, SpeculativeDecoder
from circuits_llm.decoding.metrics import RoundKind
from circuits_llm.decoding.warping import (
    InvalidDistributionError,
    SamplingConfig,
    sample_token,
    target_probs,
)
from circuits_llm.protocols import BackboneStep

VOCAB = 3
GREEDY = SamplingConfig(0.0)
SAMPLING = SamplingConfig(1.0)


class EditedHead(ToyHead):
    """A ToyHead whose outputs pass through ``edit`` (in place) before the decoder sees them."""

    def __init__(self, edit: Callable[[ToyHead, dict[str, Tensor]], None], architecture: str = "cp",
                 window: int = 3) -> None:
        super().__init__(architecture, window, 1 if architecture == "ff" else 2, 6, VOCAB)
        self.edit = edit

    def forward(self, hidden: Tensor) -> dict[str, Tensor]:
        params = super().forward(hidden)
        self.edit(self, params)
        return params


def input_slots(head: ToyHead, variable: int) -> list[tuple[str, int]]:
    """``(fold name, slot)`` of every input layer of ``variable`` in the head's circuit."""
    return [(name, slot) for name, spec in head.circuit.parameter_specs().items()
            for slot, v in enumerate(spec.variables) if v == variable]


# ------------------------------------------------------------------------ head outputs
@pytest.mark.parametrize("problem", list(ParameterProblem), ids=[p.name for p in ParameterProblem])
@pytest.mark.parametrize("config", [GREEDY, SAMPLING], ids=["greedy", "sampling"])
def test_invalid_head_output_is_an_error_naming_it(problem: ParameterProblem,
                                                   config: SamplingConfig) -> None:
    def edit(head: ToyHead, params: dict[str, Tensor]) -> None:
        name, slot = input_slots(head, 1)[0]
        if problem is ParameterProblem.NO_MASS:
            params[name][0, slot, 0] = -math.inf
        else:
            params[name][0, slot, 0, 2] = math.nan if problem is ParameterProblem.NAN else math.inf

    head = EditedHead(edit)
    name, slot = input_slots(head, 1)[0]
    layer = head.circuit.parameter_specs()[name].layers[slot].describe()
    decoder = SpeculativeDecoder(ToyLM(VOCAB), head)
    with pytest.raises(DecoderError) as info:
        decoder.generate([0, 1], 4, temperature=config.temperature,
                         generator=torch.Generator().manual_seed(0))
    message = str(info.value)
    assert message.startswith("the draft head's output for this round is unusable: ")
    assert f"params['{name}'][0, {slot}, 0" in message and layer in message
    assert (problem.value if problem is not ParameterProblem.NO_MASS else "no mass") in message
    decoder.head.edit = lambda head, params: None  # the decoder is usable again
    assert len(decoder.generate([0, 1], 4).tokens) == 4


# ------------------------------------------------------------------------ token laws
@pytest.mark.parametrize("config", [GREEDY, SAMPLING, SamplingConfig(0.5, top_k=1, top_p=0.5)],
                         ids=["greedy", "sampling", "warped"])
@pytest.mark.parametrize(("row", "message"), [
    ([-math.inf] * 4, r"\(row 1\) are -inf for every token: no token is possible"),
    ([0.0, math.nan, 1.0, 0.0], r"\(row 1\) hold nan at token 1"),
    ([0.0, 1.0, 0.0, math.inf], r"\(row 1\) hold inf at token 3"),
])
def test_target_probs_rejects_rows_without_a_possible_token(config: SamplingConfig,
                                                            row: list[float], message: str) -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], row])
    with pytest.raises(InvalidDistributionError, match=message):
        target_probs(logits, config)
    with pytest.raises(InvalidDistributionError, match=r"^the verifier logits"):
        target_probs(logits, config, "the verifier logits")
    assert target_probs(logits[:1], config).shape == (1, 4)  # the valid row alone is fine


def test_a_tiny_temperature_that_overflows_is_named() -> None:
    logits = torch.tensor([1e30, 0.0], dtype=torch.float32)
    with pytest.raises(InvalidDistributionError, match=r"divided by temperature 1e-10 hold inf"):
        target_probs(logits, SamplingConfig(1e-10))


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("probs", [[0.0, 0.0, 0.0], [0.5, math.nan, 0.5], [0.5, -0.1, 0.6],
                                   [math.inf, 0.0, 1.0]])
def test_sample_token_rejects_what_cannot_be_sampled(greedy: bool, probs: list[float]) -> None:
    with pytest.raises(InvalidDistributionError, match="cannot draw a token"):
        sample_token(torch.tensor(probs, dtype=torch.float64), greedy, None)


def test_sample_token_still_draws_valid_laws() -> None:
    probs = torch.tensor([0.0, 0.25, 0.75], dtype=torch.float64)
    assert sample_token(probs, True, None) == 2
    assert sample_token(probs * 4, True, None) == 2  # unnormalised is fine
    draws = {sample_token(probs, False, torch.Generator().manual_seed(s)) for s in range(40)}
    assert draws == {1, 2}
    with pytest.raises(InvalidDistributionError, match=r"non-empty \(V,\) vector"):
        sample_token(torch.zeros(0), True, None)


class MaskedLM(ToyLM):
    """A ToyLM whose verifier logits are all -inf at every position (nothing is possible)."""

    def extend(self, tokens: Tensor) -> BackboneStep:
        step = super().extend(tokens)
        return BackboneStep(torch.full_like(step.verifier_logits, -math.inf), step.draft_hidden)


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decoders_reject_verifier_logits_without_a_possible_token(speculative: bool,
                                                                  temperature: float) -> None:
    lm = MaskedLM(VOCAB)
    decoder = (SpeculativeDecoder(lm, ToyHead("cp", 3, 2, lm.hidden_size, VOCAB)) if speculative
               else AutoregressiveDecoder(lm))
    with pytest.raises(InvalidDistributionError,
                       match=r"^the backbone's verifier logits (\(row 0\) )?are -inf for every token"):
        decoder.generate([0, 1], 3, temperature=temperature)


# ------------------------------------------------------------------------ impossible X_0 = c
def forbid_first_token(token: int) -> Callable[[ToyHead, dict[str, Tensor]], None]:
    """Give ``X_0 = token`` probability zero (a -inf logit in every input unit of variable 0)."""
    def edit(head: ToyHead, params: dict[str, Tensor]) -> None:
        for name, slot in input_slots(head, 0):
            params[name][:, slot, :, token] = -math.inf
    return edit


@pytest.mark.parametrize("architecture", ["ff", "cp", "btree"])
@pytest.mark.parametrize("config", [GREEDY, SAMPLING], ids=["greedy", "sampling"])
def test_impossible_next_token_makes_an_autoregressive_round(architecture: str,
                                                             config: SamplingConfig) -> None:
    """The prompt ends in the forbidden token, so the first round cannot draft: every draft of
    that round is rejected and ``p_1`` decides, an autoregressive step in law (the round keeps
    its fixed shapes, so it still verifies a whole window). Greedy: the very token of that step;
    sampling: the law, checked exactly by the enumeration tests (tests/test_decoder_exact.py)."""
    lm = ToyLM(VOCAB, seed=2)
    head = EditedHead(forbid_first_token(1), architecture)
    speculative = SpeculativeDecoder(lm, head).generate(
        [0, 1], 1, config.temperature, generator=torch.Generator().manual_seed(5))
    plain = AutoregressiveDecoder(ToyLM(VOCAB, seed=2)).generate(
        [0, 1], 1, config.temperature, generator=torch.Generator().manual_seed(5))
    assert speculative.rounds[0].kind is RoundKind.AUTOREGRESSIVE
    assert speculative.rounds[0].accepted == 0 and speculative.rounds[0].drafted == 0
    if config.greedy:
        assert torch.equal(speculative.tokens, plain.tokens)
    longer = SpeculativeDecoder(lm, head).generate([0, 1], 12, config.temperature,
                                                   generator=torch.Generator().manual_seed(5))
    assert len(longer.tokens) == 12
    assert any(r.kind is RoundKind.SPECULATIVE for r in longer.rounds)  # where 1 is not next
    if config.greedy:  # greedy decoding is deterministic: exactly the target's tokens
        reference = AutoregressiveDecoder(ToyLM(VOCAB, seed=2)).generate([0, 1], 12)
        assert torch.equal(longer.tokens, reference.tokens)


# ------------------------------------------------------------------------ one call at a time
class BlockingHead(ToyHead):
    """A ToyHead that, when armed, signals ``entered`` and waits for ``release`` in its forward."""

    def __init__(self) -> None:
        super().__init__("cp", 3, 2, 6, VOCAB)
        self.armed = True
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, hidden: Tensor) -> dict[str, Tensor]:
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.release.wait(30), "the test never released the head"
        return super().forward(hidden)


def test_a_second_thread_gets_a_clear_error_and_the_first_is_unharmed() -> None:
    lm = ToyLM(VOCAB)
    head = BlockingHead()
    decoder = SpeculativeDecoder(lm, head)
    results: dict[str, object] = {}

    def first() -> None:
        try:
            results["tokens"] = decoder.generate([0, 1], 6).tokens
        except BaseException as error:  # reported by the assertions below
            results["error"] = error

    thread = threading.Thread(target=first, name="first-decoder-thread")
    thread.start()
    try:
        assert head.entered.wait(30)
        with pytest.raises(DecoderError, match=r"this decoder is already generating \(in thread "
                                               r"'first-decoder-thread'.*not thread-safe; use one "
                                               r"decoder \(with its own backbone\) per thread"):
            decoder.generate([0, 1], 6)
        other = AutoregressiveDecoder(lm)  # another decoder on the same backbone
        with pytest.raises(DecoderError, match="this backbone is already generating"):
            other.generate([0, 1], 2)
    finally:
        head.release.set()
        thread.join(30)
    assert not thread.is_alive() and "error" not in results, results.get("error")
    reference = SpeculativeDecoder(ToyLM(VOCAB), ToyHead("cp", 3, 2, 6, VOCAB)).generate([0, 1], 6)
    assert torch.equal(results["tokens"], reference.tokens)  # type: ignore[arg-type]
    assert torch.equal(decoder.generate([0, 1], 6).tokens, reference.tokens)  # free again


def test_a_reentrant_call_is_refused_and_a_failed_call_releases_the_decoder() -> None:
    lm = ToyLM(VOCAB)
    calls: list[str] = []

    def reenter(head: ToyHead, params: dict[str, Tensor]) -> None:
        calls.append("head")
        decoder.generate([0, 1], 2)  # from inside a round of the same decoder

    decoder = SpeculativeDecoder(lm, EditedHead(reenter))
    with pytest.raises(DecoderError, match=r"this decoder is already generating.*not thread-safe"):
        decoder.generate([0, 1], 3)
    assert calls == ["head"]
    decoder.head.edit = lambda head, params: None
    assert len(decoder.generate([0, 1], 3).tokens) == 3  # the failed call released it
