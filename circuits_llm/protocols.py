"""The two contracts the speculative decoder is written against.

* :class:`Backbone`: a causal LM with a KV cache that returns, for every new position, the
  verifier's next-token logits and the hidden state the draft head reads (the same final hidden
  state without LoRA; the draft branch's state with LoRA on the last k layers).
* :class:`DraftHead`: maps hidden states to the parameters of a compiled circuit over a window of
  ``window`` future tokens (variables ``0 .. window-1``, ``vocab_size`` categories each).

Alignment (shared by training and decoding): the head applied to the hidden state after token
``x_t`` describes the window ``(x_{t+1}, ..., x_{t+window})``; variable 0 is ``x_{t+1}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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


@runtime_checkable
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


@runtime_checkable
class DraftHead(Protocol):
    """Maps hidden states to circuit parameters for a window of future tokens."""

    window: int
    vocab_size: int
    hidden_size: int
    circuit: CompiledCircuit

    def __call__(self, hidden: Tensor) -> dict[str, Tensor]:
        """``hidden`` (B, d) -> external parameters of :attr:`circuit` with batch B."""
        ...
