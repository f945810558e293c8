"""A circuit on the draft block (issue 44, item 2(b)): one pass of a context-aware block, then an
exact joint law over the whole window from any circuit head.

A round runs the :class:`~circuits_llm.draft_block.block.DraftBlock` ONCE, at the last verified
position: its first step (:meth:`~circuits_llm.draft_block.follower.BlockCacheFollower.first_step`)
appends the pending pairs of the previous round's accepted positions and the round's own pair
``(h_{N-2}, c)`` to the block's KV cache, and returns the block's output ``o_1`` (1, d) there,
which has read the whole context through the block's attention. ``o_1`` is then the hidden state
of a circuit head (:class:`~circuits_llm.heads.MTPHead`: FF, CP, HMM, BTree or a user's circuit,
with or without the token input, over its own compressed draft vocabulary or all ``V``), and the
circuit part of the round is :class:`~circuits_llm.decoding.round.RoundProgram`'s own draft
program: the conditioned bottom-up pass, the top-down draw of the window (max-product completion
when greedy) and the exact conditionals ``q`` of the drafts, then the shared accept program. The
program only swaps the hidden state it is given for ``o_1``; everything the circuit heads' exactness
argument (docs/decoder-exactness.md) needs holds unchanged, because ``o_1`` is a function of
verified tokens only (never of this round's drafts).

Alignment: the block at position ``N-2`` reads ``(h_{N-2}, x_{N-1} = c)``, so ``o_1`` plays the
part of a hidden state after ``x_{N-2}`` whose window is ``(X_0 = c, d_1, .., d_{n-1})``, as for
a head on the backbone's feature; training (:mod:`circuits_llm.training.block_circuit`)
uses the same alignment.

Because the round program is a head's :class:`~circuits_llm.decoding.round.RoundProgram` with
another hidden state (:meth:`BlockCircuitRoundProgram.head_hidden`), the decoder's modes apply as
to a head: the context copy (``lookup``), every ``draft_length`` rule, and a constraint with
``FREE`` or ``PRODUCT`` drafting (the head's circuit on ``o_1`` times the automaton, forced runs
and respelling included); every path calls the block exactly once a round.

The cache follows the verifier exactly as :class:`~circuits_llm.draft_block.drafter.BlockDrafter`'s
does (the shared :class:`~circuits_llm.draft_block.follower.BlockCacheFollower`), and here there are
no speculative entries at all: only verified pairs ever enter the cache.

The block's own draft vocabulary (that of its LM-head readout, used by recursive drafting and
block training) plays no part here: the drafts are the head's categories, so the head's draft
vocabulary is the round's, whatever the block's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.inputs import check_draft_tokens
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.warping import DecoderError, SamplingConfig
from circuits_llm.draft_block.block import DraftBlock, DraftBlockError
from circuits_llm.draft_block.follower import BlockCacheFollower
from circuits_llm.draft_block.step import BlockStepMode
from circuits_llm.draft_block.weights import DraftWeights
from circuits_llm.protocols import draft_head_problem
from circuits_llm.runtime.compiling import Compiler

__all__ = ["BlockCircuitDrafter", "BlockCircuitRoundProgram"]


def check_block_head(block: DraftBlock, head: object) -> None:
    """Raise one :class:`DraftBlockError` when ``head`` cannot read ``block``'s outputs: it is not
    a :class:`~circuits_llm.protocols.DraftHead`, reads another hidden size than the block's
    ``d``, is built for another vocabulary ``V``, has a window below 2 or one its circuit does not
    span, a bad draft vocabulary, or lives on another device."""
    problem = draft_head_problem(head)
    if problem is not None:
        raise DraftBlockError(f"a BlockCircuitDrafter drafts with a circuit head: {problem}")
    hidden, vocab = head.hidden_size, head.vocab_size  # type: ignore[attr-defined]
    if hidden != block.hidden_size:
        raise DraftBlockError(f"the head reads hidden states of size {hidden} but the block's "
                              f"outputs are {block.hidden_size} wide")
    if vocab != block.vocab_size:
        raise DraftBlockError(f"the head drafts for a vocabulary of {vocab} ids but the block's "
                              f"target has {block.vocab_size}")
    circuit, window = head.circuit, head.window  # type: ignore[attr-defined]
    if window < 2 or circuit.num_variables != window:
        raise DraftBlockError(f"the head's window must be >= 2 and match its circuit's "
                              f"{circuit.num_variables} variables, got {window}")
    try:
        size = check_draft_tokens(head)  # type: ignore[arg-type]
    except DecoderError as error:
        raise DraftBlockError(str(error)) from error
    if any(k != size for k in circuit.category_sizes):
        raise DraftBlockError(f"every circuit variable must have {size} categories (the head's "
                              f"draft vocabulary), got {list(circuit.category_sizes)}")
    device = block.device
    if circuit.device != device:
        raise DraftBlockError(f"the head's circuit is on {circuit.device} but the block on "
                              f"{device}: move both to one device")


class BlockCircuitDrafter(BlockCacheFollower):
    """A :class:`~circuits_llm.protocols.ContextDrafter`: the draft block run once per round,
    its output read by a circuit head that drafts the whole window with its exact joint law.

    Use it as ``SpeculativeDecoder(model, BlockCircuitDrafter(block, head))``.

    Args:
        block: the :class:`DraftBlock` (its weights are read, not trained here).
        head: a circuit head (:class:`~circuits_llm.heads.MTPHead` or any
            :class:`~circuits_llm.protocols.DraftHead`) of the block's hidden size and
            vocabulary, on the block's device.
        step_mode: when the block's calls run compiled
            (:class:`~circuits_llm.draft_block.follower.BlockCacheFollower`).
        weights: how the block's projections are held
            (:class:`~circuits_llm.draft_block.follower.BlockCacheFollower`; default: int8 on a
            CPU).

    Attributes:
        head: the circuit head.
        window: the head's window ``n`` (the verified token and ``n - 1`` drafts).
        draft_tokens: the head's draft vocabulary (``None``: all ``V``).

    Raises:
        DraftBlockError: a block that is not a :class:`DraftBlock`, or a head that cannot read
            its outputs (:func:`check_block_head`).
    """

    def __init__(self, block: DraftBlock, head: object, *,
                 step_mode: BlockStepMode = BlockStepMode.AUTO,
                 weights: DraftWeights = DraftWeights.AUTO) -> None:
        super().__init__(block, step_mode, weights)
        check_block_head(block, head)
        self.head = head
        self.window: int = head.window  # type: ignore[attr-defined]
        self.draft_tokens: Tensor | None = getattr(head, "draft_tokens", None)

    @staticmethod
    def decoding_problem(lookup: ContextLookup | None, draft_length: DraftLength) -> str | None:
        """Why the decoder cannot draft with this drafter given ``lookup`` and ``draft_length``,
        or ``None``: the circuit on the block takes the context copy and every rule, as a head
        does (its round program is a head's)."""
        return None

    def round_program(self, config: SamplingConfig, *, compile: bool = False,
                      compiler: Compiler | None = None, draft_length: DraftLength | None = None,
                      lookup: ContextLookup | None = None) -> BlockCircuitRoundProgram:
        """The round's program for ``config`` (:class:`BlockCircuitRoundProgram`), with the
        decoder's ``draft_length`` rule and context copy ``lookup``, as a head's
        :class:`~circuits_llm.decoding.round.RoundProgram` takes them."""
        return BlockCircuitRoundProgram(self, config, compile=compile, compiler=compiler,
                                        draft_length=draft_length, lookup=lookup)


class BlockCircuitRoundProgram(RoundProgram):
    """A circuit head's round program whose hidden state is the block's output.

    :meth:`head_hidden` runs the block's one step (its cache grows by the verified pairs; compiled
    with ``compile``, :meth:`~circuits_llm.draft_block.follower.BlockCacheFollower.compile_steps`)
    and returns ``o_1`` (1, d); :meth:`RoundProgram.draft` calls it once a round and runs the head
    and the circuit (compiled with ``compile``) on it, with the copy component and the draft-length
    rule as for a head, and the decoder's product drafting under a constraint calls it once a
    round too; the accept program is the shared one. Every other method (uniform tape,
    :meth:`RoundProgram.conditionals`, :meth:`RoundProgram.verified`) is the circuit head's,
    called with ``o_1`` as the hidden state.

    Args:
        drafter: the :class:`BlockCircuitDrafter` whose block, cache and head the round uses.
        config: the sampling configuration (greedy when ``temperature == 0``).
        compile, compiler, draft_length, lookup: as for :class:`RoundProgram`.
    """

    def __init__(self, drafter: BlockCircuitDrafter, config: SamplingConfig, *,
                 compile: bool = False, compiler: Compiler | None = None,
                 draft_length: DraftLength | None = None,
                 lookup: ContextLookup | None = None) -> None:
        super().__init__(drafter.head, config, compile=compile, compiler=compiler,
                         draft_length=draft_length, lookup=lookup)
        self.drafter = drafter
        if compile:
            drafter.compile_steps(compiler)

    def block_output(self, hidden: Tensor, c: Tensor) -> Tensor:
        """The round's one block call: ``hidden`` (1, d) the seed feature ``h_{N-2}``, ``c`` (1,)
        long the verified token -> ``o_1`` (1, d) on the circuit's device (the pending pairs and
        ``(hidden, c)`` join the block's cache)."""
        with torch.no_grad():
            return self.drafter.first_step(hidden, c).to(self.circuit.device)

    def head_hidden(self, hidden: Tensor, c: Tensor) -> Tensor:
        """``o_1`` (1, d): :meth:`block_output`, the hidden state the head reads this round."""
        return self.block_output(hidden, c)
