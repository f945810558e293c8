"""The two contracts the speculative decoder is written against.

* :class:`Backbone`: a causal LM with a KV cache that returns, for every new position, the
  verifier's next-token logits and the hidden state the draft head reads (the same final hidden
  state without LoRA; the draft branch's state with LoRA on the last k layers).
* :class:`DraftHead`: maps hidden states to the parameters of a compiled circuit over a window of
  ``window`` future tokens (variables ``0 .. window-1``, ``vocab_size`` categories each).
* :class:`ContextDrafter`: a drafter with its own state over the context (a draft block with its
  own KV cache, :mod:`circuits_llm.draft_block`): it builds a round's drafts itself and follows
  the verifier, fed the features of the positions each round accepts.

Alignment (shared by training and decoding): the head applied to the hidden state after token
``x_t`` describes the window ``(x_{t+1}, ..., x_{t+window})``; variable 0 is ``x_{t+1}``.

Both are static types only. Conformance at run time is :func:`backbone_problem` and
:func:`draft_head_problem`: plain ``getattr`` checks that name what is missing. A structural
``isinstance`` against a runtime-checkable Protocol cannot be used, because since Python 3.12 it
reads attributes with ``inspect.getattr_static``, which does not see an ``nn.Module``'s
submodules and parameters (they live in ``_modules`` and ``_parameters``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from circuits.compiled import CompiledCircuit


@dataclass
class BackboneStep:
    """What one backbone call returns for the ``m`` tokens it appended.

    Attributes:
        verifier_logits: (B, m, V) next-token logits of the target model at each new position.
        draft_hidden: (B, m, d) hidden state the draft head reads at each new position.
    """

    verifier_logits: Tensor
    draft_hidden: Tensor


class Backbone(Protocol):
    """A causal LM with caches, seen by the decoder."""

    vocab_size: int
    hidden_size: int

    @property
    def length(self) -> int:
        """Number of tokens currently held in the caches."""
        ...

    def reset(self) -> None:
        """Empty every cache (start a new sequence)."""
        ...

    def extend(self, tokens: Tensor) -> BackboneStep:
        """Run ``tokens`` (B, m) after the cached ones in one forward call and cache them."""
        ...

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached positions in every cache (rollback)."""
        ...


class DraftHead(Protocol):
    """Maps hidden states to circuit parameters for a window of future tokens.

    A head may also read the verified token ``c`` (``X_0``): it then has ``reads_token = True``
    and is called ``head(hidden, token)`` with ``token`` (B,) long, ``X_0``'s category (a
    draft-vocabulary index when it has ``draft_tokens``; -1 for a token outside them, which the
    head must read as "no token": the round then drafts after a stand-in for it). Call it
    through :func:`draft_parameters`, which passes the token only to heads that read it.
    """

    window: int
    vocab_size: int
    hidden_size: int
    circuit: CompiledCircuit

    def __call__(self, hidden: Tensor) -> dict[str, Tensor]:
        """``hidden`` (B, d) -> external parameters of :attr:`circuit` with batch B."""
        ...


class ContextDrafter(Protocol):
    """A drafter that reads the context through state of its own, kept in step with the verifier.

    The decoder calls :meth:`begin` once per sequence with the prefill's features, builds one
    program per sampling configuration with :meth:`round_program` (its ``draft`` returns the
    round's :class:`~circuits_llm.decoding.round_data.DraftResult` with the exact ``q``; the
    accept part is the shared :class:`~circuits_llm.decoding.round.AcceptProgram`), and after each
    round calls :meth:`follow` with the features of the positions the round kept. Position
    alignment as for heads: the feature at position ``j`` (the backbone's draft hidden state after
    ``x_j``) is read with the token ``x_{j+1}``.

    Optional members the decoder (:mod:`circuits_llm.decoding.decoder`, through
    :mod:`circuits_llm.decoding.context_drafting`) uses when present; the run-time check
    (:func:`context_drafter_problem`) asks only for the members above:

    * ``decoding_problem(lookup, rule) -> str | None``: why the drafter cannot decode with the
      decoder's ``lookup`` (a :class:`~circuits_llm.decoding.lookup.ContextLookup` or ``None``)
      and ``draft_length`` rule (a :class:`~circuits_llm.decoding.draft_length.DraftLength`), or
      ``None``. The decoder raises a ``DecoderError`` naming the drafter with that reason when the
      decoder is built. A drafter without it takes neither: only ``lookup=None`` and
      ``DraftLength.fixed()`` (every draft verified) are accepted.
    * ``round_program(config, *, compile=, compiler=, draft_length=, lookup=)``: with a
      ``decoding_problem`` the decoder also passes its rule and lookup as these two keywords
      (without one it passes only ``compile`` and ``compiler``).
    * ``device``: a ``torch.device`` where the drafts (and ``q``) live; without it, the CPU.

    What the decoder reads of the program ``round_program`` returns: ``window`` (the drafter's),
    ``draw_uniforms(generator)`` (sampling only: a round's float64 uniforms, the accept part's
    ``window`` last), ``draft(hidden (1, d), c (1,) long, uniforms or None, component)`` with
    ``component`` the round's copy component (``(n+1,)`` float64 with a lookup, else ``None``)
    -> ``DraftResult``, ``verified(draft) -> int`` (``L``, the drafts to verify), and the accept
    part's ``accept`` and ``outcome``. A ``DraftResult`` whose ``head_ok`` is false makes the
    decoder raise ("the draft block's logits for this round are not finite"). Under a constraint
    with ``ConstrainedDrafting.PRODUCT``, the program drafts:

    * from the product of its head's circuit and the constraint's automaton when it is a
      :class:`~circuits_llm.decoding.round.RoundProgram` (the circuit on a draft block): the
      decoder calls its ``head_hidden(hidden (1, d), c (1,)) -> (1, d)`` exactly once a round to
      get the hidden state the head reads (a program with state, such as a block, runs its one
      step there), then ``head_parameters`` and the product drafter on ``head`` and ``circuit``;
    * else by its own ``constrained_draft(hidden, c, uniforms, tracker, component)``, when it
      has one: ``tracker`` the :class:`~circuits_llm.decoding.constrained.ConstraintTracker`
      (``tracker.state`` the automaton's state after ``c``); every draft must be a token the
      automaton allows and ``q`` exactly the law each was drawn from; the decoder verifies
      ``int(draft.length)`` drafts and counts a round whose ``possible`` is false (nothing
      could be drafted) as autoregressive;
    * else freely, as without a constraint (only the target is masked).

    A batch of prompts (:mod:`circuits_llm.decoding.batch`) keeps per-row state for a draft
    block's drafters only (:mod:`circuits_llm.draft_block.batch`), without ``lookup`` or a
    ``draft_length`` rule.
    """

    window: int
    vocab_size: int
    hidden_size: int

    def begin(self, hidden: Tensor, tokens: Tensor) -> None:
        """Start a sequence: ``hidden`` (1, m, d) features of the prefilled positions except the
        last (whose feature seeds the first round), ``tokens`` (m,) the token after each."""
        ...

    def follow(self, hidden: Tensor, tokens: Tensor) -> None:
        """After a round: ``hidden`` (1, m, d) the verify forward's features of the kept block's
        positions except the last, ``tokens`` (m,) the token after each (drafts the round
        accepted, or forced tokens)."""
        ...

    def round_program(self, config: object, *, compile: bool = False,
                      compiler: object | None = None) -> object:
        """The round's program for ``config`` (a
        :class:`~circuits_llm.decoding.warping.SamplingConfig`): a
        :class:`~circuits_llm.decoding.round.AcceptProgram` (the shared accept part) with
        ``draw_uniforms``, ``draft`` and ``verified``; ``compiler`` a
        :class:`~circuits_llm.runtime.compiling.Compiler` (this floor imports neither). A drafter
        with ``decoding_problem`` also takes ``draft_length=`` and ``lookup=`` (see above)."""
        ...


def draft_parameters(head: object, hidden: Tensor, token: Tensor) -> dict[str, Tensor]:
    """A head's raw circuit parameters for ``hidden`` (B, d) and ``X_0``'s category ``token``
    (B,) long: ``head(hidden, token)`` for a head that reads the token (``reads_token``), else
    ``head(hidden)``."""
    if getattr(head, "reads_token", False):
        return head(hidden, token)  # type: ignore[operator,no-any-return]
    return head(hidden)  # type: ignore[operator,no-any-return]


#: The members the run-time checks below read: typed attributes, then methods.
_BACKBONE_ATTRIBUTES: dict[str, type] = {"vocab_size": int, "hidden_size": int, "length": int}
_BACKBONE_METHODS = ("reset", "extend", "crop")
_DRAFT_HEAD_ATTRIBUTES: dict[str, type] = {"window": int, "vocab_size": int, "hidden_size": int,
                                           "circuit": CompiledCircuit}
_DRAFT_HEAD_METHODS = ("__call__",)
_CONTEXT_DRAFTER_ATTRIBUTES: dict[str, type] = {"window": int, "vocab_size": int,
                                                "hidden_size": int}
_CONTEXT_DRAFTER_METHODS = ("begin", "follow", "round_program")


def _problem(obj: object, attributes: dict[str, type], methods: tuple[str, ...],
             contract: str) -> str | None:
    """What ``obj`` lacks to meet ``contract``: every missing or mistyped member, or ``None``."""
    missing: list[str] = []
    wrong: list[str] = []
    for name in (*attributes, *methods):
        try:
            value = getattr(obj, name)
        except AttributeError:
            missing.append(name)
            continue
        except Exception as error:  # a failing property is as good as missing: say why
            wrong.append(f"{name} (reading it raised {type(error).__name__}: {error})")
            continue
        expected = attributes.get(name)
        if expected is None:
            if not callable(value):
                wrong.append(f"{name} (not callable)")
        elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            wrong.append(f"{name} (a {expected.__name__} expected, got {type(value).__name__})")
    if not missing and not wrong:
        return None
    parts = (["it has no " + ", ".join(missing)] if missing else []) + wrong
    return f"{type(obj).__name__} does not implement {contract}: {'; '.join(parts)}"


def backbone_problem(obj: object) -> str | None:
    """Why ``obj`` is not a :class:`Backbone` (names each missing or mistyped member), or ``None``."""
    return _problem(obj, _BACKBONE_ATTRIBUTES, _BACKBONE_METHODS, "circuits_llm.protocols.Backbone")


def draft_head_problem(obj: object) -> str | None:
    """Why ``obj`` is not a :class:`DraftHead` (names each missing or mistyped member), or ``None``.

    Works for ``nn.Module`` heads on every Python version: ``getattr`` sees submodules such as
    the compiled ``circuit``.
    """
    return _problem(obj, _DRAFT_HEAD_ATTRIBUTES, _DRAFT_HEAD_METHODS,
                    "circuits_llm.protocols.DraftHead")


def context_drafter_problem(obj: object) -> str | None:
    """Why ``obj`` is not a :class:`ContextDrafter` (names each missing or mistyped member), or
    ``None``; ``getattr`` checks, so ``nn.Module`` drafters are seen whole."""
    return _problem(obj, _CONTEXT_DRAFTER_ATTRIBUTES, _CONTEXT_DRAFTER_METHODS,
                    "circuits_llm.protocols.ContextDrafter")
