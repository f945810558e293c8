"""What one verifier forward records for the draft branch, and the draft branch run from it.

The draft head reads either the verifier's final hidden state (the LM head's input) or the output
of the draft branch: copies of the last ``k`` decoder layers with LoRA adapters, called with the
very arguments the verifier's last ``k`` layers received (mask, position embeddings, ...), their
own KV cache substituted for the verifier's. Forward pre-hooks record those arguments.

The hooks are registered once per model, on every decoder layer and the LM head, and shared by
every backbone built on that model (:func:`capture_hooks`); they record only while a backbone's
call has started a capture. Registering hooks per call would not do: ``torch.compile`` traces hooks
that exist before a compiled call but cannot register new ones inside it, and it guards on how many
hooks a module has, so hooks that come and go (or one set per backbone) would recompile the graphs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from circuits_llm.backbone._arch import UnsupportedModelError


@dataclass
class Capture:
    """What the hooks record during one verifier forward call.

    Attributes:
        layer_calls: ``(layer index, args, kwargs)`` of every decoder layer call, in call order.
        head_input: (B, m, d) tensor the LM head read (the final hidden state), once it ran.
    """

    layer_calls: list[tuple[int, tuple, dict]] = field(default_factory=list)
    head_input: Tensor | None = None


@dataclass
class CaptureSlot:
    """Where the hooks write; ``capture`` is None when no call is being recorded."""

    capture: Capture | None = None


class _LayerHook:
    """Forward pre-hook (with kwargs) of decoder layer ``index``: record its call in the active capture."""

    def __init__(self, slot: CaptureSlot, index: int) -> None:
        self.slot = slot
        self.index = index

    def __call__(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.slot.capture is not None:
            self.slot.capture.layer_calls.append((self.index, args, dict(kwargs)))


class _HeadHook:
    """Forward pre-hook of the LM head: record its input in the active capture."""

    def __init__(self, slot: CaptureSlot) -> None:
        self.slot = slot

    def __call__(self, _module: nn.Module, args: tuple) -> None:
        if self.slot.capture is not None:
            self.slot.capture.head_input = args[0]


def is_capture_hook(hook: object) -> bool:
    """Whether ``hook`` is one of this module's hooks (copies of hooked layers drop them)."""
    return isinstance(hook, _LayerHook | _HeadHook)


class CaptureHooks:
    """The hooks of one model, recording only between :meth:`start` and :meth:`stop`.

    Both only set a Python attribute, so ``torch.compile`` traces them. Idle, a hook costs one
    attribute test per layer call.
    """

    def __init__(self, layers: nn.ModuleList, lm_head: nn.Module) -> None:
        self.slot = CaptureSlot()
        for index, layer in enumerate(layers):
            layer.register_forward_pre_hook(_LayerHook(self.slot, index), with_kwargs=True)
        lm_head.register_forward_pre_hook(_HeadHook(self.slot))

    def start(self) -> Capture:
        """Record the next forward (until :meth:`stop`) into a new :class:`Capture`."""
        capture = Capture()
        self.slot.capture = capture
        return capture

    def stop(self) -> None:
        self.slot.capture = None


_HOOKS: weakref.WeakKeyDictionary[nn.Module, CaptureHooks] = weakref.WeakKeyDictionary()


def capture_hooks(layers: nn.ModuleList, lm_head: nn.Module) -> CaptureHooks:
    """The capture hooks of the model whose decoder layers are ``layers`` (registered on first use)."""
    hooks = _HOOKS.get(layers)
    if hooks is None:
        hooks = _HOOKS[layers] = CaptureHooks(layers, lm_head)
    return hooks


def swap_cache(args: tuple, kwargs: dict, verifier_cache: Cache | None,
               draft_cache: Cache | None) -> tuple[tuple, dict]:
    """Replace the verifier cache object by the draft cache in a layer's call arguments.

    Raises:
        UnsupportedModelError: if the layer did not receive the verifier cache at all.
    """
    if verifier_cache is None:
        return args, dict(kwargs)
    found = False

    def swap(value: object) -> object:
        nonlocal found
        if value is verifier_cache:
            found = True
            return draft_cache
        return value

    new_args = tuple(swap(a) for a in args)
    new_kwargs = {key: swap(value) for key, value in kwargs.items()}
    if not found:
        raise UnsupportedModelError(
            "the decoder layers did not receive the verifier cache as an argument, so the draft "
            "branch cannot be given its own cache"
        )
    return new_args, new_kwargs


def draft_output(cap: Capture, num_layers: int, draft_layers: nn.ModuleList, final_norm: nn.Module | None,
                 lm_head: nn.Module, verifier_cache: Cache | None, draft_cache: Cache | None) -> Tensor:
    """(B, m, d) draft hidden state from a capture: the LM head input (no draft layers), or the
    output of the draft layers run on the arguments captured from the last ``k`` of the model's
    ``num_layers`` layers, through the final norm.

    Raises:
        UnsupportedModelError: the model did not call its LM head or its last layers as expected.
    """
    k = len(draft_layers)
    if k == 0:
        if cap.head_input is None:
            raise UnsupportedModelError(
                f"the LM head {type(lm_head).__name__} was not called by the model's forward"
            )
        return cap.head_input
    calls = [(args, kwargs) for index, args, kwargs in cap.layer_calls if index >= num_layers - k]
    if len(calls) != k:
        raise UnsupportedModelError(
            f"expected each of the last {k} decoder layers to be called once per forward, "
            f"saw {len(calls)} calls"
        )
    hidden = hidden_entering(*calls[0])
    for layer, (args, kwargs) in zip(draft_layers, calls, strict=True):
        args, kwargs = swap_cache(args, kwargs, verifier_cache, draft_cache)
        if args:
            args = (hidden, *args[1:])
        else:
            kwargs["hidden_states"] = hidden
        out = layer(*args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
    assert final_norm is not None  # checked when the backbone was built
    return final_norm(hidden)


def hidden_entering(args: tuple, kwargs: dict) -> Tensor:
    """The hidden state a recorded decoder-layer call received (its first positional argument,
    else its ``hidden_states`` keyword)."""
    return args[0] if args else kwargs["hidden_states"]


def with_layer_outputs(cap: Capture, layers: tuple[int, ...], hidden: Tensor) -> Tensor:
    """``hidden`` (B, m, d) after the outputs of the decoder layers ``layers`` (each ``<
    num_layers - 1``) in a recorded forward: ``[l_a; l_b; ...; hidden]`` (B, m, (n + 1) d), what
    a draft block with those fused layers reads; ``hidden`` itself without layers. A layer's
    output is the hidden state entering the layer after it.

    Raises:
        UnsupportedModelError: a layer after one of them was not called once.
    """
    if not layers:
        return hidden
    entering: dict[int, Tensor] = {}
    for index, args, kwargs in cap.layer_calls:
        if index - 1 in layers:
            if index - 1 in entering:
                raise UnsupportedModelError(f"decoder layer {index} was called more than once in "
                                            "one forward, so its input is ambiguous")
            entering[index - 1] = hidden_entering(args, kwargs)
    missing = [i for i in layers if i not in entering]
    if missing:
        raise UnsupportedModelError(f"the outputs of layers {missing} were not seen: the layers "
                                    "after them were not called with their hidden state")
    return torch.cat([*(entering[i] for i in layers), hidden], -1)
