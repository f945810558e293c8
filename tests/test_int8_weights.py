"""Int8 weights for drafting: the int8 linear layer (both ways of computing it), the block's int8
copy, what ``DraftWeights.AUTO`` chooses, and greedy decoding with int8 drafts equal to the
model's own (the sampled law with int8 drafts is in test_draft_block_law.py)."""

from __future__ import annotations

import pytest
import torch
from draft_block_models import perturbed_block, tiny_llama
from torch import nn

from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.draft_block import (
    BlockCircuitDrafter,
    BlockDrafter,
    DraftBlockError,
    DraftWeights,
)
from circuits_llm.draft_block.weights import drafting_block, int8_block
from circuits_llm.runtime.int8_linear import WIDE_ROWS, Int8Linear, int8_rows, native_bfloat16

MODEL = tiny_llama(vocab=48)


def test_int8_rows_reconstruct_each_row_within_half_a_step() -> None:
    weight = torch.randn(7, 40, dtype=torch.float64) * torch.logspace(-3, 2, 7)[:, None]
    weight[3] = 0
    codes, scales = int8_rows(weight)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    error = (codes.double() * scales.double()[:, None] - weight).abs()
    assert torch.all(error <= scales.double()[:, None] * 0.5 + 1e-6 * weight.abs())
    assert scales[3] == 1 and torch.all(codes[3] == 0)
    with pytest.raises(ValueError, match=r"\(N, K\) float weight"):
        int8_rows(torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("width", [8, 24, 32, 48])
def test_int8_linear_matches_its_dequantised_weight(width: int) -> None:
    """Widths that are multiples of 16 run the packed kernel (bfloat16 activations and outputs),
    the others the dequantised product (exact to float64 rounding); both apply the same weight."""
    torch.manual_seed(width)
    linear = nn.Linear(width, 20, bias=True).double()
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(3, 5, width, dtype=torch.float64)
    out = layer(x)
    assert out.shape == (3, 5, 20) and out.dtype == torch.float64
    reference = nn.functional.linear(x, layer.dequantized(torch.float64), linear.bias)
    packed = layer.uses_packed_kernel(x)
    assert packed == (width % 16 == 0)
    if packed:  # bfloat16 in and out: ~3 significant digits
        torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)
    else:
        torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    # and the int8 weight is close to the float one
    torch.testing.assert_close(layer.dequantized(torch.float64), linear.weight.detach(),
                               rtol=0, atol=float(linear.weight.detach().abs().max()) / 127)
    with pytest.raises(ValueError, match=rf"inputs \(\.\.\., {width}\)"):
        layer(torch.zeros(2, width + 1, dtype=torch.float64))


def test_wide_calls_multiply_by_bfloat16_codes_where_bfloat16_is_native(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From ``WIDE_ROWS`` rows a packed-width call multiplies by the codes in bfloat16 (where
    oneDNN computes bfloat16 natively), fewer rows by the packed int8 kernel: both apply the same
    weight, and the bfloat16 codes are kept out of the state dict."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 24, bias=False)
    layer = Int8Linear.from_linear(linear)
    calls = {"packed": 0}
    packed = torch._weight_int8pack_mm

    def counted(*args: object) -> torch.Tensor:
        calls["packed"] += 1
        return packed(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "_weight_int8pack_mm", counted)
    for rows in range(1, WIDE_ROWS + 3):
        x = torch.randn(rows, 32)
        before = calls["packed"]
        out = layer(x)
        reference = nn.functional.linear(x, layer.dequantized(torch.float32))
        torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)
        wide = rows >= WIDE_ROWS and native_bfloat16(x.device)
        assert calls["packed"] - before == (0 if wide else 1)
    assert set(layer.state_dict()) == {"codes", "scales", "packed_scales"}


@pytest.mark.parametrize("rows", [1, WIDE_ROWS])
def test_int8_linear_compiles_whole_graph_on_either_side_of_wide_rows(rows: int) -> None:
    """A compiled draft-block step (``BlockStepMode.COMPILED`` on a CPU, first steps of up to
    ``window + 1`` rows) traces the layer: the CPU's bfloat16 answer must read as a constant, not
    break the graph (a cached probe once did), and the traced call gives the eager one's output."""
    torch.manual_seed(rows)
    layer = Int8Linear.from_linear(nn.Linear(32, 24, bias=True))
    x = torch.randn(rows, 32)
    compiled = torch.compile(layer, backend="eager", fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)


def test_int8_linear_refuses_malformed_parts() -> None:
    with pytest.raises(ValueError, match="int8"):
        Int8Linear(torch.zeros(2, 3), torch.ones(2), None)
    with pytest.raises(ValueError, match=r"scales must be \(2,\)"):
        Int8Linear(torch.zeros(2, 3, dtype=torch.int8), torch.ones(3), None)
    with pytest.raises(ValueError, match=r"bias must be \(2,\)"):
        Int8Linear(torch.zeros(2, 3, dtype=torch.int8), torch.ones(2), torch.ones(4))


def test_int8_block_is_a_copy_sharing_the_target() -> None:
    block = perturbed_block(MODEL, steps=2, draft_vocab=[0, 5, 9])
    before = {name: tensor.clone() for name, tensor in block.state_dict().items()}
    copy = int8_block(block)
    assert copy is not block
    assert copy.target.embedding is block.target.embedding
    assert copy.target.lm_head is block.target.lm_head
    assert not any(isinstance(module, nn.Linear) for module in copy.modules())
    assert isinstance(copy.fuse, Int8Linear)
    assert isinstance(copy.layers[0].self_attn.q_proj, Int8Linear)
    assert isinstance(copy.layers[0].mlp.down_proj, Int8Linear)
    assert not any(parameter.requires_grad for parameter in copy.parameters())
    assert copy.dtype == block.dtype and copy.device == block.device
    assert all(torch.equal(before[name], tensor) for name, tensor in block.state_dict().items())
    assert isinstance(block.fuse, nn.Linear)
    assert int8_block(copy) is copy  # already int8
    torch.testing.assert_close(copy.logits(torch.ones(2, 32, dtype=torch.float64)),
                               block.logits(torch.ones(2, 32, dtype=torch.float64)))
    with pytest.raises(DraftBlockError, match="quantises a DraftBlock"):
        int8_block(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_auto_weights_quantise_float32_cpu_blocks_only() -> None:
    block64 = perturbed_block(MODEL, steps=2)
    assert DraftWeights.AUTO.resolve(block64) is DraftWeights.AS_TRAINED
    assert drafting_block(block64, DraftWeights.AUTO) is block64
    block32 = perturbed_block(tiny_llama(vocab=48).float(), steps=2)
    assert DraftWeights.AUTO.resolve(block32) is DraftWeights.INT8
    assert DraftWeights.AS_TRAINED.resolve(block32) is DraftWeights.AS_TRAINED
    drafter = BlockDrafter(block32)
    assert drafter.weights is DraftWeights.INT8 and isinstance(drafter.block.fuse, Int8Linear)
    assert drafter.step.block is drafter.block  # the step runs the int8 copy too
    assert BlockDrafter(block32, weights=DraftWeights.AS_TRAINED).block is block32
    with pytest.raises(DraftBlockError, match="weights must be a DraftWeights"):
        BlockDrafter(block32, weights="int8")  # type: ignore[arg-type]


def test_auto_weights_keep_widths_the_packed_kernel_cannot_take() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=40, hidden_size=24, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)).eval()
    block = perturbed_block(model, steps=2)
    assert DraftWeights.AUTO.resolve(block) is DraftWeights.AS_TRAINED
    assert DraftWeights.INT8.resolve(block) is DraftWeights.INT8  # asked for: dequantised products


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float64])
def test_greedy_with_int8_drafts_equals_the_models_generate(model_dtype: torch.dtype) -> None:
    model = tiny_llama(vocab=48).to(model_dtype)
    block = perturbed_block(model, steps=3, draft_vocab=list(range(0, 48, 2)), noise=0.2)
    prompt = torch.tensor([[3, 7, 11, 2, 5]])
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, prompt.shape[1]:]
    drafter = BlockDrafter(block, weights=DraftWeights.INT8)
    result = SpeculativeDecoder(model, drafter).generate(prompt[0].tolist(), 24, eos_token_id=())
    assert result.tokens.tolist() == expected.tolist()


def test_int8_drafts_are_close_to_the_trained_blocks() -> None:
    """The int8 copy's first-step logits stay within a few percent of the trained block's, and its
    greedy first draft is the same at (almost) every position: int8 moves acceptance a little, not
    the drafts' meaning."""
    from circuits_llm.backbone import HFBackbone
    model = tiny_llama(vocab=48).float()
    block = perturbed_block(model, steps=2, noise=0.2)
    sequence = torch.randint(1, 48, (1, 40), generator=torch.Generator().manual_seed(0))
    _, hidden = HFBackbone(model).hidden_states(sequence)
    drafts = {}
    for weights in (DraftWeights.AS_TRAINED, DraftWeights.INT8):
        drafter = BlockDrafter(block, weights=weights)
        with torch.no_grad():  # the block over the whole text: (h_j, x_{j+1}) at every j
            outputs = drafter.step(drafter.cache, hidden[:, :-1], sequence[:, 1:])[0]
            drafts[weights] = drafter.block.logits(outputs)
    full, int8 = drafts[DraftWeights.AS_TRAINED], drafts[DraftWeights.INT8]
    assert float((int8 - full).abs().max()) <= 0.05 * float(full.abs().max())
    agree = (int8.argmax(-1) == full.argmax(-1)).float().mean()
    assert agree >= 0.9


def test_circuit_on_an_int8_block_reads_the_int8_copy() -> None:
    from circuits_llm.heads import MTPHead
    model = tiny_llama(vocab=48).float()
    block = perturbed_block(model, steps=2)
    head = MTPHead.from_name("ff", 3, 1, 32, 48).float().eval()
    drafter = BlockCircuitDrafter(block, head)
    assert drafter.weights is DraftWeights.INT8 and isinstance(drafter.block.fuse, Int8Linear)
    assert drafter.step.block is drafter.block
    prompt = [3, 7, 11, 2, 5]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    result = SpeculativeDecoder(model, drafter).generate(prompt, 12, eos_token_id=())
    assert result.tokens.tolist() == expected.tolist()


def test_int8_readout_recomputes_its_largest_logits_exactly() -> None:
    """The readout's top ``exact_top`` logits per row are the trained rows' exact products (so the
    argmax is the trained readout's), the others within int8 and bfloat16 rounding; a vocabulary
    smaller than ``exact_top`` is recomputed whole."""
    from circuits_llm.draft_block.weights import EXACT_TOP, Int8Readout
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(300, 32, generator=generator, dtype=torch.float64)
    bias = torch.randn(300, generator=generator, dtype=torch.float64)
    normed = torch.randn(5, 7, 32, generator=generator, dtype=torch.float64)
    exact = normed @ rows.T + bias
    readout = Int8Readout(rows, bias)
    got = readout(normed)
    assert got.shape == (5, 7, 300) and got.dtype == torch.float64
    top = readout.codes(normed).topk(EXACT_TOP, -1).indices  # the int8 logits' largest
    torch.testing.assert_close(got.gather(-1, top), exact.gather(-1, top), rtol=1e-12, atol=1e-12)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    torch.testing.assert_close(got, exact, rtol=0, atol=0.05 * float(exact.abs().max()))
    assert not torch.allclose(got, exact, rtol=0, atol=1e-9)  # the rest is approximate
    small = Int8Readout(rows[:10], None)
    torch.testing.assert_close(small(normed), normed @ rows[:10].T, rtol=1e-12, atol=1e-12)


def test_the_int8_copy_reads_out_through_its_int8_readout() -> None:
    block = perturbed_block(tiny_llama(vocab=48).float(), steps=2, draft_vocab=list(range(40)))
    copy = int8_block(block)
    from circuits_llm.draft_block.weights import Int8Readout
    assert isinstance(copy.__dict__["readout_override"], Int8Readout)
    assert "readout_override" not in block.__dict__
    assert not any(name.startswith("readout") for name in copy.state_dict())
    output = torch.randn(3, 32)
    full, int8 = block.logits(output), copy.logits(output)
    assert int8.shape == full.shape == (3, 40)
    assert torch.equal(int8.argmax(-1), full.argmax(-1))
    torch.testing.assert_close(int8, full, rtol=0, atol=0.05 * float(full.abs().max()))
