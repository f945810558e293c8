"""The LM's own next-token law as a soft training target (self-distillation with the LM's law).

A self-distilled row is one sample of the LM's continuation; its tokens are one draw from the law
the head should learn. The LM's whole conditional law at every position costs nothing more: it is
the LM head applied to the hidden states the trainer already has (cached features with no LoRA,
or the live forward). Training each window slot against that law, instead of the one drawn token,
removes the sampling noise of the targets (the chain rule of the KL divergence: for a draft ``q``
and the LM ``p`` over a window,
``KL(p || q) = E_{x ~ p} sum_j KL(p(. | x_{<j}) || q(. | x_{<j}))``, so the per-slot cross-entropy
to ``p(. | x_{<j})`` along sampled prefixes has the same minimiser as the token loss and less
variance).

:class:`TeacherLaw` holds the LM's logits ``(B, T, C)`` over the head's categories (the draft
vocabulary for a compressed head, renormalised over it like the token loss's conditioning) and
how to read them: the ``top_k`` most likely categories per position (the loss scores the head on
those only: one more circuit row each), at ``temperature`` (0: the argmax alone, the law of
greedy decoding). :func:`teacher_candidates` aligns them with the loss's windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits.errors import InvalidInputError

__all__ = ["LanguageModelTeacher", "TeacherLaw", "teacher_candidates"]


@dataclass(frozen=True)
class TeacherLaw:
    """The LM's next-token law at every position of a batch, and how the loss reads it.

    Attributes:
        logits: (B, T, C) float: ``logits[b, t]`` are the LM's logits of ``x_{t+1}`` given
            ``x_{<=t}``, over the head's ``C`` categories (draft-vocabulary order for a
            compressed head).
        top_k: the number of most likely categories per position the head is scored on (>= 1).
        temperature: the law is ``softmax(logits / temperature)``; 0 puts all mass on the argmax
            (the greedy decoder's law; ``top_k`` is then 1).
        weight: the loss of slot ``j`` is ``(1 - weight) L_j + weight S_j``: ``L_j`` on the data's
            tokens, ``S_j`` the cross-entropy to this law, in ``[0, 1]``.
    """

    logits: Tensor
    top_k: int = 16
    temperature: float = 1.0
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.logits, Tensor) or not self.logits.is_floating_point() \
                or self.logits.dim() != 3:
            got = tuple(self.logits.shape) if isinstance(self.logits, Tensor) else \
                type(self.logits).__name__
            raise InvalidInputError(f"teacher logits must be a float (B, T, C) tensor, got {got}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise InvalidInputError(f"teacher top_k must be an int >= 1, got {self.top_k!r}")
        for name, value, low in (("temperature", self.temperature, 0.0),
                                 ("weight", self.weight, 0.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < low:
                raise InvalidInputError(f"teacher {name} must be a finite number >= {low}, "
                                        f"got {value!r}")
        if self.weight > 1:
            raise InvalidInputError(f"teacher weight must be in [0, 1], got {self.weight!r}")

    def candidates(self) -> tuple[Tensor, Tensor]:
        """``(index (B, T, k) long, prob (B, T, k))``: each position's ``k`` most likely
        categories and their probabilities under the law (not renormalised over the ``k``: the
        mass outside them is left out of the cross-entropy). ``k = min(top_k, C)``, 1 at
        temperature 0 (probability 1)."""
        logits = self.logits.detach()
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if self.temperature == 0:
            index = logits.argmax(-1, keepdim=True)
            return index, torch.ones(index.shape, dtype=logits.dtype, device=logits.device)
        log_law = torch.log_softmax(logits / self.temperature, -1)
        values, index = log_law.topk(min(self.top_k, logits.shape[-1]), dim=-1)
        return index, values.exp()


def teacher_candidates(teacher: TeacherLaw, window: int, batch: int, length: int,
                       categories: int) -> tuple[Tensor, Tensor]:
    """The teacher's candidates for every window slot.

    Slot ``j`` (0-based) of the window at ``t`` is ``x_{t+j+1}``, whose law given ``x_{<=t+j}``
    sits at position ``t + j``.

    Returns:
        ``(index (B, T, n, k) long, prob (B, T, n, k))``; slots past the sequence's end hold
        index 0 with probability 0.

    Raises:
        InvalidInputError: the logits are not ``(batch, length, categories)``.
    """
    if tuple(teacher.logits.shape) != (batch, length, categories):
        raise InvalidInputError(
            f"teacher logits must have shape (B, T, C) = {(batch, length, categories)} (C: the "
            f"head's categories, the draft vocabulary of a compressed head), got "
            f"{tuple(teacher.logits.shape)}")
    index, prob = teacher.candidates()

    def windows(values: Tensor) -> Tensor:
        pad = values.new_zeros(batch, window, values.shape[-1])
        padded = torch.cat([values, pad], dim=1)  # (B, T + n, k)
        return padded.unfold(1, window, 1)[:, :length].transpose(2, 3).contiguous()

    return windows(index), windows(prob)


class LanguageModelTeacher:
    """The LM's logits over a head's categories, from what a training step already has.

    With cached features and no LoRA the step holds the LM head's input (the last hidden state
    after the final norm): the logits are its LM-head rows of the head's categories applied to
    it (``(B, T, d) -> (B, T, C)``; ``B T d C`` multiply-adds). A live step has the LM's logits
    themselves (``(B, T, V)``): the head's categories are picked from them.

    Args:
        model: the causal LM (its output embedding is read, never changed).
        draft_tokens: (C,) the head's draft vocabulary (model ids), or None for every token.
        top_k, temperature, weight: see :class:`TeacherLaw`.
    """

    def __init__(self, model: torch.nn.Module, draft_tokens: Tensor | None, top_k: int,
                 temperature: float, weight: float) -> None:
        output = model.get_output_embeddings()  # type: ignore[operator]
        if output is None or not isinstance(getattr(output, "weight", None), Tensor):
            raise InvalidInputError(f"{type(model).__name__} has no output embedding whose rows "
                                    f"give its logits; train with target_law tokens")
        matrix = output.weight.detach()
        bias = getattr(output, "bias", None)
        self.draft_tokens = None if draft_tokens is None else draft_tokens.to(matrix.device)
        rows = matrix if self.draft_tokens is None else matrix.index_select(0, self.draft_tokens)
        self.rows = rows.float()
        self.bias = None if bias is None else (
            bias.detach() if self.draft_tokens is None else
            bias.detach().index_select(0, self.draft_tokens)).float()
        self.top_k, self.temperature = top_k, temperature
        self.weight = weight

    def from_features(self, features: Tensor) -> TeacherLaw:
        """``features`` (B, T, d): the LM head's input -> the law over the head's categories."""
        logits = torch.nn.functional.linear(features.to(self.rows.device, torch.float32),
                                            self.rows, self.bias)
        return TeacherLaw(logits, self.top_k, self.temperature, self.weight)

    def from_logits(self, logits: Tensor) -> TeacherLaw:
        """``logits`` (B, T, V): the LM's own -> the law over the head's categories."""
        if self.draft_tokens is not None:
            logits = logits.index_select(-1, self.draft_tokens.to(logits.device))
        return TeacherLaw(logits.float(), self.top_k, self.temperature, self.weight)

    def check_features(self, features: Tensor, logits: Tensor) -> float:
        """The largest gap between the logits rebuilt from ``features`` (1, T, d) and the model's
        own ``logits`` (1, T, V), relative to ``1 + max |logit|``; a model whose logits are not
        its LM head's rows applied to that state (scaled or soft-capped logits) shows a large
        one."""
        rebuilt = self.from_features(features).logits
        own = self.from_logits(logits).logits.to(rebuilt.device)
        return float((rebuilt - own).abs().max() / (1 + own.abs().max()))
