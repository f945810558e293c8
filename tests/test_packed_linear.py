"""Packed linear layers (circuits_llm.backbone.packed_linear): same values, same module.

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
    PackingBackend,
    PackingChoice,
    available_backends,
    choose_packing,
    linear_packing_available,
    pack_linear_layers,
    repack_linear_layers,
    tune_linear_packing,
)

pytestmark = pytest.mark.skipif(not linear_packing_available(),
                                reason="this torch build has no packed GEMM (not an x86 build)")

#: every backend this torch has (the x86 CPU wheels have both)
BACKENDS = available_backends()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False])
def test_every_row_count_matches_f_linear(bias: bool, backend: PackingBackend) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear, rows=8, min_rows=3, backend=backend)
    with torch.no_grad():
        for rows in range(1, 12):
            x = torch.randn(1, rows, 48)
            torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias),
                                       rtol=1e-5, atol=1e-5)
        # padding rows never leak into real ones: each real row equals its own product
        x = torch.randn(5, 48)
        alone = torch.stack([packed(row.expand(4, 48))[0] for row in x])
        torch.testing.assert_close(packed(x), alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_changed_weight_is_repacked_and_gradients_take_the_plain_path(
        backend: PackingBackend) -> None:
    torch.manual_seed(1)
    packed = PackedLinear(nn.Linear(16, 24), rows=4, min_rows=2, backend=backend)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_packed_layer_deep_copies_and_pickles(backend: PackingBackend) -> None:
    """The packed copy is an opaque tensor: copies drop it and pack again when used (the LoRA
    draft branch deep-copies the last layers of a model that may already be packed)."""
    torch.manual_seed(3)
    packed = PackedLinear(nn.Linear(16, 24), rows=8, backend=backend)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_linear_layers_keeps_parameters_ties_and_state_dict(backend: PackingBackend) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(2)
    model = LlamaForCausalLM(config).eval()
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    min_rows = 2 if backend is PackingBackend.ONEDNN else 4
    assert pack_linear_layers(model, rows=8, min_rows=min_rows, backend=backend) == linears == 2 * 7 + 1
    assert {(m.backend, m.min_rows) for m in model.modules() if isinstance(m, PackedLinear)} == \
        {(backend, min_rows)}
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
    assert pack_linear_layers(reference, rows=3, backend=PackingBackend.MKL) == 0  # min_rows 4 > 3


def test_bad_row_counts_and_hooked_layers_are_refused() -> None:
    with pytest.raises(ValueError, match="min_rows"):
        PackedLinear(nn.Linear(4, 4), rows=3, min_rows=4)
    with pytest.raises(ValueError, match="min_rows"):
        PackedLinear(nn.Linear(4, 4), rows=3, min_rows=0)
    with pytest.raises(ValueError, match="PackingBackend"):
        PackedLinear(nn.Linear(4, 4), rows=8, backend="mkl")  # type: ignore[arg-type]
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match="before wrapping"):
        pack_linear_layers(model, rows=8)
    assert type(model[0]) is nn.Linear


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_reads_the_same_in_every_block(backend: PackingBackend) -> None:
    """oneDNN serves every block unpadded and MKL pads with zero rows: either way a row's output
    does not depend on the rows it came with (what keeps verify blocks and AR steps comparable)."""
    torch.manual_seed(4)
    packed = PackedLinear(nn.Linear(40, 56), rows=8, min_rows=1, backend=backend)
    x = torch.randn(8, 40)
    with torch.no_grad():
        for count in range(1, 9):
            torch.testing.assert_close(packed(x[:count]), packed(x)[:count], rtol=1e-6, atol=1e-6)


def test_choose_packing_takes_the_fastest_backend_from_its_smallest_winning_block() -> None:
    # what an AMD EPYC measured (1 thread, SmolLM2's linear weights): oneDNN wins from 2 rows
    amd = {"plain": {1: 67.0, 2: 125.0, 4: 133.0, 8: 142.0}, "mkl": {1: 130.0, 2: 140.0, 4: 128.0,
           8: 130.0}, "onednn": {1: 74.0, 2: 79.0, 4: 85.0, 8: 94.0}}
    choice = choose_packing(amd, 8)
    assert choice == PackingChoice(PackingBackend.ONEDNN, 2, 8, amd)
    assert choice.describe().startswith("onednn for blocks of 2..8 rows (ms per pass over the "
                                        "linear weights at 1/2/4/8 rows: plain 67/125/133/142")
    # MKL alone, winning from 4 rows only (the Intel Xeon of the first measurements)
    intel = {"plain": {1: 62.0, 2: 72.0, 4: 106.0, 8: 135.0}, "mkl": {1: 90.0, 2: 77.0, 4: 96.0,
             8: 96.0}}
    assert choice_of(intel) == (PackingBackend.MKL, 4)
    # one size's timing flipped by noise does not cut the range: the total over sizes decides
    mixed = {"plain": {1: 10.0, 2: 20.0, 4: 30.0, 8: 40.0}, "onednn": {1: 11.0, 2: 15.0, 4: 31.0,
             8: 35.0}}
    assert choice_of(mixed) == (PackingBackend.ONEDNN, 2)
    # a backend that wins only at the largest block serves only it; a tie with plain is no gain
    assert choice_of({"plain": {1: 10.0, 2: 20.0, 8: 40.0}, "mkl": {1: 30.0, 2: 30.0, 8: 35.0}}) \
        == (PackingBackend.MKL, 8)
    assert choose_packing({"plain": {1: 10.0, 8: 40.0}, "mkl": {1: 10.0, 8: 40.0}}, 8) is None
    # nothing faster than F.linear at the largest block: no packing
    assert choose_packing({"plain": {1: 1.0, 8: 2.0}, "mkl": {1: 3.0, 8: 2.5}}, 8) is None


def choice_of(milliseconds: dict[str, dict[int, float]]) -> tuple[PackingBackend, int]:
    choice = choose_packing(milliseconds, 8)
    assert choice is not None
    return choice.backend, choice.min_rows


def test_tuning_compares_each_backend_with_f_linear_timed_beside_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine slows down by 1.5x between the two backends' turns: oneDNN, 0.7x F.linear at
    the same moment, is still chosen (compared with the first turn's F.linear it would look no
    faster), and the choice's milliseconds are in the first turn's units."""
    import circuits_llm.backbone.packed_linear as packing
    from circuits_llm.runtime.timing import Timing
    if len(BACKENDS) < 2:
        pytest.skip("needs both packing backends (this torch lacks one)")
    slowdown = {PackingBackend.MKL.value: 1.0, PackingBackend.ONEDNN.value: 1.5}
    relative = {PackingBackend.MKL.value: 1.2, PackingBackend.ONEDNN.value: 0.7}

    def fake_interleaved(candidates: dict[str, object], **_: object) -> dict[str, Timing]:
        backend = next(name for name in candidates if name != "plain")
        plain = 0.1 * slowdown[backend]
        return {"plain": Timing([plain]), backend: Timing([plain * relative[backend]])}

    monkeypatch.setattr(packing, "interleaved", fake_interleaved)
    model = nn.Sequential(nn.Linear(16, 16))
    choice = tune_linear_packing(model, rows=4, repeats=1)
    assert choice is not None and choice.backend is PackingBackend.ONEDNN and choice.min_rows == 1
    assert choice.milliseconds["plain"] == {1: 100.0, 2: 100.0, 4: 100.0}
    assert choice.milliseconds["onednn"] == pytest.approx({1: 70.0, 2: 70.0, 4: 70.0})
    assert choice.milliseconds["mkl"] == pytest.approx({1: 120.0, 2: 120.0, 4: 120.0})


def test_tune_linear_packing_measures_every_backend_on_the_model() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64))
    choice = tune_linear_packing(model, rows=4, repeats=1)
    assert type(model[0]) is nn.Linear  # measuring swaps nothing
    if choice is not None:  # the winner depends on this machine; what it reports does not
        assert set(choice.milliseconds) == {"plain", *(b.value for b in BACKENDS)}
        assert all(set(times) == {1, 2, 4} for times in choice.milliseconds.values())
        assert choice.backend in BACKENDS and 1 <= choice.min_rows <= 4 and choice.rows == 4
        assert choice == choose_packing(choice.milliseconds, 4)
    assert tune_linear_packing(nn.Sequential(nn.ReLU()), rows=4) is None  # no linear layer
    # without a backend, pack_linear_layers packs what the measurement chooses (or nothing)
    swapped = pack_linear_layers(model, rows=4)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert swapped == len(packed) in (0, 2)
    assert all(m.backend in BACKENDS and m.rows == 4 for m in packed)
