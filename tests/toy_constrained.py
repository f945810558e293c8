"""Exact laws of constrained decoding on the toy LM of :mod:`toy`, by enumeration.

:func:`constrained_target_law` is constrained autoregressive decoding's law (the logits masked by a
token automaton's state, then warped); :func:`constrained_decoder_law` is the speculative decoder's
under a constraint, FREE or PRODUCT drafting (the head's circuit times the automaton, optionally
mixed with the constraint's walk or a copy of the context), enumerated with the decoder's own round functions.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor
from toy import Law, ToyHead, ToyLM, add_outcomes, stand_in_marginal

from circuits_llm.decoding.acceptance import CorrectionPolicy, round_law
from circuits_llm.decoding.constraint_path import ConstraintPath, ConstraintSteps, round_component
from circuits_llm.decoding.lookup import ContextLookup, LookupIndex, copy_posterior, unpack
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import SamplingConfig, target_probs


def _allowed_mask(automaton: object, state: int, vocab: int) -> Tensor:
    """(V,) bool: the ids ``automaton`` allows in ``state`` (read from ``allowed``, not ``mask``)."""
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[automaton.allowed(state)] = True  # type: ignore[attr-defined]
    return mask


def _cut_at(tokens: tuple[int, ...], eos: int) -> tuple[tuple[int, ...], bool]:
    """``tokens`` up to and including the first ``eos``, and whether there was one."""
    if eos in tokens:
        return tokens[:tokens.index(eos) + 1], True
    return tokens, False


def constrained_target_law(lm: ToyLM, automaton: object, prompt: Sequence[int], length: int,
                           config: SamplingConfig) -> Law:
    """The exact law of the first ``length`` tokens of constrained autoregressive decoding.

    At every step the logits are masked by the automaton's state after the output so far (the
    prompt is not read; disallowed ids get ``-inf``), *then* warped (:func:`target_probs`).
    Decoding stops after the automaton's EOS (kept): such sequences are shorter than ``length``.
    """
    eos, vocab = automaton.eos_token_id, lm.vocab_size  # type: ignore[attr-defined]
    law: Law = {}

    def walk(tokens: tuple[int, ...], state: int, prob: float) -> None:
        if len(tokens) == length or (tokens and tokens[-1] == eos):
            law[tokens] = law.get(tokens, 0.0) + prob
            return
        logits = lm.next_token_logits([*prompt, *tokens])
        masked = logits.masked_fill(~_allowed_mask(automaton, state, vocab), float("-inf"))
        p = target_probs(masked, config)
        for y in range(vocab):
            if p[y] > 0:
                walk((*tokens, y), automaton.advance(state, y), prob * float(p[y]))  # type: ignore[attr-defined]

    walk((), automaton.initial_state, 1.0)  # type: ignore[attr-defined]
    return law


def _masked_rows(logits: Tensor, automaton: object, state: int, drafts: Sequence[int]) -> Tensor:
    """``logits`` (L+1, V) of ``[c, d_1..d_L]``, row ``k`` masked by the state after
    ``d_1..d_k``; after a draft the automaton forbids, the last state (those rows are unreachable:
    that draft has target probability 0)."""
    vocab = logits.shape[-1]
    states = [state]
    for token in drafts:
        allowed = _allowed_mask(automaton, states[-1], vocab)
        if not bool(allowed[token]):
            break
        states.append(automaton.advance(states[-1], token))  # type: ignore[attr-defined]
    states += [states[-1]] * (len(drafts) + 1 - len(states))
    mask = torch.stack([_allowed_mask(automaton, s, vocab) for s in states]).to(logits.device)
    return logits.masked_fill(~mask, float("-inf"))


def _forced_run(automaton: object, state: int, drafts: Sequence[int], limit: int) -> list[int]:
    """The ids the automaton forces after ``drafts`` from ``state`` (one allowed id, never EOS),
    at most ``limit``: the decoder's jump-forward past a product draft."""
    for token in drafts:
        state = automaton.advance(state, token)  # type: ignore[attr-defined]
    run: list[int] = []
    while len(run) < limit:
        allowed = automaton.allowed(state).tolist()  # type: ignore[attr-defined]
        if len(allowed) != 1 or allowed[0] == automaton.eos_token_id:  # type: ignore[attr-defined]
            break
        run.append(allowed[0])
        state = automaton.advance(state, allowed[0])  # type: ignore[attr-defined]
    return run


def _extended_rows(rows: Tensor, path: Tensor, copy: Tensor) -> Tensor:
    """The mixture's conditionals (n-1, K + 1) along ``path``: ``(1 - pi) h`` on the draft
    vocabulary, plus ``pi`` on the proposal's token (its own column, or column ``K`` when it lies
    outside the draft vocabulary)."""
    size = rows.shape[1]
    pi = copy_posterior(rows, path, copy)
    out = torch.cat([(1 - pi[:, None]) * rows, torch.zeros(rows.shape[0], 1, dtype=rows.dtype)], 1)
    for k, entry in enumerate(unpack(copy)[0].tolist()):
        out[k, entry if entry >= 0 else size] += pi[k]
    return out


def _full_rows(extended: Tensor, extra: Sequence[int], ids: Tensor, vocab: int) -> Tensor:
    """(n-1, K + 1) rows over the draft vocabulary plus one extra id per row -> (n-1, V)."""
    full = torch.zeros(extended.shape[0], vocab, dtype=torch.float64)
    full[:, ids] = extended[:, :-1]
    for k, token in enumerate(extra):
        full[k, token] += extended[k, -1]
    return full


def drafted_rows(drafter: object, result: object) -> Tensor:
    """A :class:`ProductDrafter` draft's ``q`` (n-1, K + 1) with its extra column's ids, as
    (n-1, V) rows over the model's vocabulary (what :func:`_product_drafts` returns)."""
    return _full_rows(result.q.cpu(), result.extra.tolist(),  # type: ignore[attr-defined]
                      drafter.draft_tokens, drafter.position.numel())  # type: ignore[attr-defined]


def _product_drafts(drafter: object, params: object, c: int, state: int, greedy: bool,
                    component: Tensor | None = None, mixed_q: bool = True,
                    free_point_mass: bool = True) -> list[tuple[Tensor, Tensor, int, float]]:
    """Every draft :class:`ProductDrafter` can make after ``c`` in automaton state ``state``:
    ``(tokens (n-1,) model ids, q (n-1, V) its conditionals, L, probability)``. Sampling: the
    tree of :meth:`AutomatonProduct.draw`'s own conditionals (the draw is steered along every
    branch with ``choose``); greedy: the drafter's own (argmax) draft, with a one-hot ``q``.

    ``component``: a copy of the context mixed into the product (the decoder's ``lookup``): the
    tree's branches then follow the mixture's conditionals (the product's rows along each prefix
    and the copy's posterior weight, the copy cut where the automaton forbids it; drawn one
    variable at a time, the mixture needs no cut at the copy's end: after it every conditional is
    the product's own). A proposal token outside the draft vocabulary is one more branch of its
    row (probability ``pi``); taking it follows the proposal to its end, which is where that
    draft's verification stops (its row is the point mass at the token when the drafter has no
    draftable token there). ``mixed_q=False``: the accept test reads the product's own
    conditionals instead (the negative control); ``free_point_mass=False``: that row keeps the
    mixture's conditional instead of the point mass (another)."""
    d = drafter
    n = d.window  # type: ignore[attr-defined]
    ids = d.draft_tokens  # type: ignore[attr-defined]
    size = ids.numel()
    vocab = d.position.numel()  # type: ignore[attr-defined]
    index = int(d.position[c])  # type: ignore[attr-defined]
    if state not in d.local:  # type: ignore[attr-defined]
        # no draft: the round verifies [c] alone (L = 0), an autoregressive step in law
        return [(torch.zeros(n - 1, dtype=torch.long), torch.zeros(n - 1, vocab, dtype=torch.float64),
                 0, 1.0)]
    # c outside the draft vocabulary: X_0 is drawn first (a stand-in), the drafts condition on it
    lead = 1 if index < 0 else 0
    observed = torch.tensor([index] if lead == 0 else [], dtype=torch.long)
    start = d.local[state]  # type: ignore[attr-defined]
    automaton = d.table.restart(start)  # type: ignore[attr-defined]
    copy, free_outside = (None, False) if component is None else \
        d.allowed_copy(component, start)  # type: ignore[attr-defined]
    proposal = [] if copy is None else unpack(copy)[0][:int(unpack(copy)[1])].tolist()
    proposal_ids = [int(ids[e]) if e >= 0 else -e - 1 for e in proposal]
    extra = proposal_ids + [0] * (n - 1 - len(proposal_ids))

    def verified_length(values: list[int]) -> int:
        local, walk = start, []
        for value in values:
            local = int(d.table.next_state[local, value])  # type: ignore[attr-defined]
            walk.append(local)
        return next((k for k, s in enumerate(walk) if s == d.sink), n - 1)  # type: ignore[attr-defined]

    if greedy:
        result, _ = d.draft(params, c, state, None, None, component)  # type: ignore[attr-defined]
        tokens = result.tokens.cpu()
        one_hot = torch.nn.functional.one_hot(tokens, vocab).double()
        values = [int(d.position[t]) for t in tokens.tolist()]  # type: ignore[attr-defined]
        outside = next((k for k, v in enumerate(values[:int(result.length)]) if v < 0), None)
        if outside is None:
            assert int(result.length) == verified_length(values)
        else:  # the copy left the draft vocabulary: verified to the proposal's end
            assert tokens[:len(proposal_ids)].tolist() == proposal_ids
            assert int(result.length) == len(proposal_ids)
        return [(tokens, one_hot, int(result.length), 1.0)]

    leaves: list[tuple[Tensor, Tensor, int, float]] = []

    def expand(prefix: list[int]) -> None:
        steer = list(prefix)

        def choose(conditional: Tensor) -> int:
            return steer.pop(0) if steer else int(conditional.argmax())

        drawn = d.product.draw(params, automaton, observed,  # type: ignore[attr-defined]
                               consume_from=1, choose=choose)
        assert drawn.length == n - 1 + lead
        every = drawn.conditionals.cpu()  # (n - 1 + lead, K): the stand-in's row first
        rows = every[lead:]
        path = drawn.values[1:].cpu()
        plain = torch.cat([rows, torch.zeros(n - 1, 1, dtype=torch.float64)], 1)
        q = plain if copy is None else _extended_rows(rows, path, copy)
        stand_in = float(every[0, prefix[0]]) if lead and prefix else 1.0
        branches = every[0] if lead and not prefix else q[len(prefix) - lead]
        for x in branches.nonzero()[:, 0].tolist():
            if x == size and not (lead and not prefix):  # the proposal's token outside
                j = len(prefix) - lead
                drafted = prefix[lead:]
                weight = stand_in * float(q[torch.arange(j), torch.tensor(drafted, dtype=torch.long)]
                                          .prod()) * float(q[j, size])
                final = q.clone()
                if free_outside and free_point_mass:
                    final[j] = 0.0
                    final[j, size] = 1.0
                final[j + 1:] = 0.0
                final[j + 1:len(proposal_ids), size] = 1.0
                tokens = torch.tensor([int(ids[v]) for v in drafted] + proposal_ids[j:], dtype=torch.long)
                tokens = torch.cat([tokens, torch.zeros(n - 1 - tokens.numel(), dtype=torch.long)])
                leaves.append((tokens, _full_rows(final, extra, ids, vocab), len(proposal_ids), weight))
                continue
            values = [*prefix, x]
            if len(values) < n - 1 + lead:
                expand(values)
                continue
            drafted = values[lead:]
            final = q if copy is None else _extended_rows(rows, torch.tensor(drafted), copy)
            weight = float(final[torch.arange(n - 1), torch.tensor(drafted)].prod())
            if lead:
                weight *= float(every[0, values[0]])  # the stand-in's probability
            leaves.append((ids[torch.tensor(drafted)],
                           _full_rows(final if mixed_q else plain, extra, ids, vocab),
                           verified_length(drafted), weight))

    expand([])
    return leaves


def constrained_decoder_law(lm: ToyLM, head: ToyHead, automaton: object, prompt: Sequence[int],
                            length: int, config: SamplingConfig, drafting: object,
                            policy: CorrectionPolicy = CorrectionPolicy.EXACT,
                            lookup: ContextLookup | None = None, mixed_q: bool = True,
                            components: list[Tensor] | None = None,
                            free_point_mass: bool = True) -> Law:
    """The exact law of the first ``length`` tokens of ``SpeculativeDecoder(lm, head,
    constrained_drafting=drafting).generate(prompt, length, constraint=automaton)`` (CPU).

    Enumerates every draft with its exact draft probability: ``PRODUCT``: the tree of the
    conditionals of the head's circuit times the drafter's automaton (the one
    :class:`~circuits_llm.decoding.constrained.ProductDrafter` builds: free rows, sink, ``L`` = the
    drafts before the free part; with ``lookup``, the copy of the context mixed in:
    :func:`_product_drafts`); ``FREE``: :meth:`RoundProgram.conditionals` as
    :func:`decoder_law` does. Greedy: the decoder's own draft (one-hot ``q``). Every accept/reject
    outcome comes from :func:`round_law` on the target rows masked by the automaton states along
    the draft, every state change from :func:`transition`; decoding ends after the automaton's EOS.
    """
    from circuits_llm.decoding.constrained import ConstrainedDrafting, ProductDrafter

    window, vocab = head.window, lm.vocab_size
    eos = automaton.eos_token_id  # type: ignore[attr-defined]
    program = RoundProgram(head, config)
    drafter = ProductDrafter(head, automaton) if drafting is ConstrainedDrafting.PRODUCT else None
    ids = torch.arange(vocab) if head.draft_tokens is None else head.draft_tokens
    inside = set(ids.tolist())
    size = len(ids)
    all_drafts = torch.tensor(list(itertools.product(range(size), repeat=window - 1)))
    rounds: dict[tuple[int, ...], Law] = {}

    def state_of(output: Sequence[int]) -> int:
        state = automaton.initial_state  # type: ignore[attr-defined]
        for token in output:
            state = automaton.advance(state, token)  # type: ignore[attr-defined]
        return state

    def widen(compact: Tensor) -> Tensor:
        """(n-1, K) rows over the draft vocabulary -> (n-1, V)."""
        q = torch.zeros(window - 1, vocab, dtype=torch.float64)
        q[:, ids] = compact
        return q

    def free_drafts(hidden: Tensor, c: int) -> list[tuple[Tensor, Tensor, int, float]]:
        if config.greedy:
            draft = program.draft(hidden, torch.tensor([c]), None)
            tokens = draft.tokens.clone()
            index = tokens if head.draft_tokens is None else program.position[tokens]  # type: ignore[index]
            q = torch.nn.functional.one_hot(index, size).double()
            if not bool(draft.possible):
                q = torch.zeros_like(q)
            return [(tokens, widen(q), window - 1, 1.0)]
        # c outside the draft vocabulary: every stand-in for X_0, weighted by the head's marginal
        branches = [(None, 1.0)] if c in inside else \
            list(enumerate(stand_in_marginal(program, hidden, c).tolist()))
        leaves = []
        for stand_in, prior in branches:
            compact = program.conditionals(hidden, c, all_drafts, stand_in=stand_in)  # (D, n-1, K)
            probs = prior * compact.gather(2, all_drafts[:, :, None])[:, :, 0].prod(1)
            leaves += [(ids[index], widen(q), window - 1, float(w))
                       for index, q, w in zip(all_drafts, compact, probs, strict=True) if w > 0]
        return leaves

    def round_outcomes(sequence: tuple[int, ...]) -> Law:
        if sequence in rounds:
            return rounds[sequence]
        outcomes: Law = defaultdict(float)
        state = state_of(sequence[len(prompt):])
        lm.reset()
        c = sequence[-1]
        if len(sequence) == 1:  # one-token prompt: a plain (masked) autoregressive step
            logits = lm.extend(torch.tensor([[c]])).verifier_logits[0, -1:]
            p = target_probs(_masked_rows(logits, automaton, state, [])[0], config)
            for y in p.nonzero()[:, 0].tolist():
                outcomes[(y,)] += float(p[y])
        else:
            hidden = lm.extend(torch.tensor([sequence[:-1]])).draft_hidden[:, -1]
            if drafter is not None:
                with torch.no_grad():
                    params = head.circuit.log_parameters(
                        program.head_parameters(hidden, torch.tensor([c])))
                component = None
                if lookup is not None:  # the walk of the constraint, else the copy
                    path = None
                    if lookup.constraint_weight > 0:
                        path = ConstraintPath(ConstraintSteps(automaton))  # type: ignore[arg-type]
                        path.record(automaton.initial_state,  # type: ignore[attr-defined]
                                    sequence[len(prompt):])
                    component = round_component(lookup, LookupIndex(lookup.max_ngram, sequence),
                                                path, state, drafter.position.tolist(),
                                                window - 1, torch.device("cpu"),
                                                lookup.outside_vocabulary)
                    if components is not None:
                        components.append(component)
                drafts = _product_drafts(drafter, params, c, state, config.greedy, component,
                                         mixed_q, free_point_mass)
            else:
                drafts = free_drafts(hidden, c)
            for tokens, q, verified, weight in drafts:
                draft = tokens[:verified]
                forced = _forced_run(automaton, state, draft.tolist(), window) \
                    if drafter is not None and policy is CorrectionPolicy.EXACT else []
                lm.crop(len(sequence) - 1)
                block = torch.cat([torch.tensor([c]), draft, torch.tensor(forced, dtype=torch.long)])
                step = lm.extend(block[None])
                logits = _masked_rows(step.verifier_logits[0], automaton, state, block[1:].tolist())
                p = target_probs(logits, config)
                law = round_law(p[:verified + 1], q[:verified], draft)
                if not forced:
                    add_outcomes(outcomes, law, draft, policy, weight)
                    continue
                # every draft accepted: the bonus row is a point mass at the first forced token;
                # the forced run is emitted and the last token drawn after it
                probs, tail = law.outcome_probs(), p[verified + len(forced)]
                for s, y in probs.nonzero().tolist():
                    mass = weight * float(probs[s, y])
                    if s < verified:
                        outcomes[(*draft[:s].tolist(), y)] += mass
                        continue
                    assert y == forced[0], (y, forced)
                    for z in tail.nonzero()[:, 0].tolist():
                        outcomes[(*draft.tolist(), *forced, z)] += mass * float(tail[z])
        rounds[sequence] = dict(outcomes)
        return rounds[sequence]

    def continuation(sequence: tuple[int, ...], remaining: int) -> Law:
        result: Law = defaultdict(float)
        for emitted, prob in round_outcomes(sequence).items():
            kept, stopped = _cut_at(emitted[:remaining], eos)
            if stopped or len(kept) == remaining:
                result[kept] += prob
                continue
            for tail, tail_prob in continuation(sequence + emitted, remaining - len(emitted)).items():
                result[emitted + tail] += prob * tail_prob
        return result

    return dict(continuation(tuple(prompt), length)) if length > 0 else {(): 1.0}
