"""Where the backbone finds a model's parts: OPT keeps its final norm (and, at some sizes, an output
projection) on its decoder, and the LoRA draft branch must apply exactly what the model applies."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

from circuits_llm.backbone import HFBackbone, UnsupportedModelError
from circuits_llm.backbone._arch import find_parts


@pytest.mark.parametrize("projection", [None, 16], ids=["no-projection", "project-out"])
@pytest.mark.parametrize("norm_before", [True, False], ids=["final-norm", "no-final-norm"])
def test_opt_takes_a_lora_draft_branch(projection: int | None, norm_before: bool) -> None:
    """Untrained LoRA is the identity, so the draft branch's hidden state fed to the LM head gives
    the verifier's logits; with a projection the draft hidden state has the projected width."""
    config = OPTConfig(vocab_size=50, hidden_size=32, num_hidden_layers=3, ffn_dim=64,
                       num_attention_heads=4, max_position_embeddings=64,
                       word_embed_proj_dim=projection or 32, do_layer_norm_before=norm_before)
    torch.manual_seed(0)
    model = OPTForCausalLM(config).eval().double()
    backbone = HFBackbone(model, lora_layers=1)
    ids = torch.randint(0, 50, (1, 7))
    step = backbone.extend(ids)
    with torch.no_grad():
        reference = model(ids).logits
        from_draft = model.get_output_embeddings()(step.draft_hidden)
    assert step.draft_hidden.shape == (1, 7, projection or 32)
    torch.testing.assert_close(step.verifier_logits, reference, rtol=0, atol=1e-10)
    torch.testing.assert_close(from_draft, reference, rtol=0, atol=1e-10)


def test_a_model_with_no_final_norm_found_is_refused_a_draft_branch() -> None:
    """GPT-2 with its ``ln_f`` removed (not declared absent): one clear error naming the paths."""
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=32))
    del model.transformer.ln_f
    assert find_parts(model).final_norm is None
    message = r"no final norm found on GPT2Model.*decoder\.final_layer_norm"
    with pytest.raises(UnsupportedModelError, match=message):
        HFBackbone(model, lora_layers=1)
