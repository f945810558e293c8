"""The draft block's decode step over its preallocated cache (``circuits_llm.draft_block.step``)
computes what the block's Hugging Face forward computes, in float64 to rounding.

For Llama shapes with grouped-query heads, biases in the attention and the MLP, an explicit head
size and scaled rotary angles, and for two layers: a run of calls (a prefill longer than a chunk,
one-position steps, a rollback and a re-extension, capacity doubling from a tiny start) gives at
every position the output of one causal forward over the whole sequence, and the cache holds that
forward's keys and values; eager, through the CUDA-graph replay double, and traced whole by
``torch.compile`` (``fullgraph``). Bad calls raise one clear error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_graph_double import CudaGraphDouble
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from circuits_llm.draft_block import BlockInit, DraftBlock, DraftBlockError
from circuits_llm.draft_block.step import BlockStep
from circuits_llm.runtime.compiling import Compilation

SHAPES: dict[str, dict[str, Any]] = {
    "grouped heads": {},
    "biases": {"attention_bias": True, "mlp_bias": True},
    "head size 16": {"head_dim": 16},
    "llama3 rotary": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 16}},
    "no grouping": {"num_key_value_heads": 4},
}


def _model(**changes: Any) -> LlamaForCausalLM:
    torch.manual_seed(0)
    settings: dict[str, Any] = {"num_key_value_heads": 2, **changes}
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=False, **settings)
    return LlamaForCausalLM(config).double().eval()


def _block(model: LlamaForCausalLM, layers: int = 1) -> DraftBlock:
    block = DraftBlock(model, steps=3, layers=layers, init=BlockInit.LAST_LAYER)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator,
                                             dtype=parameter.dtype))
    return block.eval()


def _reference(block: DraftBlock, hidden: torch.Tensor, tokens: torch.Tensor
               ) -> tuple[torch.Tensor, DynamicCache]:
    """One causal forward over the whole sequence: outputs (1, n, d) and its keys and values."""
    n = hidden.shape[1]
    positions = torch.arange(n)
    cache = DynamicCache()
    with torch.no_grad():
        output = block(hidden, tokens, positions, positions[None, :] <= positions[:, None], cache)
    return output, cache


def _tracing_compiler(fn: Any, *, name: str, device: torch.device) -> Compilation:
    """``torch.compile`` whole-graph, static shapes, without a code generator (tracing only)."""
    return Compilation(torch.compile(fn, backend="eager", fullgraph=True, dynamic=False), False)


def _run(step: BlockStep, block: DraftBlock, hidden: torch.Tensor, tokens: torch.Tensor,
         expected: torch.Tensor) -> Any:
    """Prefill 7 positions, 3 one-position steps, roll back 2, then 5 more positions in one call
    and 2 steps: every output against ``expected`` at its position."""
    cache = step.new_cache(capacity=4)  # doubles to fit
    done = 0

    def call(m: int) -> None:
        nonlocal done
        output = step(cache, hidden[:, done:done + m], tokens[:, done:done + m])
        torch.testing.assert_close(output, expected[:, done:done + m], rtol=1e-10, atol=1e-12)
        done += m
        assert cache.get_seq_length() == done

    call(7)
    for _ in range(3):
        call(1)
    # a rollback: positions 8 and 9 were speculative, the same inputs come again
    cache.truncate(8)
    done = 8
    call(5)
    call(1)
    call(1)
    return cache


@pytest.mark.parametrize("mode", ["eager", "double", "traced"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_step_equals_the_blocks_forward(shape: str, mode: str) -> None:
    model = _model(**SHAPES[shape])
    block = _block(model, layers=2 if shape == "grouped heads" else 1)
    generator = torch.Generator().manual_seed(2)
    n = 15
    hidden = torch.randn(1, n, 32, generator=generator, dtype=torch.float64)
    tokens = torch.randint(0, 40, (1, n), generator=generator)
    expected, reference = _reference(block, hidden, tokens)
    step = BlockStep(block)
    double = CudaGraphDouble()
    if mode != "eager":
        step.compile(3, double if mode == "double" else _tracing_compiler)
    cache = _run(step, block, hidden, tokens, expected)
    assert cache.capacity >= n and cache.capacity & (cache.capacity - 1) == 0
    for mine, theirs in zip(cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(mine.values, theirs.values, rtol=1e-10, atol=1e-12)
    if mode == "double":  # one-row steps and 3-row chunks, each a compiled call
        assert double.calls["draft block step"] == 3 + 3 + 2 + 2


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_batch_call_gives_each_row_its_own_forward(shape: str) -> None:
    """``BlockStep.batch``: three sequences of different lengths, each row's new positions of a
    different count (1 to 4), through rounds of batch calls with a rollback of one row between
    them: every row's outputs and cache equal one causal forward over that row alone (float64);
    the cache of a row that takes another row's inputs (negative control) does not."""
    model = _model(**SHAPES[shape])
    block = _block(model, layers=2 if shape == "grouped heads" else 1)
    generator = torch.Generator().manual_seed(3)
    n = 14
    hidden = torch.randn(3, n, 32, generator=generator, dtype=torch.float64)
    tokens = torch.randint(0, 40, (3, n), generator=generator)
    references = [_reference(block, hidden[b:b + 1], tokens[b:b + 1]) for b in range(3)]
    step = BlockStep(block)
    caches = [step.new_cache(capacity=2) for _ in range(3)]
    for counts in ((4, 1, 2), (1, 3, 1), (2, 1, 4), (1, 1, 1)):
        starts = [cache.length for cache in caches]
        outputs = step.batch(caches, [hidden[b, s:s + m] for b, (s, m) in
                                      enumerate(zip(starts, counts, strict=True))],
                             [tokens[b, s:s + m] for b, (s, m) in
                              enumerate(zip(starts, counts, strict=True))])
        assert outputs.shape == (3, 32)
        for b, (start, m) in enumerate(zip(starts, counts, strict=True)):
            torch.testing.assert_close(outputs[b], references[b][0][0, start + m - 1],
                                       rtol=1e-10, atol=1e-12)
        caches[1].truncate(caches[1].length - 1)  # row 1's last position was speculative
    for cache, (_, reference) in zip(caches, references, strict=True):
        held = cache.length
        for mine, theirs in zip(cache.layers, reference.layers, strict=True):
            torch.testing.assert_close(mine.keys, theirs.keys[:, :, :held], rtol=1e-10,
                                       atol=1e-12)
            torch.testing.assert_close(mine.values, theirs.values[:, :, :held], rtol=1e-10,
                                       atol=1e-12)
    swapped = step.new_cache()
    step.batch([swapped], [hidden[0, :4]], [tokens[2, :4]])
    assert not torch.allclose(swapped.layers[0].values, references[0][1].layers[0].values[:, :, :4])
    with pytest.raises(DraftBlockError, match="one cache, \\(m, d\\) features and \\(m,\\) tokens"):
        step.batch(caches, [hidden[0, :1]] * 3, [tokens[0, :0]] * 3)


def test_bad_calls_say_what_was_wrong() -> None:
    block = _block(_model())
    step = BlockStep(block)
    cache = step.new_cache()
    with pytest.raises(DraftBlockError, match=r"hidden \(1, m, d\) and tokens \(1, m\)"):
        step(cache, torch.zeros(1, 2, 32, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(DraftBlockError, match="cannot keep 3 of 0 cached positions"):
        cache.truncate(3)
    with pytest.raises(DraftBlockError, match="rows must be an int >= 1"):
        step.compile(0)
    with pytest.raises(DraftBlockError, match="a BlockStep runs a DraftBlock"):
        BlockStep(None)  # type: ignore[arg-type]


def test_the_cache_grows_without_losing_what_it_holds() -> None:
    block = _block(_model())
    step = BlockStep(block)
    cache = step.new_cache(capacity=1)
    hidden = torch.randn(1, 6, 32, dtype=torch.float64)
    tokens = torch.randint(0, 40, (1, 6))
    step(cache, hidden[:, :2], tokens[:, :2])
    held = [layer.keys.clone() for layer in cache.layers]
    step(cache, hidden[:, 2:], tokens[:, 2:])
    assert cache.capacity == 8
    for before, layer in zip(held, cache.layers, strict=True):
        torch.testing.assert_close(layer.keys[:, :, :2], before, rtol=0, atol=0)
