"""MKL-packed linear layers (circuits_llm.backbone.packed_linear): same values, same module.

The packed path must be invisible but for speed: outputs equal ``F.linear``'s to float32
rounding for every row count, the model's parameters, ties and state dict are unchanged, a
changed weight is never served from a stale packed copy, and decoding through a packed model
gives the tokens the unpacked model gives.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from circuits_llm.backbone.packed_linear import (
    PackedLinear,
    linear_packing_available,
    pack_linear_layers,
    repack_linear_layers,
)

pytestmark = pytest.mark.skipif(not linear_packing_available(),
                                reason="this torch build has no MKL packed GEMM (not an x86 MKL build)")


@pytest.mark.parametrize("bias", [True, False])
def test_every_row_count_matches_f_linear(bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear, rows=8, min_rows=3)
    with torch.no_grad():
        for rows in range(1, 12):
            x = torch.randn(1, rows, 48)
            torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias),
                                       rtol=1e-5, atol=1e-5)
        # padding rows never leak into real ones: each real row equals its own product
        x = torch.randn(5, 48)
        alone = torch.stack([packed(row.expand(4, 48))[0] for row in x])
        torch.testing.assert_close(packed(x), alone, rtol=1e-5, atol=1e-5)


def test_a_changed_weight_is_repacked_and_gradients_take_the_plain_path() -> None:
    torch.manual_seed(1)
    packed = PackedLinear(nn.Linear(16, 24), rows=4, min_rows=2)
    x = torch.randn(3, 16)
    with torch.no_grad():
        before = packed(x)
        packed.weight.mul_(2.0)  # in place: the version counter moves
        after = packed(x)
        torch.testing.assert_close(after - packed.bias, 2 * (before - packed.bias),
                                   rtol=1e-5, atol=1e-5)
        packed.load_state_dict({"weight": torch.zeros(24, 16), "bias": torch.ones(24)})
        torch.testing.assert_close(packed(x), torch.ones(3, 24))
        # an edit through .data escapes the version counter: repack_linear_layers makes it seen
        packed.weight.data.add_(1.0)
        assert repack_linear_layers(nn.Sequential(packed)) == 1
        torch.testing.assert_close(packed(x), 1 + x.sum(-1, keepdim=True).expand(3, 24))
    y = packed(x.requires_grad_())  # needs gradients: F.linear, which has a backward
    y.sum().backward()
    assert packed.weight.grad is not None and x.grad is not None


def test_a_packed_layer_deep_copies_and_pickles() -> None:
    """The packed copy is an opaque MKL tensor: copies drop it and pack again when used (the
    LoRA draft branch deep-copies the last layers of a model that may already be packed)."""
    torch.manual_seed(3)
    packed = PackedLinear(nn.Linear(16, 24), rows=8)
    x = torch.randn(6, 16)
    with torch.no_grad():
        expected = packed(x)
        for twin in (copy.deepcopy(packed), torch.load(_pickled(packed), weights_only=False)):
            assert twin._packed is None
            torch.testing.assert_close(twin(x), expected, rtol=1e-5, atol=1e-5)
            assert twin._packed is not None


def _pickled(module: nn.Module) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return buffer


def test_pack_linear_layers_keeps_parameters_ties_and_state_dict() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(2)
    model = LlamaForCausalLM(config).eval()
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linear_layers(model, rows=8) == linears == 2 * 7 + 1
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(isinstance(m, nn.Linear) for m in model.modules() if isinstance(m, PackedLinear))
    ids = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        for length in (1, 2, 4, 7, 8, 20):
            torch.testing.assert_close(model(ids[:, :length]).logits,
                                       reference(ids[:, :length]).logits, rtol=1e-5, atol=1e-5)
    # greedy decoding through the packed model gives the unpacked model's tokens
    from circuits_llm.backbone import HFBackbone
    from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
    from circuits_llm.heads import MTPHead
    head = MTPHead.from_name("ff", window=8, rank=1, hidden_size=32, vocab_size=97).eval()
    plain = AutoregressiveDecoder(HFBackbone(reference)).generate(ids[0, :5], 30).tokens
    drafted = SpeculativeDecoder(HFBackbone(model), head).generate(ids[0, :5], 30).tokens
    assert torch.equal(plain, drafted)
    # the LoRA draft branch deep-copies the last layers of the packed model and wraps them
    lora = SpeculativeDecoder(HFBackbone(model, lora_layers=1), head).generate(ids[0, :5], 30).tokens
    assert lora.shape == drafted.shape
    assert pack_linear_layers(model, rows=8) == 0  # already packed: nothing left to swap
    assert pack_linear_layers(reference, rows=3) == 0  # blocks too small to gain


def test_bad_row_counts_and_hooked_layers_are_refused() -> None:
    with pytest.raises(ValueError, match="min_rows"):
        PackedLinear(nn.Linear(4, 4), rows=3, min_rows=4)
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match="before wrapping"):
        pack_linear_layers(model, rows=8)
    assert type(model[0]) is nn.Linear
