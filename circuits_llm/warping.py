"""The target law a decoder samples from: Hugging Face's temperature / top-k / top-p warps.

A speculative decoder is exact with respect to *a* target distribution; with sampling options
that target is the warped one. These warps reproduce, operation for operation, the semantics of
the installed ``transformers`` warpers as ``GenerationMixin._get_logits_processor`` chains them
(``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper``,
``min_tokens_to_keep=1``), so ``model.generate(do_sample=True, temperature=t, top_k=k, top_p=p)``
and the decoders of this package sample from the same law (``tests/test_decoder_exact.py``
checks the equivalence on random logits):

* temperature ``t``: ``logits / t`` (skipped when ``t == 1``, as HF does);
* top-k ``k``: keep every token whose logit is ``>=`` the ``k``-th largest (ties are kept);
* top-p ``p``: sort ascending, remove the tokens whose cumulative probability is ``<= 1 - p``,
  always keep the most probable one (skipped when ``p == 1``).

Temperature 0 means greedy decoding: the "law" is a point mass on the first argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


class DecoderError(ValueError):
    """A decoder was built or called with inputs that cannot work (the message says why)."""


class SamplingError(DecoderError):
    """A sampling option is out of its domain (the message names it and the valid range)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How the target law is derived from the verifier's logits.

    Attributes:
        temperature: 0 for greedy decoding, otherwise a finite positive float.
        top_k: keep the ``top_k`` most likely tokens (>= 1), or None for no top-k filter.
        top_p: nucleus mass in ``(0, 1]``, or None for no top-p filter.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0 \
                or math.isinf(t):
            raise SamplingError(
                f"temperature must be a finite float >= 0 (0 = greedy), got {t!r}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise SamplingError(f"top_k must be an int >= 1 or None, got {k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                              or math.isnan(p) or not 0 < p <= 1):
            raise SamplingError(f"top_p must be a float in (0, 1] or None, got {p!r}")

    @property
    def greedy(self) -> bool:
        """True for temperature 0: the target is the argmax of the raw logits."""
        return self.temperature == 0


def warp_logits(logits: Tensor, config: SamplingConfig) -> Tensor:
    """Apply temperature, then top-k, then top-p along the last dimension, like HF.

    Args:
        logits: (..., V) raw next-token logits.
        config: a sampling (not greedy) configuration.

    Returns:
        (..., V) warped logits in ``logits.dtype``; filtered tokens are ``-inf``.
    """
    if config.greedy:
        raise SamplingError("greedy decoding (temperature 0) has no warped logits; use target_probs")
    scores = logits
    if config.temperature != 1.0:
        scores = scores / config.temperature
    if config.top_k is not None:
        k = min(config.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if config.top_p is not None and config.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - config.top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, -math.inf)
    return scores


def target_probs(logits: Tensor, config: SamplingConfig) -> Tensor:
    """The target law for every row of ``logits``: (..., V) -> (..., V) float64 probabilities.

    Greedy: a one-hot vector on ``argmax`` (first maximum, like ``torch.argmax`` in HF's greedy
    search). Sampling: ``softmax(warp_logits(logits))`` computed in float64.
    """
    if config.greedy:
        index = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float64, device=logits.device).scatter_(
            -1, index, 1.0)
    return torch.softmax(warp_logits(logits, config).double(), dim=-1)


def sample_token(probs: Tensor, greedy: bool, generator: torch.Generator | None) -> int:
    """Draw one token from a (V,) probability vector (greedy: its argmax, no randomness used)."""
    if greedy:
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))
