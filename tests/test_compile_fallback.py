"""A program the compiler refuses runs eager, with one warning, and nothing else changes.

Inductor refuses some programs at their first call (torch 2.11 on an H200:
``InductorError: NotImplementedError: NYI TritonSplitDimKernel reductions`` for the BTree draft
program). A compiler injected through :func:`~circuits_llm.runtime.compiling.use_compiler` makes
one program refuse at its first call: the draft program, the accept program, or the backbone's
step for one block length. Every other program is "compiled" by the CUDA-graph double (so the
copies out of static outputs are exercised too). For each:

* exactly one :class:`CompileFallbackWarning`, naming the program and the error, however many
  rounds and ``generate`` calls follow; one record in :func:`compile_fallbacks`;
* greedy output token-identical to ``model.generate``, sampled output identical to eager
  decoding's draws;
* the failing program never runs compiled again, and the other programs still run compiled.

Also: errors that are not compile refusals are not swallowed, and the decoder benchmark records
the programs that fell back.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from cuda_graph_double import CudaGraphDouble
from torch._inductor.exc import InductorError
from toy import ToyHead, ToyLM
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.acceptance import SampledAccept
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.heads import MTPHead
from circuits_llm.runtime.compiling import (
    Compilation,
    CompiledProgram,
    CompileFallbackWarning,
    compile_fallbacks,
    use_compiler,
)

VOCAB, HIDDEN, EOS = 48, 32, 47
#: compiled rounds as a GPU runs them: the sampled accept over the whole window, as one program
WHOLE_WINDOW = SampledAccept.WHOLE_WINDOW
NYI = "NYI TritonSplitDimKernel reductions"
PROMPTS = (torch.tensor([[5, 9, 5, 9, 3]]), torch.tensor([[7]]), torch.tensor([[4, 4]]))


def _gpt2() -> PreTrainedModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4,
                                       n_positions=128, bos_token_id=0, eos_token_id=EOS,
                                       pad_token_id=0))
    return model.double().eval()


MODEL = _gpt2()


def _head(architecture: str = "btree") -> MTPHead:
    return MTPHead.from_name(architecture, 4, 2, HIDDEN, VOCAB,
                             lm_head_weight=MODEL.get_output_embeddings().weight.detach(),
                             dtype=torch.float64, sum_init_std=0.5)


def _reference(prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    out = MODEL.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def _variant(args: tuple[Any, ...]) -> str:
    """The specialisation a call selects: the block length for a backbone step (token ids)."""
    first = args[0] if args else None
    if isinstance(first, torch.Tensor) and first.dim() == 2 and first.dtype == torch.long:
        return f"{first.shape[1]} tokens"
    return ""


class RefusingCompiler:
    """Compiles every program with the CUDA-graph double, except that the programs whose name
    starts with ``prefix`` (and whose call selects ``variant``, when given) raise Inductor's error
    at their first compiled call, as ``torch.compile`` does when Inductor refuses a graph.

    Attributes:
        compiled_calls: (program name, variant) -> calls that ran "compiled" (through the double).
        refused_calls: (program name, variant) -> calls that raised.
    """

    def __init__(self, prefix: str, variant: str | None = None) -> None:
        self.double = CudaGraphDouble()
        self.prefix = prefix
        self.variant = variant
        self.compiled_calls: Counter[tuple[str, str]] = Counter()
        self.refused_calls: Counter[tuple[str, str]] = Counter()

    def __call__(self, fn: Callable[..., Any], *, name: str, device: torch.device) -> Compilation:
        replay = self.double(fn, name=name, device=device).fn
        refuses = name.startswith(self.prefix)

        def compiled(*args: Any) -> Any:
            key = (name, _variant(args))
            if refuses and self.variant in (None, key[1]):
                self.refused_calls[key] += 1
                raise InductorError(NotImplementedError(NYI), None)
            self.compiled_calls[key] += 1
            return replay(*args)

        return Compilation(compiled, static_outputs=True)

    def compiled(self, prefix: str, variant: str | None = None) -> int:
        """How many calls of the programs named ``prefix...`` (of ``variant``) ran compiled."""
        return sum(n for (name, v), n in self.compiled_calls.items()
                   if name.startswith(prefix) and variant in (None, v))


def _fallback_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]


def _decode_everything(compiler: RefusingCompiler) -> tuple[list[str], list[Any]]:
    """Greedy and sampled decoding of several prompts with a compiled decoder built under
    ``compiler``, checked against ``model.generate`` and eager decoding; -> (the fall back
    warnings, the new :func:`compile_fallbacks` records)."""
    head = _head()
    eager = SpeculativeDecoder(HFBackbone(MODEL), head)
    before = len(compile_fallbacks())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with use_compiler(compiler):
            decoder = SpeculativeDecoder(MODEL, head, compile=True, sampled_accept=WHOLE_WINDOW)
        for _ in range(2):  # the second pass: no new warning, the failing program stays eager
            for prompt in PROMPTS:
                result = decoder.generate(prompt, 12, eos_token_id=EOS)
                assert result.tokens.tolist() == _reference(prompt, 12)
            for seed in range(2):
                got = decoder.generate(PROMPTS[0], 10, 0.9, 10, None, torch.Generator().manual_seed(seed))
                want = eager.generate(PROMPTS[0], 10, 0.9, 10, None, torch.Generator().manual_seed(seed))
                assert got.tokens.tolist() == want.tokens.tolist()
    return _fallback_warnings(caught), list(compile_fallbacks()[before:])


@pytest.mark.parametrize("program", ["draft program", "accept program"])
def test_a_refused_round_program_runs_eager_once_loudly(program: str) -> None:
    compiler = RefusingCompiler(program)
    messages, records = _decode_everything(compiler)
    # one per refusing program: greedy and sampling are two programs (two configurations)
    assert len(messages) == 2 and len(records) == 2, messages
    assert {r.program for r in records} == {f"{program} (btree head, window 4, greedy)",
                                            f"{program} (btree head, window 4, sampling)"}
    for message, record in zip(messages, records, strict=True):
        assert record.program in message and NYI in message and "eager" in message
        assert record.error == f"InductorError: NotImplementedError: {NYI}"
    assert sum(compiler.refused_calls.values()) == 2  # each refused once, then never called again
    assert compiler.compiled(program) == 0
    others = {"draft program", "accept program"} - {program}
    for other in [*others, "backbone step"]:  # the other programs still run compiled
        assert compiler.compiled(other) > 0, other
    assert compiler.compiled("backbone step", "4 tokens") > 0
    assert compiler.compiled("backbone step", "1 tokens") > 0


def test_a_refused_backbone_block_length_runs_eager_once_loudly() -> None:
    compiler = RefusingCompiler("backbone step", variant="4 tokens")
    messages, records = _decode_everything(compiler)
    assert len(messages) == 1 and len(records) == 1, messages
    assert records[0].program == "backbone step (GPT2LMHeadModel) [batch 1, 4 tokens]"
    assert records[0].program in messages[0] and NYI in messages[0]
    assert sum(compiler.refused_calls.values()) == 1
    assert compiler.compiled("backbone step", "4 tokens") == 0
    assert compiler.compiled("backbone step", "1 tokens") > 0  # the other block length
    for other in ("draft program", "accept program"):
        assert compiler.compiled(other) > 0, other


def test_a_refused_autoregressive_step_runs_eager_once_loudly() -> None:
    compiler = RefusingCompiler("backbone step", variant="1 tokens")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with use_compiler(compiler):
            decoder = AutoregressiveDecoder(MODEL, compile=True)
        for prompt in PROMPTS:
            assert decoder.generate(prompt, 8).tokens.tolist() == _reference(prompt, 8)
    messages = _fallback_warnings(caught)
    assert len(messages) == 1 and "[batch 1, 1 token]" in messages[0], messages


def test_a_refused_round_program_on_a_toy_backbone() -> None:
    """The toy backbone is not compiled: only the round's programs are, and one refuses."""
    lm = ToyLM(4, draft_branch=True, seed=1)
    head = ToyHead("btree", 4, 2, lm.hidden_size, 4, seed=1, draft_tokens=(2, 0, 3))
    eager = SpeculativeDecoder(lm, head)
    compiler = RefusingCompiler("draft program")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with use_compiler(compiler):
            decoder = SpeculativeDecoder(ToyLM(4, draft_branch=True, seed=1), head, compile=True,
                                         sampled_accept=WHOLE_WINDOW)
        for seed in range(3):
            got = decoder.generate([1, 2, 0], 12, 1.0, generator=torch.Generator().manual_seed(seed))
            want = eager.generate([1, 2, 0], 12, 1.0, generator=torch.Generator().manual_seed(seed))
            assert got.tokens.tolist() == want.tokens.tolist()
    assert len(_fallback_warnings(caught)) == 1
    assert compiler.compiled("accept program") > 0 and compiler.compiled("draft program") == 0


# ---------------------------------------------------------------------- only refusals fall back
def _raising(error: BaseException) -> Callable[..., Any]:
    def compiler(fn: Callable[..., Any], *, name: str, device: torch.device) -> Compilation:
        def compiled(*_args: Any) -> Any:
            raise error
        return Compilation(compiled, static_outputs=False)
    return compiler


@pytest.mark.parametrize("error", [
    RuntimeError("an error raised while the graph ran"),
    torch._dynamo.exc.Unsupported("a graph break under fullgraph=True"),
], ids=["runtime", "graph-break"])
def test_other_errors_are_not_swallowed(error: BaseException) -> None:
    """A graph break is a bug of the traced code, and a runtime error may come after part of the
    program ran (a step updates caches in place): neither is retried eagerly."""
    program = CompiledProgram(lambda x: x + 1, name="p", device=torch.device("cpu"),
                              compiler=_raising(error))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        with pytest.raises(type(error)):
            program(torch.zeros(1))
    assert program.fallbacks == {}


def test_a_fall_back_is_per_variant() -> None:
    calls: list[int] = []

    def compiler(fn: Callable[..., Any], *, name: str, device: torch.device) -> Compilation:
        def compiled(x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            if x.shape[0] == 2:
                raise InductorError(NotImplementedError(NYI), None)
            return fn(x)
        return Compilation(compiled, static_outputs=False)

    program = CompiledProgram(lambda x: x * 3, name="p", device=torch.device("cpu"),
                              compiler=compiler, variant=lambda x: f"size {x.shape[0]}")
    with pytest.warns(CompileFallbackWarning, match=r"p \[size 2\].*InductorError"):
        assert program(torch.ones(2)).tolist() == [3.0, 3.0]
    for size in (2, 1, 2, 1):
        assert program(torch.ones(size)).tolist() == [3.0] * size
    assert calls == [2, 1, 1]  # size 2 was tried compiled once; size 1 stays compiled
    assert program.fallbacks == {"size 2": f"InductorError: NotImplementedError: {NYI}"}


# ---------------------------------------------------------------------- the benchmark records them
def test_the_decoder_benchmark_records_compile_fallbacks() -> None:
    import torch._inductor.config as inductor_config

    from benchmarks.decoder_bench import BenchConfig, format_tables, run_benchmark

    tiny = BenchConfig(hidden_size=16, layers=2, attention_heads=2, intermediate_size=32,
                       architectures=("ff",), windows=(4,), rank=2, variants=("lean",),
                       prompt_tokens=12, new_tokens=5, repeats=1, timing_rounds=1, threads=1,
                       kernels="torch", compiled_windows=(4,), compiled_variants=("lean",))
    compiler = RefusingCompiler("draft program")
    # run_benchmark switches on kernel profiling for code compiled later: undone after the test
    # (through the config's own patch: monkeypatch's undo deletes a SubConfigProxy's setting)
    profiling = {"cpp.enable_kernel_profile": inductor_config.cpp.enable_kernel_profile}
    with warnings.catch_warnings(), inductor_config.patch(profiling):
        warnings.simplefilter("ignore", CompileFallbackWarning)
        with use_compiler(compiler):
            result = run_benchmark(tiny, log=lambda _line: None)
    fallbacks = result["machine"]["compile_fallbacks"]
    assert fallbacks and all(p.startswith("draft program (ff head, window 4") for p in fallbacks)
    assert set(fallbacks.values()) == {f"InductorError: NotImplementedError: {NYI}"}
    head = result["heads"][0]
    assert head["compiled"]["compile_fallbacks"] == fallbacks and "compile_fallbacks" not in head["eager"]
    assert head["compiled"]["decode"]["greedy"]["matches_ar"] is True
    assert compiler.compiled("accept program") > 0 and compiler.compiled("backbone step") > 0
    table = format_tables(result)
    assert "compiled*" in table and "COMPILE FALLBACK draft program (ff head, window 4" in table
    clean = run_benchmark(dataclasses.replace(tiny, compiled_windows=()), log=lambda _line: None)
    assert clean["machine"]["compile_fallbacks"] == {}
