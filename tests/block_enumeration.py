"""Brute-force enumerators of a draft block's decoding law (issue 44), for the tests of the block's
drafters with the decoder's modes (tests/test_draft_block_modes.py).

Each returns the exact law of the first ``length`` tokens a :class:`SpeculativeDecoder` with the
drafter emits, as ``{tokens: probability}`` (float64), written out from the definitions and
independently of the decoder's code paths: the block's output for every history comes from a fresh
prefill of the block (:func:`draft_block_models.fresh_first_step`), every draft is weighted by the
drafter's law, verified up to the draft-length rule's ``L`` (and the copy's cut), and accepted by
:func:`~circuits_llm.decoding.acceptance.round_law` with the ``q`` the round would use. A
``wrong_q`` flag gives each enumerator's negative control (a ``q`` the decoder must not use), whose
law the tests tell apart from the target's.

* :func:`circuit_law`: a circuit on the block, with a rule and the copy of the context;
* :func:`recursive_law`: the recursive block, with a rule, the copy and a constraint
  (``PRODUCT`` or ``FREE`` drafting);
* :func:`circuit_constrained_law`: a circuit on the block under a constraint;
* :func:`constrained_law`: the constrained decoder's law from any drafter's enumerated drafts
  (forced runs, masked target rows, EOS);
* :func:`pooled`: samples and a law with their small cells merged, for a chi-square test.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from draft_block_models import fresh_first_step
from toy import Law, _copy_mixture, add_outcomes, continuation_law, stand_in_marginal
from toy_constrained import _forced_run, _masked_rows, _product_drafts
from transformers import LlamaForCausalLM

from circuits_llm.constraints import TokenAutomaton
from circuits_llm.decoding.acceptance import CorrectionPolicy, round_law, usable_conditionals
from circuits_llm.decoding.constrained import ConstrainedDrafting, ProductDrafter
from circuits_llm.decoding.constraint_path import round_component
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup, LookupIndex
from circuits_llm.decoding.warping import SamplingConfig, target_probs, warp_logits
from circuits_llm.draft_block import BlockCircuitDrafter, BlockDrafter, DraftBlock

#: every draft of one round: ``(tokens (n-1,) model ids, q (n-1, V) the conditionals it is
#: accepted with, L the drafts verified, probability)``
Drafts = list[tuple[torch.Tensor, torch.Tensor, int, float]]


def state_after(automaton: TokenAutomaton, tokens: Sequence[int]) -> int:
    """The state of ``automaton`` after ``tokens`` from its initial state (each token must be
    allowed where it comes)."""
    state = automaton.initial_state
    for token in tokens:
        state = automaton.advance(state, token)
    return state



def copy_fires(lookup: ContextLookup, prompt: Sequence[int]) -> bool:
    """Whether the copy of the context proposes a draft after ``prompt`` (so that a law with
    ``lookup`` really mixes it in from the first round)."""
    proposal, _ = LookupIndex(lookup.max_ngram, prompt).propose(2)
    return bool(proposal)



def circuit_law(drafter: BlockCircuitDrafter, model: LlamaForCausalLM, prompt: Sequence[int],
                length: int, config: SamplingConfig, rule: DraftLength | None,
                lookup: ContextLookup | None, wrong_q: bool = False,
                lengths: list[int] | None = None) -> Law:
    """The decoder's law of ``length`` tokens after ``prompt`` with a circuit on the block over the
    target ``model``, enumerated: every draft weighted by the
    head's conditionals on the block's output (mixed with the copy, written out from the mixture's
    definition: ``toy._copy_mixture``), verified up to the rule's ``L`` and the copy's cut;
    ``wrong_q``: accepted with the head's conditionals without the copy (with a copy) or on the
    backbone's feature (without). ``lengths`` collects every draft's verified length."""
    program = drafter.round_program(config, draft_length=rule)
    ids = drafter.draft_tokens
    assert ids is not None
    window, vocab = drafter.window, model.config.vocab_size
    drafts = torch.tensor(list(itertools.product(range(len(ids)), repeat=window - 1)))

    def round_outcomes(sequence: tuple[int, ...]) -> Law:
        outcomes: Law = defaultdict(float)
        output, feature, _ = fresh_first_step(drafter.block, model, sequence)
        c = sequence[-1]
        branches = [(None, 1.0)] if c in ids.tolist() else \
            list(enumerate(stand_in_marginal(program, output, c).tolist()))
        for stand_in, prior in branches:
            compact = program.conditionals(output, c, drafts, stand_in=stand_in)
            probs = compact.gather(2, drafts[:, :, None])[:, :, 0].prod(1)
            cuts = torch.full((len(drafts),), window - 1)
            accept = program.conditionals(feature, c, drafts, stand_in=stand_in) \
                if wrong_q and lookup is None else compact
            if lookup is not None:
                probs, cuts, component = _copy_mixture(sequence, lookup, ids, vocab, drafts, probs)
                if not wrong_q:
                    accept = compact = program.conditionals(output, c, drafts, component,
                                                            stand_in=stand_in)
            for index, rows, accept_rows, weight, cut in zip(
                    drafts, compact, accept, (prior * probs).tolist(), cuts.tolist(), strict=True):
                if weight <= 0:
                    continue
                verified = window - 1 if rule is None else \
                    int(rule.decide(usable_conditionals(rows), index))
                verified = min(verified, cut)
                if lengths is not None:
                    lengths.append(verified)
                draft = ids[index]
                q = torch.zeros(window - 1, vocab, dtype=torch.float64)
                q[:, ids] = accept_rows
                with torch.no_grad():
                    logits = model(torch.tensor([[*sequence, *draft.tolist()]])).logits[0]
                p = target_probs(logits[-window:], config)
                add_outcomes(outcomes, round_law(p[:verified + 1], q[:verified], draft[:verified]),
                             draft[:verified], CorrectionPolicy.EXACT, weight)
        return outcomes

    return continuation_law(round_outcomes, prompt, length)



def recursive_law(block: DraftBlock, model: LlamaForCausalLM, prompt: Sequence[int],
                  length: int, config: SamplingConfig, rule: DraftLength | None = None,
                  automaton: TokenAutomaton | None = None,
                  drafting: ConstrainedDrafting = ConstrainedDrafting.PRODUCT,
                  lookup: ContextLookup | None = None, wrong_q: bool = False,
                  lengths: list[int] | None = None, exit_below: float | None = None,
                  exit_by_component: bool = False) -> Law:
    """The recursive block's law, enumerated: each step's law ``h_k`` from a fresh prefill of the
    block and the recursion's own steps (under a constraint with ``PRODUCT`` drafting restricted
    to the allowed draft-vocabulary tokens and renormalised, the recursion stopping before a state
    with none), verified up to the rule's ``L`` on the (masked) target rows, with the forced runs
    after a product draft.

    ``lookup``: the copy mixed in, written out from its definition: the law of a draft path ``d``
    is ``(1 - w) H(d) + w [d_{<=m} = s] prod_{k > m} h_k(d_k)`` (the proposal ``s``, cut before
    its first token outside the draft vocabulary or, under ``PRODUCT``, forbidden), and ``q`` its
    conditionals by brute-force prefix sums over every path.

    ``wrong_q`` (the negative controls): accepted with the recursion's own ``h`` (with a copy),
    the unrestricted law (under ``PRODUCT``), or the block's readout of the backbone's feature
    instead of its own output. ``lengths`` collects every draft's verified length.

    ``exit_below`` (``BlockDrafter(sampled_exit=)``): a round stops drafting after a draft whose
    step law (the block's, unwarped, restricted under ``PRODUCT``) gives its argmax less than
    this, unless the drafts so far follow the copy's proposal; each component's mass goes to the
    prefix where it stops, and ``q`` stays the mixture's conditionals. ``exit_by_component`` (the
    negative control): the exit spares the drafts the copy *chose* instead, a rule that reads
    which component drew them, under which that ``q`` is no longer the law of the next draft."""
    ids = torch.arange(model.config.vocab_size) if block.draft_tokens is None \
        else block.draft_tokens
    window, vocab, size = block.window, model.config.vocab_size, len(ids)
    restrict = automaton is not None and drafting is ConstrainedDrafting.PRODUCT

    def law_of(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(warp_logits(logits, config).double(), -1)

    def copy_of(sequence: tuple[int, ...], state: int) -> tuple[list[int], float]:
        """The proposal as draft-vocabulary indices, and its weight (0: no copy)."""
        proposal, ngram = ([], 0) if lookup is None else \
            LookupIndex(lookup.max_ngram, sequence).propose(window - 1)
        kept: list[int] = []
        for token in proposal:
            if token not in ids.tolist() or (restrict and token not in  # type: ignore[union-attr]
                                             automaton.allowed(state).tolist()):
                break
            if restrict:
                state = automaton.advance(state, token)  # type: ignore[union-attr]
            kept.append(ids.tolist().index(token))
        return kept, lookup.weights[ngram - 1] if kept and lookup is not None else 0.0

    def drafts_of(sequence: tuple[int, ...], state: int) -> Drafts:
        drafter = BlockDrafter(block)
        first, feature, _ = fresh_first_step(block, model, sequence, drafter)
        with torch.no_grad():  # a negative control's law: the block's readout of the feature
            stale = law_of(block.logits(block.read_features(feature))[0])
        paths: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[float]]] = []

        def expand(output: torch.Tensor, index: list[int], rows: list[torch.Tensor],
                   wrong: list[torch.Tensor], state: int, peaks: list[float]) -> None:
            step = len(index)
            if step < window - 1:
                with torch.no_grad():
                    logits = block.logits(output)[0]
                allowed = torch.ones(size, dtype=torch.bool)
                if restrict:
                    allowed = torch.isin(ids, automaton.allowed(state))  # type: ignore[union-attr]
                if bool(allowed.any()):
                    masked = logits.masked_fill(~allowed, float("-inf"))
                    law = law_of(masked)
                    peak = float(torch.softmax(masked.double(), -1).max())  # unwarped
                    other = law_of(logits) if restrict else stale
                    for x in allowed.nonzero()[:, 0].tolist():  # every allowed token: the copy's too
                        token = int(ids[x])
                        after = automaton.advance(state, token) if restrict else state  # type: ignore[union-attr]
                        nxt = output
                        if step < window - 2:
                            drafter.cache.truncate(drafter.length + step)
                            with torch.no_grad():
                                nxt = drafter.next_step(output, torch.tensor([token]))
                        expand(nxt, [*index, x], [*rows, law], [*wrong, other], after,
                               [*peaks, peak])
                    return
            paths.append((index, rows, wrong, peaks))

        expand(first, [], [], [], state, [])
        copy, weight = copy_of(sequence, state)

        def masses(index: list[int], rows: list[torch.Tensor]) -> tuple[float, float]:
            """The whole path's mass under the recursion and under the copy."""
            drawn = [float(row[x]) for row, x in zip(rows, index, strict=True)]
            own = float(torch.tensor(drawn, dtype=torch.float64).prod())
            copied = index[:len(copy)] == copy and len(index) >= len(copy)
            tail = float(torch.tensor(drawn[len(copy):], dtype=torch.float64).prod())
            return (1 - weight) * own, (weight * tail if copied else 0.0)

        def stop(index: list[int], peaks: list[float], chose_copy: bool) -> int:
            """The drafts a round of this path draws before its exit."""
            for k in range(len(index) - 1):
                spared = (chose_copy and k < len(copy)) if exit_by_component else \
                    (k < len(copy) and index[:k + 1] == copy[:k + 1])
                if exit_below is not None and not spared and peaks[k] < exit_below:
                    return k + 1
            return len(index)

        prefix: dict[tuple[int, ...], float] = defaultdict(float)
        stopped: dict[tuple[int, ...], float] = defaultdict(float)  # mass by drafted prefix
        kept: dict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for index, rows, wrong, peaks in paths:
            own, copied = masses(index, rows)
            for k in range(len(index) + 1):
                prefix[tuple(index[:k])] += own + copied
            for m, chose_copy in ((own, False), (copied, True)):
                reach = stop(index, peaks, chose_copy)
                stopped[tuple(index[:reach])] += m
                kept[tuple(index[:reach])] = (rows[:reach], wrong[:reach])
        leaves: Drafts = []
        for drafted, m in stopped.items():
            index, (rows, wrong) = list(drafted), kept[drafted]
            if m <= 0:
                continue
            reachable, pad = len(index), window - 1 - len(index)
            mixed = [torch.tensor([prefix[(*index[:k], x)] for x in range(size)],
                                  dtype=torch.float64) / prefix[tuple(index[:k])]
                     for k in range(reachable)]
            zeros = [torch.zeros(size, dtype=torch.float64)] * pad
            index_t = torch.tensor(index + [0] * pad, dtype=torch.long)
            compact = torch.stack(mixed + zeros)
            verified = window - 1 if rule is None else int(rule.decide(compact, index_t))
            verified = min(verified, reachable)
            if lengths is not None:
                lengths.append(verified)
            accepted = compact if not wrong_q else \
                torch.stack((rows if lookup is not None else wrong) + zeros)
            q = torch.zeros(window - 1, vocab, dtype=torch.float64)
            q[:, ids] = accepted
            leaves.append((ids[index_t], q, verified, m))
        return leaves

    if automaton is None:
        def round_outcomes(sequence: tuple[int, ...]) -> Law:
            outcomes: Law = defaultdict(float)
            for tokens, q, verified, weight in drafts_of(sequence, -1):
                with torch.no_grad():
                    logits = model(torch.tensor([[*sequence, *tokens.tolist()]])).logits[0]
                p = target_probs(logits[-window:], config)
                add_outcomes(outcomes, round_law(p[:verified + 1], q[:verified],
                                                 tokens[:verified]),
                             tokens[:verified], CorrectionPolicy.EXACT, weight)
            return outcomes

        return continuation_law(round_outcomes, prompt, length)
    return constrained_law(model, automaton, prompt, length, config, drafts_of,
                           forced=drafting is ConstrainedDrafting.PRODUCT)



def constrained_law(model: LlamaForCausalLM, automaton: TokenAutomaton, prompt: Sequence[int],
                    length: int, config: SamplingConfig,
                    drafts_of: Callable[[tuple[int, ...], int], Drafts], forced: bool) -> Law:
    """The decoder's law under ``automaton`` (whose states :func:`state_after` walks), enumerated
    from ``drafts_of(sequence, state)``
    (every draft after ``sequence``: tokens (n-1,), q (n-1, V), L, probability): each verified on
    the target rows masked along the draft, with the forced run after it (``forced``: PRODUCT
    drafting), each outcome moved as the decoder moves; decoding ends after the automaton's EOS
    (``toy_constrained.constrained_decoder_law``'s verification, with the drafts given)."""
    rounds: dict[tuple[int, ...], Law] = {}
    eos = automaton.eos_token_id

    def round_outcomes(sequence: tuple[int, ...]) -> Law:
        if sequence in rounds:
            return rounds[sequence]
        outcomes: Law = defaultdict(float)
        state = state_after(automaton, sequence[len(prompt):])
        for tokens, q, verified, weight in drafts_of(sequence, state):
            draft = tokens[:verified]
            run = _forced_run(automaton, state, draft.tolist(), tokens.numel() + 1) \
                if forced else []
            block = [*draft.tolist(), *run]
            with torch.no_grad():
                logits = model(torch.tensor([[*sequence, *block]])).logits[0, -len(block) - 1:]
            p = target_probs(_masked_rows(logits, automaton, state, block), config)
            law = round_law(p[:verified + 1], q[:verified], draft)
            if not run:
                add_outcomes(outcomes, law, draft, CorrectionPolicy.EXACT, weight)
                continue
            probs, tail = law.outcome_probs(), p[verified + len(run)]
            for s, y in probs.nonzero().tolist():
                mass = weight * float(probs[s, y])
                if s < verified:
                    outcomes[(*draft[:s].tolist(), y)] += mass
                    continue
                assert y == run[0], (y, run)
                for z in tail.nonzero()[:, 0].tolist():
                    outcomes[(*block, z)] += mass * float(tail[z])
        rounds[sequence] = dict(outcomes)
        return rounds[sequence]

    def continuation(sequence: tuple[int, ...], remaining: int) -> Law:
        result: Law = defaultdict(float)
        for emitted, prob in round_outcomes(sequence).items():
            kept = emitted[:remaining]
            if eos in kept:
                kept = kept[:kept.index(eos) + 1]
            if kept[-1:] == (eos,) or len(kept) == remaining:
                result[kept] += prob
                continue
            for tail, tail_prob in continuation(sequence + emitted,
                                                remaining - len(emitted)).items():
                result[emitted + tail] += prob * tail_prob
        return result

    return dict(continuation(tuple(prompt), length))



def circuit_constrained_law(drafter: BlockCircuitDrafter, model: LlamaForCausalLM,
                            automaton: TokenAutomaton, prompt: Sequence[int], length: int,
                            config: SamplingConfig, drafting: ConstrainedDrafting,
                            lookup: ContextLookup | None = None, wrong_q: bool = False) -> Law:
    """The law of a circuit on the block over the target ``model`` under ``automaton``,
    enumerated with :func:`constrained_law`: ``PRODUCT``: the
    tree of the head-times-automaton conditionals on the block's output (with the copy mixed in:
    ``toy_constrained._product_drafts``; ``wrong_q``: accepted with the product's own conditionals
    instead of the mixture's); ``FREE``: the head's conditionals on the block's output
    (``wrong_q``: on the backbone's feature)."""
    head = drafter.head
    program = drafter.round_program(config)
    window, vocab = drafter.window, model.config.vocab_size
    ids = torch.arange(vocab) if drafter.draft_tokens is None else drafter.draft_tokens
    product = ProductDrafter(head, automaton) if drafting is ConstrainedDrafting.PRODUCT else None
    every = torch.tensor(list(itertools.product(range(len(ids)), repeat=window - 1)))

    def drafts_of(sequence: tuple[int, ...], state: int) -> Drafts:
        output, feature, _ = fresh_first_step(drafter.block, model, sequence)
        c = sequence[-1]
        if product is not None:
            with torch.no_grad():
                params = head.circuit.log_parameters(  # type: ignore[attr-defined]
                    program.head_parameters(output, torch.tensor([c])))
            component = None
            if lookup is not None:
                component = round_component(lookup, LookupIndex(lookup.max_ngram, sequence), None,
                                            state, product.position.tolist(), window - 1,
                                            torch.device("cpu"), lookup.outside_vocabulary)
            return _product_drafts(product, params, c, state, config.greedy, component,
                                   mixed_q=not wrong_q)
        branches = [(None, 1.0)] if c in ids.tolist() else \
            list(enumerate(stand_in_marginal(program, output, c).tolist()))
        leaves: Drafts = []
        for stand_in, prior in branches:
            compact = program.conditionals(output, c, every, stand_in=stand_in)
            accept = program.conditionals(feature, c, every, stand_in=stand_in) if wrong_q \
                else compact
            probs = prior * compact.gather(2, every[:, :, None])[:, :, 0].prod(1)
            for index, rows, weight in zip(every, accept, probs.tolist(), strict=True):
                q = torch.zeros(window - 1, vocab, dtype=torch.float64)
                q[:, ids] = rows
                if weight > 0:
                    leaves.append((ids[index], q, window - 1, weight))
        return leaves

    return constrained_law(model, automaton, prompt, length, config, drafts_of,
                           forced=product is not None)



def pooled(samples: list[tuple[int, ...]], law: Law, minimum: float = 5.0
            ) -> tuple[list[tuple[int, ...]], Law]:
    """``samples`` and ``law`` with the cells whose expected count is below ``minimum`` merged
    into one (what the chi-square approximation needs); samples outside the law fail."""
    assert set(samples) <= set(law), "a sample outside the constrained law's support"
    small = {k for k, p in law.items() if len(samples) * p < minimum}
    merged: Law = {k: p for k, p in law.items() if k not in small}
    if small:
        merged[(-1,)] = sum(law[k] for k in small)
    return [(-1,) if s in small else s for s in samples], merged


