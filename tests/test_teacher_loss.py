"""The loss against the LM's own law (``mtp_loss(..., teacher=TeacherLaw(...))``).

* the cross-entropy of every window slot to the teacher's top-k law equals brute-force
  enumeration of the head's joint law (float64; FF, HMM, BTree; FULL and LEAN; a compressed draft
  vocabulary; heads that read the verified token), on the tiled training pass and on the
  materialised reference path, gradients included;
* temperature 0 with the data's own tokens as the argmax gives back the token loss exactly;
  weight 0 gives back the plain loss; the whole vocabulary at temperature 1 is the full
  cross-entropy;
* ``target_log_softmax`` with several categories per unit; clear errors.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_token_input import RANKS, token_head

from circuits.errors import InvalidInputError
from circuits_llm.heads import MTPHead
from circuits_llm.heads.chunked import FullTiles, LeanTiles, target_log_softmax
from circuits_llm.heads.vocab import draft_positions
from circuits_llm.protocols import draft_parameters
from circuits_llm.training.loss import _window_pass, mtp_loss
from circuits_llm.training.teacher import TeacherLaw

pytestmark = pytest.mark.filterwarnings("ignore::circuits_llm.heads.sizing.HeadBudgetWarning")
WINDOW, VOCAB, HIDDEN = 3, 9, 6
DRAFT = (5, 1, 0, 7, 2)


def plain_head(architecture: str, variant: str, draft: tuple[int, ...] | None,
               seed: int = 0) -> MTPHead:
    """A float64 head that does not read the token, every parameter random."""
    generator = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    head = MTPHead.from_name(architecture, WINDOW, RANKS[architecture], HIDDEN, VOCAB, variant,
                             lm_head, draft_vocab=draft, dtype=torch.float64, seed=seed)
    with torch.no_grad():
        for parameter in head.parameters():
            if parameter.requires_grad:
                parameter.copy_(torch.randn(parameter.shape, generator=generator,
                                            dtype=parameter.dtype))
    return head.eval()


def make_head(architecture: str, variant: str, draft: tuple[int, ...] | None,
              reads_token: bool) -> MTPHead:
    if reads_token:
        return token_head(HIDDEN, VOCAB, architecture, WINDOW, draft, variant, seed=2)
    return plain_head(architecture, variant, draft, seed=2)


def enumerated_ce(head: MTPHead, hidden: torch.Tensor, tokens: torch.Tensor,
                  teacher: TeacherLaw) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, n) cross-entropy of every slot to the teacher's top-k law, and its validity, from
    the head's joint law enumerated over every window assignment."""
    batch, length = tokens.shape
    categories = head.draft_vocab_size
    draft = getattr(head, "draft_tokens", None)
    index = tokens if draft is None else draft_positions(draft, VOCAB)[tokens]
    law = torch.log_softmax(teacher.logits / teacher.temperature, -1) \
        if teacher.temperature > 0 else None
    every = torch.tensor(list(itertools.product(range(categories), repeat=WINDOW)))
    ce = torch.zeros(batch, length, WINDOW, dtype=torch.float64)
    valid = torch.zeros(batch, length, WINDOW, dtype=torch.bool)
    for b, t in itertools.product(range(batch), range(length)):
        if t + 1 >= length or (head.reads_token and int(index[b, t + 1]) < 0):
            continue  # no window, or the token it reads is outside the draft vocabulary
        params = draft_parameters(head, hidden[b, t][None], index[b, t + 1][None].clamp_min(0))
        repeated = {k: v.expand(len(every), *v.shape[1:]) for k, v in params.items()}
        joint = head.circuit.log_likelihood(every, params=repeated)  # (C^n,) log q
        for j in range(WINDOW):
            if t + j + 1 >= length or bool((index[b, t + 1:t + j + 1] < 0).any()):
                continue
            prefix = index[b, t + 1:t + j + 1]
            match = (every[:, :j] == prefix).all(1)
            slot = torch.stack([joint[match & (every[:, j] == c)].logsumexp(0)
                                for c in range(categories)])
            log_cond = slot - slot.logsumexp(0)
            if law is None:
                top = teacher.logits[b, t + j].argmax()[None]
                prob = torch.ones(1, dtype=torch.float64)
            else:
                values, top = law[b, t + j].topk(min(teacher.top_k, categories))
                prob = values.exp()
            ce[b, t, j] = -(prob * log_cond[top]).sum()
            valid[b, t, j] = True
    return ce, valid


CASES = [(a, v, d, r) for a in RANKS for v in ("full", "lean") for d in (None, DRAFT)
         for r in (False, True)]


@pytest.mark.parametrize(("architecture", "variant", "draft", "reads_token"), CASES,
                         ids=[f"{a}-{v}-{'compressed' if d else 'full'}-{'token' if r else 'plain'}"
                              for a, v, d, r in CASES])
def test_teacher_cross_entropy_equals_enumeration(architecture: str, variant: str,
                                                  draft: tuple[int, ...] | None,
                                                  reads_token: bool) -> None:
    head = make_head(architecture, variant, draft, reads_token)
    generator = torch.Generator().manual_seed(5)
    batch, length = 2, 6
    hidden = torch.randn(batch, length, HIDDEN, generator=generator, dtype=torch.float64)
    tokens = torch.randint(0, VOCAB, (batch, length), generator=generator)
    logits = 2 * torch.randn(batch, length, head.draft_vocab_size, generator=generator,
                             dtype=torch.float64)
    teacher = TeacherLaw(logits, top_k=3, temperature=0.7)
    want, want_valid = enumerated_ce(head, hidden, tokens, teacher)
    for materialise in (False, True):
        got = _window_pass(head, hidden, tokens, None, 5, materialise, teacher)
        assert got.teacher_valid is not None and got.teacher_ce is not None
        assert torch.equal(got.teacher_valid, want_valid)
        torch.testing.assert_close(got.teacher_ce, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("architecture", list(RANKS))
def test_teacher_gradients_match_the_materialised_path(architecture: str) -> None:
    head = make_head(architecture, "lean", DRAFT, reads_token=True)
    generator = torch.Generator().manual_seed(8)
    hidden = torch.randn(2, 5, HIDDEN, generator=generator, dtype=torch.float64)
    tokens = torch.tensor([[5, 1, 0, 7, 2], [1, 1, 3, 0, 5]])
    teacher = TeacherLaw(torch.randn(2, 5, len(DRAFT), generator=generator, dtype=torch.float64),
                         top_k=2, temperature=1.3, weight=0.6)
    grads = []
    for materialise in (False, True):
        head.zero_grad()
        mtp_loss(head, hidden, tokens, teacher=teacher, chunk_rows=4,
                 materialise=materialise).loss.backward()
        grads.append({n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, value in grads[0].items():
        torch.testing.assert_close(value, grads[1][name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("architecture", list(RANKS))
def test_greedy_teacher_at_the_data_tokens_is_the_token_loss(architecture: str) -> None:
    head = make_head(architecture, "full", None, reads_token=False)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (3, 7), generator=generator)
    hidden = torch.randn(3, 7, HIDDEN, generator=generator, dtype=torch.float64)
    # logits[b, t] peak at x_{t+1}: the greedy law is the data's next token
    logits = torch.randn(3, 7, VOCAB, generator=generator, dtype=torch.float64)
    logits[:, :-1].scatter_(-1, tokens[:, 1:, None], 50.0)
    plain = mtp_loss(head, hidden, tokens)
    distilled = mtp_loss(head, hidden, tokens, teacher=TeacherLaw(logits, temperature=0.0))
    assert distilled.teacher_nll is not None and plain.teacher_nll is None
    torch.testing.assert_close(distilled.teacher_nll, plain.nll, rtol=0, atol=1e-12)
    torch.testing.assert_close(distilled.loss, plain.loss, rtol=0, atol=1e-12)
    unweighted = mtp_loss(head, hidden, tokens, teacher=TeacherLaw(logits, weight=0.0))
    torch.testing.assert_close(unweighted.loss, plain.loss, rtol=0, atol=1e-12)


def test_the_whole_vocabulary_is_the_full_cross_entropy() -> None:
    head = make_head("btree", "full", None, reads_token=False)
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (1, 5), generator=generator)
    hidden = torch.randn(1, 5, HIDDEN, generator=generator, dtype=torch.float64)
    logits = torch.randn(1, 5, VOCAB, generator=generator, dtype=torch.float64)
    got = _window_pass(head, hidden, tokens, None, None, False, TeacherLaw(logits, top_k=VOCAB))
    assert got.teacher_ce is not None
    # slot 0 of the window at t is x_{t+1}, with no prefix: sum_c p(c) (-log q_t(c))
    for t in range(4):
        params = head(hidden[0, t][None])
        x = torch.arange(VOCAB)[:, None].expand(VOCAB, WINDOW)
        observed = torch.tensor([True, False, False]).expand(VOCAB, WINDOW)
        repeated = {k: v.expand(VOCAB, *v.shape[1:]) for k, v in params.items()}
        log_q = head.circuit.log_marginal(x, observed, params=repeated)
        want = -(torch.softmax(logits[0, t], -1) * log_q).sum()
        torch.testing.assert_close(got.teacher_ce[0, t, 0], want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["full", "lean"])
def test_target_log_softmax_reads_several_categories(kind: str) -> None:
    generator = torch.Generator().manual_seed(6)
    positions, units, categories, dim = 5, 3, 7, 4
    hidden = torch.randn(positions, dim, generator=generator, dtype=torch.float64,
                         requires_grad=True)
    if kind == "full":
        weight = torch.randn(units, categories, dim, generator=generator, dtype=torch.float64,
                             requires_grad=True)
        tiled = FullTiles(hidden, weight, None)
        logits = torch.einsum("sd,ukd->suk", hidden, weight)
    else:
        lm_head = torch.randn(categories, dim, generator=generator, dtype=torch.float64)
        codes = torch.randn(positions, units, 2, generator=generator, dtype=torch.float64,
                            requires_grad=True)
        up = torch.randn(units, 2, categories, generator=generator, dtype=torch.float64,
                         requires_grad=True)
        tiled = LeanTiles(hidden, lm_head, codes, up, None)
        logits = (hidden @ lm_head.T)[:, None, :] + torch.einsum("sur,urk->suk", codes, up)
    targets = torch.randint(0, categories, (positions, units, 4), generator=generator)
    got = target_log_softmax(tiled, targets, 4)
    want = torch.log_softmax(logits, -1).gather(-1, targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    upstream = torch.randn(got.shape, generator=generator, dtype=torch.float64)
    mine = torch.autograd.grad((got * upstream).sum(), tiled.inputs[0])
    theirs = torch.autograd.grad((want * upstream).sum(), tiled.inputs[0])
    torch.testing.assert_close(mine[0], theirs[0], rtol=0, atol=1e-12)


def test_teacher_errors_are_clear() -> None:
    head = make_head("ff", "full", DRAFT, reads_token=False)
    tokens = torch.tensor([[5, 1, 0, 7]])
    hidden = torch.randn(1, 4, HIDDEN, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match=r"draft vocabulary of a compressed head"):
        mtp_loss(head, hidden, tokens, teacher=TeacherLaw(torch.randn(1, 4, VOCAB)))
    for kwargs, message in (({"top_k": 0}, "top_k"), ({"temperature": -1.0}, "temperature"),
                            ({"weight": 1.5}, "weight"), ({"temperature": float("nan")},
                                                          "temperature")):
        with pytest.raises(InvalidInputError, match=message):
            TeacherLaw(torch.randn(1, 4, 5), **kwargs)
    with pytest.raises(InvalidInputError, match="float"):
        TeacherLaw(torch.zeros(1, 4, 5, dtype=torch.long))
