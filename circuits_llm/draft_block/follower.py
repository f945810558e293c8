"""A draft block's KV cache for one sequence, kept in step with the verifier's: the part every way
of drafting from the block shares (the recursion, :mod:`~circuits_llm.draft_block.drafter`; the
circuit on the block, :mod:`~circuits_llm.draft_block.circuit_drafter`; each row of a batch,
:mod:`~circuits_llm.draft_block.batch`).

Between rounds the cache holds the block's entries of the positions whose pair ``(h_j, x_{j+1})``
is verified. After a round the speculative entries are cropped and the kept positions' pairs
(features the verify forward already computed) become pending: they join the next round's first
block call, so the cache follows the verifier with no extra backbone call and no extra block
call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_llm.draft_block.block import DraftBlock, DraftBlockError, check_pairs
from circuits_llm.draft_block.step import BlockKVCache, BlockStep, BlockStepMode
from circuits_llm.draft_block.weights import DraftWeights, drafting_block
from circuits_llm.runtime.compiling import Compiler

__all__ = ["BlockCacheFollower"]


class BlockCacheFollower:
    """A draft block's KV cache for one sequence, kept in step with the verifier's: the part of a
    :class:`~circuits_llm.protocols.ContextDrafter` over a :class:`DraftBlock` that every way of
    drafting from the block shares
    (:class:`~circuits_llm.draft_block.drafter.BlockDrafter`'s recursion,
    :class:`~circuits_llm.draft_block.circuit_drafter.BlockCircuitDrafter`'s circuit).

    The block runs through a :class:`~circuits_llm.draft_block.step.BlockStep` over a
    preallocated :class:`~circuits_llm.draft_block.step.BlockKVCache` (eager, or compiled once a
    round program is built with ``compile``, as ``step_mode`` says: :meth:`compile_steps`).

    Args:
        block: the draft block.
        step_mode: when the block's calls run compiled
            (:class:`~circuits_llm.draft_block.step.BlockStepMode`; default: with compiled round
            programs on a GPU).
        weights: how the block's projections are held
            (:class:`~circuits_llm.draft_block.weights.DraftWeights`; default: int8 where the
            packed kernel runs, a CPU, else as trained).

    Attributes:
        block: the draft block the drafter runs: the one given, or its int8 copy
            (:func:`~circuits_llm.draft_block.weights.drafting_block`).
        step: the block's decode step (shared by shallow copies, as the weights are).
        cache: the block's KV cache.
        length: positions of the cache holding verified pairs (speculative ones come after).
    """

    def __init__(self, block: DraftBlock, step_mode: BlockStepMode = BlockStepMode.AUTO,
                 weights: DraftWeights = DraftWeights.AUTO) -> None:
        if not isinstance(block, DraftBlock):
            raise DraftBlockError(f"a {type(self).__name__} drafts with a DraftBlock, got "
                                  f"{type(block).__name__}")
        if not isinstance(step_mode, BlockStepMode):
            raise DraftBlockError(f"step_mode must be a BlockStepMode, got {step_mode!r}")
        if not isinstance(weights, DraftWeights):
            raise DraftBlockError(f"weights must be a DraftWeights, got {weights!r}")
        self.weights = weights.resolve(block)  # AS_TRAINED or INT8
        self.block = drafting_block(block, self.weights)
        self.step_mode = step_mode
        self.vocab_size: int = block.vocab_size
        #: the width of the features it reads from the backbone (the block's ``feature_size``)
        self.hidden_size: int = block.feature_size
        self.step = BlockStep(self.block)
        self.cache: BlockKVCache = self.step.new_cache()
        self.length = 0
        self._pending: tuple[Tensor, Tensor] | None = None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target's layers whose outputs the drafter reads besides the LM head's input (the
        block's fused layers; ``()``: none). A decoder given the model builds its backbone with
        them (:class:`~circuits_llm.backbone.HFBackbone`'s ``feature_layers``)."""
        return self.block.fused_layers

    @property
    def device(self) -> torch.device:
        """Where the block's weights (and its drafts) live."""
        return self.block.device

    # ------------------------------------------------------------------ the cache
    def _check(self, hidden: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """``hidden`` (1, m, F) features and ``tokens`` (m,) checked, on the block's device ->
        the ``h`` the block reads (1, m, d) (:meth:`DraftBlock.read_features`) and the tokens."""
        hidden, tokens = check_pairs(hidden, tokens, self.hidden_size, self.device)
        return self.block.read_features(hidden), tokens

    def begin(self, hidden: Tensor, tokens: Tensor) -> None:
        """Start a sequence: an empty cache; the prefill's pairs ``hidden`` (1, m, d), ``tokens``
        (m,) pending (run with the first round's first step)."""
        hidden, tokens = self._check(hidden, tokens)
        self.cache = self.step.new_cache()
        self.length = 0
        self._pending = (hidden, tokens) if tokens.numel() else None

    def follow(self, hidden: Tensor, tokens: Tensor) -> None:
        """After a round: crop the speculative entries; the kept positions' pairs ``hidden``
        (1, m, d) (the verify forward's features) and ``tokens`` (m,) become pending."""
        hidden, tokens = self._check(hidden, tokens)
        if self._pending is not None:  # a round that never drafted (a one-token prompt's first)
            hidden = torch.cat([self._pending[0], hidden], 1)
            tokens = torch.cat([self._pending[1], tokens])
        self.drop_speculative()
        self._pending = (hidden, tokens) if tokens.numel() else None

    def drop_speculative(self) -> None:
        """Crop the cache's speculative entries (those after the verified :attr:`length`)."""
        self.cache.truncate(self.length)

    def compile_steps(self, compiler: Compiler | None = None) -> None:
        """What a round program built with ``compile`` calls: from now on the block's calls run
        compiled (fixed shapes: one position, and first steps of up to ``window + 1`` positions)
        through ``compiler`` (``None``: the current one), if :attr:`step_mode` compiles on the
        block's device."""
        if self.step_mode.compiles(self.device):
            self.step.compile(self.window + 1, compiler)

    def flush(self) -> None:
        """Run the pending pairs into the cache now (the next round would have)."""
        self.drop_speculative()
        if self._pending is not None:
            hidden, tokens = self._pending
            self.step(self.cache, hidden, tokens[None])
            self.length += tokens.numel()
            self._pending = None

    def first_step(self, hidden: Tensor, c: Tensor) -> Tensor:
        """The round's first block call: the pending pairs and ``(hidden (1, F), c (1,))``, all
        verified, appended to the cache -> (1, d) the block's output at the last one."""
        features = self.block.read_features(hidden[:, None].to(self.device))
        tokens = c.to(self.device, torch.long)
        if self._pending is not None:
            features = torch.cat([self._pending[0], features.to(self._pending[0].dtype)], 1)
            tokens = torch.cat([self._pending[1], tokens])
            self._pending = None
        output = self.step(self.cache, features, tokens[None])
        self.length += tokens.numel()
        return output[:, -1]
