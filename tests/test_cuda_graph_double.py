"""Compiled decoding stays exact under CUDA-graph semantics, checked on the CPU with a double.

``torch.compile(mode="reduce-overhead")`` on CUDA hands out static outputs that any later compiled
call may overwrite (``tests/cuda_graph_double.py`` explains the semantics the double emulates). The
decoder's compiled path (the round's draft and accept programs and the backbone's compiled steps)
runs here through :class:`CudaGraphDouble`, which poisons every earlier output at each call:

* the double itself: a stale output raises, a stale view reads poison, buffers are reused;
* it has teeth: the same decoder with its output copies switched off fails (today's bug);
* greedy compiled decoding is token-identical to ``model.generate`` (HF GPT-2, float64) and to
  eager decoding (toy), speculative and autoregressive;
* sampled compiled decoding draws exactly what eager decoding draws from the same generator
  (eager decoding's law is exact: ``test_decoder_exact.py``), and a chi-square test against the
  brute-force target law.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from cuda_graph_double import CudaGraphDouble, StaleOutputError
from toy import ToyHead, ToyLM, law_p_value, target_law
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.acceptance import SampledAccept
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.heads import MTPHead
from circuits_llm.runtime.compiling import Compilation, CompiledProgram, use_compiler

VOCAB, HIDDEN, EOS = 48, 32, 47
#: compiled rounds as a GPU runs them: the sampled accept over the whole window, as one program
WHOLE_WINDOW = SampledAccept.WHOLE_WINDOW
TOY_VOCAB = 4
DRAFT_TOKENS = (2, 0, 3)


def _gpt2() -> PreTrainedModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4,
                                       n_positions=128, bos_token_id=0, eos_token_id=EOS,
                                       pad_token_id=0))
    return model.double().eval()  # float64: every argmax agrees with model.generate's


MODEL = _gpt2()


def _head(architecture: str, variant: str = "lean", window: int = 4) -> MTPHead:
    return MTPHead.from_name(architecture, window, 2, HIDDEN, VOCAB, variant=variant,
                             lm_head_weight=MODEL.get_output_embeddings().weight.detach(),
                             dtype=torch.float64, sum_init_std=0.5)


def _reference(prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    out = MODEL.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def _programs_ran(double: CudaGraphDouble, *kinds: str) -> None:
    """Every named kind of program ran through the double (the compiled path was taken)."""
    for kind in kinds:
        assert sum(n for name, n in double.calls.items() if name.startswith(kind)) > 0, \
            (kind, dict(double.calls))


# ---------------------------------------------------------------------- the double itself
def test_the_double_poisons_every_earlier_output() -> None:
    double = CudaGraphDouble()
    first = CompiledProgram(lambda x: (x + 1, (x > 0).all()), name="first", device=torch.device("cpu"),
                            compiler=lambda fn, **_: Compilation(double(fn, name="first",
                                                                        device=torch.device("cpu")).fn,
                                                                 static_outputs=False))
    second = double(lambda x: x * 2, name="second", device=torch.device("cpu")).fn
    value, positive = first(torch.arange(3.0))  # not copied out: static_outputs=False
    view = value[1:]
    with torch._C.DisableTorchFunctionSubclass():
        escaped = value[1:]  # a plain view (as a kernel would hold one): no check, poisoned data
    assert value.tolist() == [1.0, 2.0, 3.0] and bool(positive) is False
    again = second(torch.ones(2))
    static = again.untyped_storage().data_ptr()
    with pytest.raises(StaleOutputError, match="overwritten by a subsequent run"):
        value.sum()
    with pytest.raises(StaleOutputError):
        bool(positive)
    with pytest.raises(StaleOutputError):  # a view the caller made is stale with its base
        view.tolist()
    assert type(escaped) is torch.Tensor and torch.isnan(escaped).all()  # what the "replay" left
    assert again.tolist() == [2.0, 2.0]
    with pytest.raises(StaleOutputError):  # an earlier output as the input of the next call
        second(again)
    fresh = second(torch.ones(2))
    assert fresh.tolist() == [2.0, 2.0] and double.calls == Counter(first=1, second=3)
    assert fresh.untyped_storage().data_ptr() == static  # one static output buffer per graph


def test_copied_outputs_survive_later_calls() -> None:
    double = CudaGraphDouble()
    program = CompiledProgram(lambda x: (x + 1, None), name="p", device=torch.device("cpu"),
                              compiler=double)
    value, nothing = program(torch.arange(3.0))
    program(torch.zeros(3))
    assert value.tolist() == [1.0, 2.0, 3.0] and nothing is None
    assert type(value) is torch.Tensor  # no alias of a static buffer escapes


# ---------------------------------------------------------------------- the double has teeth
class _Uncopied:
    """The double, with the programs whose names start with ``prefix`` declared to have ordinary
    outputs: their outputs are not copied out (the unfixed code)."""

    def __init__(self, prefix: str) -> None:
        self.double = CudaGraphDouble()
        self.prefix = prefix

    def __call__(self, fn, *, name: str, device: torch.device) -> Compilation:  # type: ignore[no-untyped-def]
        compiled = self.double(fn, name=name, device=device).fn
        return Compilation(compiled, static_outputs=not name.startswith(self.prefix))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
@pytest.mark.parametrize("uncopied", ["draft program", "backbone step"])
def test_reading_a_replayed_output_late_fails_under_the_double(uncopied: str,
                                                               temperature: float) -> None:
    """Without its copies, a program's outputs are read after a later compiled call: the draft's
    block by the backbone's verify step and its tokens, ``q`` and flags by the accept program; the
    backbone's logits by the accept program and its hidden state by the next draft program."""
    with use_compiler(_Uncopied(uncopied)):
        decoder = SpeculativeDecoder(MODEL, _head("cp"), compile=True, sampled_accept=WHOLE_WINDOW)
    with pytest.raises(StaleOutputError, match=f"an output of {uncopied}"):
        decoder.generate(torch.tensor([[5, 9, 5, 9, 3]]), 8, temperature,
                         generator=torch.Generator().manual_seed(0))
    if uncopied == "draft program":  # a backbone that is not compiled: the accept program reads it
        lm = ToyLM(TOY_VOCAB, draft_branch=True, seed=5)
        head = ToyHead("btree", 4, 2, lm.hidden_size, TOY_VOCAB, seed=5, draft_tokens=DRAFT_TOKENS)
        with use_compiler(_Uncopied(uncopied)):
            decoder = SpeculativeDecoder(lm, head, compile=True, sampled_accept=WHOLE_WINDOW)
        with pytest.raises(StaleOutputError, match=r"draft program .* after call \d+ \(accept program"):
            decoder.generate([1, 2, 0], 8, temperature, generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------- greedy identity
@pytest.mark.parametrize(("architecture", "variant", "lora_layers"),
                         [("btree", "lean", 0), ("cp", "full", 1), ("hmm", "lean", 0)])
def test_compiled_greedy_equals_generate_under_cuda_graph_semantics(
        architecture: str, variant: str, lora_layers: int) -> None:
    """Backbone steps (lengths 1 and 4), draft and accept all run through the double."""
    double = CudaGraphDouble()
    with use_compiler(double):
        decoder = SpeculativeDecoder(MODEL, _head(architecture, variant), lora_layers=lora_layers,
                                     compile=True, sampled_accept=WHOLE_WINDOW)
    assert decoder.backbone.compiled and decoder.backbone.compiled_lengths == (1, 4)
    if lora_layers:  # random non-zero adapters: the draft branch differs from the verifier
        generator = torch.Generator().manual_seed(1)
        for parameter in decoder.backbone.draft_parameters():  # type: ignore[attr-defined]
            parameter.data = 0.3 * torch.randn(parameter.shape, generator=generator,
                                               dtype=parameter.dtype)
    for prompt in (torch.tensor([[5, 9, 5, 9, 3]]), torch.tensor([[7]]), torch.tensor([[4, 4]])):
        result = decoder.generate(prompt, 14, eos_token_id=EOS)
        assert result.tokens.tolist() == _reference(prompt, 14)
        assert decoder.backbone.length == prompt.shape[1] + len(result.tokens) - 1
    _programs_ran(double, "draft program", "accept program", "backbone step")


def test_compiled_autoregressive_equals_generate_under_cuda_graph_semantics() -> None:
    double = CudaGraphDouble()
    with use_compiler(double):
        decoder = AutoregressiveDecoder(MODEL, compile=True)
    for prompt in (torch.tensor([[5, 9, 5, 9, 3]]), torch.tensor([[4, 4]])):  # [4, 4]: compiled prefill
        assert decoder.generate(prompt, 12).tokens.tolist() == _reference(prompt, 12)
    _programs_ran(double, "backbone step")


@pytest.mark.parametrize(("architecture", "draft_tokens"),
                         [("btree", DRAFT_TOKENS), ("cp", None), ("ff", None)])
def test_compiled_greedy_equals_eager_on_toy(architecture: str,
                                             draft_tokens: tuple[int, ...] | None) -> None:
    lm = ToyLM(TOY_VOCAB, draft_branch=True, seed=1)
    head = ToyHead(architecture, 4, 1 if architecture == "ff" else 2, lm.hidden_size, TOY_VOCAB,
                   seed=1, draft_tokens=draft_tokens)
    eager = SpeculativeDecoder(lm, head)
    double = CudaGraphDouble()
    with use_compiler(double):
        compiled = SpeculativeDecoder(ToyLM(TOY_VOCAB, draft_branch=True, seed=1), head, compile=True,
                                      sampled_accept=WHOLE_WINDOW)
    for prompt in ([0, 2], [1], [2, 1, 3]):
        want = eager.generate(prompt, 14)
        got = compiled.generate(prompt, 14)
        assert got.tokens.tolist() == want.tokens.tolist()
        assert [r.accepted for r in got.rounds] == [r.accepted for r in want.rounds]
    _programs_ran(double, "draft program", "accept program")


# ---------------------------------------------------------------------- the sampled law
@pytest.mark.parametrize(("architecture", "draft_tokens", "config"), [
    ("btree", DRAFT_TOKENS, SamplingConfig(1.0, top_k=3)),
    ("hmm", None, SamplingConfig(0.8)),
    ("cp", DRAFT_TOKENS, SamplingConfig(1.2, top_p=0.8)),
])
def test_compiled_sampling_draws_what_eager_draws_under_cuda_graph_semantics(
        architecture: str, draft_tokens: tuple[int, ...] | None, config: SamplingConfig) -> None:
    """Same generator, same tokens and acceptances: the compiled law is eager's exact law."""
    lm = ToyLM(TOY_VOCAB, draft_branch=True, seed=5)
    head = ToyHead(architecture, 4, 2, lm.hidden_size, TOY_VOCAB, seed=5, draft_tokens=draft_tokens)
    eager = SpeculativeDecoder(lm, head)
    double = CudaGraphDouble()
    with use_compiler(double):
        compiled = SpeculativeDecoder(ToyLM(TOY_VOCAB, draft_branch=True, seed=5), head, compile=True,
                                      sampled_accept=WHOLE_WINDOW)
    sampling = {"temperature": config.temperature, "top_k": config.top_k, "top_p": config.top_p}
    for seed in range(4):
        want = eager.generate([1, 2, 0], 16, generator=torch.Generator().manual_seed(seed), **sampling)
        got = compiled.generate([1, 2, 0], 16, generator=torch.Generator().manual_seed(seed), **sampling)
        assert got.tokens.tolist() == want.tokens.tolist()
        assert [r.accepted for r in got.rounds] == [r.accepted for r in want.rounds]
    _programs_ran(double, "draft program", "accept program")


def test_compiled_hf_sampling_draws_what_eager_draws_under_cuda_graph_semantics() -> None:
    head = _head("btree")
    eager = SpeculativeDecoder(HFBackbone(MODEL), head)
    double = CudaGraphDouble()
    with use_compiler(double):
        compiled = SpeculativeDecoder(MODEL, head, compile=True, sampled_accept=WHOLE_WINDOW)
    prompt = torch.tensor([[5, 9, 5, 9, 3]])
    for seed in range(2):
        want = eager.generate(prompt, 12, 0.9, 10, 0.95, torch.Generator().manual_seed(seed))
        got = compiled.generate(prompt, 12, 0.9, 10, 0.95, torch.Generator().manual_seed(seed))
        assert got.tokens.tolist() == want.tokens.tolist()
    _programs_ran(double, "draft program", "accept program", "backbone step")


def test_compiled_sampling_matches_the_target_law_under_cuda_graph_semantics() -> None:
    """Chi-square of 300 compiled two-token decodes against the brute-force target law."""
    head = ToyHead("btree", 4, 2, 6, TOY_VOCAB, seed=5, draft_tokens=DRAFT_TOKENS)
    with use_compiler(CudaGraphDouble()):
        compiled = SpeculativeDecoder(ToyLM(TOY_VOCAB, draft_branch=True, seed=5), head, compile=True,
                                      sampled_accept=WHOLE_WINDOW)
    law = target_law(ToyLM(TOY_VOCAB, draft_branch=True, seed=5), [1, 2], 2, SamplingConfig(1.0))
    generator = torch.Generator().manual_seed(99)
    samples = [tuple(compiled.generate([1, 2], 2, 1.0, generator=generator).tokens.tolist())
               for _ in range(300)]
    assert set(samples) <= set(law)
    assert law_p_value(samples, law) > 1e-3


# ---------------------------------------------------------------------- what is compiled
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling"])
def test_the_compiled_programs_trace_to_one_graph(greedy: bool) -> None:
    """The callables handed to the compiler (the draft program's three outputs, the accept
    program with its packing) are one graph each: no host synchronisation inside a round."""
    from circuits_llm.decoding.round import RoundProgram

    lm = ToyLM(TOY_VOCAB, seed=2)
    head = ToyHead("btree", 4, 2, lm.hidden_size, TOY_VOCAB, seed=2, draft_tokens=DRAFT_TOKENS)
    program = RoundProgram(head, SamplingConfig(0.0 if greedy else 0.9, top_k=3))
    hidden = torch.randn(1, lm.hidden_size, dtype=torch.float64)
    c = torch.tensor([2])
    uniforms = None if greedy else program.draw_uniforms(torch.Generator().manual_seed(0))
    with torch.no_grad():
        explained = torch._dynamo.explain(program._draft_program)(hidden, c, uniforms)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        draft = program.draft(hidden, c, uniforms)
        logits = torch.randn(4, TOY_VOCAB, dtype=torch.float64)
        args = (logits, draft.tokens, draft.q, draft.head_ok, draft.possible, uniforms)
        explained = torch._dynamo.explain(program._accept_program)(*args)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        packed = program._accept_program(*args)
    outcome = program.outcome(packed)
    assert outcome.draft == tuple(draft.tokens.tolist()) and outcome.head_ok
