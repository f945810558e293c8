"""Exact speculative decoding with a circuit draft head: one backbone call per round.

Round invariant (``docs/decoder-exactness.md`` proves exactness): the backbone caches
``x_1..x_t``; ``hidden`` is the draft hidden state at ``x_t``; the next token ``c = x_{t+1}`` is
already decided (emitted) but not cached. A round

1. parameterises the circuit over the window ``(x_{t+1}, .., x_{t+n})`` from ``hidden`` and
   *conditions it on* ``X_0 = c``;
2. drafts ``d_1..d_{n-1}`` from that exact conditional (greedy: its max-product completion) and
   chooses how many to verify, ``L`` (``draft_length``: all ``n - 1`` by default; a
   :class:`~circuits_llm.decoding.draft_length.DraftLength` rule that reads only draft-side
   quantities, which keeps the law exact: see that module);
3. runs ``backbone.extend([c, d_1..d_L])`` once: the verifier's ``p_1..p_{L+1}`` (``p_{L+1}`` is
   the bonus position) and the draft hidden states at every new position;
4. accepts ``d_k`` with probability ``min(1, p_k(d_k) / q_k(d_k))`` where ``q_k`` is the circuit's
   exact conditional given ``c, d_1..d_{k-1}``; at the first rejection emits a token of
   ``norm(max(0, p_k - q_k))``, otherwise a bonus token of ``p_{L+1}``;
5. crops the caches to ``x_1..x_t, c, d_1..d_s`` and takes the hidden state at ``d_s``.

So after every round ``backbone.length == len(prompt) + len(output) - 1``.

Steps 1-2 and 4 are two fixed-shape programs with no host synchronisation inside
(:class:`~circuits_llm.decoding.round.RoundProgram`, compiled with ``compile=True``); one small tensor
crosses to the host per round: the draft, how many drafts were accepted, the emitted token and
validity flags (a ``draft_length`` rule that depends on the round adds one read of ``L`` before the
verify call). A head with a compressed draft vocabulary (``head.draft_tokens``, K model ids)
drafts over those K tokens; ``q`` is 0 elsewhere and the residual covers the rest.
With ``lookup`` (:class:`~circuits_llm.decoding.lookup.ContextLookup`) step 2 drafts from the
head's circuit mixed with a copy of what followed the last earlier occurrence of the output's
final n-gram, and ``q`` is that mixture's exact conditional (see that module).

Both decoders stop at the model's end-of-sequence ids by default, as ``model.generate`` does
(``generation_config.eos_token_id``, else ``config.eos_token_id``, when the backbone is, or wraps,
a Hugging Face model; :meth:`AutoregressiveDecoder.default_eos_token_ids`).

If the draft gives ``X_0 = c`` probability zero, every draft is rejected and ``p_1`` decides:
an autoregressive round in law. A ``c`` outside a compressed draft vocabulary still drafts: the
head draws a stand-in for ``X_0`` with the drafts and ``q`` conditions on it
(:mod:`~circuits_llm.decoding.round`; under a constraint, the product draws it). Invalid head
outputs or verifier logits raise a :class:`DecoderError` naming the tensor; so does a concurrent
``generate`` (not thread-safe).

The verification law is a pure function of ``(p, q, draft)`` followed by a state change
(:mod:`circuits_llm.decoding.acceptance`: ``round_law``, ``transition``); the accept program and
the exact-law enumerator of the tests both use them.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import Tensor

from circuits_llm.constraints import TokenAutomaton
from circuits_llm.decoding import context_drafting
from circuits_llm.decoding.acceptance import CorrectionPolicy, Transition, transition
from circuits_llm.decoding.autoregressive import VERIFIER_LOGITS, AutoregressiveDecoder, now
from circuits_llm.decoding.backbones import as_backbone
from circuits_llm.decoding.batch import SpeculativeRows
from circuits_llm.decoding.constrained import (
    ConstrainedDrafting,
    ConstraintTracker,
    ProductDrafter,
    through_forced,
)
from circuits_llm.decoding.constraint_path import ConstraintPath, ConstraintSteps, round_component
from circuits_llm.decoding.draft_depth import AdaptiveDepth, DepthTracker, observed_acceptance
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.inputs import check_draft_tokens, head_parameters
from circuits_llm.decoding.lookup import ContextLookup, LookupIndex, unpack
from circuits_llm.decoding.metrics import DecodeResult, RoundKind, RoundStats
from circuits_llm.decoding.respelling import DraftRespeller
from circuits_llm.decoding.round import RoundProgram, SampledAccept
from circuits_llm.decoding.round_data import DraftResult, RoundOutcome
from circuits_llm.decoding.stopping import StopCondition
from circuits_llm.decoding.warping import DecoderError, SamplingConfig, target_probs
from circuits_llm.protocols import (
    Backbone,
    BackboneStep,
    ContextDrafter,
    DraftHead,
    context_drafter_problem,
    draft_head_problem,
)
from circuits_llm.runtime.compiling import Compiler, current_compiler

__all__ = [
    "AutoregressiveDecoder", "ConstrainedDrafting", "ContextLookup", "CorrectionPolicy",
    "DecodeResult", "DecoderError", "DraftLength", "SpeculativeDecoder",
]


class SpeculativeDecoder(AutoregressiveDecoder):
    """Lossless speculative decoding with a circuit draft head, one backbone call per round.

    Args:
        backbone: a :class:`Backbone`, or an HF causal LM (wrapped in ``HFBackbone`` with
            ``lora_layers`` LoRA layers on its draft branch).
        head: a :class:`DraftHead` whose circuit spans ``window >= 2`` variables, or a
            :class:`~circuits_llm.protocols.ContextDrafter` (a draft block's
            :class:`~circuits_llm.draft_block.BlockDrafter`: recursive drafts from a decoder layer
            with its own KV cache, fed the features of the positions each round keeps; or
            :class:`~circuits_llm.draft_block.BlockCircuitDrafter`: a circuit head on the block's
            output). One with ``decoding_problem(lookup, draft_length)`` takes the ``lookup`` and
            rule it accepts (its ``round_program`` gets them); under ``PRODUCT`` drafting its
            round program drafts from the product when a :class:`RoundProgram`, by its own
            ``constrained_draft`` when it has one, else freely.
        lora_layers: only used when ``backbone`` is an HF model.
        policy: keep :attr:`CorrectionPolicy.EXACT`; the other value is a biased negative control.
        draft_length: how many of the window's ``n - 1`` drafts a round verifies
            (:class:`~circuits_llm.decoding.draft_length.DraftLength`): ``DraftLength.fixed()``
            (default: all), ``DraftLength.fixed(L)``, or ``DraftLength.confident(threshold)``
            (stop where the head's own estimate of success drops below ``threshold``). Every
            rule keeps the output law exactly the target's (it reads only the head's side; see
            that module for the argument). With ``compile`` every block length the rule can
            choose gets a compiled backbone forward.
        compile: run the round's draft and accept programs
            (:class:`~circuits_llm.decoding.round.RoundProgram`) through ``torch.compile`` (fixed
            shapes, no host synchronisation inside a round) and, when ``backbone`` is an HF model,
            wrap it with a static KV cache and compiled forwards for blocks of 1 and ``L + 1``
            tokens for every ``L`` of ``draft_length`` (the window, by default). A Backbone
            passed in keeps its own setting (build it with ``HFBackbone(model, compile=True)`` to
            compile both sides; the decoder adds those block lengths to it). Everything compiles with
            the compiler current when the decoder is built
            (:func:`~circuits_llm.runtime.compiling.use_compiler`; default ``torch.compile``, CUDA
            graphs on CUDA); a program the compiler refuses runs eager after one
            :class:`~circuits_llm.runtime.compiling.CompileFallbackWarning`.
        constrained_drafting: how rounds draft under ``generate(constraint=)``
            (:class:`~circuits_llm.decoding.constrained.ConstrainedDrafting`): ``PRODUCT``
            (default: the head's circuit times the constraint's automaton, drafts that satisfy it
            by construction) or ``FREE`` (the head drafts as without a constraint; only the
            target is masked). Either way the output law is the constrained model's.
        lookup: mix a copy of the context into every round's draft
            (:class:`~circuits_llm.decoding.lookup.ContextLookup`: the continuation of the last
            earlier occurrence of the output's final n-gram, one more component of the draft's
            circuit; exact). ``None`` (default): the head alone. Combines with the constraint
            product too (mixed into the product's sequential draw, the copy cut before its first
            token the constraint forbids), where a round whose copy proposes nothing draftable
            proposes the constraint's walk instead (:mod:`~circuits_llm.decoding.constraint_path`;
            ``ContextLookup.constraint_weight``).
        respell_greedy_drafts: under a constraint with ``PRODUCT`` drafting and the tokenizer
            passed to ``generate``, a greedy round re-encodes its drafts' text with the tokenizer
            before the verify (:mod:`~circuits_llm.decoding.respelling`: the product often drafts
            a split spelling, ``"`` then ``:``, where the model writes ``":``). Greedy output is
            the argmax chain whatever is drafted; sampling rounds never respell. Default True.
        draft_depth: choose each round's depth, ``0..n-1`` drafts, before the round from how
            earlier rounds' drafts were accepted and what a round costs
            (:class:`~circuits_llm.decoding.draft_depth.AdaptiveDepth`; ``0``: a plain step). A
            drafter that drafts step by step (a recursive draft block) draws only that many; a
            circuit head still drafts its window and verifies at most that many. Combines with
            ``draft_length`` (the smaller ``L`` wins) and keeps the law exact (that module).
            ``None`` (default): the rule's ``L``.
        sampled_accept: how a sampled round's accept computes the target's law, with the same
            decisions either way (:class:`~circuits_llm.decoding.round.SampledAccept`; ``AUTO``:
            row by row, eager, on a CPU; the whole window, compiled with ``compile``, elsewhere).
    """

    def __init__(self, backbone: Backbone | object, head: DraftHead | ContextDrafter, *,
                 lora_layers: int = 0,
                 policy: CorrectionPolicy = CorrectionPolicy.EXACT, compile: bool = False,
                 draft_length: DraftLength | None = None,
                 constrained_drafting: ConstrainedDrafting = ConstrainedDrafting.PRODUCT,
                 lookup: ContextLookup | None = None, respell_greedy_drafts: bool = True,
                 draft_depth: AdaptiveDepth | None = None,
                 sampled_accept: SampledAccept = SampledAccept.AUTO) -> None:
        rule = DraftLength.fixed() if draft_length is None else draft_length
        if not isinstance(rule, DraftLength):
            raise DecoderError(f"draft_length must be a circuits_llm.decoding.draft_length."
                               f"DraftLength, got {draft_length!r}")
        window = getattr(head, "window", 1)
        blocks: tuple[int, ...] = (1,)
        if isinstance(window, int) and not isinstance(window, bool) and window >= 2:
            rule.check(window)
            blocks = tuple(length + 1 for length in rule.lengths(window))
            if draft_depth is not None or getattr(head, "stops_early", False):
                blocks = tuple(range(1, window + 1))  # any depth 0..n-1 may be verified
        if draft_depth is not None and not isinstance(draft_depth, AdaptiveDepth):
            raise DecoderError(f"draft_depth must be None or a circuits_llm.decoding.draft_depth."
                               f"AdaptiveDepth, got {draft_depth!r}")
        feature_layers = tuple(getattr(head, "feature_layers", ()))
        self.backbone = as_backbone(backbone, lora_layers, compile, blocks, feature_layers)
        problem = draft_head_problem(head)
        #: the drafter with state of its own, when ``head`` is one (else None: a circuit head)
        self._context_drafter: ContextDrafter | None = None
        if problem is not None and context_drafter_problem(head) is None:
            self._context_drafter = head  # type: ignore[assignment]
        elif problem is not None:
            raise DecoderError(f"head must implement circuits_llm.protocols.DraftHead: {problem} "
                               f"(or ContextDrafter: {context_drafter_problem(head)})")
        if head.vocab_size != self.backbone.vocab_size:
            raise DecoderError(f"the head's vocab_size {head.vocab_size} differs from the "
                               f"backbone's {self.backbone.vocab_size}")
        if head.hidden_size != self.backbone.hidden_size:
            fused = f" (the outputs of layers {list(feature_layers)} and the LM head's input: " \
                f"build the backbone with HFBackbone(model, feature_layers=" \
                f"{list(feature_layers)}), or pass the model)" if feature_layers else ""
            raise DecoderError(f"the head reads hidden states of size {head.hidden_size}{fused} "
                               f"but the backbone's are {self.backbone.hidden_size}")
        if self._context_drafter is not None:
            context_drafting.check_drafter(self._context_drafter, lookup, rule)
        else:
            self._check_circuit(head)  # type: ignore[arg-type]
        if not isinstance(policy, CorrectionPolicy):
            raise DecoderError(f"policy must be a CorrectionPolicy, got {policy!r}")
        if not isinstance(constrained_drafting, ConstrainedDrafting):
            raise DecoderError(f"constrained_drafting must be a ConstrainedDrafting, got "
                               f"{constrained_drafting!r}")
        if lookup is not None and not isinstance(lookup, ContextLookup):
            raise DecoderError(f"lookup must be None or a circuits_llm.decoding.lookup."
                               f"ContextLookup, got {lookup!r}")
        if not isinstance(sampled_accept, SampledAccept):
            raise DecoderError(f"sampled_accept must be a SampledAccept, got {sampled_accept!r}")
        self.sampled_accept = sampled_accept
        if not isinstance(respell_greedy_drafts, bool):
            raise DecoderError(f"respell_greedy_drafts must be a bool, got "
                               f"{respell_greedy_drafts!r}")
        self.respell_greedy_drafts = respell_greedy_drafts
        #: the respeller of the last tokenizer seen (its vocabulary's bytes, read once)
        self._respeller: DraftRespeller | None = None
        self.lookup = lookup
        #: the output so far, indexed for the copy component (during generate, with a lookup)
        self._index: LookupIndex | None = None
        #: the constraint's walk and the output's habits (during a constrained generate with a
        #: lookup and PRODUCT drafting), and what it reads of each automaton (built once)
        self._path: ConstraintPath | None = None
        self._steps: dict[TokenAutomaton, ConstraintSteps] = {}
        #: model id -> draft-vocabulary index (-1 outside it) on the host, for the copy component
        self._position: list[int] | None = None
        draft_tokens = getattr(head, "draft_tokens", None)
        if lookup is not None and draft_tokens is not None:
            self._position = [-1] * head.vocab_size
            for index, token in enumerate(draft_tokens.tolist()):
                self._position[token] = index
        self.constrained_drafting = constrained_drafting
        #: product drafters, one per constraint automaton (built at its first round)
        self._drafters: dict[TokenAutomaton, ProductDrafter] = {}
        self.head = head
        self.policy = policy
        self.draft_length = rule
        self.compile = bool(compile)
        #: what compiles the round programs, built lazily (one per sampling configuration)
        self._compiler: Compiler | None = current_compiler() if compile else None
        self.lookahead = head.window - 1
        self._programs: dict[SamplingConfig, RoundProgram] = {}
        self.draft_depth = draft_depth
        #: this decode's acceptance estimates and depths (during generate, with a draft_depth)
        self.depths: DepthTracker | None = None

    @staticmethod
    def _check_circuit(head: DraftHead) -> None:
        """A circuit head's window, circuit and draft vocabulary agree."""
        circuit = head.circuit
        if head.window < 2 or circuit.num_variables != head.window:
            raise DecoderError(f"the head's window must be >= 2 (variable 0 is the known next "
                               f"token, the rest are drafted) and match its circuit's "
                               f"{circuit.num_variables} variables; got window={head.window}")
        draft_size = check_draft_tokens(head)
        if any(k != draft_size for k in circuit.category_sizes):
            raise DecoderError(f"every circuit variable must have {draft_size} categories (the "
                               f"head's draft vocabulary), got {list(circuit.category_sizes)}")

    @property
    def device(self) -> torch.device:
        """The head's circuit device (drafts and conditionals live there), or the drafter's."""
        if self._context_drafter is not None:
            return context_drafting.drafter_device(self._context_drafter)
        return self.head.circuit.device  # type: ignore[union-attr]

    def _program(self, config: SamplingConfig) -> RoundProgram:
        """The round's draft/accept programs for ``config``: built (and compiled) once per
        configuration, since warping and greedy/sampling are part of the program."""
        program = self._programs.get(config)
        if program is None:
            if self._context_drafter is None:
                program = RoundProgram(self.head, config, compile=self.compile,
                                       compiler=self._compiler, draft_length=self.draft_length,
                                       lookup=self.lookup)
            else:
                program = context_drafting.drafter_program(
                    self._context_drafter, config, compile=self.compile,
                    compiler=self._compiler, draft_length=self.draft_length, lookup=self.lookup)
            program.use_sampled_accept(self.sampled_accept, self.device)
            self._programs[config] = program
        return program

    def _batch_drafter(self) -> SpeculativeRows:
        """A batch of prompts drafts row by row with this decoder's round, its copy and its
        draft-length rule included (:mod:`~circuits_llm.decoding.batch`)."""
        return SpeculativeRows(self)

    def _drafter(self, tracker: ConstraintTracker, head: DraftHead) -> ProductDrafter:
        """The product drafter of ``head`` (the round program's) and the tracker's automaton
        (built once per automaton)."""
        drafter = self._drafters.get(tracker.automaton)
        if drafter is None:
            drafter = self._drafters[tracker.automaton] = ProductDrafter(head, tracker.automaton)
            tracker.pending += drafter.build_seconds  # constraint work, paid once per automaton
        return drafter

    def _decode(self, prompt: list[int], stop: StopCondition, config: SamplingConfig,
                generator: torch.Generator | None,
                tracker: ConstraintTracker | None = None) -> DecodeResult:
        """The decode loop, with the output indexed for the copy component when ``lookup`` and a
        fresh depth tracker with a ``draft_depth`` (kept in :attr:`depths` after the decode)."""
        if self.draft_depth is not None:  # as deep as this configuration's rounds draft
            self.depths = self.draft_depth.start(self._program(config).window - 1)
        if self.lookup is None:
            return super()._decode(prompt, stop, config, generator, tracker)
        self._index = LookupIndex(self.lookup.max_ngram, prompt)
        if tracker is not None and self.lookup.constraint_weight > 0 \
                and self.constrained_drafting is ConstrainedDrafting.PRODUCT:
            steps = self._steps.get(tracker.automaton)
            if steps is None:
                steps = self._steps[tracker.automaton] = ConstraintSteps(tracker.automaton)
            self._path = ConstraintPath(steps)
        try:
            return super()._decode(prompt, stop, config, generator, tracker)
        finally:
            self._index, self._path = None, None

    def _start(self, prompt: list[int], prefill: BackboneStep | None) -> None:
        """A context drafter starts the sequence with the prefill's pairs: the feature after
        each prompt token but the last two, with the token that follows it."""
        if self._context_drafter is not None:
            self._context_drafter.begin(*context_drafting.prefill_pairs(
                prompt, None if prefill is None else prefill.draft_hidden, self.head.hidden_size,
                self.device))

    def _round(self, c: int, hidden: Tensor | None, config: SamplingConfig,
               generator: torch.Generator | None, tracker: ConstraintTracker | None = None
               ) -> tuple[Transition, BackboneStep, RoundStats]:
        move, step, stats = self._speculative_round(c, hidden, config, generator, tracker)
        if self._context_drafter is not None:  # the kept positions' features, from this verify
            self._context_drafter.follow(*context_drafting.kept_pairs(step.draft_hidden, move))
        if self._index is not None:
            self._index.extend(move.emitted)
        if self._path is not None and tracker is not None:  # the tracker emits them after this
            start = time.perf_counter()
            self._path.record(tracker.state, move.emitted)
            tracker.pending += time.perf_counter() - start
        return move, step, stats

    def _component(self, program: RoundProgram, tracker: ConstraintTracker | None = None
                   ) -> Tensor | None:
        """This round's proposal component (:func:`~circuits_llm.decoding.constraint_path.
        round_component`: the context copy, else the constraint's walk), or None without a
        lookup."""
        if self._index is None or self.lookup is None:
            return None
        start = time.perf_counter()
        beyond = tracker is not None and self.lookup.outside_vocabulary \
            and self.constrained_drafting is ConstrainedDrafting.PRODUCT
        component = round_component(self.lookup, self._index, self._path,
                                    -1 if tracker is None else tracker.state, self._position,
                                    program.window - 1, self.device, beyond)
        if self._path is not None and tracker is not None:
            tracker.pending += time.perf_counter() - start
        return component

    def _speculative_round(self, c: int, hidden: Tensor | None, config: SamplingConfig,
                           generator: torch.Generator | None,
                           tracker: ConstraintTracker | None = None
                           ) -> tuple[Transition, BackboneStep, RoundStats]:
        if hidden is None:  # one-token prompt: nothing to parameterise the head with yet
            return super()._round(c, hidden, config, generator, tracker)
        program, clock = self._program(config), self.device
        size = 0
        t0 = now(clock)
        uniforms = None if config.greedy else program.draw_uniforms(generator)
        product = tracker is not None and self.constrained_drafting is ConstrainedDrafting.PRODUCT
        first = torch.tensor([c], device=clock)
        component = self._component(program, tracker if product else None)
        copying = self.depths is not None and component is not None \
            and int(unpack(component)[1]) > 0  # a host read, only for the depth rule
        depth = None if self.depths is None else self.depths.choose(copying)
        if product and isinstance(program, RoundProgram):
            assert tracker is not None
            seed = program.head_hidden(hidden, first)  # a block's output: its one call a round
            params = head_parameters(program.circuit, program.head_parameters(seed, first))
            # n uniforms: the drafts', then the stand-in's (used when c is outside the draft
            # vocabulary)
            draws = None if config.greedy else torch.rand(
                program.window, generator=generator, dtype=torch.float64, device=clock)
            drafter = self._drafter(tracker, program.head)  # type: ignore[arg-type]
            draft, seconds = drafter.draft(
                params, c, tracker.state, None if draws is None else draws[:-1], self.draft_length,
                component, None if draws is None else float(draws[-1]))
            tracker.pending += seconds
            size = drafter.last_size
            length = int(draft.length)  # type: ignore[arg-type]
        elif product and callable(getattr(program, "constrained_draft", None)):
            draft = program.constrained_draft(  # type: ignore[attr-defined]
                hidden, first, uniforms, tracker, component)
            length = int(draft.length)  # type: ignore[arg-type]
        elif depth is not None and getattr(program, "draws_by_depth", False):
            draft = program.draft(hidden, first, uniforms, component,  # type: ignore[call-arg]
                                  depth=max(depth, 1))  # depth 0 still probes one draft
            length = program.verified(draft)
        else:
            draft = program.draft(hidden, first, uniforms, component)
            length = program.verified(draft)  # L: verify [c, d_1..d_L]
        if depth is not None and length > depth:
            length = depth
            draft = replace(draft, length=torch.tensor(depth, device=draft.tokens.device))
        if product and config.greedy and self.respell_greedy_drafts \
                and tracker.tokenizer is not None:  # type: ignore[union-attr]
            draft, length = self._respelled(draft, length, tracker)  # type: ignore[arg-type]
        block = draft.block if length == program.window - 1 else draft.block[:, :length + 1]
        forced = self._forced_run(tracker, block, program.window)
        if forced:
            block = torch.cat([block, torch.tensor([forced], device=block.device)], 1)
        t1 = now(clock)
        step = self.backbone.extend(block)
        t2 = now(clock)
        logits = step.verifier_logits[0]
        if tracker is not None:  # row k: the state after c, d_1..d_k
            logits = tracker.masked(logits, block[0, 1:].tolist())
        outcome = program.outcome(program.accept(logits[:length + 1], draft, uniforms))
        self._explain_failure(outcome, program, hidden, c, step, config)
        if self.depths is not None and outcome.possible:
            self.depths.observe(copying, observed_acceptance(
                logits, config, draft.tokens, draft.q, program.draft_tokens, length,
                outcome.accepted))
        move = transition(self.policy, outcome.draft, outcome.accepted, outcome.token)
        if forced and outcome.accepted == length:
            move = through_forced(move, forced, logits[length + len(forced)], config, generator)
        t3 = now(clock)
        # impossible evidence: every draft was rejected and p_1 decided, an AR step in law;
        # otherwise ``drafted`` is L, the drafts this round verified
        kind, drafted = (RoundKind.SPECULATIVE, len(outcome.draft)) if outcome.possible else \
            (RoundKind.AUTOREGRESSIVE, 0)
        stats = RoundStats(kind, drafted, outcome.accepted, len(move.emitted), draft_s=t1 - t0,
                           verify_s=t2 - t1, accept_s=t3 - t2, total_s=t3 - t0,
                           constraint_s=0.0 if tracker is None else tracker.take(),
                           product_size=size)
        return move, step, stats

    def _respelled(self, draft: DraftResult, length: int, tracker: ConstraintTracker
                   ) -> tuple[DraftResult, int]:
        """A greedy round's drafts re-encoded in the tokenizer's spelling
        (:meth:`~circuits_llm.decoding.respelling.DraftRespeller.respell_draft`; the respeller of
        the last tokenizer seen is kept), with the new ``L``. Counted as constraint work."""
        start = time.perf_counter()
        respeller = self._respeller
        if respeller is None or respeller.tokenizer is not tracker.tokenizer:
            respeller = self._respeller = DraftRespeller(tracker.tokenizer)
        draft, length = respeller.respell_draft(draft, length, tracker.automaton, tracker.state)
        tracker.pending += time.perf_counter() - start
        return draft, length

    def _forced_run(self, tracker: ConstraintTracker | None, block: Tensor, window: int
                    ) -> list[int]:
        """The tokens the constraint forces after the verified block ``[c, d_1..d_L]`` (PRODUCT
        drafting, the exact policy; at most ``window``, and what the backbone's cache can hold)."""
        if tracker is None or self.constrained_drafting is not ConstrainedDrafting.PRODUCT \
                or self.policy is not CorrectionPolicy.EXACT:
            return []
        limit = window
        capacity = getattr(self.backbone, "max_length", None)
        if capacity is not None:
            limit = min(limit, capacity - self.backbone.length - block.shape[1])
        return tracker.forced_run(block[0, 1:].tolist(), limit) if limit > 0 else []

    def _explain_failure(self, outcome: RoundOutcome, program: RoundProgram, hidden: Tensor,
                         c: int, step: BackboneStep, config: SamplingConfig) -> None:
        """Turn a round's failed flag into the detailed error of the eager checks (rare path:
        the fast path only carries two booleans back to the host)."""
        if not outcome.head_ok and self._context_drafter is not None:
            raise DecoderError("the draft block's logits for this round are not finite")
        if not outcome.head_ok:
            with torch.no_grad():
                first = torch.tensor([c], device=hidden.device)
                head_parameters(self.head.circuit, program.head_parameters(hidden, first))
            raise DecoderError("the draft head's output for this round is not finite")
        if not outcome.verifier_ok:
            target_probs(step.verifier_logits[0], config, VERIFIER_LOGITS)
            raise DecoderError(f"{VERIFIER_LOGITS} have a row without a finite maximum")
