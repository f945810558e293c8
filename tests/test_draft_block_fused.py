"""A draft block that reads EAGLE-3's fused features: the outputs of some of the target's layers
beside the LM head's input (``DraftBlock(fused_layers=)``, ``HFBackbone(feature_layers=)``).

* The backbone's draft hidden state is ``[l_i; h]``: layer ``i``'s output, then the LM head's
  input, on the dynamic cache, the static one and the training pass (float64, to 1e-12).
* A fresh fusion starts exactly where the block without it stands; a moved one does not (the
  control that the fusion is read).
* The decoder builds its backbone with the block's layers: greedy output is ``generate``'s, the
  block's cache equals a fresh prefill, the law enumerated on a tiny vocabulary equals the
  target's, and sampled output passes a chi-square eager and through the CUDA-graph replay double
  (a shifted law is rejected); a backbone without the layers is refused with the fix.
* The int8 drafting copy quantises the fusion too; save and load keep it; training moves it; a
  batch of rows decodes each as alone.
* Bad layer lists are refused with one clear error.
"""

from __future__ import annotations

import pytest
import torch
from block_enumeration import recursive_law
from cuda_graph_double import CudaGraphDouble
from draft_block_models import (
    NextTokenLogits,
    assert_cache_is_a_fresh_prefill,
    block_circuit_head,
    greedy_generate,
    perturbed_block,
    tiny_llama,
)
from toy import law_p_value, target_law, total_variation

from circuits_llm.backbone import CacheKind, HFBackbone
from circuits_llm.decoding.acceptance import SampledAccept
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.warping import DecoderError, SamplingConfig
from circuits_llm.draft_block import (
    BlockCircuitDrafter,
    BlockDrafter,
    BlockStepMode,
    DraftBlock,
    DraftBlockError,
    load_draft_block,
    save_draft_block,
)
from circuits_llm.draft_block.training import prefill_features, train_block
from circuits_llm.draft_block.weights import DraftWeights, drafting_block
from circuits_llm.runtime.compiling import use_compiler
from circuits_llm.runtime.int8_linear import Int8Linear

MODEL = tiny_llama(scale=4.0)
FUSED = (0,)  # the tiny Llama has 2 layers: layer 1's output feeds the LM head's input
VOCAB = list(range(0, 48, 2))


def _fused_block(steps: int = 3, noise: float = 0.1) -> DraftBlock:
    return perturbed_block(MODEL, steps=steps, draft_vocab=VOCAB, fused_layers=FUSED,
                           noise=noise)


def test_the_backbone_hands_the_layers_outputs_then_the_head_input() -> None:
    ids = torch.tensor([[1, 5, 7, 9, 3, 2]])
    with torch.no_grad():
        states = MODEL(input_ids=ids, output_hidden_states=True).hidden_states
    _, top = HFBackbone(MODEL).hidden_states(ids)
    wanted = torch.cat([states[1], top], -1)
    _, fused = HFBackbone(MODEL, feature_layers=FUSED).hidden_states(ids)
    torch.testing.assert_close(fused, wanted, rtol=0, atol=1e-12)
    for kind in CacheKind:
        backbone = HFBackbone(MODEL, feature_layers=FUSED, cache=kind, max_cache_len=16
                              if kind is CacheKind.STATIC else None)
        assert backbone.hidden_size == 64
        first = backbone.extend(ids[:, :4]).draft_hidden
        second = backbone.extend(ids[:, 4:]).draft_hidden
        torch.testing.assert_close(torch.cat([first, second], 1), wanted, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layers", [(1,), (0, 0), (True,), "0", (-1,)])
def test_bad_layer_lists_are_refused(layers: object) -> None:
    with pytest.raises(ValueError, match="feature layers must be"):
        HFBackbone(MODEL, feature_layers=layers)  # type: ignore[arg-type]
    with pytest.raises(DraftBlockError, match="fused_layers: feature layers must be"):
        DraftBlock(MODEL, fused_layers=layers)  # type: ignore[arg-type]


def test_a_fresh_fusion_starts_where_the_block_stands_and_a_moved_one_reads() -> None:
    plain = perturbed_block(MODEL, draft_vocab=VOCAB)
    fused = DraftBlock(MODEL, steps=3, draft_vocab=VOCAB, fused_layers=FUSED).double()
    missing, unexpected = fused.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and missing and all(n.startswith("layer_fusion.") for n in missing)
    features = prefill_features(HFBackbone(MODEL, feature_layers=FUSED),
                                torch.tensor([[1, 5, 7, 9, 3, 2, 8]]))
    assert features.hidden.shape[-1] == fused.feature_size == 64
    top = features.hidden[..., 32:]
    torch.testing.assert_close(fused.read_features(features.hidden), top, rtol=0, atol=0)
    with torch.no_grad():
        fused.layer_fusion.project.weight.normal_(0.0, 0.3)
    assert (fused.read_features(features.hidden) - top).abs().max() > 1e-3
    with pytest.raises(DraftBlockError, match=r"feature_layers=\[0\]"):
        fused.read_features(top)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
@pytest.mark.parametrize("lookup", [None, ContextLookup((0.5, 0.9))], ids=["alone", "lookup"])
def test_decoding_with_a_fused_block(temperature: float, lookup: ContextLookup | None) -> None:
    """Greedy output is ``generate``'s, and the block's cache equals a fresh prefill of it."""
    drafter = BlockDrafter(_fused_block())
    decoder = SpeculativeDecoder(MODEL, drafter, lookup=lookup)
    assert decoder.backbone.feature_layers == FUSED  # type: ignore[attr-defined]
    for prompt, count in (([1, 5, 7, 9, 3], 14), ([4, 2, 2, 4, 2, 2], 10)):
        result = decoder.generate(prompt, count, temperature=temperature, eos_token_id=(),
                                  generator=torch.Generator().manual_seed(3))
        if temperature == 0:
            assert result.tokens.tolist() == greedy_generate(MODEL, prompt, count)
        assert_cache_is_a_fresh_prefill(drafter, MODEL, prompt + result.tokens.tolist(),
                                        drafter.window)


def test_a_circuit_on_a_fused_block_decodes_like_generate() -> None:
    drafter = BlockCircuitDrafter(_fused_block(), block_circuit_head(MODEL, "btree", 4, VOCAB))
    assert drafter.feature_layers == FUSED and drafter.hidden_size == 64
    decoder = SpeculativeDecoder(MODEL, drafter)
    prompt = [1, 5, 7, 9, 3]
    result = decoder.generate(prompt, 12, temperature=0.0, eos_token_id=())
    assert result.tokens.tolist() == greedy_generate(MODEL, prompt, 12)
    assert_cache_is_a_fresh_prefill(drafter, MODEL, prompt + result.tokens.tolist(),
                                    drafter.window)


def test_a_backbone_without_the_layers_is_refused_with_the_fix() -> None:
    with pytest.raises(DecoderError, match=r"HFBackbone\(model, feature_layers=\[0\]\)"):
        SpeculativeDecoder(HFBackbone(MODEL), BlockDrafter(_fused_block()))


SMALL_VOCAB = 4
SMALL = tiny_llama(vocab=SMALL_VOCAB, scale=3.0)
PROMPT = [1, 2, 3, 1, 2]


def _small_block() -> DraftBlock:
    return perturbed_block(SMALL, steps=2, draft_vocab=[0, 2, 3], noise=0.3, fused_layers=FUSED)


@pytest.mark.parametrize("lookup", [None, ContextLookup((0.5, 0.9))], ids=["alone", "lookup"])
def test_the_enumerated_law_is_the_targets(lookup: ContextLookup | None) -> None:
    config = SamplingConfig(1.0)
    target = target_law(NextTokenLogits(SMALL), PROMPT, 3, config)  # type: ignore[arg-type]
    exact = recursive_law(_small_block(), SMALL, PROMPT, 3, config,  # type: ignore[arg-type]
                          lookup=lookup)
    assert abs(sum(exact.values()) - 1) < 1e-12
    assert total_variation(exact, target) <= 1e-9


@pytest.mark.parametrize("way", ["eager", "compiled"])
def test_sampled_output_follows_the_law(way: str) -> None:
    compiled = way == "compiled"
    double = CudaGraphDouble()
    drafter = BlockDrafter(_small_block(),
                           step_mode=BlockStepMode.COMPILED if compiled else BlockStepMode.EAGER)
    with use_compiler(double):
        decoder = SpeculativeDecoder(
            SMALL, drafter, compile=compiled,
            sampled_accept=SampledAccept.WHOLE_WINDOW if compiled else SampledAccept.AUTO)
    generator = torch.Generator().manual_seed(0)
    samples = [tuple(decoder.generate(PROMPT, 2, temperature=1.0, generator=generator,
                                      eos_token_id=()).tokens.tolist()) for _ in range(600)]
    if compiled:
        assert double.calls["draft block step"] > 0
    target = target_law(NextTokenLogits(SMALL), PROMPT, 2, SamplingConfig(1.0))  # type: ignore[arg-type]
    assert law_p_value(samples, target) > 1e-3
    shifted = {((x[0] + 1) % SMALL_VOCAB, *x[1:]): p for x, p in target.items()}
    assert law_p_value(samples, shifted) < 1e-6


def test_int8_copy_save_load_and_training_keep_the_fusion(tmp_path: object) -> None:
    model = tiny_llama(seed=2).float()
    block = perturbed_block(model, draft_vocab=VOCAB, fused_layers=FUSED).float()
    copy = drafting_block(block, DraftWeights.INT8)
    assert isinstance(copy.layer_fusion.project, Int8Linear)
    features = torch.randn(1, 5, 64)
    torch.testing.assert_close(copy.read_features(features), block.read_features(features),
                               rtol=0.05, atol=0.05)
    directory = save_draft_block(block, tmp_path / "fused", model)  # type: ignore[operator]
    loaded = load_draft_block(directory, model)
    assert loaded.fused_layers == FUSED
    for name, value in block.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0)
    data = prefill_features(HFBackbone(model, feature_layers=FUSED),
                            torch.randint(1, 47, (4, 12), generator=torch.Generator().manual_seed(0)))
    before = block.layer_fusion.project.weight.detach().clone()
    train_block(block, data, depths=2, steps=3, lr=1e-2)
    assert not torch.equal(block.layer_fusion.project.weight, before)


def test_a_batch_decodes_each_row_as_alone() -> None:
    decoder = SpeculativeDecoder(MODEL, BlockDrafter(_fused_block()))
    prompts, limits = [[1, 5, 7, 9, 3], [1], [4, 2, 2]], [10, 8, 6]
    result = decoder.generate(prompts, limits, 0.0, eos_token_id=())
    for prompt, count, tokens in zip(prompts, limits, result.tokens, strict=True):
        assert list(tokens) == greedy_generate(MODEL, prompt, count)
