"""HFBackbone: cached extend/crop against plain forwards, LoRA draft branch, adapters, bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
)
from transformers.cache_utils import DynamicCache

from circuits.errors import InvalidInputError
from circuits_llm.backbone import (
    ADAPTER_CONFIG,
    AdapterMismatchError,
    HFBackbone,
    UnsupportedModelError,
)
from circuits_llm.protocols import backbone_problem

V = 64
ATOL = 1e-5


def llama(seed: int = 0, **overrides: object) -> PreTrainedModel:
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
    )
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def gpt2(seed: int = 0, **overrides: object) -> PreTrainedModel:
    torch.manual_seed(seed)
    cfg = dict(
        n_embd=32, n_layer=4, n_head=4, vocab_size=V, bos_token_id=0, eos_token_id=None, pad_token_id=None
    )
    cfg.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**cfg)).eval()


MODELS = {"llama": llama, "gpt2": gpt2}


def perturb_lora(bb: HFBackbone, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bb.draft_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def extend_chunks(bb: HFBackbone, ids: Tensor, sizes: list[int]) -> tuple[Tensor, Tensor]:
    logits, hidden, start = [], [], 0
    for size in sizes:
        step = bb.extend(ids[:, start : start + size])
        assert step.verifier_logits.shape == (ids.shape[0], size, V)
        assert step.draft_hidden.shape == (ids.shape[0], size, bb.hidden_size)
        logits.append(step.verifier_logits)
        hidden.append(step.draft_hidden)
        start += size
    assert bb.length == start
    return torch.cat(logits, 1), torch.cat(hidden, 1)


def cache_tensors(cache: DynamicCache) -> list[tuple[int, Tensor, Tensor]]:
    return [
        (i, layer.keys.clone(), layer.values.clone())
        for i, layer in enumerate(cache.layers)
        if layer.is_initialized and layer.keys.numel() > 0
    ]


def assert_same_caches(a: DynamicCache, b: DynamicCache) -> None:
    ta, tb = cache_tensors(a), cache_tensors(b)
    assert [i for i, _, _ in ta] == [i for i, _, _ in tb]
    for (_, ka, va), (_, kb, vb) in zip(ta, tb, strict=True):
        assert ka.shape == kb.shape
        torch.testing.assert_close(ka, kb, atol=ATOL, rtol=0)
        torch.testing.assert_close(va, vb, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("k", [0, 1, 2])
def test_chunked_extend_matches_full_forward(arch: str, k: int) -> None:
    model = MODELS[arch]()
    bb = HFBackbone(model, lora_layers=k)
    assert backbone_problem(bb) is None
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref_logits = model(ids).logits
        ref_final = model.base_model(ids).last_hidden_state
    logits, hidden = extend_chunks(bb, ids, [5, 3, 1])
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    # zero-initialised LoRA B: the draft branch reproduces the verifier's final hidden state
    torch.testing.assert_close(hidden, ref_final, atol=ATOL, rtol=0)
    if k:
        perturb_lora(bb)
        bb.reset()
        logits, hidden = extend_chunks(bb, ids, [5, 3, 1])
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
        assert (hidden - ref_final).abs().max() > 1e-3
        _, full_hidden = bb.hidden_states(ids)
        torch.testing.assert_close(hidden, full_hidden, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("k", [0, 1, 2])
def test_crop_then_extend_equals_fresh_prefill(arch: str, k: int) -> None:
    model = MODELS[arch]()
    bb = HFBackbone(model, lora_layers=k)
    perturb_lora(bb)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (2, 10), generator=gen)
    new = torch.randint(0, V, (2, 3), generator=gen)
    bb.extend(ids[:, :6])
    bb.extend(ids[:, 6:])  # a rejected draft of 4 tokens
    bb.crop(7)
    assert bb.length == 7
    step = bb.extend(new)
    assert bb.length == 10
    accepted = torch.cat([ids[:, :7], new], 1)
    with torch.no_grad():
        fresh = model(accepted, use_cache=True)
    torch.testing.assert_close(step.verifier_logits, fresh.logits[:, 7:], atol=ATOL, rtol=0)
    assert_same_caches(bb.verifier_cache, fresh.past_key_values)
    rolled_back_draft = bb.draft_cache
    rolled_back_hidden = step.draft_hidden
    bb.reset()
    prefill = bb.extend(accepted)
    assert_same_caches(rolled_back_draft, bb.draft_cache)
    torch.testing.assert_close(rolled_back_hidden, prefill.draft_hidden[:, 7:], atol=ATOL, rtol=0)
    if k:
        assert len(cache_tensors(bb.draft_cache)) == k
    else:
        assert cache_tensors(bb.draft_cache) == []


def test_crop_to_zero_and_noop_crop() -> None:
    bb = HFBackbone(llama(), lora_layers=1)
    ids = torch.randint(0, V, (1, 4))
    bb.extend(ids)
    bb.crop(4)
    assert bb.length == 4
    bb.crop(0)
    assert bb.length == 0 and bb.verifier_cache.get_seq_length() == 0
    bb.extend(torch.randint(0, V, (3, 2)))  # a new batch size is fine after emptying the caches
    assert bb.length == 2


@pytest.mark.parametrize("arch", MODELS)
def test_perturbed_lora_changes_draft_not_verifier(arch: str) -> None:
    model = MODELS[arch]()
    bb = HFBackbone(model, lora_layers=2, lora_rank=4)
    ids = torch.randint(0, V, (1, 6))
    before = bb.extend(ids)
    perturb_lora(bb)
    bb.reset()
    after = bb.extend(ids)
    torch.testing.assert_close(after.verifier_logits, before.verifier_logits, atol=0, rtol=0)
    assert (after.draft_hidden - before.draft_hidden).abs().max() > 1e-3
    assert all(not p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("k", [0, 1, 2])
def test_shared_layers_run_once_per_extend(arch: str, k: int) -> None:
    model = MODELS[arch]()
    bb = HFBackbone(model, lora_layers=k)
    layers = list(bb._parts.layers)
    calls = {id(m): 0 for m in [*layers, *bb.draft_layers]}

    def count(module: nn.Module, _args: tuple) -> None:
        calls[id(module)] += 1

    handles = [m.register_forward_pre_hook(count) for m in [*layers, *bb.draft_layers]]
    try:
        bb.extend(torch.randint(0, V, (1, 5)))
        bb.extend(torch.randint(0, V, (1, 2)))
    finally:
        for h in handles:
            h.remove()
    assert [calls[id(m)] for m in layers] == [2] * len(layers)
    assert [calls[id(m)] for m in bb.draft_layers] == [2] * k
    # the draft copies share the frozen base weights: only LoRA matrices are new
    base_ids = {id(p) for p in model.parameters()}
    own = [p for n, p in bb.draft_layers.named_parameters() if "lora_" not in n]
    assert all(id(p) in base_ids for p in own)


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("k", [0, 1])
def test_greedy_extend_reproduces_generate(arch: str, k: int) -> None:
    model = MODELS[arch]()
    bb = HFBackbone(model, lora_layers=k)
    perturb_lora(bb)
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(5))
    expected = model.generate(prompt, do_sample=False, max_new_tokens=12)
    step = bb.extend(prompt)
    out = [prompt]
    for _ in range(12):
        nxt = step.verifier_logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        step = bb.extend(nxt)
    assert torch.equal(torch.cat(out, 1), expected)


def test_hidden_states_gradients_reach_lora_only() -> None:
    model = gpt2()
    bb = HFBackbone(model, lora_layers=2, lora_rank=4, lora_dropout=0.1).train()
    assert bb.training and not model.training
    perturb_lora(bb)
    ids = torch.randint(0, V, (2, 7))
    logits, hidden = bb.hidden_states(ids)
    assert logits.shape == (2, 7, V) and hidden.shape == (2, 7, 32)
    assert not logits.requires_grad and hidden.requires_grad
    hidden.square().sum().backward()
    params = bb.draft_parameters()
    assert params and all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    assert all(p.grad is None for p in model.parameters())
    assert bb.length == 0  # caches untouched


def test_hidden_states_attention_mask_right_padding() -> None:
    bb = HFBackbone(llama(), lora_layers=1)
    perturb_lora(bb)
    ids = torch.randint(0, V, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    logits, hidden = bb.hidden_states(ids, attention_mask=mask)
    short_logits, short_hidden = bb.hidden_states(ids[1:, :4])
    torch.testing.assert_close(logits[1:, :4], short_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(hidden[1:, :4], short_hidden, atol=ATOL, rtol=0)


def test_sliding_window_model_rolls_back_exactly() -> None:
    torch.manual_seed(0)
    model = MistralForCausalLM(
        MistralConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=3,
        )
    ).eval()
    bb = HFBackbone(model, lora_layers=1)
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        ref = model(ids).logits
    logits, _ = extend_chunks(bb, ids, [5, 3, 1])
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    bb.crop(4)
    step = bb.extend(ids[:, 4:])
    torch.testing.assert_close(step.verifier_logits, ref[:, 4:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", MODELS)
def test_save_load_adapter_round_trip(arch: str, tmp_path: Path) -> None:
    model = MODELS[arch]()
    bb = HFBackbone(model, lora_layers=2, lora_rank=4)
    perturb_lora(bb)
    ids = torch.randint(0, V, (1, 6))
    want = bb.extend(ids).draft_hidden
    bb.save_adapter(tmp_path / "adapter")
    meta = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert meta["lora_layers"] == 2 and meta["lora_rank"] == 4
    other = HFBackbone(model, lora_layers=2, lora_rank=4)
    other.load_adapter(tmp_path / "adapter")
    torch.testing.assert_close(other.extend(ids).draft_hidden, want, atol=0, rtol=0)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter.json", "adapter.safetensors"]


def test_load_adapter_mismatches(tmp_path: Path) -> None:
    bb = HFBackbone(llama(), lora_layers=2, lora_rank=4)
    bb.save_adapter(tmp_path)
    with pytest.raises(AdapterMismatchError, match="lora_rank"):
        HFBackbone(llama(), lora_layers=2, lora_rank=8).load_adapter(tmp_path)
    with pytest.raises(AdapterMismatchError, match="lora_layers"):
        HFBackbone(llama(), lora_layers=1, lora_rank=4).load_adapter(tmp_path)
    with pytest.raises(AdapterMismatchError, match="config_fingerprint"):
        HFBackbone(llama(intermediate_size=48), lora_layers=2, lora_rank=4).load_adapter(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        bb.load_adapter(tmp_path / "missing")
    with pytest.raises(ValueError, match="no adapter to save"):
        HFBackbone(llama()).save_adapter(tmp_path / "none")


def test_bad_tokens_raise_clear_errors() -> None:
    bb = HFBackbone(llama(), lora_layers=1)
    with pytest.raises(InvalidInputError, match="non-empty"):
        bb.extend(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        bb.extend(torch.tensor([[1, V]]))
    with pytest.raises(InvalidInputError, match="id -1"):
        bb.extend(torch.tensor([[-1, 2]]))
    with pytest.raises(InvalidInputError, match="integer dtype"):
        bb.extend(torch.ones(1, 2))
    with pytest.raises(InvalidInputError, match="shape"):
        bb.extend(torch.ones(3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        bb.extend([[1, 2]])  # type: ignore[arg-type]
    bb.extend(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(InvalidInputError, match="batch size"):
        bb.extend(torch.ones(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="length"):
        bb.crop(4)
    with pytest.raises(ValueError, match="length"):
        bb.crop(-1)
    with pytest.raises(TypeError, match="length"):
        bb.crop(1.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="attention_mask"):
        bb.hidden_states(
            torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.long)
        )
    assert bb.length == 3  # failed calls left the caches alone


def test_bad_construction_raises_clear_errors() -> None:
    with pytest.raises(ValueError, match="lora_layers"):
        HFBackbone(llama(), lora_layers=5)
    with pytest.raises(ValueError, match="lora_rank"):
        HFBackbone(llama(), lora_layers=1, lora_rank=0)
    with pytest.raises(ValueError, match="lora_dropout"):
        HFBackbone(llama(), lora_layers=1, lora_dropout=1.0)
    with pytest.raises(UnsupportedModelError, match="match no sub-module"):
        HFBackbone(llama(), lora_layers=1, lora_target_modules=["nope"])
    with pytest.raises(UnsupportedModelError, match="PreTrainedModel"):
        HFBackbone(nn.Linear(2, 2))  # type: ignore[arg-type]
    torch.manual_seed(0)
    bare = LlamaModel(
        LlamaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(UnsupportedModelError, match="LM head"):
        HFBackbone(bare)


def test_explicit_target_modules() -> None:
    bb = HFBackbone(llama(), lora_layers=1, lora_rank=2, lora_target_modules=["q_proj", "v_proj"])
    assert bb.lora_target_modules == ["q_proj", "v_proj"]
    assert len(bb.draft_parameters()) == 4


def test_failed_forward_resets_caches() -> None:
    bb = HFBackbone(llama(), lora_layers=1)
    bb.extend(torch.randint(0, V, (1, 4)))

    def boom(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("boom")

    handle = bb.draft_layers[0].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            bb.extend(torch.randint(0, V, (1, 2)))
    finally:
        handle.remove()
    assert bb.length == 0 and bb.verifier_cache.get_seq_length() == 0
    bb.extend(torch.randint(0, V, (1, 2)))
    assert bb.length == 2
