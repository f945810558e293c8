"""HFBackbone on a static KV cache, eager and compiled: rollback by length reset, capacity, no host sync.

The eager-static tests are cheap and cover both architectures and every draft-branch depth. The
compiled ones share two module-scoped backbones (a ``torch.compile`` of a tiny model still takes
tens of seconds on a CPU): float32 Llama without LoRA (lengths 1 and 3, batch 2) and float64 GPT-2
with one LoRA layer (length 3).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch
from test_backbone import V, gpt2, llama, perturb_lora
from torch import Tensor
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import MistralConfig, MistralForCausalLM, PreTrainedModel

from circuits.errors import InvalidInputError
from circuits_llm.backbone import CacheCapacityError, CacheKind, HFBackbone, UnsupportedModelError
from circuits_llm.backbone._capture import is_capture_hook
from circuits_llm.protocols import backbone_problem

MODELS = {"llama": llama, "gpt2": gpt2}
#: Tolerances against a fresh prefill: float64 (the same arithmetic up to summation order) and float32.
TOL64 = 1e-12
TOL32 = 1e-5
#: aten ops that read a tensor value back to the host (a device synchronisation on an accelerator).
HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "unique"}


class _Dispatches(TorchDispatchMode):
    """Counts the aten ops dispatched in its body, compiled graphs included.

    Declared an infrastructure mode: dynamo refuses to run compiled code under any other dispatch
    mode. The compiled graph's own kernels are not ops; what it dispatches (extern matmuls,
    attention) is counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def dispatches(fn: Callable[[], object]) -> Counter[str]:
    counter = _Dispatches()
    with torch.no_grad(), counter:
        fn()
    return counter.counts


def tol(model: PreTrainedModel) -> float:
    return TOL64 if model.dtype == torch.float64 else TOL32


def ids(shape: tuple[int, int], seed: int) -> Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def garble_stale_slots(bb: HFBackbone) -> None:
    """Overwrite every cache slot past the valid length with large finite garbage."""
    gen = torch.Generator().manual_seed(7)
    for cache in (bb.verifier_cache, bb.draft_cache):
        for layer in cache.layers:
            if layer.is_initialized:
                for t in (layer.keys, layer.values):
                    tail = t[:, :, bb.length :]
                    tail.copy_(100 * torch.randn(tail.shape, generator=gen, dtype=t.dtype))


def check_rollback(bb: HFBackbone, fresh: HFBackbone, seed: int, garble: bool) -> None:
    """extend 6, extend 3 (a draft, all but its first token rejected), crop to 7, extend 3: the last
    extend's outputs equal those of the model on the 10 accepted tokens, and of a fresh backbone
    prefilled with them."""
    model = bb.model
    start, rejected, new = ids((2, 6), seed), ids((2, 3), seed + 1), ids((2, 3), seed + 2)
    bb.reset()
    bb.extend(start)
    bb.extend(rejected)
    bb.crop(7)
    assert bb.length == 7
    if garble:
        garble_stale_slots(bb)
    step = bb.extend(new)
    assert bb.length == 10
    accepted = torch.cat([start, rejected[:, :1], new], 1)
    with torch.no_grad():
        want = model(accepted).logits[:, 7:]
    torch.testing.assert_close(step.verifier_logits, want, atol=tol(model), rtol=0)
    fresh.reset()
    prefill = fresh.extend(accepted)
    torch.testing.assert_close(step.draft_hidden, prefill.draft_hidden[:, 7:], atol=tol(model), rtol=0)


def greedy(bb: HFBackbone, prompt: Tensor, steps: int) -> Tensor:
    bb.reset()
    step = bb.extend(prompt)
    out = [prompt]
    for _ in range(steps):
        nxt = step.verifier_logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        step = bb.extend(nxt)
    return torch.cat(out, 1)


# ---------------------------------------------------------------------------------- eager static


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("k", [0, 1, 2])
def test_static_rollback_equals_fresh_prefill(arch: str, k: int, dtype: torch.dtype) -> None:
    model = MODELS[arch]().to(dtype)
    bb = HFBackbone(model, lora_layers=k, cache=CacheKind.STATIC, max_cache_len=16)
    assert backbone_problem(bb) is None
    assert bb.cache_kind is CacheKind.STATIC and not bb.compiled and bb.max_length == 16
    perturb_lora(bb)
    fresh = HFBackbone(model, lora_layers=k, cache=CacheKind.DYNAMIC)
    fresh.draft_layers.load_state_dict(bb.draft_layers.state_dict())
    check_rollback(bb, fresh, seed=3, garble=False)
    check_rollback(bb, fresh, seed=4, garble=True)  # stale slots are never read


@pytest.mark.parametrize("arch", MODELS)
def test_static_matches_dynamic_chunk_by_chunk(arch: str) -> None:
    model = MODELS[arch]().double()
    static = HFBackbone(model, lora_layers=1, cache=CacheKind.STATIC, max_cache_len=12)
    dynamic = HFBackbone(model, lora_layers=1)
    perturb_lora(static)
    dynamic.draft_layers.load_state_dict(static.draft_layers.state_dict())
    tokens = ids((1, 12), 5)
    for lo, hi in [(0, 5), (5, 6), (6, 9), (9, 12)]:
        a, b = static.extend(tokens[:, lo:hi]), dynamic.extend(tokens[:, lo:hi])
        torch.testing.assert_close(a.verifier_logits, b.verifier_logits, atol=TOL64, rtol=0)
        torch.testing.assert_close(a.draft_hidden, b.draft_hidden, atol=TOL64, rtol=0)
    assert static.length == 12 == static.max_length


def test_sliding_window_model_on_static_cache() -> None:
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=3,
    )).eval().double()
    bb = HFBackbone(model, lora_layers=1, cache=CacheKind.STATIC, max_cache_len=12)
    tokens = ids((1, 9), 6)
    with torch.no_grad():
        want = model(tokens).logits
    bb.extend(tokens[:, :5])
    bb.extend(ids((1, 3), 7))  # rejected
    bb.crop(5)
    garble_stale_slots(bb)
    step = bb.extend(tokens[:, 5:])
    torch.testing.assert_close(step.verifier_logits, want[:, 5:], atol=TOL64, rtol=0)


def test_capacity_error_says_what_to_pass() -> None:
    bb = HFBackbone(llama(), cache=CacheKind.STATIC, max_cache_len=8)
    bb.extend(ids((1, 6), 1))
    with pytest.raises(CacheCapacityError, match=r"max_cache_len=8 .* N >= 9"):
        bb.extend(ids((1, 3), 2))
    assert bb.length == 6  # refused before running: nothing changed
    bb.extend(ids((1, 2), 3))
    assert bb.length == 8
    with pytest.raises(CacheCapacityError, match="max_cache_len"):
        bb.extend(ids((1, 1), 4))
    bb.crop(7)
    bb.extend(ids((1, 1), 4))  # the rolled-back slot is free again
    assert bb.length == 8
    assert isinstance(CacheCapacityError("x"), InvalidInputError)


def test_reset_keeps_tensors_and_batch_change_reallocates() -> None:
    model = llama().double()
    bb = HFBackbone(model, cache=CacheKind.STATIC, max_cache_len=10)
    bb.extend(ids((2, 4), 1))
    keys = bb.verifier_cache.layers[0].keys
    bb.reset()
    assert bb.length == 0
    first = bb.extend(ids((2, 3), 2))
    assert bb.verifier_cache.layers[0].keys is keys  # same storage: the compiled graphs stay valid
    with torch.no_grad():
        torch.testing.assert_close(first.verifier_logits, model(ids((2, 3), 2)).logits, atol=TOL64, rtol=0)
    with pytest.raises(InvalidInputError, match="batch size"):
        bb.extend(ids((3, 1), 3))
    bb.crop(0)
    step = bb.extend(ids((3, 2), 3))
    assert bb.verifier_cache.layers[0].keys.shape[0] == 3
    with torch.no_grad():
        torch.testing.assert_close(step.verifier_logits, model(ids((3, 2), 3)).logits, atol=TOL64, rtol=0)


def test_static_failed_forward_empties_caches() -> None:
    bb = HFBackbone(llama(), lora_layers=1, cache=CacheKind.STATIC, max_cache_len=10)
    bb.extend(ids((1, 4), 1))

    def boom(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("boom")

    handle = bb.draft_layers[0].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            bb.extend(ids((1, 2), 2))
    finally:
        handle.remove()
    assert bb.length == 0
    step = bb.extend(ids((1, 2), 2))
    with torch.no_grad():
        torch.testing.assert_close(step.verifier_logits, bb.model(ids((1, 2), 2)).logits, atol=TOL32, rtol=0)


def test_static_under_inference_mode_then_outside() -> None:
    bb = HFBackbone(llama(), cache=CacheKind.STATIC, max_cache_len=10)
    with torch.inference_mode():
        bb.extend(ids((1, 4), 1))  # allocates the caches: they must not be inference tensors
    step = bb.extend(ids((1, 2), 2))  # in-place update outside inference mode
    assert not step.verifier_logits.is_inference()
    with torch.no_grad():
        want = bb.model(torch.cat([ids((1, 4), 1), ids((1, 2), 2)], 1)).logits[:, 4:]
    torch.testing.assert_close(step.verifier_logits, want, atol=TOL32, rtol=0)


def test_option_errors() -> None:
    model = llama()
    with pytest.raises(ValueError, match="compile=True needs the static cache"):
        HFBackbone(model, compile=True, cache=CacheKind.DYNAMIC)
    with pytest.raises(ValueError, match="max_cache_len sizes the static cache"):
        HFBackbone(model, max_cache_len=16)
    with pytest.raises(ValueError, match="compiled_lengths needs compile=True"):
        HFBackbone(model, cache=CacheKind.STATIC, compiled_lengths=(1, 4))
    with pytest.raises(TypeError, match="CacheKind"):
        HFBackbone(model, cache="static")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="compile must be a bool"):
        HFBackbone(model, compile=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_cache_len"):
        HFBackbone(model, compile=True, max_cache_len=0)
    with pytest.raises(ValueError, match="compiled length"):
        HFBackbone(model, compile=True, max_cache_len=8, compiled_lengths=(1, 9))
    with pytest.raises(ValueError, match="needs a compiled backbone"):
        HFBackbone(model, cache=CacheKind.STATIC).add_compiled_length(4)
    bb = HFBackbone(model, compile=True)  # nothing is compiled before the first call of a length
    assert bb.compiled and bb.compiled_lengths == (1,)
    assert bb.max_length == model.config.max_position_embeddings  # 2048 for this config: the cap
    bb.add_compiled_length(5)
    bb.add_compiled_length(1)
    assert bb.compiled_lengths == (1, 5)
    dynamic = HFBackbone(model)
    assert dynamic.max_length is None and not dynamic.compiled and dynamic.compiled_lengths == ()


def test_capture_hooks_once_per_model_and_not_on_draft_copies() -> None:
    model = llama()
    compiled = HFBackbone(model, lora_layers=1, compile=True, max_cache_len=16)
    later = HFBackbone(model, lora_layers=2)  # copies layers that already carry the hooks
    HFBackbone(model, cache=CacheKind.STATIC)
    for layer in [*model.model.layers, model.lm_head]:
        assert sum(is_capture_hook(h) for h in layer._forward_pre_hooks.values()) == 1
    for layer in [*compiled.draft_layers, *later.draft_layers]:
        for sub in layer.modules():
            assert not any(is_capture_hook(h) for h in sub._forward_pre_hooks.values())
    tokens = ids((1, 5), 1)
    with torch.no_grad():
        want = model(tokens).logits
    for bb in (compiled, later):  # the prompt prefill runs eagerly: no compilation here
        torch.testing.assert_close(bb.extend(tokens).verifier_logits, want, atol=TOL32, rtol=0)
    logits, _ = compiled.hidden_states(tokens)  # the training forward is unaffected
    torch.testing.assert_close(logits, want, atol=TOL32, rtol=0)


# ---------------------------------------------------------------------------------- compiled


@pytest.fixture(scope="module")
def compiled32() -> Iterator[tuple[HFBackbone, HFBackbone]]:
    """(compiled, eager dynamic) float32 Llama backbones, k = 0; graphs for batch 2, lengths 1 and 3."""
    model = llama()
    yield (HFBackbone(model, compile=True, max_cache_len=24, compiled_lengths=(1, 3)),
           HFBackbone(model))


@pytest.fixture(scope="module")
def compiled64() -> Iterator[tuple[HFBackbone, HFBackbone]]:
    """(compiled, eager dynamic) float64 GPT-2 backbones with a perturbed LoRA layer; length 3.

    GPT-2, not Llama: Llama's rotary embedding is computed in float32 whatever the model's dtype,
    and inductor's float32 cos/sin differ from eager's in the last bits, which caps the agreement of
    a compiled float64 Llama at about 1e-8; GPT-2's learned positions keep float64 exact.
    """
    model = gpt2(seed=2).double()
    bb = HFBackbone(model, lora_layers=1, compile=True, max_cache_len=24, compiled_lengths=(3,))
    perturb_lora(bb)
    dynamic = HFBackbone(model, lora_layers=1)
    dynamic.draft_layers.load_state_dict(bb.draft_layers.state_dict())
    yield bb, dynamic


@pytest.mark.slow
@pytest.mark.parametrize("which", ["compiled32", "compiled64"])
def test_compiled_rollback_equals_fresh_prefill(which: str, request: pytest.FixtureRequest) -> None:
    bb, dynamic = request.getfixturevalue(which)
    check_rollback(bb, dynamic, seed=3, garble=False)
    check_rollback(bb, dynamic, seed=8, garble=True)
    bb.crop(7)
    assert sum(dispatches(lambda: bb.extend(ids((2, 3), 1))).values()) < 80  # the graph ran, not eager


@pytest.mark.slow
def test_compiled_greedy_equals_dynamic_token_for_token(compiled32: tuple[HFBackbone, HFBackbone]) -> None:
    bb, dynamic = compiled32
    prompt = ids((2, 5), 9)
    out = greedy(bb, prompt, 12)
    assert torch.equal(out, greedy(dynamic, prompt, 12))
    assert torch.equal(out, dynamic.model.generate(prompt, do_sample=False, max_new_tokens=12))


@pytest.mark.slow
def test_compiled_extend_dispatches_few_ops_and_reads_nothing_back(
    compiled32: tuple[HFBackbone, HFBackbone],
) -> None:
    bb, dynamic = compiled32
    for backbone in (bb, dynamic):
        backbone.reset()
        backbone.extend(ids((2, 6), 1))
        for m in (3, 1):  # warm: both graphs exist
            backbone.extend(ids((2, m), 2))
            backbone.crop(6)
    graphs = counters["stats"]["unique_graphs"]
    # more backbones on the same model, and eager calls of them, must not invalidate the graphs
    eager = HFBackbone(bb.model, cache=CacheKind.STATIC, max_cache_len=24)
    eager.extend(ids((2, 6), 1))
    dynamic.hidden_states(ids((2, 6), 1))
    counts = {}
    for name, backbone in (("compiled", bb), ("eager", eager)):
        for m in (3, 1):
            block = ids((2, m), 3)
            counts[name, m] = dispatches(lambda b=backbone, x=block: b.extend(x))
            crop = dispatches(lambda b=backbone: b.crop(6))
            assert sum(crop.values()) <= 2 and not HOST_READS & crop.keys()
    for m in (3, 1):
        compiled, eager_counts = counts["compiled", m], counts["eager", m]
        assert not HOST_READS & compiled.keys(), compiled
        assert HOST_READS & eager_counts.keys()  # the counter sees host reads where there are some
        # one graph: its extern matmuls (7 per layer + the LM head) and attention, little else
        assert sum(compiled.values()) <= 4 * sum(compiled[op] for op in ("mm", "addmm", "bmm")), compiled
        assert 5 * sum(compiled.values()) < sum(eager_counts.values())
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation


@pytest.mark.slow
def test_compiled_bad_token_is_a_clear_error(compiled32: tuple[HFBackbone, HFBackbone]) -> None:
    bb, _ = compiled32
    bb.reset()
    bb.extend(ids((2, 4), 1))
    with pytest.raises(InvalidInputError, match=r"outside the vocabulary \[0, 64\)"):
        bb.extend(torch.tensor([[1], [V]]))
    assert bb.length == 0  # checked inside the graph, after it ran: the caches were emptied
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):  # eager prefill: checked first
        bb.extend(torch.tensor([[1, 2, -1, 3], [0, 0, 0, 0]]))
    check_rollback(bb, compiled32[1], seed=10, garble=False)  # usable again (caches reallocated)


@pytest.mark.slow
def test_compiled_capacity_error(compiled32: tuple[HFBackbone, HFBackbone]) -> None:
    bb, _ = compiled32
    bb.reset()
    bb.extend(ids((2, 22), 1))
    with pytest.raises(CacheCapacityError, match=r"N >= 25"):
        bb.extend(ids((2, 3), 2))
    assert bb.length == 22
    bb.extend(ids((2, 1), 3))
    bb.crop(21)
    bb.extend(ids((2, 3), 4))  # fits after the rollback
    assert bb.length == 24


@pytest.mark.slow
def test_compiled_graph_budget_is_a_clear_error(compiled32: tuple[HFBackbone, HFBackbone]) -> None:
    bb, dynamic = compiled32
    bb.reset()
    bb.extend(ids((2, 4), 1))
    bb.extend(ids((2, 3), 2))
    bb.extend(ids((2, 1), 3))  # both graphs of batch 2 exist (built by earlier tests or now)
    bb.reset()
    bb.extend(ids((1, 4), 4))  # a new batch size: eager prefill, then a third graph would be needed
    budget = torch._dynamo.config.patch(recompile_limit=2)
    with budget, pytest.raises(RuntimeError, match="recompile_limit=2"):
        bb.extend(ids((1, 1), 5))  # refused before compiling anything
    assert bb.length == 0
    check_rollback(bb, dynamic, seed=11, garble=False)  # the batch-2 graphs still serve


@pytest.mark.slow
def test_uncompilable_model_is_a_clear_error() -> None:
    model = llama()
    bb = HFBackbone(model, compile=True, max_cache_len=16)

    def reads_a_value(_module: object, args: tuple) -> None:
        if float(args[0].sum()) > 1e30:  # a host read inside the forward: no whole graph
            raise AssertionError

    model.model.layers[1].register_forward_pre_hook(reads_a_value)
    bb.extend(ids((1, 4), 1))  # eager prefill: fine
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM .* cannot be compiled.*compile=False"):
        bb.extend(ids((1, 1), 2))  # the compiled step refuses at tracing time
    assert bb.length == 0
