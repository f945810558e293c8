"""circuits_llm.training.loss: Eq. 4 against a brute-force per-window loop, masking, gradients, training."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from circuits.errors import InvalidInputError
from circuits_llm.backbone import HFBackbone
from circuits_llm.heads import MTPHead
from circuits_llm.text import byte_level as data
from circuits_llm.training.loss import (
    default_gamma,
    mtp_loss,
    window_log_conditionals,
    window_targets,
)

ARCHITECTURES = ["ff", "cp", "hmm", "btree"]
V, D = 6, 5


def make_head(name: str, window: int = 4, rank: int = 3, dtype: torch.dtype = torch.float64,
              seed: int = 0) -> MTPHead:
    """A tiny head with randomised (non-initial) parameters, so every circuit part matters."""
    weight = torch.randn(V, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    head = MTPHead.from_name(name, window, 1 if name == "ff" else rank, D, V, "full", weight,
                             dtype=dtype, sum_init_std=0.5, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.4 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return head


@torch.no_grad()
def brute_force(head: MTPHead, hidden: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
                gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 4 by a loop over sequences, positions and slots with one marginal query each."""
    batch, length = tokens.shape
    n = head.window
    per_seq = torch.zeros(batch, n, dtype=torch.float64)
    counts = torch.zeros(batch, n, dtype=torch.long)
    for b in range(batch):
        for t in range(length):
            params = head(hidden[b, t][None])
            for j in range(1, n + 1):
                if t + j >= length or not bool(mask[b, t:t + j + 1].all()):
                    break
                x = torch.zeros(1, n, dtype=torch.long)
                x[0, :j] = tokens[b, t + 1:t + j + 1]
                upto = torch.arange(n) < j
                before = torch.arange(n) < j - 1
                joint = head.circuit.log_marginal(x, upto, params)
                prefix = head.circuit.log_marginal(x, before, params) if j > 1 else \
                    torch.zeros(1, dtype=torch.float64)
                per_seq[b, j - 1] += float(prefix - joint)
                counts[b, j - 1] += 1
    has = counts > 0
    slot = torch.where(has, per_seq / counts.clamp_min(1), 0.0).sum(0) / has.sum(0).clamp_min(1)
    weights = torch.tensor([gamma ** j for j in range(n)], dtype=torch.float64)
    return (weights * slot).sum(), slot


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_loss_equals_brute_force_with_padding(name: str) -> None:
    head = make_head(name)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (3, 7), generator=generator)
    hidden = torch.randn(3, 7, D, generator=generator, dtype=torch.float64)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0  # right padding
    mask[2, 3:] = 0  # shorter than the window: slots 3, 4 have no valid target
    tokens[1, 5:] = -100  # padding ids out of the vocabulary are fine where masked
    out = mtp_loss(head, hidden, tokens, mask, gamma=0.7)
    expected, slot = brute_force(head, hidden, tokens.clamp_min(0), mask.bool(), 0.7)
    assert torch.allclose(out.nll, slot, atol=1e-10, rtol=1e-10)
    assert torch.allclose(out.loss, expected, atol=1e-10, rtol=1e-10)
    assert out.count.tolist() == [6 + 4 + 2, 5 + 3 + 1, 4 + 2, 3 + 1]
    assert torch.allclose(out.bits_per_token, slot / math.log(2))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_shared_prefix_marginals_match_replicated_parameters(name: str) -> None:
    """The loss's core query (prefixes share their window's parameters) equals the same query with
    every parameter tensor replicated once per prefix, in value and in gradient."""
    head = make_head(name, window=5, seed=2)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, D, generator=generator, dtype=torch.float64)
    x = torch.randint(0, V, (6, 5), generator=generator)
    params = {k: v.detach().requires_grad_(True) for k, v in head(hidden).items()}
    shared = head.circuit.log_prefix_marginals(x, params=params)  # (6, 5)
    rows = x.repeat_interleave(5, dim=0)
    replicated = {k: v.repeat_interleave(5, dim=0) for k, v in params.items()}
    masks = (torch.arange(5)[None, :] <= torch.arange(5)[:, None]).repeat(6, 1)
    reference = head.circuit.log_marginal(rows, masks, replicated).view(6, 5)
    assert torch.allclose(shared, reference, atol=1e-12, rtol=0)
    weights = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    ours = torch.autograd.grad((shared * weights).sum(), list(params.values()))
    theirs = torch.autograd.grad((reference * weights).sum(), list(params.values()))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_padding_does_not_leak() -> None:
    """Values and hidden states at padded positions do not change the loss."""
    head = make_head("btree")
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (2, 8), generator=generator)
    hidden = torch.randn(2, 8, D, generator=generator, dtype=torch.float64)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 6:] = False
    base = mtp_loss(head, hidden, tokens, mask)
    tokens2, hidden2 = tokens.clone(), hidden.clone()
    tokens2[0, 6:] = (tokens2[0, 6:] + 1) % V
    hidden2[0, 6:] += 3.0
    other = mtp_loss(head, hidden2, tokens2, mask)
    assert torch.equal(base.loss, other.loss)
    unmasked = mtp_loss(head, hidden2, tokens2)
    assert not torch.allclose(base.loss, unmasked.loss)


def test_window_targets_validity() -> None:
    tokens = torch.arange(5)[None]
    mask = torch.tensor([[1, 1, 1, 0, 1]], dtype=torch.bool)
    targets, valid = window_targets(tokens, 3, mask)
    assert targets[0, 0].tolist() == [1, 2, 0]
    assert valid[0].long().tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_gradients_reach_head_and_hidden(name: str) -> None:
    head = make_head(name, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 6, D, generator=generator).requires_grad_(True)
    tokens = torch.randint(0, V, (2, 6), generator=generator)
    mtp_loss(head, hidden, tokens).loss.backward()
    trainable = [p for p in head.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None and bool(p.grad.abs().sum() > 0)
                             for p in trainable if p.dim() > 1 and p.numel() > 0)
    assert hidden.grad is not None and bool(hidden.grad[:, :-1].abs().sum() > 0)
    assert bool((hidden.grad[:, -1] == 0).all())  # the last position has no target


def test_ff_loss_is_sum_of_slot_cross_entropies() -> None:
    head = make_head("ff", window=4)
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, V, (2, 9), generator=generator)
    hidden = torch.randn(2, 9, D, generator=generator, dtype=torch.float64)
    out = mtp_loss(head, hidden, tokens, gamma=1.0)
    params = head(hidden.reshape(-1, D))
    (name,) = [k for k, v in params.items() if v.shape[-1] == V]
    logits = params[name].view(2, 9, 4, V)  # FF: one input unit per slot, slot j = variable j
    expected = torch.zeros((), dtype=torch.float64)
    for j in range(4):
        steps = 9 - j - 1
        ce = torch.nn.functional.cross_entropy(logits[:, :steps, j].reshape(-1, V),
                                               tokens[:, j + 1:j + 1 + steps].reshape(-1))
        expected = expected + ce
    assert torch.allclose(out.loss, expected, atol=1e-10)


def test_default_gamma_and_weights() -> None:
    assert default_gamma(8) == 0.8 and default_gamma(9) == 0.9
    head = make_head("cp", window=3)
    tokens = torch.randint(0, V, (1, 5))
    out = mtp_loss(head, torch.randn(1, 5, D, dtype=torch.float64), tokens)
    assert torch.allclose(out.weights, torch.tensor([1.0, 0.8, 0.64], dtype=torch.float64))
    assert torch.allclose(out.loss, (out.weights * out.nll).sum())


def test_log_conditionals_are_normalised() -> None:
    """Summing exp(log q(x_{t+j} | prefix)) over x_{t+j} gives 1 for every slot."""
    head = make_head("hmm", window=3)
    hidden = torch.randn(1, 1, D, dtype=torch.float64).expand(V, 4, D)
    tokens = torch.zeros(V, 4, dtype=torch.long)
    tokens[:, 1] = 2
    tokens[:, 2] = torch.arange(V)  # every value of slot 2 after the same x_{t+1}
    log_cond, valid = window_log_conditionals(head, hidden.contiguous(), tokens)
    assert bool(valid[:, 0, 1].all())
    assert abs(float(log_cond[:, 0, 1].detach().exp().sum()) - 1.0) < 1e-12


def test_bad_inputs_raise_clear_errors() -> None:
    head = make_head("cp", dtype=torch.float32)
    hidden = torch.randn(2, 5, D)
    tokens = torch.randint(0, V, (2, 5))
    cases = [
        (dict(hidden=hidden[0]), "shape \\(B, T, d\\)"),
        (dict(hidden=torch.randn(2, 5, D + 1)), "size 6 in its last dimension"),
        (dict(tokens=tokens[:, :4]), "tokens must have shape"),
        (dict(tokens=tokens.float()), "integer tensor"),
        (dict(tokens=tokens + V), "outside the vocabulary"),
        (dict(mask=torch.ones(2, 4)), "mask must be a \\(B, T\\)"),
        (dict(mask=torch.full((2, 5), 2)), "only 0 and 1"),
        (dict(gamma=1.5), "gamma must be"),
        (dict(mask=torch.zeros(2, 5, dtype=torch.bool)), "no valid target"),
    ]
    for change, message in cases:
        kwargs = dict(hidden=hidden, tokens=tokens, mask=None, gamma=None)
        kwargs.update(change)
        with pytest.raises(InvalidInputError, match=message):
            mtp_loss(head, **kwargs)  # type: ignore[arg-type]


def test_adamw_steps_lower_the_loss_on_stdlib_bytes() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=data.VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         bos_token_id=int(data.SpecialToken.BOS), eos_token_id=None,
                         pad_token_id=None)
    backbone = HFBackbone(LlamaForCausalLM(config), lora_layers=1, lora_rank=4)
    lm_head = backbone.model.get_output_embeddings().weight.detach()
    head = MTPHead.from_name("btree", window=4, rank=4, hidden_size=32,
                             vocab_size=data.VOCAB_SIZE, lm_head_weight=lm_head)
    stream = data.pack(data.corpus_files(data.Split.TRAIN)[:3], max_bytes=4000)
    batch = data.windows(stream, data.WindowSpec(length=48, stride=48))[:4]
    optimiser = torch.optim.AdamW([*head.parameters(), *backbone.draft_parameters()], lr=3e-3)
    losses = []
    for _ in range(8):
        _, hidden = backbone.hidden_states(batch)
        out = mtp_loss(head, hidden, batch)
        optimiser.zero_grad()
        out.loss.backward()
        optimiser.step()
        losses.append(float(out.loss))
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(p.grad is not None for p in backbone.draft_parameters())
