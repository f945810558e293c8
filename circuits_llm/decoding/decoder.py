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

Both decoders stop at the model's end-of-sequence ids by default, as ``model.generate`` does
(``generation_config.eos_token_id``, else ``config.eos_token_id``, when the backbone is, or wraps,
a Hugging Face model; :meth:`AutoregressiveDecoder.default_eos_token_ids`).

If the draft gives ``X_0 = c`` probability zero (or ``c`` is outside the draft vocabulary),
every draft is rejected and ``p_1`` decides: an autoregressive round in law. Invalid head
outputs or verifier logits raise a :class:`DecoderError` naming the tensor; so does a concurrent
``generate`` (not thread-safe).

The verification law is a pure function of ``(p, q, draft)`` followed by a state change
(:mod:`circuits_llm.decoding.acceptance`: ``round_law``, ``transition``); the accept program and
the exact-law enumerator of the tests both use them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from circuits_llm.constraints import TokenAutomaton
from circuits_llm.decoding.acceptance import CorrectionPolicy, Transition, transition
from circuits_llm.decoding.backbones import as_backbone, hf_model_under
from circuits_llm.decoding.constrained import (
    ConstrainedDrafting,
    ConstraintTracker,
    ProductDrafter,
    resolve_constraint,
)
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.exclusive import exclusive
from circuits_llm.decoding.inputs import check_draft_tokens, check_prompt, head_parameters
from circuits_llm.decoding.metrics import DecodeResult, RoundKind, RoundStats, summarize
from circuits_llm.decoding.round import RoundOutcome, RoundProgram
from circuits_llm.decoding.stopping import StopCondition, eos_ids
from circuits_llm.decoding.warping import DecoderError, SamplingConfig, sample_token, target_probs
from circuits_llm.protocols import (
    Backbone,
    BackboneStep,
    DraftHead,
    draft_head_problem,
)
from circuits_llm.runtime.compiling import Compiler, current_compiler

__all__ = [
    "AutoregressiveDecoder", "ConstrainedDrafting", "CorrectionPolicy", "DecodeResult",
    "DecoderError", "DraftLength", "SpeculativeDecoder",
]


#: how invalid verifier logits are named in errors
VERIFIER_LOGITS = "the backbone's verifier logits"


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class AutoregressiveDecoder:
    """Plain autoregressive decoding with a :class:`Backbone` (the benchmark baseline).

    Same API, target law, cache invariant and statistics as :class:`SpeculativeDecoder`; every
    round is one backbone call on the single token ``c``.

    Args:
        backbone: a Backbone, or an HF causal LM (wrapped in ``HFBackbone`` without LoRA).
        compile: an HF model is wrapped with a static KV cache and a compiled forward
            (``HFBackbone(..., compile=True)``, with the compiler current now:
            :func:`~circuits_llm.runtime.compiling.use_compiler`); a Backbone keeps its own setting.

    Decoding stops at the model's EOS ids by default, like ``model.generate``
    (:meth:`default_eos_token_ids`); ``generate(..., eos_token_id=())`` turns that off.
    """

    #: tokens a round may cache beyond the output so far (the speculative window adds n - 1)
    lookahead = 0

    def __init__(self, backbone: Backbone | object, *, compile: bool = False) -> None:
        self.backbone = as_backbone(backbone, 0, compile)
        self.compile = bool(compile)

    @property
    def device(self) -> torch.device:
        """Where token tensors are created and timed: the backbone's device (CPU if unknown)."""
        device = getattr(self.backbone, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    # ------------------------------------------------------------------ checks
    def _prompt(self, input_ids: Tensor | Sequence[int]) -> list[int]:
        return check_prompt(input_ids, self.backbone.vocab_size)

    def default_eos_token_ids(self) -> tuple[int, ...]:
        """The EOS ids :meth:`generate` stops at when given neither ``eos_token_id`` nor ``stop``:
        those ``model.generate`` stops at (``generation_config.eos_token_id``, one id or a list,
        else ``config.eos_token_id``; :func:`~circuits_llm.decoding.stopping.eos_ids`) when the
        backbone is, or wraps, a Hugging Face model; ``()`` for other backbones. Read at every
        call, so a changed ``generation_config`` counts."""
        model = hf_model_under(self.backbone)
        return () if model is None else eos_ids(model)

    @staticmethod
    def _eos(eos_token_id: int | Sequence[int] | None) -> set[int]:
        if eos_token_id is None:
            return set()
        if isinstance(eos_token_id, int):
            return {eos_token_id}
        if isinstance(eos_token_id, Tensor):
            return {int(t) for t in eos_token_id.reshape(-1).tolist()}
        return {int(t) for t in eos_token_id}

    # ------------------------------------------------------------------ rounds
    def _round(self, c: int, hidden: Tensor | None, config: SamplingConfig,
               generator: torch.Generator | None, tracker: ConstraintTracker | None = None
               ) -> tuple[Transition, BackboneStep, RoundStats]:
        start = _now(self.device)
        step = self.backbone.extend(torch.tensor([[c]], device=self.device))
        logits = step.verifier_logits[0, -1:]
        if tracker is not None:
            logits = tracker.masked(logits, [])
        p = target_probs(logits[0], config, VERIFIER_LOGITS)
        verified = _now(self.device)
        token = sample_token(p, config.greedy, generator)
        end = _now(self.device)
        stats = RoundStats(RoundKind.AUTOREGRESSIVE, 0, 0, 1, verify_s=verified - start,
                           accept_s=end - verified, total_s=end - start,
                           constraint_s=0.0 if tracker is None else tracker.take())
        return Transition((token,), token, 1), step, stats

    @torch.no_grad()
    def generate(self, input_ids: Tensor | Sequence[int], max_new_tokens: int,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None,
                 eos_token_id: int | Sequence[int] | None = None,
                 stop: StopCondition | None = None, constraint: object | None = None,
                 tokenizer: Any = None) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids``.

        Args:
            input_ids: (L,) or (1, L) token ids, or a list of ints; L >= 1.
            max_new_tokens: exact number of tokens to generate (fewer only at EOS); >= 0.
            temperature: 0 = greedy; > 0 samples from the warped target (HF semantics).
            top_k, top_p: HF's top-k / nucleus filters (None = off).
            generator: the randomness source (on the decoding device).
            eos_token_id: stop after emitting (one of) these ids (kept in the output). ``None``
                (default): the model's own EOS ids, as ``model.generate`` stops
                (:meth:`default_eos_token_ids`), unless ``stop`` is given; ``()``: no EOS stop.
            stop: stop strings (and their tokenizer) as ``model.generate(stop_strings=...)``
                matches them: decoding ends after the token that completes one, kept, exactly
                where ``generate`` ends (:class:`~circuits_llm.decoding.stopping.StopCondition`; its own
                ``max_new_tokens`` and EOS ids are added to the arguments' limits). A ``stop``
                replaces the default EOS ids: only its own and ``eos_token_id``'s count.
            constraint: a :class:`~circuits_llm.constraints.Regex`,
                :class:`~circuits_llm.constraints.JsonSchema` or built
                :class:`~circuits_llm.constraints.TokenAutomaton`: the output law becomes the
                model's masked by the constraint's automaton and renormalised, as outlines and
                xgrammar define it (the mask is applied before warping; the prompt is not read;
                decoding also stops at the automaton's EOS). See
                :mod:`~circuits_llm.decoding.constrained`.
            tokenizer: the model's tokenizer, to build a Regex or JsonSchema constraint.

        Returns:
            :class:`DecodeResult`; ``tokens`` (T,) holds the new tokens only.

        Raises:
            DecoderError: bad arguments; invalid head outputs or verifier logits; or this decoder
                (or its backbone) is already generating in another thread: not thread-safe.
        """
        prompt = self._prompt(input_ids)
        config = SamplingConfig(temperature, top_k, top_p)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 0:
            raise DecoderError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        eos = self._eos(eos_token_id)
        if eos_token_id is None and stop is None:
            eos = set(self.default_eos_token_ids())
        if stop is not None and not isinstance(stop, StopCondition):
            raise DecoderError(f"stop must be a circuits_llm.decoding.stopping.StopCondition, got "
                               f"{type(stop).__name__}")
        tracker = None
        if constraint is not None:  # decoding also ends at the automaton's EOS
            tracker = ConstraintTracker(resolve_constraint(
                constraint, tokenizer, self.backbone.vocab_size,
                tuple(sorted(eos)) or self.default_eos_token_ids()))
            eos.add(tracker.eos_token_id)
        condition = StopCondition(
            max_new_tokens if stop is None else min(max_new_tokens, stop.max_new_tokens),
            tuple(sorted(eos)) + (() if stop is None else stop.eos_token_ids),
            () if stop is None else stop.stop_strings, criteria=() if stop is None else stop.criteria)
        capacity = getattr(self.backbone, "max_length", None)
        needed = len(prompt) + max_new_tokens + self.lookahead
        if isinstance(capacity, int) and needed > capacity:
            raise DecoderError(
                f"the backbone's cache holds {capacity} tokens but this call may need {needed} "
                f"(prompt {len(prompt)} + max_new_tokens {max_new_tokens} + {self.lookahead} "
                "drafted ahead): build the backbone with a larger max_cache_len, or generate less")
        with exclusive(decoder=self, backbone=self.backbone):
            return self._decode(prompt, condition, config, generator, tracker)

    def _decode(self, prompt: list[int], stop: StopCondition, config: SamplingConfig,
                generator: torch.Generator | None,
                tracker: ConstraintTracker | None = None) -> DecodeResult:
        """The body of :meth:`generate` on checked arguments (run under :func:`exclusive`)."""
        backbone = self.backbone
        backbone.reset()
        hidden: Tensor | None = None
        prefill_s, prefill_calls = 0.0, 0
        if len(prompt) >= 2:
            start = _now(self.device)
            step = backbone.extend(torch.tensor([prompt[:-1]], device=self.device))
            hidden = step.draft_hidden[:, -1]
            prefill_s, prefill_calls = _now(self.device) - start, 1
        c, output, rounds = prompt[-1], [], []
        scanner = stop.scanner(prompt)
        keep = scanner.keep(output)
        while keep is None:
            base = backbone.length
            move, step, stats = self._round(c, hidden, config, generator, tracker)
            if tracker is not None:
                tracker.emit(move.emitted)
            backbone.crop(base + move.keep)
            hidden = step.draft_hidden[:, move.keep - 1]
            c = move.next_token
            output.extend(move.emitted)
            rounds.append(stats)
            keep = scanner.keep(output)
        output = output[:keep]
        if output:
            backbone.crop(len(prompt) + len(output) - 1)
        tokens = torch.tensor(output, dtype=torch.long)
        return DecodeResult(tokens, rounds, summarize(rounds, len(output), prefill_calls, prefill_s))


class SpeculativeDecoder(AutoregressiveDecoder):
    """Lossless speculative decoding with a circuit draft head, one backbone call per round.

    Args:
        backbone: a :class:`Backbone`, or an HF causal LM (wrapped in ``HFBackbone`` with
            ``lora_layers`` LoRA layers on its draft branch).
        head: a :class:`DraftHead` whose circuit spans ``window >= 2`` variables.
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
    """

    def __init__(self, backbone: Backbone | object, head: DraftHead, *, lora_layers: int = 0,
                 policy: CorrectionPolicy = CorrectionPolicy.EXACT, compile: bool = False,
                 draft_length: DraftLength | None = None,
                 constrained_drafting: ConstrainedDrafting = ConstrainedDrafting.PRODUCT) -> None:
        rule = DraftLength.fixed() if draft_length is None else draft_length
        if not isinstance(rule, DraftLength):
            raise DecoderError(f"draft_length must be a circuits_llm.decoding.draft_length."
                               f"DraftLength, got {draft_length!r}")
        window = getattr(head, "window", 1)
        blocks: tuple[int, ...] = (1,)
        if isinstance(window, int) and not isinstance(window, bool) and window >= 2:
            rule.check(window)
            blocks = tuple(length + 1 for length in rule.lengths(window))
        self.backbone = as_backbone(backbone, lora_layers, compile, blocks)
        problem = draft_head_problem(head)
        if problem is not None:
            raise DecoderError(f"head must implement circuits_llm.protocols.DraftHead: {problem}")
        if head.vocab_size != self.backbone.vocab_size:
            raise DecoderError(f"the head's vocab_size {head.vocab_size} differs from the "
                               f"backbone's {self.backbone.vocab_size}")
        if head.hidden_size != self.backbone.hidden_size:
            raise DecoderError(f"the head reads hidden states of size {head.hidden_size} but the "
                               f"backbone's are {self.backbone.hidden_size}")
        circuit = head.circuit
        if head.window < 2 or circuit.num_variables != head.window:
            raise DecoderError(f"the head's window must be >= 2 (variable 0 is the known next "
                               f"token, the rest are drafted) and match its circuit's "
                               f"{circuit.num_variables} variables; got window={head.window}")
        draft_size = check_draft_tokens(head)
        if any(k != draft_size for k in circuit.category_sizes):
            raise DecoderError(f"every circuit variable must have {draft_size} categories (the "
                               f"head's draft vocabulary), got {list(circuit.category_sizes)}")
        if not isinstance(policy, CorrectionPolicy):
            raise DecoderError(f"policy must be a CorrectionPolicy, got {policy!r}")
        if not isinstance(constrained_drafting, ConstrainedDrafting):
            raise DecoderError(f"constrained_drafting must be a ConstrainedDrafting, got "
                               f"{constrained_drafting!r}")
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

    @property
    def device(self) -> torch.device:
        """The head's circuit device (drafts and conditionals live there)."""
        return self.head.circuit.device

    def _program(self, config: SamplingConfig) -> RoundProgram:
        """The round's draft/accept programs for ``config``: built (and compiled) once per
        configuration, since warping and greedy/sampling are part of the program."""
        program = self._programs.get(config)
        if program is None:
            program = self._programs[config] = RoundProgram(
                self.head, config, compile=self.compile, compiler=self._compiler,
                draft_length=self.draft_length)
        return program

    def _drafter(self, tracker: ConstraintTracker) -> ProductDrafter:
        """The product drafter of the tracker's automaton (built once per automaton)."""
        drafter = self._drafters.get(tracker.automaton)
        if drafter is None:
            drafter = self._drafters[tracker.automaton] = ProductDrafter(self.head,
                                                                         tracker.automaton)
            tracker.pending += drafter.build_seconds  # constraint work, paid once per automaton
        return drafter

    def _round(self, c: int, hidden: Tensor | None, config: SamplingConfig,
               generator: torch.Generator | None, tracker: ConstraintTracker | None = None
               ) -> tuple[Transition, BackboneStep, RoundStats]:
        if hidden is None:  # one-token prompt: nothing to parameterise the head with yet
            return super()._round(c, hidden, config, generator, tracker)
        program, clock = self._program(config), self.device
        size = 0
        t0 = _now(clock)
        uniforms = None if config.greedy else program.draw_uniforms(generator)
        if tracker is not None and self.constrained_drafting is ConstrainedDrafting.PRODUCT:
            first = torch.tensor([c], device=clock)
            params = head_parameters(self.head.circuit, program.head_parameters(hidden, first))
            draws = None if config.greedy else torch.rand(
                program.window - 1, generator=generator, dtype=torch.float64, device=clock)
            drafter = self._drafter(tracker)
            draft, seconds = drafter.draft(params, c, tracker.state, draws, self.draft_length)
            tracker.pending += seconds
            size = drafter.last_size
            length = int(draft.length)  # type: ignore[arg-type]
        else:
            draft = program.draft(hidden, torch.tensor([c], device=clock), uniforms)
            length = program.verified(draft)  # L: verify [c, d_1..d_L]
        t1 = _now(clock)
        block = draft.block if length == program.window - 1 else draft.block[:, :length + 1]
        step = self.backbone.extend(block)
        t2 = _now(clock)
        logits = step.verifier_logits[0]
        if tracker is not None:  # row k: the state after c, d_1..d_k
            logits = tracker.masked(logits, block[0, 1:].tolist())
        outcome = program.outcome(program.accept(logits, draft, uniforms))
        t3 = _now(clock)
        self._explain_failure(outcome, program, hidden, c, step, config)
        move = transition(self.policy, outcome.draft, outcome.accepted, outcome.token)
        # impossible evidence: every draft was rejected and p_1 decided, an AR step in law;
        # otherwise ``drafted`` is L, the drafts this round verified
        kind, drafted = (RoundKind.SPECULATIVE, len(outcome.draft)) if outcome.possible else \
            (RoundKind.AUTOREGRESSIVE, 0)
        stats = RoundStats(kind, drafted, outcome.accepted, len(move.emitted), draft_s=t1 - t0,
                           verify_s=t2 - t1, accept_s=t3 - t2, total_s=t3 - t0,
                           constraint_s=0.0 if tracker is None else tracker.take(),
                           product_size=size)
        return move, step, stats

    def _explain_failure(self, outcome: RoundOutcome, program: RoundProgram, hidden: Tensor,
                         c: int, step: BackboneStep, config: SamplingConfig) -> None:
        """Turn a round's failed flag into the detailed error of the eager checks (rare path:
        the fast path only carries two booleans back to the host)."""
        if not outcome.head_ok:
            with torch.no_grad():
                first = torch.tensor([c], device=hidden.device)
                head_parameters(self.head.circuit, program.head_parameters(hidden, first))
            raise DecoderError("the draft head's output for this round is not finite")
        if not outcome.verifier_ok:
            target_probs(step.verifier_logits[0], config, VERIFIER_LOGITS)
            raise DecoderError(f"{VERIFIER_LOGITS} have a row without a finite maximum")
