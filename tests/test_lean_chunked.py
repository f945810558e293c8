"""Chunked input log-probabilities for the training loss (circuits_llm.heads.chunked).

* the chunked loss and its gradients (every head parameter and the hidden states, as with LoRA)
  equal the materialised ones in float64, FULL and LEAN, with and without a compressed draft
  vocabulary, for tiles from one (position, unit) pair up to everything at once;
* ``target_log_softmax`` against a direct log-softmax (hypothesis) and ``gradcheck``;
* memory: at a vocabulary of 49,152 no tensor of the chunked loss (forward and backward) is larger
  than a tile of ``chunk_rows x K`` logits, the head's own parameters or (LEAN) its derived map
  ``W_lm U`` of ``units x rho x K``, none of which grows with the positions, while the
  materialised path (the negative control) holds ``positions x units x K``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from circuits.errors import InvalidInputError
from circuits_llm.heads import HeadVariant, MTPHead
from circuits_llm.heads.chunked import FullTiles, LeanTiles, TiledLogits, target_log_softmax, tiles
from circuits_llm.training.loss import mtp_loss

ARCHITECTURES = ["ff", "cp", "hmm", "btree"]
VARIANTS = [HeadVariant.FULL, HeadVariant.LEAN]
V, D = 13, 5
DRAFT = (7, 0, 12, 3, 5, 9)  # ids 1, 2, 4, 6, 8, 10, 11 are outside


def make_head(name: str, variant: HeadVariant, draft: tuple[int, ...] | None, window: int = 4,
              rank: int = 3, seed: int = 0, vocab: int = V, hidden: int = D,
              dtype: torch.dtype = torch.float64) -> MTPHead:
    """A head whose every parameter is random (LEAN's ``up`` off zero), so all paths matter."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=generator, dtype=dtype)
    head = MTPHead.from_name(name, window, 1 if name == "ff" else rank, hidden, vocab, variant,
                             weight, draft_vocab=draft, dtype=dtype, sum_init_std=0.5, seed=seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.4 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return head


def batch(head: MTPHead, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden (3, 9, d) requiring grad, tokens (3, 9), mask (3, 9)) with padding and, for a
    compressed head, mostly in-vocabulary tokens and a few outside."""
    generator = torch.Generator().manual_seed(seed)
    if head.draft_tokens is None:
        tokens = torch.randint(0, head.vocab_size, (3, 9), generator=generator)
    else:
        pick = torch.randint(0, head.draft_vocab_size, (3, 9), generator=generator)
        tokens = head.draft_tokens[pick]
        tokens[0, 4], tokens[2, 1] = 2, 11  # outside the draft vocabulary
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    hidden = torch.randn(3, 9, head.hidden_size, generator=generator, dtype=torch.float64)
    return hidden.requires_grad_(True), tokens, mask


def loss_and_gradients(head: MTPHead, hidden: torch.Tensor, tokens: torch.Tensor,
                       mask: torch.Tensor, **options: Any) -> dict[str, torch.Tensor]:
    head.zero_grad(set_to_none=True)
    hidden.grad = None
    out = mtp_loss(head, hidden, tokens, mask, **options)
    out.loss.backward()
    result = {"loss": out.loss.detach(), "nll_sum": out.nll_sum, "count": out.count,
              "hidden": hidden.grad.clone()}
    for name, parameter in head.named_parameters():
        if parameter.requires_grad:
            grad = parameter.grad
            result[name] = torch.zeros_like(parameter) if grad is None else grad.clone()
    return result


@pytest.mark.parametrize("draft", [None, DRAFT], ids=["full-vocab", "compressed"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_chunked_loss_and_gradients_equal_the_materialised(name: str, variant: HeadVariant,
                                                           draft: tuple[int, ...] | None) -> None:
    head = make_head(name, variant, draft)
    hidden, tokens, mask = batch(head)
    reference = loss_and_gradients(head, hidden, tokens, mask, materialise=True)
    assert float(reference["loss"]) > 0 and float(reference["hidden"].abs().max()) > 0
    units = head.input_units
    for rows in (1, 2, units - 1, units + 1, 10 ** 6, None):  # tiles cut units and positions
        chunked = loss_and_gradients(head, hidden, tokens, mask, chunk_rows=rows)
        assert chunked.keys() == reference.keys()
        assert torch.equal(chunked["count"], reference["count"])
        for key, value in reference.items():
            torch.testing.assert_close(chunked[key], value, rtol=0, atol=1e-12,
                                       msg=lambda m, key=key, rows=rows: f"{key}, rows={rows}: {m}")


def test_chunked_parameters_equal_the_head_outputs_for_any_evidence() -> None:
    """``observed_log_parameters`` at x = 0 equals ``head(hidden)`` at x = targets, for
    likelihoods and every marginal (not only prefixes)."""
    head = make_head("btree", HeadVariant.LEAN, DRAFT)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(7, D, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, len(DRAFT), (7, 4), generator=generator)
    observed = torch.rand(7, 4, generator=generator) < 0.6
    prepared = head.observed_log_parameters(hidden, targets, chunk_rows=3)
    zeros = torch.zeros_like(targets)
    expected = head.circuit.log_marginal(targets, observed, params=head(hidden))
    got = head.circuit.log_marginal(zeros, observed, params=prepared)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_bad_chunk_arguments_are_clear_errors() -> None:
    head = make_head("cp", HeadVariant.LEAN, None)
    hidden, tokens, mask = batch(head)
    with pytest.raises(InvalidInputError, match="chunk_rows must be None or an int >= 1"):
        mtp_loss(head, hidden, tokens, mask, chunk_rows=0)
    with pytest.raises(InvalidInputError, match=r"targets must be a long tensor of shape \(2, 4\)"):
        head.observed_log_parameters(torch.randn(2, D, dtype=torch.float64),
                                     torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(InvalidInputError, match=r"hidden must be a float tensor of shape \(batch, 5\)"):
        head.observed_log_parameters(torch.randn(2, 3), torch.zeros(2, 4, dtype=torch.long))


# ------------------------------------------------------------------------------ the primitive
def tiled_and_direct(kind: str, positions: int, units: int, categories: int, bias: bool,
                     seed: int) -> tuple[TiledLogits, torch.Tensor, list[torch.Tensor]]:
    """A tile map with random float64 inputs, its logits written out directly (S, U, K), and the
    inputs that require grad (LEAN's LM head does not)."""
    generator = torch.Generator().manual_seed(seed)

    def leaf(*shape: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=grad)

    hidden, offsets = leaf(positions, 3), leaf(units, categories) if bias else None
    if kind == "full":
        weight = leaf(units, categories, 3)
        direct = torch.einsum("sd,ukd->suk", hidden, weight)
        tiled: TiledLogits = FullTiles(hidden, weight, offsets)
        wanted = [hidden, weight]
    else:
        lm_head, codes, vocab_up = leaf(categories, 3, grad=False), leaf(positions, units, 2), \
            leaf(units, 2, categories)
        direct = (hidden @ lm_head.T)[:, None, :] + torch.einsum("sur,urk->suk", codes, vocab_up)
        tiled = LeanTiles(hidden, lm_head, codes, vocab_up, offsets)
        wanted = [hidden, codes, vocab_up]
    if offsets is not None:
        direct, wanted = direct + offsets, [*wanted, offsets]
    return tiled, direct, wanted


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["full", "lean"]), positions=st.integers(1, 6),
       units=st.integers(1, 5), categories=st.integers(1, 7), rows=st.integers(1, 40),
       bias=st.booleans(), seed=st.integers(0, 10 ** 6))
def test_target_log_softmax_equals_log_softmax(kind: str, positions: int, units: int,
                                               categories: int, rows: int, bias: bool,
                                               seed: int) -> None:
    tiled, direct, wanted = tiled_and_direct(kind, positions, units, categories, bias, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    targets = torch.randint(0, categories, (positions, units), generator=generator)
    weights = torch.randn(positions, units, generator=generator, dtype=torch.float64)
    ours = target_log_softmax(tiled, targets, rows)
    grads = torch.autograd.grad((ours * weights).sum(), wanted)
    expected_value = torch.log_softmax(direct, -1).gather(-1, targets[..., None])[..., 0]
    expected = torch.autograd.grad((expected_value * weights).sum(), wanted)
    torch.testing.assert_close(ours, expected_value, rtol=0, atol=1e-12)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    covered = torch.zeros(positions, units, dtype=torch.long)
    for block, unit_blocks in tiles(positions, units, rows):
        for unit_block in unit_blocks:
            covered[block, unit_block] += 1
            assert covered[block, unit_block].numel() <= rows
    assert bool((covered == 1).all())  # every pair in exactly one tile


@pytest.mark.parametrize("kind", ["full", "lean"])
def test_target_log_softmax_gradcheck(kind: str) -> None:
    tiled, _, wanted = tiled_and_direct(kind, 3, 2, 4, True, 0)
    targets = torch.randint(0, 4, (3, 2), generator=torch.Generator().manual_seed(1))
    fixed = [v for v in tiled.inputs if not v.requires_grad]

    def function(*inputs: torch.Tensor) -> torch.Tensor:
        values = iter(inputs)
        tensors = [next(values) if v.requires_grad else v for v in tiled.inputs]
        rebuilt = FullTiles(*tensors) if kind == "full" else LeanTiles(*tensors)
        return target_log_softmax(rebuilt, targets, 3)

    assert len(fixed) == (1 if kind == "lean" else 0)
    assert torch.autograd.gradcheck(function, tuple(wanted))


# ------------------------------------------------------------------------------ memory
class LargestStorage(TorchDispatchMode):
    """Records the largest storage (bytes) of any tensor an operator returns (views report the
    storage they share, so only real allocations can raise it)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("compressed", [False, True], ids=["V", "K"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_memory_is_one_tile_not_positions_times_units_times_vocab(variant: HeadVariant,
                                                                  compressed: bool) -> None:
    vocab, hidden_size, rows = 49152, 8, 8
    draft = tuple(range(0, vocab, 12)) if compressed else None  # K = 4096
    head = make_head("cp", variant, draft, window=2, rank=2, vocab=vocab, hidden=hidden_size,
                     dtype=torch.float32)
    categories = head.draft_vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor(draft) if draft is not None else torch.arange(vocab)
    tokens = ids[torch.randint(0, len(ids), (2, 48), generator=generator)]
    hidden = torch.randn(2, 48, hidden_size, generator=generator, requires_grad=True)
    own = max(t.untyped_storage().nbytes() for t in [*head.parameters(), *head.buffers()])
    # LEAN's derived map W_lm U (units, rho, K): parameter-sized, independent of the positions
    derived = head.input_units * head.lean_rank * categories * 4 if variant is HeadVariant.LEAN \
        else 0
    tile = rows * categories * 4
    with LargestStorage() as chunked:
        mtp_loss(head, hidden, tokens, chunk_rows=rows).loss.backward()
    assert chunked.largest <= max(own, derived, tile), (chunked.largest, own, derived, tile)
    # the negative control: the materialised path holds every position's and unit's logits
    with LargestStorage() as materialised:
        mtp_loss(head, hidden, tokens, materialise=True).loss.backward()
    windows = 2 * 47
    assert materialised.largest >= windows * head.input_units * categories * 4 \
        > 8 * max(own, derived, tile)
