"""One speculative round as two fixed-shape programs with no host synchronisation inside.

A round (see :mod:`circuits_llm.decoding.decoder` for the invariant and ``docs/decoder-exactness.md`` for
the proof) is split at the backbone call:

1. :meth:`RoundProgram.draft`: ``hidden`` (1, d) and the known next token ``c`` -> the drafted
   window ``d_1..d_{n-1}``, the draft's exact conditionals ``q`` over the head's draft
   vocabulary, and how many drafts to verify, ``L`` (the
   :class:`~circuits_llm.decoding.draft_length.DraftLength` rule, ``n - 1`` by default; it reads
   only draft-side quantities, which keeps the law exact). Head forward, normalisation, the conditioned
   bottom-up pass, the top-down draw (or max-product completion when greedy), the
   prefix-conditional pass and the rule.
2. The backbone verifies ``[c, d_1..d_L]`` (one forward; :mod:`circuits_llm.backbone`).
3. :meth:`RoundProgram.accept`: the verifier's logits -> how many drafts were accepted, the
   emitted token, and the validity flags, vectorised over the window (residuals, bonus token);
   ``L`` is a tensor input and the positions after it are masked (never accepted; the bonus
   token comes from ``p_{L+1}``), so one graph serves every ``L``. A sampled round on a CPU is
   accepted row by row instead (:class:`~circuits_llm.decoding.acceptance.SampledAccept`: eager,
   one host read per test, the target's rows up to the first rejection only), with the same
   decisions.

Every tensor shape depends only on (window, draft vocabulary, model vocabulary, circuit
structure): no ``.item()``, no data-dependent shapes, no Python branch on a tensor value. So
both programs can be compiled (``torch.compile``; on CUDA also captured as CUDA graphs) and the
only thing that crosses to the host per round is one small integer tensor
(:meth:`RoundProgram.outcome`: the draft, ``L``, the accepted count, the emitted token and the
flags), which the accept program packs itself; a draft-length rule that depends on the round adds
the read of ``L`` (:meth:`RoundProgram.verified`) before the verify call, whose block length it
sets.

Compiled, both programs run as :class:`~circuits_llm.runtime.compiling.CompiledProgram`: under
CUDA graphs every output is copied out before the program returns, because the draft's outputs
are read after the backbone's verify forward and by the accept program (later compiled calls, which
may overwrite the static outputs of every earlier one); and a program the compiler refuses runs
eager, with one :class:`~circuits_llm.runtime.compiling.CompileFallbackWarning`. The draft program
returns four tensors (the verify block, ``q``, the two flags, ``L``) of which
:class:`~circuits_llm.decoding.round_data.DraftResult`'s fields are views, so that only four small
copies are made (the values the programs exchange live in :mod:`~circuits_llm.decoding.round_data`).

Randomness comes from the caller's ``torch.Generator`` as one tape of float64 uniforms per round
(:class:`~circuits_llm.decoding.round_data.UniformTape`), drawn before the programs run:
compiled code never holds a generator, and eager and compiled programs draw the same tokens from
the same tape.

Impossible evidence (the head gives ``X_0 = c`` probability zero) needs no branch either: ``q``
becomes ``0``, so every draft is rejected and the residual is ``p_1``, the autoregressive law. A
``c`` outside a compressed draft vocabulary leaves ``X_0`` unobserved instead: the drafts come
with a drawn *stand-in* for it, on which ``q`` conditions (exact: docs/decoder-exactness.md §1).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from circuits.compiled import CompiledCircuit
from circuits.compiled.layers import Semiring
from circuits.compiled.prepared import Trace
from circuits.compiled.queries import row_conditionals
from circuits.compiled.sampling import argmax_chooser, descend
from circuits.kernels import GumbelChooser, use_backend
from circuits_llm.decoding.acceptance import (
    SampledAccept,
    draw_from_row,
    round_decisions,
    row_by_row_outcome,
)
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup, mixed_conditionals, overlay
from circuits_llm.decoding.round_data import DraftResult, RoundOutcome, UniformTape
from circuits_llm.decoding.warping import DecoderError, SamplingConfig, warp_logits
from circuits_llm.protocols import draft_parameters
from circuits_llm.runtime.compiling import CompiledProgram, Compiler

#: compiled programs (head x configuration) one process can hold before Dynamo recompiles stop
MAX_PROGRAMS = 64

__all__ = ["AcceptProgram", "RoundProgram", "SampledAccept"]


def _usable(raw: Tensor) -> Tensor:
    """() bool: ``raw`` holds no NaN and no ``+inf`` and every last-dimension row has mass."""
    return (~(torch.isnan(raw) | torch.isposinf(raw))).all() & (raw.amax(-1) > -math.inf).all()


class AcceptProgram:
    """The accept program of one decoding configuration, whatever drafted: the verifier's logits,
    the draft and its conditionals ``q`` -> the accepted count and the emitted token
    (:func:`~circuits_llm.decoding.acceptance.round_decisions`; greedy: the matching prefix and an
    argmax). Shared by the circuit heads' :class:`RoundProgram` and by drafters that build their
    drafts another way (:mod:`circuits_llm.draft_block`), so every drafter is verified by the same
    code.

    Args:
        config: the sampling configuration (greedy when ``temperature == 0``).
        window: ``n``: the verified token ``c`` and up to ``n - 1`` drafts.
        vocab_size: ``V``, the model's vocabulary.
        draft_tokens: (K,) long model ids of a compressed draft vocabulary (``q``'s columns), or
            ``None`` (``q`` spans the whole vocabulary).
        device: where the program's tensors live.
        compile: run the accept program compiled
            (:class:`~circuits_llm.runtime.compiling.CompiledProgram`).
        compiler: the compiler when ``compile`` (``None``: the current one).
        label: how the compiled program is named in warnings.
    """

    def __init__(self, config: SamplingConfig, window: int, vocab_size: int,
                 draft_tokens: Tensor | None, device: torch.device, *, compile: bool = False,
                 compiler: Compiler | None = None, label: str = "") -> None:
        self.config = config
        self.window = window
        self.vocab_size = vocab_size
        self.draft_tokens: Tensor | None = None if draft_tokens is None else draft_tokens.to(device)
        # model id -> draft-vocabulary index (-1 outside it)
        self.position: Tensor | None = None
        if self.draft_tokens is not None:
            position = torch.full((vocab_size,), -1, dtype=torch.long, device=device)
            position[self.draft_tokens] = torch.arange(self.draft_tokens.numel(), device=device)
            self.position = position
        self.compiled = compile
        #: how a sampled round's accept runs (:meth:`use_sampled_accept`)
        self.sampled_accept = SampledAccept.AUTO.resolve(device)
        self._accept: Callable[..., Tensor] = self._accept_program
        if compile:
            self._accept = CompiledProgram(self._accept_program, name=f"accept program ({label})",
                                           device=device, compiler=compiler)

    def use_sampled_accept(self, mode: SampledAccept, device: torch.device) -> None:
        """Run sampled rounds' accepts as ``mode`` says on ``device`` (:class:`SampledAccept`;
        greedy rounds are unaffected)."""
        if not isinstance(mode, SampledAccept):
            raise DecoderError(f"sampled_accept must be a SampledAccept, got {mode!r}")
        self.sampled_accept = mode.resolve(device)

    def accept(self, logits: Tensor, draft: DraftResult, uniforms: Tensor | None) -> Tensor:
        """The verifier's ``logits`` (L+1, V) for the block ``[c, d_1..d_L]`` -> one long tensor
        holding, in order, the draft tokens (n-1), ``L``, the accepted count, the emitted token,
        and the head, verifier and evidence flags: everything :meth:`outcome` reads in the round's
        one host transfer. Fewer than ``n`` rows are padded to ``n`` (rows the program masks), so
        the accept program has one shape whatever ``L``. A sampled round decided
        :attr:`SampledAccept.ROW_BY_ROW` returns the same tensor, built on the host."""
        if uniforms is not None and draft.q is not None \
                and self.sampled_accept is SampledAccept.ROW_BY_ROW:
            with torch.no_grad():
                return row_by_row_outcome(logits, draft, uniforms, self.config, self.window,
                                          self.position, self.draft_tokens)
        with torch.no_grad():
            missing = self.window - logits.shape[0]
            if missing:
                logits = torch.nn.functional.pad(logits, (0, 0, 0, missing))
            if draft.extra is None:
                return self._accept(logits, draft.tokens, draft.q, draft.head_ok,
                                    draft.possible, uniforms, draft.length)
            return self._accept(logits, draft.tokens, draft.q, draft.head_ok, draft.possible,
                                uniforms, draft.length, draft.extra)

    def _accept_program(self, logits: Tensor, tokens: Tensor, q: Tensor | None, head_ok: Tensor,
                        possible: Tensor, uniforms: Tensor | None,
                        length: Tensor | None = None, extra: Tensor | None = None) -> Tensor:
        """The compiled accept program: :meth:`_accept_eager` and the packing of its decisions with
        the draft into :meth:`accept`'s one tensor (one output: one copy under CUDA graphs).
        ``length`` () long: ``L`` (``None``: ``n - 1``); ``extra``: :attr:`DraftResult.extra`."""
        if length is None:
            length = torch.full((), self.window - 1, dtype=torch.long, device=tokens.device)
        accepted, token, verifier_ok = self._accept_eager(logits, tokens, q, possible, uniforms,
                                                          length, extra)
        flags = torch.stack([head_ok, verifier_ok, possible]).long()
        return torch.cat([tokens, length[None], accepted[None], token[None], flags])

    def _accept_eager(self, logits: Tensor, tokens: Tensor, q: Tensor | None, possible: Tensor,
                      uniforms: Tensor | None, length: Tensor | int | None = None,
                      extra: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``logits`` (n, V) (rows after ``L + 1`` are padding, never read for a decision),
        ``tokens`` (n-1,) model ids, ``q`` (n-1, K) or None (greedy; with ``extra`` (n-1,) long:
        (n-1, K + 1), :attr:`DraftResult.extra`), ``length`` ``L`` (() long tensor or int;
        ``None``: ``n - 1``) -> (accepted (), emitted token (), verifier ok ())."""
        drafted = self.window - 1
        verified = torch.arange(drafted, device=tokens.device) < (drafted if length is None
                                                                   else length)
        rows = self._verified_rows(logits, length)
        if q is None:  # greedy: accept the prefix that matches the argmax, then emit an argmax
            top, best = logits.max(-1)  # the first maximum: argmax's index, in one faster pass
            ok = (torch.isfinite(top) | ~rows).all()
            # a draft the head could not make (impossible X_0 = c) is never accepted: p_1 decides
            matches = (tokens == best[:drafted]) & possible & verified
            accepted = torch.cumprod(matches.long(), 0).sum()
            return accepted, best.index_select(0, accepted[None])[0], ok
        assert uniforms is not None
        warped = warp_logits(logits, self.config)
        ok = (torch.isfinite(warped.amax(-1)) | ~rows).all()
        p = torch.softmax(warped.double(), -1)  # (n, V)
        tests = uniforms[-self.window:]
        accepted, row = self._decide(p, q, tokens, tests[:drafted], length, extra)
        return accepted, draw_from_row(row, tests[drafted]), ok

    def _verified_rows(self, logits: Tensor, length: Tensor | int | None) -> Tensor:
        """(n,) bool: the verifier rows of the block ``[c, d_1..d_L]`` (the first ``L + 1``; the
        rest is padding, whose validity does not matter)."""
        bound = self.window if length is None else length + 1
        return torch.arange(logits.shape[0], device=logits.device) < bound

    def _decide(self, p: Tensor, q: Tensor, tokens: Tensor, tests: Tensor,
                length: Tensor | int | None = None, extra: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """:func:`~circuits_llm.decoding.acceptance.round_decisions` with this program's draft
        vocabulary."""
        return round_decisions(p, q, tokens, tests, length, self.position, self.draft_tokens,
                               extra)

    @staticmethod
    def outcome(packed: Tensor) -> RoundOutcome:
        """Read :meth:`accept`'s tensor on the host: the round's one synchronisation (a rule
        whose ``L`` depends on the round adds one before the verify call)."""
        values = packed.tolist()
        return RoundOutcome(tuple(values[:values[-6]]), values[-5], values[-4], bool(values[-3]),
                            bool(values[-2]), bool(values[-1]))


class RoundProgram(AcceptProgram):
    """The draft and accept programs of one decoding configuration (head, greedy or sampling).

    Args:
        head: a draft head (``window``, ``circuit``, ``__call__(hidden) -> raw parameters``;
            optionally ``draft_tokens`` (K,) long: a compressed draft vocabulary).
        config: the sampling configuration (greedy when ``temperature == 0``).
        compile: run both programs compiled (:class:`~circuits_llm.runtime.compiling.CompiledProgram`;
            by default ``torch.compile``, ``mode="reduce-overhead"`` on CUDA: CUDA graphs). Traced
            code takes the kernels' torch path (:func:`circuits.kernels.use_triton`), which
            inductor fuses itself.
        compiler: the compiler of both programs when ``compile`` (``None``: the current one,
            :func:`~circuits_llm.runtime.compiling.use_compiler`).
        draft_length: how many drafts a round verifies
            (:class:`~circuits_llm.decoding.draft_length.DraftLength`; ``None``: the whole window).
        lookup: mix a copy of the context into the draft
            (:class:`~circuits_llm.decoding.lookup.ContextLookup`; every :meth:`draft` then takes
            the round's copy component, and a sampling round one more uniform to pick it).
    """

    def __init__(self, head: object, config: SamplingConfig, *, compile: bool = False,
                 compiler: Compiler | None = None, draft_length: DraftLength | None = None,
                 lookup: ContextLookup | None = None) -> None:
        self.head = head
        self.config = config
        self.circuit: CompiledCircuit = head.circuit  # type: ignore[attr-defined]
        self.window: int = head.window  # type: ignore[attr-defined]
        rule = DraftLength.fixed() if draft_length is None else draft_length
        if not isinstance(rule, DraftLength):
            raise DecoderError(f"draft_length must be a DraftLength, got {rule!r}")
        rule.check(self.window)
        self.draft_length = rule
        self.lookup = lookup
        #: the number of drafts every round verifies, when the rule fixes it (else None)
        self.static_length = rule.static_length(self.window)
        device = self.circuit.device
        label = (f"{getattr(head, 'architecture', None) or type(head).__name__} head, window "
                 f"{self.window}, {'greedy' if config.greedy else 'sampling'}"
                 f"{'' if rule == DraftLength.fixed() else ', draft length ' + rule.describe()}")
        super().__init__(config, self.window, head.vocab_size,  # type: ignore[attr-defined]
                         getattr(head, "draft_tokens", None), device, compile=compile,
                         compiler=compiler, label=label)
        self.draft_size = self.circuit.category_sizes[0]
        #: eager refresh of the head's cached derived tensors, which compiled code only reads
        self._refresh: Callable[[], None] | None = getattr(head, "refresh_derived", None)
        self._draft: Callable[..., tuple[Tensor, Tensor | None, Tensor, Tensor]] = \
            self._draft_program
        self.tape_length = 0 if config.greedy else self._count_uniforms()
        if compile:
            # every program compiles the same two functions for its own head and configuration:
            # room for many programs in one process before Dynamo would give up on them
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, MAX_PROGRAMS)
            dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit,
                                                     4 * MAX_PROGRAMS)
            # outputs copied out under CUDA graphs; a program the compiler refuses runs eager
            self._draft = CompiledProgram(self._draft_program, name=f"draft program ({label})",
                                          device=device, compiler=compiler)

    # ------------------------------------------------------------------ randomness
    def _count_uniforms(self) -> int:
        hidden = torch.zeros(1, self.head.hidden_size, device=self.circuit.device,  # type: ignore[attr-defined]
                             dtype=getattr(self.head, "dtype", torch.float32))
        tape = UniformTape(None)
        first = torch.zeros(1, dtype=torch.long, device=self.circuit.device)
        with torch.no_grad(), use_backend("torch"):
            self._sample_window(draft_parameters(self.head, hidden, first), first, tape)
        return tape.used

    def draw_uniforms(self, generator: torch.Generator | None) -> Tensor:
        """One round's float64 uniforms: the top-down draw's tape, the one that picks the copy
        component (with a :class:`ContextLookup`), then ``n`` for acceptance."""
        extra = 0 if self.lookup is None else 1
        return torch.rand(self.tape_length + extra + self.window, generator=generator,
                          dtype=torch.float64, device=self.circuit.device)

    # ------------------------------------------------------------------ draft
    def draft(self, hidden: Tensor, c: Tensor, uniforms: Tensor | None,
              component: Tensor | None = None) -> DraftResult:
        """``hidden`` (1, d), ``c`` (1,) long model id, ``uniforms`` from :meth:`draw_uniforms`
        (None when greedy), ``component`` the round's copy component (n+1,) float64
        (:func:`~circuits_llm.decoding.lookup.copy_component`; only with a ``lookup``) ->
        :class:`DraftResult`."""
        if (component is None) != (self.lookup is None):
            raise DecoderError("a round program built with a ContextLookup drafts with a copy "
                               "component, and only then: pass one exactly when lookup is set")
        with torch.no_grad():
            hidden = self.head_hidden(hidden, c)
            if self.compiled:  # one stride whatever block the hidden state came from: one graph
                hidden = hidden.clone(memory_format=torch.contiguous_format)
                if self._refresh is not None:
                    self._refresh()
            return self._result(*self._draft(hidden, c, uniforms, component))

    def head_hidden(self, hidden: Tensor, c: Tensor) -> Tensor:
        """The hidden state (1, d) the head reads this round, given the backbone's ``hidden``
        (1, d) and the verified token ``c`` (1,): ``hidden`` itself here. A program on a draft
        block (:class:`~circuits_llm.draft_block.BlockCircuitRoundProgram`) runs its block here;
        :meth:`draft`, and the decoder's product drafting under a constraint, call it exactly once
        a round (:meth:`conditionals` does not: it takes the head's hidden state)."""
        return hidden

    def head_parameters(self, hidden: Tensor, c: Tensor) -> dict[str, Tensor]:
        """The head's raw parameters for ``hidden`` (1, d) after the verified token ``c`` (1,)
        model id (:func:`~circuits_llm.protocols.draft_parameters`: a head that reads the token
        gets ``c``'s draft-vocabulary index, -1 outside it: a token the head has no row for)."""
        if self.position is None:
            return draft_parameters(self.head, hidden, c)
        return draft_parameters(self.head, hidden, self.position[c])

    def _evidence(self, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x`` (1, n) with ``X_0`` = c's draft index, the mask of what is observed, and () bool:
        ``c`` is in the draft vocabulary. Outside it ``X_0`` is unobserved: the top-down pass
        draws it with the drafts (argmax when greedy), a stand-in for ``c`` in ``q``."""
        n = self.window
        index = c if self.position is None else self.position[c]
        inside = (index >= 0).all()
        x = torch.nn.functional.pad(index.clamp(min=0)[None, :], (0, n - 1))
        observed = (torch.arange(n, device=c.device)[None, :] == 0) & inside
        return x, observed, inside

    def _sample_window(self, raw: dict[str, Tensor], c: Tensor,
                       chooser: GumbelChooser | None) -> tuple[Tensor, Tensor, object]:
        """The conditioned bottom-up pass and the top-down completion: ``(state (1, n) in
        draft-vocabulary indices (``X_0``: c's index, or the stand-in drawn for a c outside the
        draft vocabulary), log q(X_0 = c) (1,) (log Z for a stand-in), prepared)``."""
        circuit = self.circuit
        prepared = circuit.resolve_params(raw, None, check=False)
        x, observed, _ = self._evidence(c)
        trace = Trace()
        semiring = Semiring.SUM if chooser is not None else Semiring.MAX
        value = circuit.evaluate(x, observed, prepared, semiring=semiring, trace=trace)
        state = descend(circuit, trace, x, observed, chooser if chooser is not None else argmax_chooser)
        return state, value, prepared

    @staticmethod
    def _result(block: Tensor, q: Tensor | None, flags: Tensor, length: Tensor) -> DraftResult:
        """The draft program's four outputs -> a :class:`DraftResult` whose tokens and flags are
        views of them (no copy, no kernel)."""
        return DraftResult(block[0, 1:], block, q, flags[0], flags[1], length)

    def verified(self, draft: DraftResult) -> int:
        """``L``, the number of drafts this round verifies, on the host: the rule's fixed number,
        or a read of ``draft.length`` (one small synchronisation) for a rule that depends on the
        round. The verify block is ``draft.block[:, :L + 1]``."""
        if self.static_length is not None:
            return self.static_length
        return self.window - 1 if draft.length is None else int(draft.length)

    def _draft_program(self, hidden: Tensor, c: Tensor, uniforms: Tensor | None,
                       component: Tensor | None = None
                       ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """The compiled draft program: ``(block (1, n) long, q (n-1, K) float64 or None when
        greedy, flags (2,) bool: head_ok, possible, length () long: L)`` (see
        :class:`DraftResult`). Few outputs: under CUDA graphs each is copied out once per round.
        The draft-length rule reads the conditionals (computed for it when greedy too) and the
        drafts, nothing of the target. With a copy ``component`` the draft is the mixture's
        (:mod:`~circuits_llm.decoding.lookup`): ``q`` is its conditionals and ``L`` at most its cut."""
        raw = self.head_parameters(hidden, c)
        head_ok = torch.stack([_usable(v) for v in raw.values()]).all()
        chooser = None if uniforms is None else UniformTape(uniforms)
        state, value, prepared = self._sample_window(raw, c, chooser)
        drafted, cut = state[0, 1:], None
        if component is not None:
            choose = None if uniforms is None else uniforms[self.tape_length]
            drafted, cut = overlay(drafted, component, choose)
            state = torch.cat([state[:, :1], drafted[None]], 1)
        tokens = drafted if self.draft_tokens is None else self.draft_tokens[drafted]
        block = torch.cat([c, tokens])[None]
        possible = torch.isfinite(value).all()  # outside the vocabulary: log Z, finite
        flags = torch.stack([head_ok, possible])
        rule = self.draft_length
        if uniforms is None and not rule.needs_conditionals:
            length = rule.decide(None, drafted)
            return block, None, flags, length if cut is None else torch.minimum(length, cut)
        q = self._conditionals(prepared, state)[0]
        if component is not None:
            q = mixed_conditionals(q, drafted, component)
        q = torch.where(possible & torch.isfinite(q).all(-1, keepdim=True), q, 0.0)
        length = rule.decide(q, drafted)
        length = length if cut is None else torch.minimum(length, cut)
        return block, None if uniforms is None else q, flags, length

    def _conditionals(self, prepared: object, states: Tensor) -> Tensor:
        """``q(X_k | X_0, d_1..d_{k-1})`` for ``k = 1..n-1`` of each window in ``states``
        (B, n) draft-vocabulary indices sharing ``prepared`` (one parameter set): (B, n-1, K)
        float64.

        One bottom-up and one derivative pass over the ``B (n-1)`` prefixes; row ``k`` mixes
        only ``X_k``'s input units (:func:`~circuits.compiled.queries.row_conditionals`)."""
        batch, n = states.shape
        device = states.device
        rows = states.repeat_interleave(n - 1, dim=0)  # (B (n-1), n)
        steps = torch.arange(n, device=device)
        prefix = steps[None, :] < torch.arange(1, n, device=device)[:, None]  # (n-1, n)
        # the one parameter set serves every row (no per-row copies of the input tables)
        queried = torch.arange(1, n, device=device).repeat(batch)  # X_k for the k-th prefix
        picked = row_conditionals(self.circuit, rows, prefix.repeat(batch, 1), prepared,
                                  self.draft_size, queried)  # (B (n-1), K)
        picked = picked.view(batch, n - 1, -1).double()
        return picked / picked.sum(-1, keepdim=True)

    def conditionals(self, hidden: Tensor, c: int, drafts: Tensor,
                     component: Tensor | None = None, stand_in: int | None = None) -> Tensor:
        """The draft's exact conditionals for given drafts, as the draft program computes them
        (eager): ``hidden`` (1, d), ``c`` the verified token's model id, ``drafts`` (B, n-1)
        draft-vocabulary indices, ``component`` a copy component (mixed in when given),
        ``stand_in`` the index drawn for ``X_0`` (exactly when ``c`` is outside the draft
        vocabulary) -> (B, n-1, K) float64, what the tests' exact-law enumeration verifies with."""
        with torch.no_grad():
            first = torch.tensor([c], device=self.circuit.device)
            prepared = self.circuit.resolve_params(self.head_parameters(hidden, first), None,
                                                   check=False)
            x, _, inside = self._evidence(first)
            if bool(inside) == (stand_in is not None):
                raise DecoderError("pass stand_in (X_0's draw) exactly when c is outside the "
                                   "draft vocabulary")
            if stand_in is not None:
                x = torch.full_like(x, stand_in)
            states = torch.cat([x[:, :1].expand(drafts.shape[0], 1), drafts.to(x.device)], 1)
            q = self._conditionals(prepared, states)
            if component is None:
                return q
            return torch.stack([mixed_conditionals(row, path, component)
                                for row, path in zip(q, states[:, 1:], strict=True)])
