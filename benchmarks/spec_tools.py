"""Benchmark-only tools for speculative decoding, used by :mod:`benchmarks.decoder_bench`.

* :class:`ForcedAcceptance`: a backbone wrapper whose verifier accepts every draft, for the
  accept-all throughput bound (the MTPC paper's ``max_tok/s``).
* :func:`shared_draft_conditionals`: a prototype of a cheaper exact draft-conditional query.
* :class:`CachedLeanParameters`: a prototype of a cheaper LEAN parameterisation for decoding.

``circuits_llm.decoder.draft_conditionals`` calls ``log_prefix_conditionals``, which replicates
every parameter tensor once per window position (``n`` copies of the ``n r V`` input logits),
re-normalises each copy and back-propagates through all of them: ``O(n * n r V)`` work for ``n``
conditionals. :func:`shared_draft_conditionals` computes the same ``(n-1, V)`` conditionals with
the ``n-1`` prefix patterns *sharing* the window's parameters
(:func:`circuits_llm.loss.evaluate_shared`): the input logits are normalised once, the backward
pass runs on ``(F, n-1, K)`` tensors only, and one contraction of the gradients against the
``(F, K, V)`` input distributions gives every conditional: ``O(n r V + n^2 r)`` work.

The derivative identity is the one of :mod:`circuits.compiled.queries`: for a smooth,
decomposable, normalised circuit, ``q(X_k = v | e) = sum_u g_u phi_u(v)`` with
``g_u = d log c(e) / d log l_u`` over the input units ``u`` of ``X_k`` (unobserved: ``l_u = 1``).
The prototype is not used by the decoder; the benchmark checks it against ``draft_conditionals``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnf
from torch import Tensor

from circuits.compiled import CompiledCircuit
from circuits.compiled.folding import FoldKind
from circuits_llm.backbone import HFBackbone
from circuits_llm.heads import MTPHead
from circuits_llm.heads.projections import LeanInputs
from circuits_llm.loss import evaluate_shared
from circuits_llm.protocols import BackboneStep


def shared_draft_conditionals(circuit: CompiledCircuit, params: dict[str, Tensor], c: int,
                              draft: Tensor) -> Tensor:
    """Exact ``q(X_k | X_0 = c, d_1..d_{k-1})`` for ``k = 1..n-1`` from one shared pass.

    Args:
        circuit: a head's circuit over variables ``0 .. n-1`` (normalised).
        params: its external parameters for ONE window (batch 1).
        c: the known first token ``X_0``.
        draft: (n-1,) long, the drafted tokens.

    Returns:
        (n-1, V) float64 probability vectors, equal to
        ``draft_conditionals(circuit, params, c, draft[None])[0]``.
    """
    window = circuit.num_variables
    x = torch.cat([draft.new_tensor([c]), draft]).to(circuit.device)[None]
    steps = torch.arange(window, device=circuit.device)
    observed = steps[None, :] < steps[1:, None]  # pattern k-1 observes X_0 .. X_{k-1}
    detached = {name: value.detach() for name, value in params.items()}
    leaves: dict[int, Tensor] = {}
    with torch.inference_mode(False), torch.enable_grad():
        root = evaluate_shared(circuit, detached, x, observed, input_leaves=leaves)
        fold_ids = list(leaves)
        grads = torch.autograd.grad(root.sum(), [leaves[i] for i in fold_ids], allow_unused=True)
    vocab = int(circuit.categories[0])
    result = torch.zeros(window - 1, vocab, dtype=root.dtype, device=root.device)
    for fold_id, grad in zip(fold_ids, grads, strict=True):
        plan, module = circuit.plans[fold_id], circuit.folds[fold_id]
        if grad is None or plan.kind is not FoldKind.INPUT:
            continue
        probs = module.log_probs(detached[plan.name])[0].exp()  # (F, K, V)
        wanted = module.variables[:, None] == steps[1:][None, :]  # (F, n-1): slot's variable is k
        weight = torch.where(wanted[:, :, None], grad[:, 0].clamp_min(0), 0.0)  # (F, n-1, K)
        result += torch.einsum("fck,fkv->cv", weight, probs)
    return (result / result.sum(-1, keepdim=True)).double()


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


class CachedLeanParameters:
    """Prototype: a LEAN head's decode-time parameterisation with its per-unit maps precomputed.

    :class:`~circuits_llm.heads.projections.LeanInputs` permutes its ``down`` tensor inside an
    einsum on every call (a full copy) and, at batch 1, pushes ``n r`` transformed states
    through the LM head (``n r d V`` multiply-adds). Here ``down`` is stored once as a
    ``(d, F K rho)`` matrix and ``W_lm U`` once as ``(F K, rho, V)``, so a call is one GEMV for
    the codes and one small batched matmul for the logits. Same values as ``head(hidden)`` up
    to float rounding; the cache must be rebuilt after every parameter update.
    """

    def __init__(self, head: MTPHead) -> None:
        inputs = head.inputs
        if not isinstance(inputs, LeanInputs):
            raise TypeError("CachedLeanParameters needs a LEAN head")
        self.head = head
        self.lm_head = inputs.lm_head.detach()
        self.blocks: list[tuple[str, int, int, int, Tensor, Tensor, Tensor | None]] = []
        with torch.no_grad():
            for name, down in inputs.down.items():
                folded, units, dim, rank = down.shape
                down_flat = down.permute(2, 0, 1, 3).reshape(dim, folded * units * rank)
                vocab_up = torch.einsum("fkrd,vd->fkrv", inputs.up[name], self.lm_head)
                bias = inputs.bias[name].detach() if name in inputs.bias else None
                self.blocks.append((name, folded, units, rank, down_flat.contiguous(),
                                    vocab_up.reshape(folded * units, rank, -1).contiguous(),
                                    bias))

    def __call__(self, hidden: Tensor) -> dict[str, Tensor]:
        """``hidden`` (B, d) -> the same ``{fold name: raw parameters}`` as ``head(hidden)``."""
        hidden = hidden.to(self.head.dtype)
        batch = hidden.shape[0]
        base = nnf.linear(hidden, self.lm_head)  # (B, V)
        out: dict[str, Tensor] = {}
        for name, folded, units, rank, down_flat, vocab_up, bias in self.blocks:
            codes = (hidden @ down_flat).view(batch, folded * units, rank).transpose(0, 1)
            logits = (torch.bmm(codes, vocab_up) + base).transpose(0, 1)  # (B, F K, V)
            logits = logits.reshape(batch, folded, units, -1)
            out[name] = logits if bias is None else logits + bias
        out.update(self.head.sums(hidden))
        return out
