"""The EM update of one table of probabilities from its expected counts.

For a sum unit's weights, or a categorical input unit's distribution, with normalised old
log-probabilities ``log p`` (a row per unit) and expected counts ``n`` (:mod:`circuits.learn.flows`):

    estimate = (n + a m) / sum_d (n + a m)            m: the support of p (1 where p > 0)
    new      = (1 - s) p + s estimate                 (probability space)

with pseudocount ``a`` (a Dirichlet prior ``a + 1`` on the support, i.e. Laplace smoothing) and
step size ``s`` (1: classical EM; below 1: stochastic, mini-batch EM). Exact zeros of ``p``
(``-inf`` log-probabilities: structural zeros, sparsity or determinism written into the circuit)
are kept: no pseudocount is added there (and their counts are 0, as every flow through them is),
so EM never changes the support it was given. A unit that received no flow and has no
pseudocount keeps its old row. Computed in the parameters' dtype with a handful of element-wise
operations per table (this runs once per mini-batch), without turning tiny probabilities into
exact zeros.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def em_log_update(old_log: Tensor, counts: Tensor, step_size: float, pseudocount: float) -> Tensor:
    """New normalised log-probabilities ``(..., D)``, contiguous, in ``old_log``'s dtype.

    Args:
        old_log: (..., D) normalised log-probabilities (rows ``logsumexp`` to 0).
        counts: (..., D) expected counts (non-negative; 0 wherever ``old_log`` is ``-inf``), any
            dtype and layout.
        step_size: ``s`` in (0, 1].
        pseudocount: ``a >= 0``.
    """
    old = old_log.detach()
    lowest = float(old.amin()) if old.numel() else 0.0  # decides which masks are needed
    numerator = torch.empty_like(old, memory_format=torch.contiguous_format).copy_(counts)
    if pseudocount > 0:
        if lowest == -math.inf:  # exact zeros: the prior covers the support only
            numerator.add_(old > -math.inf, alpha=pseudocount)
        else:
            numerator.add_(pseudocount)
    denominator = numerator.sum(-1, keepdim=True)
    if step_size >= 1.0:
        new = numerator.log_().sub_(denominator.log())  # log space: nothing underflows
    else:
        new = old.exp().mul_(1.0 - step_size).addcdiv_(numerator, denominator, value=step_size).log_()
        if lowest + math.log1p(-step_size) < math.log(torch.finfo(old.dtype).tiny) + 1.0:
            # a probability too small for the dtype must not become an exact zero: there the
            # estimate is negligible too, and the value is the decayed old one
            new = torch.where(new > -math.inf, new, old + math.log1p(-step_size))
    if pseudocount <= 0:  # rows without flow (0 / 0) keep their old values
        new = torch.where(denominator > 0, new, old)
    return new


__all__ = ["em_log_update"]
