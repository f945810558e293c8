"""The decoder rows of :mod:`benchmarks.gpu_check`: the speculative decoder's exact output law and
greedy identity with ``model.generate`` (circuit heads and the draft blocks), on the device, eager
and compiled.

The law (on the toy LM of ``tests/toy.py``: 3 tokens, windows of 3, logits a random function of
the last two tokens, so the target law of the first :data:`LAW_TOKENS` tokens is enumerable):

* **enumerated** (exact): the law of what the decoder emits, every branch of every round weighed
  with the round functions the decoder runs, computed on the device (:func:`toy.decoder_law`: the
  head's exact conditionals for every draft, :func:`~circuits_llm.decoding.acceptance.round_law`,
  :func:`~circuits_llm.decoding.acceptance.transition`), against the brute-force target law on the
  CPU, for the four head templates; the paper's drop-the-correction variant is the negative
  control (its law must differ);
* **sampled** (end to end): ``SpeculativeDecoder.generate`` run many times on the device, its
  outputs G-tested against the target law, with the drop-the-correction decoder as the negative
  control that the same test must reject;
* **compiled = eager**: the compiled round programs read the same uniform tape as the eager ones,
  so the compiled decoder must emit exactly the eager decoder's tokens for every seed at T=1 (then
  its law is the exact law above; compiled greedy decoding is the greedy rows' job).

Greedy identity: tiny random Llama and GPT-2 models (float64, so the multi-token verify forward and
HF's one-token steps agree on every argmax) with a random non-zero LoRA draft branch, as in
``tests/test_decoder_greedy.py``; the speculative decoder's greedy output must equal
``model.generate(do_sample=False)`` eager and compiled (static cache and compiled forwards; CUDA
graphs on CUDA).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from benchmarks.gpu_check_core import (
    ALPHA,
    Group,
    Outcome,
    Settings,
    compiler_scope,
    g_test,
)
from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.decoder import CorrectionPolicy, SpeculativeDecoder
from circuits_llm.decoding.warping import SamplingConfig
from circuits_llm.heads import MTPHead
from circuits_llm.protocols import BackboneStep

# the toy LM, head and target law of the exactness tests, reused (tests/ is not a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from toy import ToyHead, ToyLM, decoder_law, target_law, total_variation

LAW_VOCAB, LAW_WINDOW, LAW_TOKENS = 3, 3, 3
LAW_PROMPT = (0, 1)
LAW_HEADS = (("ff", 1), ("cp", 2), ("hmm", 2), ("btree", 2))
#: a compressed draft vocabulary without token 1, which ends LAW_PROMPT: the first round drafts
#: after a stand-in for it (docs/decoder-exactness.md section 1)
COMPRESSED = (0, 2)
#: the sampled check's head: seed 5, scale 2 gives the drop-the-correction control a chi-square
#: divergence of 0.15 from the target (found by enumeration), so the control is rejected for sure
SAMPLED_HEAD, SAMPLED_SEED, SAMPLED_SCALE = ("btree", 2), 5, 2.0
EXACT_TV = 1e-9
BIASED_TV = 1e-3
RowSpec = tuple[Group, str, Callable[[], Outcome]]


class DeviceToyLM(ToyLM):
    """:class:`ToyLM` whose ``extend`` answers on ``device`` (its tables and token cache stay on
    the CPU; the target law is computed from them)."""

    def __init__(self, device: torch.device, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.device = device

    def extend(self, tokens: Tensor) -> BackboneStep:
        """``tokens`` (1, m) -> logits (1, m, V) and draft hidden states (1, m, d) on the device."""
        step = super().extend(tokens.cpu())
        return BackboneStep(step.verifier_logits.to(self.device), step.draft_hidden.to(self.device))


def toy_pair(settings: Settings, architecture: str, rank: int, seed: int, scale: float = 1.0,
             draft_tokens: tuple[int, ...] | None = None) -> tuple[DeviceToyLM, ToyHead]:
    """A toy LM with a draft branch and a float64 toy head on the device (``draft_tokens``: a
    compressed draft vocabulary)."""
    lm = DeviceToyLM(settings.device, vocab_size=LAW_VOCAB, draft_branch=True, seed=seed)
    head = ToyHead(architecture, LAW_WINDOW, rank, lm.hidden_size, LAW_VOCAB, seed=seed, scale=scale,
                   draft_tokens=draft_tokens)
    return lm, head.to(settings.device)


def _enumerated_row(settings: Settings) -> Outcome:
    """:func:`toy.decoder_law` of every head against the target law, and of a BTree head whose
    compressed draft vocabulary lacks the prompt's last token (a stand-in round); the
    drop-the-correction law must differ (the check can fail)."""
    config = SamplingConfig(1.0)
    values: dict[str, dict[str, float]] = {}
    heads = [(a, r, None) for a, r in LAW_HEADS] + [("btree", 2, COMPRESSED)]
    for architecture, rank, draft_tokens in heads:
        lm, head = toy_pair(settings, architecture, rank, settings.seed, draft_tokens=draft_tokens)
        target = target_law(lm, LAW_PROMPT, LAW_TOKENS, config)
        name = architecture if draft_tokens is None else f"{architecture} compressed"
        values[name] = {
            "tv_exact": total_variation(decoder_law(lm, head, LAW_PROMPT, LAW_TOKENS, config), target),
            "tv_biased_control": total_variation(decoder_law(lm, head, LAW_PROMPT, LAW_TOKENS, config,
                                                           CorrectionPolicy.DROP_AFTER_ACCEPT), target)}
    worst = max(v["tv_exact"] for v in values.values())
    control = min(v["tv_biased_control"] for v in values.values())
    numbers = (f"{len(values)} heads, T=1, first {LAW_TOKENS} tokens: max TV {worst:.1e} (<= "
               f"{EXACT_TV:g}); drop-correction control min TV {control:.3f} (> {BIASED_TV:g})")
    return Outcome.verdict(worst <= EXACT_TV and control > BIASED_TV, numbers, values,
                           f"TV {worst:.3g} from the target" if worst > EXACT_TV
                           else f"biased control TV only {control:.3g}")


def _sampled_row(settings: Settings) -> Outcome:
    """``generate`` on the device, G-tested against the target law; the drop-the-correction
    decoder is the negative control."""
    runs = 1000 if settings.quick else 1500
    (architecture, rank), config = SAMPLED_HEAD, SamplingConfig(1.0)
    lm, head = toy_pair(settings, architecture, rank, SAMPLED_SEED, SAMPLED_SCALE)
    target = target_law(lm, LAW_PROMPT, LAW_TOKENS, config)
    cells = sorted(target)
    probs = np.array([target[k] for k in cells])
    values: dict[str, float] = {}
    for name, policy in (("exact", CorrectionPolicy.EXACT), ("control", CorrectionPolicy.DROP_AFTER_ACCEPT)):
        decoder = SpeculativeDecoder(lm, head, policy=policy)
        generator = settings.generator(7)
        seen = Counter(tuple(decoder.generate(list(LAW_PROMPT), LAW_TOKENS, 1.0, generator=generator)
                             .tokens.tolist()) for _ in range(runs))
        counts = np.array([seen.get(k, 0) for k in cells])
        values[f"p_{name}"] = g_test(counts, probs) if sum(seen.values()) == counts.sum() else 0.0
    numbers = (f"{runs} generate calls: p={values['p_exact']:.3f}; drop-correction control "
               f"p={values['p_control']:.1e} (reject < {ALPHA:g})")
    ok = values["p_exact"] > ALPHA and values["p_control"] <= ALPHA
    return Outcome.verdict(ok, numbers, values, "exact decoder rejected" if values["p_exact"] <= ALPHA
                           else "the biased control was not rejected")


def _compiled_row(settings: Settings) -> Outcome:
    """The compiled decoder emits the eager decoder's tokens for every seed (same uniform tape),
    with the whole vocabulary and with a compressed one whose first round drafts after a
    stand-in."""
    runs, tokens = (6, 10) if settings.quick else (16, 16)
    (architecture, rank) = SAMPLED_HEAD
    differ = 0
    for draft_tokens in (None, COMPRESSED):
        lm, head = toy_pair(settings, architecture, rank, SAMPLED_SEED, SAMPLED_SCALE, draft_tokens)
        eager = SpeculativeDecoder(lm, head)
        with compiler_scope(settings.compiler):
            compiled = SpeculativeDecoder(lm, head, compile=True)
        for run in range(runs):  # greedy compiled decoding: the greedy rows (real models)
            outputs = [d.generate(list(LAW_PROMPT), tokens, 1.0, generator=settings.generator(run))
                       .tokens.tolist() for d in (eager, compiled)]
            differ += outputs[0] != outputs[1]
    runs *= 2
    numbers = (f"{runs} seeds x {tokens} tokens (T=1; half with a compressed draft vocabulary, "
               f"stand-in rounds), compiler {settings.compiler.value}: {differ} outputs differ "
               "from eager")
    return Outcome.verdict(differ == 0, numbers, {"runs": runs, "differ": differ},
                           f"{differ} of {runs} compiled outputs differ from eager")


def law_rows(settings: Settings) -> list[RowSpec]:
    """The law rows: enumerated, sampled, compiled = eager."""
    return [(Group.DECODER_LAW, "enumerated, eager", lambda: _enumerated_row(settings)),
            (Group.DECODER_LAW, "sampled generate, eager", lambda: _sampled_row(settings)),
            (Group.DECODER_LAW, "compiled = eager per seed", lambda: _compiled_row(settings))]


# ------------------------------------------------------------------ greedy identity
VOCAB, HIDDEN = 48, 32


def tiny_model(name: str, device: torch.device) -> PreTrainedModel:
    """The float64 tiny Llama or GPT-2 of ``tests/test_decoder_greedy.py``, on ``device``."""
    torch.manual_seed(0)
    if name == "llama":
        model: PreTrainedModel = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            bos_token_id=0, eos_token_id=VOCAB - 1, pad_token_id=0, tie_word_embeddings=True))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4,
                                           n_positions=128, bos_token_id=0, eos_token_id=VOCAB - 1,
                                           pad_token_id=0))
    return model.double().eval().to(device)


def _greedy_outcome(settings: Settings, model: PreTrainedModel, decoder: SpeculativeDecoder,
                    generator: torch.Generator, compiled: bool, drafter: str) -> Outcome:
    """``decoder``'s greedy output against ``model.generate`` on random prompts of several
    lengths: PASS when every output is identical and drafts were both accepted and rejected (so
    the accept and the reject paths both ran); ``drafter`` names the drafter in the numbers."""
    cases = [(1, 8), (5, 12), (9, 16)] if settings.quick else [(1, 12), (2, 5), (5, 20), (9, 24)]
    mismatches, accepted, drafted = 0, 0, 0
    for length, new in cases:
        prompt = torch.randint(1, VOCAB - 1, (1, length), generator=generator).to(settings.device)
        result = decoder.generate(prompt, new)
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                  max_new_tokens=new, pad_token_id=0)
        mismatches += result.tokens.tolist() != expected[0, length:].tolist()
        accepted += result.summary.accepted
        drafted += result.summary.drafted
    way = f"compiled ({settings.compiler.value})" if compiled else "eager"
    numbers = (f"{len(cases)} prompts, {way}, {drafter}: {mismatches} differ from "
               f"model.generate; drafts accepted {accepted}/{drafted}")
    both = 0 < accepted < drafted
    return Outcome.verdict(mismatches == 0 and both, numbers,
                           {"prompts": len(cases), "mismatches": mismatches, "accepted": accepted,
                            "drafted": drafted}, f"{mismatches} greedy outputs differ" if mismatches
                           else "drafts were all accepted or all rejected: a path went unchecked")


def _greedy_row(settings: Settings, name: str, compiled: bool) -> Outcome:
    """Greedy speculative decoding (BTree window 4, a LoRA draft branch) equals
    ``model.generate`` on every prompt, and both accepted and rejected drafts occurred."""
    model = tiny_model(name, settings.device)
    window = 4
    with compiler_scope(settings.compiler):
        backbone = HFBackbone(model, lora_layers=1, compile=compiled,
                              compiled_lengths=(1, window) if compiled else None)
    generator = torch.Generator().manual_seed(1)
    for parameter in backbone.draft_parameters():  # random non-zero LoRA: drafts differ, some match
        parameter.data = 0.1 * torch.randn(parameter.shape, generator=generator,
                                           dtype=parameter.dtype).to(parameter.device)
    head = MTPHead.from_name("btree", window, 2, HIDDEN, VOCAB,
                             lm_head_weight=model.get_output_embeddings().weight.detach().cpu(),
                             dtype=torch.float64, sum_init_std=0.5).to(settings.device)
    with compiler_scope(settings.compiler):
        decoder = SpeculativeDecoder(backbone, head, compile=compiled)
    return _greedy_outcome(settings, model, decoder, generator, compiled, "LoRA draft branch")


def _block_greedy_row(settings: Settings, kind: str, compiled: bool) -> Outcome:
    """Greedy decoding with a draft block (issue 44) equals ``model.generate`` on every prompt:
    ``recursive`` (:class:`~circuits_llm.draft_block.BlockDrafter`, 3 drafts a round) or
    ``circuit`` (a BTree head on the block's output, window 4), on the tiny Llama, the block
    moved off its identity start so that drafts are both accepted and rejected; compiled: the
    static cache and compiled forwards (CUDA graphs on CUDA), the block's cache following it."""
    from circuits_llm.draft_block import BlockCircuitDrafter, BlockDrafter, DraftBlock
    model = tiny_model("llama", settings.device)
    generator = torch.Generator().manual_seed(2)
    block = DraftBlock(model, steps=3, draft_vocab=list(range(0, VOCAB, 2)))
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator,
                                             dtype=parameter.dtype).to(parameter.device))
    drafter: BlockDrafter | BlockCircuitDrafter = BlockDrafter(block.eval())
    if kind == "circuit":
        lm_head = model.get_output_embeddings().weight.detach().cpu()
        head = MTPHead.from_name("btree", 4, 2, HIDDEN, VOCAB, lm_head_weight=lm_head,
                                 dtype=torch.float64, sum_init_std=0.5,
                                 init_noise=0.3).to(settings.device).eval()
        drafter = BlockCircuitDrafter(block, head)
    with compiler_scope(settings.compiler):
        backbone = HFBackbone(model, compile=compiled,
                              compiled_lengths=(1, drafter.window) if compiled else None)
        decoder = SpeculativeDecoder(backbone, drafter, compile=compiled)
    return _greedy_outcome(settings, model, decoder, generator, compiled, f"{kind} draft block")


def greedy_rows(settings: Settings) -> list[RowSpec]:
    """Llama and GPT-2, eager and compiled; the draft blocks (recursive and a circuit on the
    block) on Llama, eager and compiled."""
    heads = [(Group.GREEDY, f"{name} {'compiled' if compiled else 'eager'}",
              lambda name=name, compiled=compiled: _greedy_row(settings, name, compiled))
             for name in ("llama", "gpt2") for compiled in (False, True)]
    blocks = [(Group.GREEDY, f"llama {kind} block {'compiled' if compiled else 'eager'}",
               lambda kind=kind, compiled=compiled: _block_greedy_row(settings, kind, compiled))
              for kind in ("recursive", "circuit") for compiled in (False, True)]
    return heads + blocks

