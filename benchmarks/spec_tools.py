"""Benchmark-only tools for speculative decoding, used by :mod:`benchmarks.decoder_bench`.

* :class:`ForcedAcceptance`: a backbone wrapper whose verifier accepts every draft, for the
  accept-all throughput bound (the MTPC paper's ``max_tok/s``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_llm.backbone import HFBackbone
from circuits_llm.protocols import BackboneStep


class ForcedAcceptance:
    """A :class:`~circuits_llm.protocols.Backbone` wrapper whose verifier agrees with every draft.

    ``extend([c, d_1..d_m])`` returns the inner backbone's results with the logits at block
    position ``i < m`` replaced by a point mass on token ``i + 1``: greedy and sampling
    verification then accept every draft (``p_k(d_k) = 1``) and the bonus token comes from the
    real last logits. Rounds cost what real rounds cost; each emits ``n`` tokens.
    """

    def __init__(self, inner: HFBackbone) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.hidden_size = inner.hidden_size

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def length(self) -> int:
        return self.inner.length

    def reset(self) -> None:
        self.inner.reset()

    def crop(self, length: int) -> None:
        self.inner.crop(length)

    def extend(self, tokens: Tensor) -> BackboneStep:
        """Inner ``extend``, then force the logits of every position but the last."""
        step = self.inner.extend(tokens)
        if tokens.shape[1] < 2:
            return step
        logits = step.verifier_logits.clone()
        forced = torch.full_like(logits[:, :-1], -1e4)
        forced.scatter_(-1, tokens[:, 1:, None].to(logits.device), 0.0)
        logits[:, :-1] = forced
        return BackboneStep(logits, step.draft_hidden)
