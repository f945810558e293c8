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


class InvalidDistributionError(DecoderError):
    """A token law cannot be sampled: logits holding NaN or ``+inf`` or only ``-inf`` (no token is
    possible), or probabilities that are negative, non-finite or all zero. The message names the
    row and, where there is one, the first offending index."""


def check_logits(logits: Tensor, what: str = "logits") -> None:
    """Raise :class:`InvalidDistributionError` unless every row of ``logits`` (..., V) has a finite
    maximum, i.e. no NaN, no ``+inf`` and at least one entry above ``-inf``.

    One reduction and one host synchronisation: once per call, paid so that a broken model or an
    impossible filter is an error instead of an arbitrary token (argmax of NaN or of all ``-inf``
    is index 0; softmax of them is NaN).
    """
    if logits.numel() == 0:
        raise InvalidDistributionError(f"{what} are empty: there is no token to choose")
    maxima = logits.detach().amax(-1)
    if bool(torch.isfinite(maxima).all()):
        return
    row = tuple(int(i) for i in (~torch.isfinite(maxima)).nonzero()[0])
    entries = logits.detach()[row]
    wrong = torch.isnan(entries) | torch.isposinf(entries)
    name = f"{what} (row {', '.join(map(str, row))})" if row else what
    if bool(wrong.any()):
        column = int(wrong.nonzero()[0, 0])
        raise InvalidDistributionError(
            f"{name} hold {float(entries[column])} at token {column}: the model's output is not "
            "a valid score vector (NaN/inf usually mean a numerically broken model or input)")
    raise InvalidDistributionError(
        f"{name} are -inf for every token: no token is possible, so there is nothing to sample. "
        "Check the logits processors or masks that removed every token")


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


#: how invalid verifier logits are named in errors
VERIFIER_LOGITS = "the backbone's verifier logits"


def target_probs(logits: Tensor, config: SamplingConfig, what: str = "logits") -> Tensor:
    """The target law for every row of ``logits``: (..., V) -> (..., V) float64 probabilities.

    Greedy: a one-hot vector on ``argmax`` (first maximum, like ``torch.argmax`` in HF's greedy
    search). Sampling: ``softmax(warp_logits(logits))`` computed in float64.

    Raises:
        InvalidDistributionError: a row of ``logits`` (greedy) or of the warped logits (sampling:
            a tiny temperature can overflow) holds NaN or ``+inf`` or is ``-inf`` everywhere
            (:func:`check_logits`; one host synchronisation per call); ``what`` names the
            logits in that message.
    """
    if config.greedy:
        check_logits(logits, what)
        # max's index is argmax's (the first maximum), and on a CPU 2-4x faster to compute
        index = logits.max(dim=-1, keepdim=True).indices
        return torch.zeros(logits.shape, dtype=torch.float64, device=logits.device).scatter_(
            -1, index, 1.0)
    warped = warp_logits(logits, config)
    check_logits(warped, what if config.temperature == 1.0 else
                 f"{what} divided by temperature {config.temperature}")
    return torch.softmax(warped.double(), dim=-1)


def sample_token(probs: Tensor, greedy: bool, generator: torch.Generator | None) -> int:
    """Draw one token from a (V,) probability vector (greedy: its argmax, no randomness used).

    ``probs`` may be unnormalised but must be finite, non-negative and not all zero, else
    :class:`InvalidDistributionError` (instead of index 0, or a device-side assert in
    ``torch.multinomial`` on CUDA). The check reads the sum and the minimum in one host
    synchronisation; a greedy draw returns its argmax from the same one.
    """
    if probs.dim() != 1 or probs.numel() == 0:
        raise InvalidDistributionError(f"a token law is a non-empty (V,) vector, got shape "
                                       f"{tuple(probs.shape)}")
    stats = [probs.sum(), probs.amin()] + ([probs.max(0).indices] if greedy else [])
    values = torch.stack([v.double() for v in stats]).tolist()
    total, lowest = values[0], values[1]
    if not (math.isfinite(total) and total > 0 and lowest >= 0):
        raise InvalidDistributionError(
            f"cannot draw a token from probabilities with sum {total} and minimum {lowest}: they "
            "must be finite, non-negative and not all zero (all zero: no token is possible)")
    if greedy:
        return int(values[2])
    return int(torch.multinomial(probs, 1, generator=generator))
