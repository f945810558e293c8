"""Drafting from the context: the head's circuit mixed with a copy of an earlier continuation.

Small models, greedy ones above all, repeat themselves: identifiers, call patterns, whole lines
come back. Prompt-lookup drafting exploits that: find the last earlier place where the context's
final ``g`` tokens occurred and propose the ``m`` tokens that followed there. Here that proposal
is not a separate drafter but one more component of the draft's law, so that the round stays
exact and the head still drafts whenever the context has nothing to copy.

**The draft law.** With the proposal ``s_1..s_m`` (draft-vocabulary indices) and a weight ``w``
(:class:`ContextLookup` picks it from the matched length ``g``), a round drafts from the mixture

    P(d) = w * [d_1..d_m = s_1..s_m] * H(d_{>m})  +  (1 - w) * H(d)

where ``H`` is the head's circuit conditioned on ``X_0 = c``. The first component is the head's
circuit with its first ``m`` drafted variables replaced by indicator leaves at the proposal, a
product that respects any vtree, so the mixture is again a circuit over the window. Drawing from
it: one uniform picks the component (greedy: the proposal whenever there is one); the head's
joint draw supplies the rest. Its exact conditionals along the drafted path are

    q_k = pi_{k-1} * onehot(s_k) + (1 - pi_{k-1}) * h_k      (k <= m)
    q_k = h_k                                                (k > m, off the proposal)

with ``h_k = H(X_k | d_{<k})`` and the posterior of the copy component given the drafted prefix,
``pi_{k-1} = w [d_{<k} = s_{<k}] / (w [d_{<k} = s_{<k}] + (1 - w) H(d_{<k}))``. The accept test and
the residual use this ``q`` (:mod:`circuits_llm.decoding.round`).

**The verified length.** When the drafted prefix equals the whole proposal the round verifies at
most ``m`` drafts (the copy component says nothing useful after it). Whether position ``k`` is
verified is then decided by ``d_{<k}`` alone (for ``k <= m`` the cut never binds; for ``k > m`` it
reads ``d_1..d_m``), so the cut is a stopping time of the draft sequence and the argument of
:mod:`circuits_llm.decoding.draft_length` applies: the output law stays exactly the target's, and
the draft's law after the cut never matters. ``tests/test_context_lookup.py`` checks all of this
by enumeration on the toy LM, greedy and sampling, eager and compiled, with a compressed draft
vocabulary, and detects the bias of a decoder that forgets the mixture in ``q``.

Under a constraint's head x automaton product, which draws one draft at a time from its exact
conditionals, :class:`SequentialCopy` draws the mixture that way (with the product in place of
the head, the copy cut before its first token the automaton forbids). Drawn one variable at a
time, the copy component continues after its ``m`` tokens with the product's *conditional* given
them, not its marginal, so past the copy every conditional of the mixture is the product's own
``h_k`` (the posterior weight of the copy no longer matters there) and the round may verify the
whole window: no cut at ``m``. There a proposal may also carry tokens outside the head's draft
vocabulary (``ContextLookup.outside_vocabulary``): a draft that follows it to such a token
leaves the product and copies the proposal to its end, where the round's verification stops;
``q`` gets one extra column for the proposal's token (:class:`SequentialCopy`).

Under a constraint with ``PRODUCT`` drafting, a round whose copy proposes nothing draftable
may propose instead the constraint's own walk (:mod:`~circuits_llm.decoding.constraint_path`: the
text the automaton fixes from the current state, and at its open choices what the output chose
last time), with the weight ``ContextLookup.constraint_weight`` (0 by default: off); it is mixed
in exactly the same way, and :func:`~circuits_llm.decoding.constraint_path.round_component`
picks between the two from the verified output alone.

The index is incremental (:class:`LookupIndex`): each emitted token updates one dictionary entry
per n-gram length, and a proposal is ``max_ngram`` dictionary reads: host work of microseconds
per round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits.compiled.automaton_product import pick_category
from circuits_llm.decoding.warping import DecoderError

__all__ = ["ContextLookup", "LookupIndex", "SequentialCopy", "copy_component", "copy_posterior",
           "mixed_conditionals", "outside_entry", "proposal_component"]


@dataclass(frozen=True)
class ContextLookup:
    """Mix a copy of the context's earlier continuation into every round's draft (module
    docstring).

    Attributes:
        weights: the copy component's mixture weight ``w`` when the longest n-gram found has
            length ``g``: ``weights[g - 1]``, each in ``[0, 1]``. ``len(weights)`` is the longest
            n-gram searched. A weight of 0 never copies on a match of that length. Greedy rounds
            of the compiled draft program copy whenever the weight is above 0; greedy rounds
            under a constraint's product draft the mode of the mixture's conditionals
            (:class:`SequentialCopy`). The weight also enters the draft's conditionals, which a
            confident draft-length rule reads.
        constraint_weight: under a constraint with ``PRODUCT`` drafting, the weight of the
            constraint's own proposal (:mod:`~circuits_llm.decoding.constraint_path`: the text the
            automaton fixes from the current state, and at its open choices what the output chose
            last time), mixed in a round where the context copy proposes no draftable token.
            In ``[0, 1]``; 0 (default) never walks: on the constrained benchmark the walk was
            within the noise of the copy alone (``docs/journal.md`` section 9).
        outside_vocabulary: under a constraint with ``PRODUCT`` drafting, keep a proposal's
            tokens outside the head's draft vocabulary (drafted from the proposal alone, carried
            in one extra column of ``q``: :class:`SequentialCopy`) instead of cutting the
            proposal before the first of them (what the compiled free path always does).
    """

    weights: tuple[float, ...] = (0.1, 0.3, 0.5)
    constraint_weight: float = 0.0
    outside_vocabulary: bool = True

    def __post_init__(self) -> None:
        weights = self.weights
        if not isinstance(weights, tuple) or not weights:
            raise DecoderError(f"ContextLookup.weights must be a non-empty tuple of numbers in "
                               f"[0, 1] (one per n-gram length), got {weights!r}")
        for weight in weights:
            if isinstance(weight, bool) or not isinstance(weight, int | float) \
                    or not 0.0 <= weight <= 1.0:
                raise DecoderError(f"ContextLookup.weights must hold numbers in [0, 1], got "
                                   f"{weight!r} in {weights!r}")
        weight = self.constraint_weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) \
                or not 0.0 <= weight <= 1.0:
            raise DecoderError(f"ContextLookup.constraint_weight must be a number in [0, 1], got "
                               f"{weight!r}")
        if not isinstance(self.outside_vocabulary, bool):
            raise DecoderError(f"ContextLookup.outside_vocabulary must be a bool, got "
                               f"{self.outside_vocabulary!r}")

    @property
    def max_ngram(self) -> int:
        """The longest n-gram searched."""
        return len(self.weights)

    def describe(self) -> str:
        """A short label, e.g. ``"lookup 0.1/0.3/0.5"`` (``", constraint 0.5"`` after it with a
        walk, ``", cut at the draft vocabulary"`` without ``outside_vocabulary``)."""
        walk = f", constraint {self.constraint_weight:g}" if self.constraint_weight else ""
        cut = "" if self.outside_vocabulary else ", cut at the draft vocabulary"
        return "lookup " + "/".join(f"{w:g}" for w in self.weights) + walk + cut


class LookupIndex:
    """Where each n-gram of a token sequence last occurred with a token after it.

    ``tokens`` grows with :meth:`extend`; :meth:`propose` returns the continuation of the last
    earlier occurrence of the longest suffix n-gram (``max_ngram`` down to 1) that has one.
    """

    def __init__(self, max_ngram: int, tokens: Sequence[int] = ()) -> None:
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < 1:
            raise DecoderError(f"max_ngram must be an int >= 1, got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        #: n-gram length -> {n-gram: index of the token that followed its last occurrence}
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram)]
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens``; every n-gram they complete before another token is indexed."""
        for token in tokens:
            end = len(self.tokens)  # the new token's index: it follows the n-grams ending at end-1
            for length in range(1, min(self.max_ngram, end) + 1):
                self._next[length - 1][tuple(self.tokens[end - length:end])] = end
            self.tokens.append(int(token))

    def propose(self, limit: int) -> tuple[list[int], int]:
        """The continuation (``limit`` tokens) of the last earlier occurrence of the longest suffix
        n-gram that occurred before, and that n-gram's length ``g``; ``([], 0)`` when no suffix
        token occurred before. A continuation that reaches the end of the tokens goes on as the
        copy itself (an overlapping copy, as in LZ77): after ``a b a b`` the suffix ``a b``
        last occurred 2 tokens back, and the proposal is ``a b a b ...``."""
        end = len(self.tokens)
        for length in range(min(self.max_ngram, end), 0, -1):
            start = self._next[length - 1].get(tuple(self.tokens[end - length:]))
            if start is not None:  # copied with overlap: a period-p loop continues itself
                proposal = self.tokens[start:start + limit]
                while len(proposal) < limit:
                    proposal.append(proposal[len(proposal) - (end - start)])
                return proposal, length
        return [], 0


def copy_component(proposal: list[int], ngram: int, lookup: ContextLookup,
                   position: Sequence[int] | None, drafts: int, device: torch.device,
                   beyond: bool = False) -> Tensor:
    """The copy component of one round as the draft program's input: (drafts + 2,) float64
    ``[s_1..s_{n-1}, m, w]`` (the proposal as draft-vocabulary indices, zero-padded; ``m`` its
    length; ``w`` its weight).

    ``proposal``: model ids from :meth:`LookupIndex.propose`; ``ngram`` its matched length;
    ``position``: model id -> draft-vocabulary index (-1 outside it), ``None`` without a compressed
    vocabulary. The proposal is cut before its first token outside the draft vocabulary (the head's
    ``q`` lives on that vocabulary; the verifier's residual covers the rest), unless ``beyond``:
    then such a token ``t`` is kept as the entry ``-(t + 1)`` (:func:`outside_entry`), for the
    head x constraint drafter, which carries it in an extra column of ``q``
    (:class:`SequentialCopy`).
    """
    weight = lookup.weights[ngram - 1] if proposal else 0.0
    return proposal_component(proposal, weight, position, drafts, device, beyond)


def outside_entry(token: int) -> int:
    """A component's entry for the model id ``token`` outside the draft vocabulary: ``-(token +
    1)`` (negative, so never a draft-vocabulary index; its own inverse)."""
    return -token - 1


def proposal_component(proposal: list[int], weight: float, position: Sequence[int] | None,
                       drafts: int, device: torch.device, beyond: bool = False) -> Tensor:
    """:func:`copy_component` of any proposal (model ids) with its mixture weight ``weight``."""
    indices: list[int] = []
    for token in proposal[:drafts]:
        index = token if position is None else position[token]
        if index < 0:
            if not beyond:
                break
            index = outside_entry(token)
        indices.append(index)
    weight = weight if indices else 0.0
    values = indices + [0] * (drafts - len(indices)) + [len(indices), weight]
    return torch.tensor(values, dtype=torch.float64, device=device)


def unpack(component: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A copy component (n+1,) float64 -> ``(proposal (n-1,) long, m () long, w () float64)``."""
    drafts = component.shape[0] - 2
    return component[:drafts].long(), component[drafts].long(), component[-1]


def overlay(drafted: Tensor, component: Tensor, choose: Tensor | None) -> tuple[Tensor, Tensor]:
    """Draw from the mixture given the head's joint draw (fixed shapes, no host read).

    Args:
        drafted: (n-1,) long, the head's draw (draft-vocabulary indices).
        component: (n+1,) float64 from :func:`copy_component`.
        choose: () float64 uniform that picks the component when sampling (copy if below ``w``);
            ``None`` when greedy (copy whenever ``m > 0`` and ``w > 0``).

    Returns:
        ``(drafts (n-1,) long, cut () long)``: the mixture's draw, and the most drafts the round
        may verify: ``m`` when the draft starts with the whole proposal, else ``n - 1``.
    """
    drafts = drafted.shape[0]
    proposal, count, weight = unpack(component)
    active = (count > 0) & (weight > 0)
    copy = active & ((weight > choose) if choose is not None else torch.ones_like(active))
    inside = torch.arange(drafts, device=drafted.device) < count
    drafts_out = torch.where(copy & inside, proposal, drafted)
    on_path = active & ((drafts_out == proposal) | ~inside).all()
    cut = torch.where(on_path, count, torch.full_like(count, drafts))
    return drafts_out, cut


def copy_posterior(head: Tensor, drafts: Tensor, component: Tensor) -> Tensor:
    """(n-1,) float64 ``pi_{k-1}``: the copy component's posterior weight given the drafted prefix
    ``d_{<k}`` (module docstring; 0 off the proposal and after its ``m`` tokens). Arguments as
    :func:`mixed_conditionals`."""
    proposal, length, weight = unpack(component)
    steps = torch.arange(drafts.shape[0], device=drafts.device)
    drafted = head.gather(1, drafts[:, None])[:, 0].clamp_min(0).log()  # log h_k(d_k)
    before = torch.cat([drafted.new_zeros(1), drafted.cumsum(0)[:-1]])  # log H(d_{<k})
    matched = torch.cumprod((drafts == proposal).long(), 0)
    matched_before = torch.cat([matched.new_ones(1), matched[:-1]]).bool()  # d_{<k} = s_{<k}
    odds = torch.log(weight) - torch.log1p(-weight) - before  # log of w / ((1 - w) H(d_{<k}))
    return torch.where(matched_before & (steps < length) & (weight > 0), torch.sigmoid(odds), 0.0)


def mixed_conditionals(head: Tensor, drafts: Tensor, component: Tensor) -> Tensor:
    """The mixture's exact conditionals along the drafted path (module docstring).

    Args:
        head: (n-1, K) float64, the head's conditionals ``h_k = H(X_k | X_0 = c, d_{<k})``.
        drafts: (n-1,) long, the drafted path (draft-vocabulary indices).
        component: (n+1,) float64 from :func:`copy_component`.

    Returns:
        (n-1, K) float64 ``q_k = pi_{k-1} onehot(s_k) + (1 - pi_{k-1}) h_k``; ``pi`` is 0 off the
        proposal and after its ``m`` tokens.
    """
    pi = copy_posterior(head, drafts, component)
    onehot = torch.nn.functional.one_hot(unpack(component)[0], head.shape[1]).to(head.dtype)
    return pi[:, None] * onehot + (1 - pi[:, None]) * head


class SequentialCopy:
    """The mixture's draw one variable at a time, for a drafter that draws each draft from its
    conditional given the earlier ones (the head x constraint product,
    :class:`~circuits_llm.decoding.constrained.ProductDrafter`): a ``choose`` callback.

    Called with the drafter's conditional ``h_k`` (K,) for ``k = 1, 2, ..`` in turn, it returns
    the draft: the draw of the mixture's conditional ``q_k`` (:func:`mixed_conditionals`) at the
    round's uniform (inverse CDF), or when greedy its mode: the copy's ``s_k`` where
    ``pi_{k-1} + (1 - pi_{k-1}) h_k(s_k)`` is the largest entry (a weak copy, a 1-gram match at
    weight 0.1, then gives way to a product that is sure of another token), else the argmax of
    ``h_k``.

    The law drawn is ``w C + (1 - w) H`` with ``C = [d_{<=m} = s] H(d_{>m} | d_{<=m})``: after
    the copy's ``m`` tokens each conditional is the drafter's own, so every position of the
    window may be verified (no cut at ``m``; module docstring).

    **Tokens outside the draft vocabulary.** A proposal built with ``beyond``
    (:func:`copy_component`) may hold, from its ``j``-th token on, tokens the drafter cannot draw
    (entry ``-(t + 1)`` for the model id ``t``). Then ``C = [d_{<=m} = s]`` and nothing after
    ``m``: a draft that reaches row ``j`` on the proposal leaves the drafter there with the copy's
    posterior weight ``pi_{j-1}`` (the call returns None: the drafter stops), its rows ``j..m``
    are the proposal's tokens, and the round verifies at most ``m`` drafts (a stopping time: it
    is decided by ``d_{<=j}``). Every row's law then has one entry more than the draft vocabulary
    (:meth:`conditionals`: ``(n-1, K + 1)``, column ``K`` the model id :meth:`extra` names): row
    ``j`` is ``(1 - pi) h_j`` on the vocabulary plus ``pi`` on ``s_j``, and rows after ``j``
    put 1 on ``s_k``. When the drafter's state before row ``j`` has no draftable token
    (``free_outside``: its draft there would end the verified part), row ``j`` is verified only
    on the proposal, so its law given that it is verified is the point mass at ``s_j``.

    Args:
        component: (n+1,) float64 from :func:`copy_component`, its proposal already cut to
            drafts the drafter can make (and, beyond them, to tokens the constraint allows).
        uniforms: (n-1,) float64 in [0, 1) (sampling) or None (greedy).
        draft_tokens: (K,) long, draft-vocabulary index -> model id (None: the identity).
        free_outside: the drafter's state before the proposal's first token outside the draft
            vocabulary has no draftable token.
    """

    def __init__(self, component: Tensor, uniforms: Tensor | None,
                 draft_tokens: Tensor | None = None, free_outside: bool = False) -> None:
        self.component = component.cpu()
        self.drafts = component.shape[0] - 2
        self.uniforms = None if uniforms is None else uniforms.tolist()
        self.path: list[int] = []
        self.free_outside = free_outside
        proposal, count, weight = unpack(self.component)
        self._proposal: list[int] = proposal[:int(count)].tolist()
        self._weight = float(weight)
        #: the proposal's model ids
        self.tokens = [outside_entry(entry) if entry < 0 else
                       entry if draft_tokens is None else int(draft_tokens[entry])
                       for entry in self._proposal]
        #: the row where the draw left the draft vocabulary on the proposal (None: it did not)
        self.outside: int | None = None
        #: ``log H(d_{<k})``: the drafter's log-probability of the drafts so far
        self._log_path = 0.0
        #: the mixture's conditional of each row drawn so far, (K + 1,) each
        self._mixed: list[Tensor] = []
        #: the draft vocabulary's size K (known from the first row)
        self.size = 0

    def copy_weight(self) -> float:
        """``pi_{k-1}`` before the next row ``k = len(path) + 1``: the copy's posterior weight
        given the drafts so far (0 off the proposal and past its end); :func:`copy_posterior`'s
        value, kept as a running sum instead of recomputed over the window."""
        k, weight = len(self.path), self._weight
        if weight <= 0.0 or k >= len(self._proposal) or self.path != self._proposal[:k]:
            return 0.0
        if weight >= 1.0:
            return 1.0
        odds = math.log(weight) - math.log1p(-weight) - self._log_path  # log w / ((1 - w) H)
        return 1.0 / (1.0 + math.exp(-odds)) if odds >= 0 else math.exp(odds) / (1.0 + math.exp(odds))

    def __call__(self, conditional: Tensor) -> int | None:
        k = len(self.path)
        head = conditional.cpu().double()
        size = self.size = head.shape[0]
        pi = self.copy_weight()
        row = torch.cat([(1 - pi) * head, head.new_zeros(1)])  # (K + 1,): column K outside
        if pi > 0.0:
            entry = self._proposal[k]
            row[entry if entry >= 0 else size] += pi
        self._mixed.append(row)
        if self.uniforms is None:  # the mode of the mixture's conditional
            pick = int(row.argmax())
        else:
            pick = pick_category(row, self.uniforms[k], None)
            assert pick is not None
        if pick == size:  # the proposal's token outside the vocabulary
            self.outside = k
            return None
        self.path.append(pick)
        probability = float(head[pick])
        self._log_path += math.log(probability) if probability > 0 else -math.inf
        return pick

    def tail(self) -> list[int]:
        """After the draw left the vocabulary: the proposal's model ids from that row on."""
        assert self.outside is not None
        return self.tokens[self.outside:]

    def extra(self) -> Tensor:
        """(n-1,) long: the model id column ``K`` of :meth:`conditionals` stands for, per row
        (the proposal's token; 0 after it)."""
        ids = self.tokens
        return torch.tensor(ids + [0] * (self.drafts - len(ids)), dtype=torch.long)

    def conditionals(self) -> Tensor:
        """(n-1, K + 1) the mixture's conditionals along the drawn path, the rows the draw drew
        from (rows after it: zero; class docstring)."""
        size = self.size
        out = torch.zeros(self.drafts, size + 1, dtype=torch.float64)
        if self._mixed:
            out[:len(self._mixed)] = torch.stack(self._mixed)
        if self.outside is None:
            return out
        j = self.outside
        if self.free_outside:
            out[j] = 0.0
            out[j, size] = 1.0
        out[j + 1:len(self.tokens), size] = 1.0
        return out
