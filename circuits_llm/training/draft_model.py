"""The trainable part of a head run: :class:`DraftModel` (the head and the LoRA draft layers),
with the backbone's features live or from the cache, and the LM's own law as the target."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from circuits_llm.backbone import HFBackbone
from circuits_llm.backbone._features import BranchArguments
from circuits_llm.heads import MTPHead
from circuits_llm.training.loss import mtp_loss
from circuits_llm.training.teacher import LanguageModelTeacher, TeacherLaw

__all__ = ["DraftModel"]


class DraftModel(nn.Module):
    """The trainable part of the draft model: the head and the LoRA draft layers.

    ``forward(tokens (B, L), mask (B, L) or None, features (B, L, d) or None) -> (loss,
    nll_sum (n,), count (n,))``. The frozen LM is reached through the backbone but not registered
    as a sub-module, so DDP only sees (and synchronises) the head and the draft layers. With
    ``features`` (cached: :mod:`circuits_llm.training.features`) the backbone does not run: they
    are the draft hidden states (``lora_layers = 0``) or the draft branch's inputs, which only the
    ``k`` draft layers turn into draft hidden states (``branch``).
    """

    def __init__(self, backbone: HFBackbone, head: MTPHead, gamma: float, bf16: bool,
                 branch: BranchArguments | None = None) -> None:
        super().__init__()
        self.head = head
        self.draft_layers = backbone.draft_layers
        self._backbone = (backbone,)
        self.gamma = gamma
        self.bf16 = bf16
        self.branch = branch
        #: the LM's own law as the target (``TargetLaw.MODEL``; None: the data's tokens)
        self.teacher: LanguageModelTeacher | None = None

    def hidden(self, tokens: Tensor, features: Tensor | None = None) -> Tensor:
        """(B, L) tokens, or their cached (B, L, d) features -> (B, L, d) float32 draft hidden
        states."""
        return self.states(tokens, features)[0]

    def states(self, tokens: Tensor, features: Tensor | None = None,
               ) -> tuple[Tensor, TeacherLaw | None]:
        """The (B, L, d) float32 draft hidden states and, with :attr:`teacher`, the LM's law
        at every position (from the live logits, or from the cached LM-head input)."""
        backbone = self._backbone[0]
        law = None
        with torch.autocast(device_type=backbone.device.type, dtype=torch.bfloat16,
                            enabled=self.bf16):
            if features is None:
                logits, hidden = backbone.hidden_states(tokens)
                if self.teacher is not None:
                    law = self.teacher.from_logits(logits)
            elif backbone.lora_layers == 0:
                hidden = features
                if self.teacher is not None:
                    law = self.teacher.from_features(features)
            else:
                if self.branch is None:
                    raise ValueError("cached branch inputs need the draft branch's arguments "
                                     "(DraftModel.branch)")
                if self.teacher is not None:
                    raise ValueError("the LM's law cannot be read from cached branch inputs")
                dtype = next(backbone.model.parameters()).dtype
                hidden = self.branch.run(backbone, features.to(backbone.device, dtype))
        return hidden.float(), law

    def forward(self, tokens: Tensor, mask: Tensor | None,
                features: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        hidden, law = self.states(tokens, features)
        out = mtp_loss(self.head, hidden, tokens, mask, self.gamma, teacher=law)
        return out.loss, out.nll_sum, out.count
