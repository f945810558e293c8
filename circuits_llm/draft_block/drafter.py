"""Recursive drafting from a draft block (FastMTP), exact under the decoder's verifier, with a KV
cache that follows the verifier's.

Alignment (as for the heads): between rounds the backbone caches ``x_0..x_{N-2}``, the seed
``hidden`` is its feature ``h_{N-2}`` and ``c = x_{N-1}`` is decided. The block's position ``j``
reads ``(h_j, x_{j+1})`` and gives the law of ``x_{j+2}``; its cache holds the positions whose
pair is *verified*.

A round (:class:`BlockRoundProgram`):

1. step 1 runs the positions still pending (the features of the previous round's accepted
   positions, see below) and the round's first position ``(h_{N-2}, c)`` in one block call; these
   are all real pairs and stay cached. Its last output ``o_1`` gives ``q_1``, the law of ``d_1``
   over the draft vocabulary (sampling: the warped softmax of the block's logits; greedy: its
   argmax);
2. step ``i = 2..k`` runs ``(o_{i-1}, d_{i-1})`` (the block's own output and draft, as in
   FastMTP) at the next position, attending to the cache, and gives ``q_i`` and ``d_i``; these
   entries are speculative;
3. the verifier accepts with ``min(1, p/q)`` and the residual (:class:`~circuits_llm.decoding.
   round.AcceptProgram`, shared with the circuit heads): each ``d_i`` is a draw of exactly the
   ``q_i`` handed to it, given everything drawn before, which is all the lemma of
   docs/decoder-exactness.md needs.

After the round (:meth:`BlockDrafter.follow`) the speculative entries are cropped and the kept
positions' pairs, whose features the verify forward already computed (``step.draft_hidden``),
become pending: they join the next round's first block call, so the cache follows the verifier
with no extra backbone call and no extra block call. :meth:`BlockDrafter.flush` runs the pending
pairs at once (the tests compare the cache with a fresh prefill of the block after it). That cache
following is :class:`BlockCacheFollower`, shared with the circuit on the block
(:class:`~circuits_llm.draft_block.circuit_drafter.BlockCircuitDrafter`, whose round runs only the
first step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from circuits_llm.backbone.cache_slots import drop_last_positions
from circuits_llm.decoding.acceptance import draw_from_row
from circuits_llm.decoding.round import AcceptProgram
from circuits_llm.decoding.round_data import DraftResult
from circuits_llm.decoding.warping import SamplingConfig, warp_logits
from circuits_llm.draft_block.block import DraftBlock, DraftBlockError
from circuits_llm.runtime.compiling import Compiler

__all__ = ["BlockCacheFollower", "BlockDrafter", "BlockRoundProgram"]


class BlockCacheFollower:
    """A draft block's KV cache for one sequence, kept in step with the verifier's: the part of a
    :class:`~circuits_llm.protocols.ContextDrafter` over a :class:`DraftBlock` that every way of
    drafting from the block shares (:class:`BlockDrafter`'s recursion,
    :class:`~circuits_llm.draft_block.circuit_drafter.BlockCircuitDrafter`'s circuit).

    Attributes:
        block: the draft block (weights).
        cache: the block's KV cache.
        length: positions of the cache holding verified pairs (speculative ones come after).
    """

    def __init__(self, block: DraftBlock) -> None:
        if not isinstance(block, DraftBlock):
            raise DraftBlockError(f"a {type(self).__name__} drafts with a DraftBlock, got "
                                  f"{type(block).__name__}")
        self.block = block
        self.vocab_size: int = block.vocab_size
        self.hidden_size: int = block.hidden_size
        self.cache = block.new_cache()
        self.length = 0
        self._pending: tuple[Tensor, Tensor] | None = None

    @property
    def device(self) -> torch.device:
        """Where the block's weights (and its drafts) live."""
        return self.block.fuse.weight.device

    # ------------------------------------------------------------------ the cache
    def _check(self, hidden: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """``hidden`` (1, m, d) and ``tokens`` (m,) checked, on the block's device."""
        if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[2] != self.hidden_size:
            raise DraftBlockError(f"features must be (1, m, {self.hidden_size}), got "
                                  f"{tuple(hidden.shape)}")
        if tokens.dim() != 1 or tokens.shape[0] != hidden.shape[1] or tokens.is_floating_point():
            raise DraftBlockError(f"tokens must be ({hidden.shape[1]},) integer ids (one per "
                                  f"feature), got {tuple(tokens.shape)} {tokens.dtype}")
        return hidden.to(self.device), tokens.to(self.device, torch.long)

    def begin(self, hidden: Tensor, tokens: Tensor) -> None:
        """Start a sequence: an empty cache; the prefill's pairs ``hidden`` (1, m, d), ``tokens``
        (m,) pending (run with the first round's first step)."""
        hidden, tokens = self._check(hidden, tokens)
        self.cache = self.block.new_cache()
        self.length = 0
        self._pending = (hidden, tokens) if tokens.numel() else None

    def follow(self, hidden: Tensor, tokens: Tensor) -> None:
        """After a round: crop the speculative entries; the kept positions' pairs ``hidden``
        (1, m, d) (the verify forward's features) and ``tokens`` (m,) become pending."""
        hidden, tokens = self._check(hidden, tokens)
        if self._pending is not None:  # a round that never drafted (a one-token prompt's first)
            hidden = torch.cat([self._pending[0], hidden], 1)
            tokens = torch.cat([self._pending[1], tokens])
        drop_last_positions(self.cache, self.cache.get_seq_length() - self.length)
        self._pending = (hidden, tokens) if tokens.numel() else None

    def flush(self) -> None:
        """Run the pending pairs into the cache now (the next round would have)."""
        drop_last_positions(self.cache, self.cache.get_seq_length() - self.length)
        if self._pending is not None:
            hidden, tokens = self._pending
            with torch.no_grad():
                self.block.extend(hidden, tokens[None], self.cache)
            self.length += tokens.numel()
            self._pending = None

    def first_step(self, hidden: Tensor, c: Tensor) -> Tensor:
        """The round's first block call: the pending pairs and ``(hidden (1, d), c (1,))``, all
        verified, appended to the cache -> (1, d) the block's output at the last one."""
        features, tokens = hidden[:, None].to(self.device), c.to(self.device, torch.long)
        if self._pending is not None:
            features = torch.cat([self._pending[0], features.to(self._pending[0].dtype)], 1)
            tokens = torch.cat([self._pending[1], tokens])
            self._pending = None
        output = self.block.extend(features, tokens[None], self.cache)
        self.length += tokens.numel()
        return output[:, -1]


class BlockDrafter(BlockCacheFollower):
    """A :class:`~circuits_llm.protocols.ContextDrafter` over a :class:`DraftBlock`: recursive
    drafting (FastMTP) from the block's KV cache and the pending features of one sequence
    (:class:`BlockCacheFollower`).

    Attributes:
        window: ``k + 1``: the verified token and the block's ``k`` recursive drafts.
        draft_tokens: the block's draft vocabulary (``None``: all ``V``).
    """

    def __init__(self, block: DraftBlock) -> None:
        super().__init__(block)
        self.window: int = block.window
        self.draft_tokens: Tensor | None = block.draft_tokens

    def next_step(self, output: Tensor, token: Tensor) -> Tensor:
        """A recursive step: the block's own ``output`` (1, d) and the draft ``token`` (1,) at the
        next position (a speculative entry, cropped by :meth:`follow`) -> (1, d)."""
        return self.block.extend(output[:, None], token[None], self.cache)[:, -1]

    # ------------------------------------------------------------------ the decoder's contract
    def round_program(self, config: SamplingConfig, *, compile: bool = False,
                      compiler: Compiler | None = None) -> BlockRoundProgram:
        """The round's program for ``config`` (:class:`BlockRoundProgram`)."""
        return BlockRoundProgram(self, config, compile=compile, compiler=compiler)


class BlockRoundProgram(AcceptProgram):
    """One round with a draft block: :meth:`draft` (``k`` recursive block steps) and the shared
    accept program. The draft runs eager (its cache grows); ``compile`` compiles the accept part.

    Args:
        drafter: the :class:`BlockDrafter` whose block and cache the drafts come from.
        config: the sampling configuration (greedy when ``temperature == 0``).
    """

    def __init__(self, drafter: BlockDrafter, config: SamplingConfig, *, compile: bool = False,
                 compiler: Compiler | None = None) -> None:
        label = f"draft block, window {drafter.window}, " \
                f"{'greedy' if config.greedy else 'sampling'}"
        super().__init__(config, drafter.window, drafter.vocab_size, drafter.draft_tokens,
                         drafter.device, compile=compile, compiler=compiler, label=label)
        self.drafter = drafter
        self.static_length = self.window - 1
        self.tape_length = self.window - 1
        self._law: Callable[[Tensor], Tensor] = (lambda logits: logits) if config.greedy else \
            (lambda logits: torch.softmax(warp_logits(logits, config).double(), -1))

    def draw_uniforms(self, generator: torch.Generator | None) -> Tensor:
        """One round's float64 uniforms: ``k`` for the drafts' inverse-CDF draws, then ``n`` for
        acceptance (read from the end by the accept program)."""
        return torch.rand(self.tape_length + self.window, generator=generator,
                          dtype=torch.float64, device=self.drafter.device)

    def verified(self, draft: DraftResult) -> int:
        """``L``: every draft is verified."""
        return self.window - 1

    def draft(self, hidden: Tensor, c: Tensor, uniforms: Tensor | None,
              component: Tensor | None = None) -> DraftResult:
        """``hidden`` (1, d) the seed feature, ``c`` (1,) long the verified token, ``uniforms``
        from :meth:`draw_uniforms` (None when greedy) -> :class:`DraftResult` with ``q``
        (k, K) float64, the law each draft was drawn from (None when greedy)."""
        if component is not None:
            raise DraftBlockError("a draft block does not mix in a context copy (lookup)")
        greedy = uniforms is None
        if greedy != self.config.greedy:
            raise DraftBlockError("uniforms must be given exactly when sampling")
        with torch.no_grad():
            output = self.drafter.first_step(hidden, c)
            drafts, rows, finite = [], [], []
            for step in range(self.window - 1):
                logits = self.drafter.block.logits(output)[0]  # (K,)
                finite.append(torch.isfinite(logits).all())
                if greedy:
                    index = logits.argmax()
                else:
                    assert uniforms is not None
                    law = self._law(logits)
                    rows.append(law)
                    index = draw_from_row(law, uniforms[step])
                token = index if self.draft_tokens is None else self.draft_tokens[index]
                drafts.append(token)
                if step < self.window - 2:
                    output = self.drafter.next_step(output, token[None])
            tokens = torch.stack(drafts)
            block = torch.cat([c.to(tokens.device), tokens])[None]
            head_ok = torch.stack(finite).all()
            q = None if greedy else torch.stack(rows)
            length = torch.tensor(self.window - 1, device=tokens.device)
            return DraftResult(block[0, 1:], block, q, head_ok, torch.ones((), dtype=torch.bool,
                                                                           device=tokens.device),
                               length)
