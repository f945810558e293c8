"""Plain autoregressive decoding: the baseline every speculative decoder is measured against, and
the decode loop both share.

:class:`AutoregressiveDecoder` runs one backbone call per token. Its
:meth:`~AutoregressiveDecoder.generate` checks the arguments, builds the stop condition (the
model's EOS ids by default, stop strings, a constraint's automaton) and runs the loop of rounds;
:class:`~circuits_llm.decoding.decoder.SpeculativeDecoder` inherits all of it and replaces only
the round. The cache invariant both keep: after every round
``backbone.length == len(prompt) + len(output) - 1`` (the last token, ``c``, is decided but not
cached).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from circuits_llm.backbone.ragged_cache import context_length
from circuits_llm.decoding.acceptance import Transition
from circuits_llm.decoding.backbones import as_backbone, hf_model_under
from circuits_llm.decoding.batch import BatchDrafter, decode_batch
from circuits_llm.decoding.batch_inputs import (
    batch_prompts,
    check_context,
    is_batch,
    per_row,
    row_generators,
)
from circuits_llm.decoding.constrained import ConstraintTracker, resolve_constraint
from circuits_llm.decoding.exclusive import exclusive
from circuits_llm.decoding.inputs import check_prompt
from circuits_llm.decoding.metrics import (
    BatchResult,
    DecodeResult,
    RoundKind,
    RoundStats,
    single_row_batch,
    summarize,
)
from circuits_llm.decoding.stopping import StopCondition, eos_ids
from circuits_llm.decoding.warping import (
    VERIFIER_LOGITS,
    DecoderError,
    SamplingConfig,
    sample_token,
    target_probs,
)
from circuits_llm.protocols import Backbone, BackboneStep

__all__ = ["VERIFIER_LOGITS", "AutoregressiveDecoder", "now"]


def now(device: torch.device) -> float:
    """Seconds on the wall clock, after the device's queued work (CUDA: a synchronisation)."""
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
        start = now(self.device)
        step = self.backbone.extend(torch.tensor([[c]], device=self.device))
        logits = step.verifier_logits[0, -1:]
        if tracker is not None:
            logits = tracker.masked(logits, [])
        p = target_probs(logits[0], config, VERIFIER_LOGITS)
        verified = now(self.device)
        token = sample_token(p, config.greedy, generator)
        end = now(self.device)
        stats = RoundStats(RoundKind.AUTOREGRESSIVE, 0, 0, 1, verify_s=verified - start,
                           accept_s=end - verified, total_s=end - start,
                           constraint_s=0.0 if tracker is None else tracker.take())
        return Transition((token,), token, 1), step, stats

    @staticmethod
    def _decide_token(row: Tensor, config: SamplingConfig, generator: torch.Generator | None
                      ) -> int:
        """An autoregressive step's token from the verifier's logits ``row`` (V,): the warped
        target's draw (greedy: its argmax); what :meth:`_round` does after its backbone call, and
        each autoregressive row of a batch round (:mod:`~circuits_llm.decoding.batch`)."""
        return sample_token(target_probs(row, config, VERIFIER_LOGITS), config.greedy, generator)

    def _clock(self) -> float:
        """Seconds on the wall clock after this decoder's queued device work (:func:`now`)."""
        return now(self.device)

    def _batch_drafter(self) -> BatchDrafter | None:
        """What drafts the rows of a batch round: nothing here (every row takes an autoregressive
        step); :class:`~circuits_llm.decoding.decoder.SpeculativeDecoder` drafts with its head."""
        return None

    def _start(self, prompt: list[int], prefill: BackboneStep | None) -> None:
        """Called once per decode after the prefill of ``prompt[:-1]`` (``prefill``: its step;
        ``None`` for a one-token prompt): nothing here; a drafter with state of its own starts
        its sequence (:class:`~circuits_llm.decoding.decoder.SpeculativeDecoder`)."""

    @torch.no_grad()
    def generate(self, input_ids: Tensor | Sequence[int], max_new_tokens: int,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None,
                 eos_token_id: int | Sequence[int] | None = None,
                 stop: StopCondition | None = None, constraint: object | None = None,
                 tokenizer: Any = None, attention_mask: Tensor | None = None
                 ) -> DecodeResult | BatchResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids``, or after each prompt of
        a batch.

        Args:
            input_ids: (L,) or (1, L) token ids, or a list of ints; L >= 1. Or a batch of prompts
                of any lengths (:mod:`~circuits_llm.decoding.batch_inputs`): a list of id lists
                or of 1-D tensors, or a (B, L) tensor with ``attention_mask``; it returns a
                :class:`~circuits_llm.decoding.metrics.BatchResult` (one backbone call per round
                for the whole batch, each row exactly as if decoded alone:
                :mod:`~circuits_llm.decoding.batch`). ``max_new_tokens``, ``stop`` and
                ``generator`` may then be one per row (lists); a batch of one decodes on the
                single-prompt path.
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
            tokenizer: the model's tokenizer, to build a Regex or JsonSchema constraint (a
                speculative decoder's greedy rounds under a constraint also respell their
                drafts with it: :mod:`~circuits_llm.decoding.respelling`).

            attention_mask: (B, L) 0/1 with a (B, L) ``input_ids``: the ids of each row (left or
                right padding); makes the input a batch.

        Returns:
            :class:`DecodeResult`; ``tokens`` (T,) holds the new tokens only. For a batch, a
            :class:`~circuits_llm.decoding.metrics.BatchResult`.

        Raises:
            DecoderError: bad arguments; invalid head outputs or verifier logits; or this decoder
                (or its backbone) is already generating in another thread: not thread-safe.
        """
        if is_batch(input_ids, attention_mask):
            return self._generate_batch(input_ids, attention_mask, max_new_tokens,
                                        SamplingConfig(temperature, top_k, top_p), generator,
                                        eos_token_id, stop, constraint)
        prompt = self._prompt(input_ids)
        config = SamplingConfig(temperature, top_k, top_p)
        self._check_limit(max_new_tokens)
        eos = self._eos(eos_token_id)
        if eos_token_id is None and stop is None:
            eos = set(self.default_eos_token_ids())
        self._check_stop(stop)
        tracker = None
        if constraint is not None:  # decoding also ends at the automaton's EOS
            tracker = ConstraintTracker(resolve_constraint(
                constraint, tokenizer, self.backbone.vocab_size,
                tuple(sorted(eos)) or self.default_eos_token_ids()), tokenizer=tokenizer)
            eos.add(tracker.eos_token_id)
        condition = self._stop_condition(max_new_tokens, eos, stop)
        capacity = getattr(self.backbone, "max_length", None)
        needed = len(prompt) + max_new_tokens + self.lookahead
        if isinstance(capacity, int) and needed > capacity:
            raise DecoderError(
                f"the backbone's cache holds {capacity} tokens but this call may need {needed} "
                f"(prompt {len(prompt)} + max_new_tokens {max_new_tokens} + {self.lookahead} "
                "drafted ahead): build the backbone with a larger max_cache_len, or generate less")
        with exclusive(decoder=self, backbone=self.backbone):
            return self._decode(prompt, condition, config, generator, tracker)

    @staticmethod
    def _check_limit(max_new_tokens: object, row: str = "") -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 0:
            raise DecoderError(f"{row}max_new_tokens must be an int >= 0, got {max_new_tokens!r}")

    @staticmethod
    def _check_stop(stop: object, row: str = "") -> None:
        if stop is not None and not isinstance(stop, StopCondition):
            raise DecoderError(f"{row}stop must be a circuits_llm.decoding.stopping.StopCondition, "
                               f"got {type(stop).__name__}")

    def _generate_batch(self, input_ids: object, attention_mask: Tensor | None,
                        max_new_tokens: int | Sequence[int], config: SamplingConfig,
                        generator: torch.Generator | Sequence[torch.Generator] | None,
                        eos_token_id: int | Sequence[int] | None,
                        stop: StopCondition | Sequence[StopCondition | None] | None,
                        constraint: object | None) -> BatchResult:
        """:meth:`generate` for a batch of prompts: the arguments checked row by row, then
        :func:`~circuits_llm.decoding.batch.decode_batch` (a batch of one: the single-prompt
        path)."""
        if constraint is not None:
            raise DecoderError(
                "generate(constraint=...) is not supported for a batch of prompts yet: decode "
                "constrained prompts one at a time (generate(prompt, constraint=...))")
        prompts = batch_prompts(input_ids, attention_mask, self.backbone.vocab_size)
        batch = len(prompts)
        limits = per_row(max_new_tokens, batch, "max_new_tokens", int)
        stops = per_row(stop, batch, "stop", StopCondition)
        generators = row_generators(generator, batch)
        conditions = []
        for b, (limit, row_stop) in enumerate(zip(limits, stops, strict=True)):
            self._check_limit(limit, f"row {b}: ")
            self._check_stop(row_stop, f"row {b}: ")
            eos = self._eos(eos_token_id)
            if eos_token_id is None and row_stop is None:
                eos = set(self.default_eos_token_ids())
            conditions.append(self._stop_condition(limit, eos, row_stop))  # type: ignore[arg-type]
        check_context(prompts, [int(limit) for limit in limits],  # type: ignore[arg-type]
                      self.lookahead, context_length(self.backbone))
        drafter = self._batch_drafter()
        with exclusive(decoder=self, backbone=self.backbone):
            if batch == 1:
                return single_row_batch(self._decode(prompts[0], conditions[0], config,
                                                     generators[0]))
            return decode_batch(self, drafter, prompts, conditions, config, generators)

    @staticmethod
    def _stop_condition(max_new_tokens: int, eos: set[int], stop: StopCondition | None
                        ) -> StopCondition:
        """One prompt's stop condition: ``max_new_tokens`` and the EOS ids ``eos``, with the
        limits, EOS ids and stop strings of ``stop`` added."""
        return StopCondition(
            max_new_tokens if stop is None else min(max_new_tokens, stop.max_new_tokens),
            tuple(sorted(eos)) + (() if stop is None else stop.eos_token_ids),
            () if stop is None else stop.stop_strings, criteria=() if stop is None else stop.criteria)

    def _decode(self, prompt: list[int], stop: StopCondition, config: SamplingConfig,
                generator: torch.Generator | None,
                tracker: ConstraintTracker | None = None) -> DecodeResult:
        """The body of :meth:`generate` on checked arguments (run under :func:`exclusive`)."""
        backbone = self.backbone
        backbone.reset()
        hidden: Tensor | None = None
        prefill_s, prefill_calls = 0.0, 0
        prefill: BackboneStep | None = None
        if len(prompt) >= 2:
            start = now(self.device)
            prefill = backbone.extend(torch.tensor([prompt[:-1]], device=self.device))
            hidden = prefill.draft_hidden[:, -1]
            prefill_s, prefill_calls = now(self.device) - start, 1
        self._start(prompt, prefill)
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
