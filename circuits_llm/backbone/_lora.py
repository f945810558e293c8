"""Building the draft branch: copies of the last ``k`` decoder layers with LoRA adapters.

The draft head of a self-drafting backbone reads either the verifier's final hidden state
(``lora_layers=0``) or the output of a draft branch (MTPC paper, Sec. 3.3-3.4 and App. D): the
last ``k`` decoder layers again, run from the hidden state the verifier's layer ``N-k`` receives
(``_capture.py`` records it, and runs the branch). The copies share the very parameter and buffer
tensors of the verifier's layers (:func:`share_params_deepcopy`: no extra weight memory, frozen
with the model); only the LoRA matrices that peft injects (:func:`inject_lora`: ``lora_B``
initialised to zero, so a new branch computes exactly what the verifier's layers do) are new and
trainable (:func:`lora_parameters`).

Kept apart from :class:`~circuits_llm.backbone.hf.HFBackbone`, which builds the branch once
(:func:`draft_branch`) and then only runs it: what is adapted, and how, is decided here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from peft import LoraConfig, inject_adapter_in_model
from torch import Tensor, nn

from circuits_llm.backbone._arch import (
    FINAL_NORM_NAMES,
    ModelParts,
    UnsupportedModelError,
    is_conv1d_target,
    lora_target_names,
)
from circuits_llm.backbone._capture import is_capture_hook
from circuits_llm.backbone._validate import check_int


@dataclass(frozen=True)
class LoraOptions:
    """The checked LoRA settings of a backbone (see ``HFBackbone``'s arguments of the same names).

    Attributes:
        layers: ``k``, decoder layers copied into the draft branch (0: no branch).
        rank: LoRA rank ``r``.
        alpha: LoRA scaling numerator (the scale is ``alpha / r``).
        dropout: dropout on the LoRA input, active only in training mode.
    """

    layers: int
    rank: int
    alpha: float
    dropout: float


def lora_options(lora_layers: int, lora_rank: int, lora_alpha: float | None, lora_dropout: float,
                 num_layers: int) -> LoraOptions:
    """Check ``HFBackbone``'s LoRA arguments (``lora_alpha=None``: equal to ``lora_rank``).

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of its range (named).
    """
    layers = check_int(lora_layers, "lora_layers", 0, num_layers)
    rank = check_int(lora_rank, "lora_rank", 1)
    alpha = float(lora_rank if lora_alpha is None else lora_alpha)
    if isinstance(lora_alpha, bool) or not alpha > 0:
        raise ValueError(f"lora_alpha must be a positive number, got {lora_alpha!r}")
    if (
        isinstance(lora_dropout, bool)
        or not isinstance(lora_dropout, int | float)
        or not 0 <= lora_dropout < 1
    ):
        raise ValueError(f"lora_dropout must be a float in [0, 1), got {lora_dropout!r}")
    return LoraOptions(layers, rank, alpha, float(lora_dropout))


def share_params_deepcopy(module: nn.Module) -> nn.Module:
    """Deep-copy ``module`` but keep the very same parameter and buffer tensors (shared, not cloned).

    The model's capture hooks (``_capture.py``) are not copied: they belong to the verifier's layers,
    and on a copy they would record the draft branch's calls as the verifier's.
    """
    memo: dict[int, object] = {id(t): t for t in module.parameters()}
    memo.update({id(t): t for t in module.buffers()})
    copied = copy.deepcopy(module, memo)
    for sub in copied.modules():
        for key in [key for key, hook in sub._forward_pre_hooks.items() if is_capture_hook(hook)]:
            del sub._forward_pre_hooks[key]
            sub._forward_pre_hooks_with_kwargs.pop(key, None)
    return copied


def draft_branch(parts: ModelParts, options: LoraOptions, target_modules: list[str] | None
                 ) -> tuple[nn.ModuleList, list[str]]:
    """The draft branch of ``options.layers`` final layers, with LoRA adapters when there are any,
    and the names of the adapted sub-modules (empty without a branch).

    Raises:
        UnsupportedModelError: a branch is asked for but the model has no final norm, or peft
            created no LoRA parameters.
        ValueError: ``target_modules`` is not None or a non-empty list of names.
    """
    if options.layers > 0 and parts.final_norm is None:
        raise UnsupportedModelError(
            f"no final norm found on {type(parts.base).__name__} (looked for an attribute among "
            f"{', '.join(FINAL_NORM_NAMES)}); it is needed for lora_layers > 0"
        )
    layers = nn.ModuleList(
        share_params_deepcopy(layer) for layer in parts.layers[parts.num_layers - options.layers :]
    )
    names = inject_lora(layers, options, target_modules) if options.layers > 0 else []
    return layers, names


def inject_lora(layers: nn.ModuleList, options: LoraOptions, target_modules: list[str] | None
                ) -> list[str]:
    """Wrap ``layers``' linear sub-modules with peft LoRA adapters (``lora_B`` = 0); the names of
    the wrapped sub-modules (``None``: every ``nn.Linear`` / GPT-2 ``Conv1D`` of a layer)."""
    first = layers[0]
    if target_modules is None:
        names, conv = lora_target_names(first)
    else:
        if (
            not isinstance(target_modules, list | tuple)
            or not target_modules
            or not all(isinstance(n, str) and n for n in target_modules)
        ):
            raise ValueError(
                "lora_target_modules must be None or a non-empty list of module names, "
                f"got {target_modules!r}"
            )
        names = sorted(set(target_modules))
        conv = is_conv1d_target(first, names)
    config = LoraConfig(
        r=options.rank,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=names,
        fan_in_fan_out=conv,
        bias="none",
        init_lora_weights=True,
    )
    inject_adapter_in_model(config, layers)
    if not lora_parameters(layers):
        raise UnsupportedModelError(f"peft created no LoRA parameters for target modules {names}")
    return names


def lora_parameters(layers: nn.Module) -> list[nn.Parameter]:
    """The trainable LoRA parameters of a draft branch (empty without adapters)."""
    return [p for name, p in layers.named_parameters() if "lora_" in name]


def lora_state(layers: nn.Module) -> dict[str, Tensor]:
    """Name -> tensor of every LoRA parameter of a draft branch (detached, on CPU)."""
    return {name: p.detach().cpu().contiguous() for name, p in layers.named_parameters()
            if "lora_" in name}
