"""What a head reads from a frozen backbone, computed once, and the draft branch run from it.

Training a draft head reads, for every sequence, either the verifier's final hidden state (the LM
head's input; ``lora_layers = 0``) or the output of the LoRA draft branch, which is a function of
the hidden state *entering* layer ``N - k`` (``k = lora_layers``) and of arguments that depend on
the sequence length only (position embeddings, position ids, the causal mask). Everything below
the branch is frozen, so those hidden states can be computed once and cached
(:mod:`circuits_llm.training.features`); a training step then runs only the ``k`` draft layers
and the head, as EAGLE-style trainers do.

* :func:`branch_input`: (B, L) tokens -> (B, L, d), what the head (``k = 0``) or the draft branch
  (``k > 0``) reads, from the very recorded forward ``HFBackbone.hidden_states`` runs, so a
  cached value is bit for bit the live one (for the same batch).
* :class:`BranchArguments`: the draft layers' other arguments for sequences of one length,
  recorded once; :meth:`BranchArguments.run` turns cached branch inputs (B, L, d) into draft
  hidden states through the same code as the live branch
  (:func:`~circuits_llm.backbone._capture.draft_output`).

Read-only: nothing here changes the backbone, its caches or its hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from circuits_llm.backbone._arch import UnsupportedModelError
from circuits_llm.backbone._capture import Capture, draft_output, hidden_entering, with_layer_outputs
from circuits_llm.backbone._validate import check_tokens
from circuits_llm.backbone.hf import HFBackbone

__all__ = ["BranchArguments", "branch_input"]


def _recorded(backbone: HFBackbone, tokens: Tensor) -> Capture:
    """The capture of one cache-free forward of ``tokens`` (B, L) (no gradients)."""
    tokens = check_tokens(tokens, backbone.vocab_size, "tokens")
    with torch.no_grad():
        _, cap = backbone._recorded(input_ids=tokens.to(backbone.device), use_cache=False)
    return cap


def _branch_calls(cap: Capture, backbone: HFBackbone) -> list[tuple[tuple, dict]]:
    """The recorded ``(args, kwargs)`` of the last ``k`` layers (checked: one call each)."""
    k, first = backbone.lora_layers, backbone.num_layers - backbone.lora_layers
    calls = [(args, kwargs) for index, args, kwargs in cap.layer_calls if index >= first]
    if len(calls) != k:
        raise UnsupportedModelError(f"expected each of the last {k} decoder layers to be called "
                                    f"once per forward, saw {len(calls)} calls")
    return calls


def branch_input(backbone: HFBackbone, tokens: Tensor) -> Tensor:
    """(B, L) tokens -> (B, L, F) in the model's dtype: the LM head's input when
    ``lora_layers == 0`` (the draft hidden state itself, after the outputs of the backbone's
    ``feature_layers`` when it has some: ``F = (n + 1) d``), else the hidden state entering layer
    ``num_layers - lora_layers`` (what the draft branch consumes). No gradients.

    Raises:
        UnsupportedModelError: the model did not call its LM head or its layers as expected.
    """
    cap = _recorded(backbone, tokens)
    if backbone.lora_layers == 0:
        if cap.head_input is None:
            raise UnsupportedModelError("the LM head was not called by the model's forward")
        return with_layer_outputs(cap, backbone.feature_layers, cap.head_input).detach()
    if backbone.feature_layers:
        raise UnsupportedModelError("cached features hold fused layers' outputs only without a "
                                    "draft branch: build the backbone with lora_layers=0")
    args, kwargs = _branch_calls(cap, backbone)[0]
    return hidden_entering(args, kwargs).detach()


#: How a recorded argument is turned back into one for a batch of B sequences.
_SAME, _BATCH = "same", "batch"


def _template(name: str, one: Any, other: Any, two: Any) -> tuple[str, Any]:
    """``(how, value)`` for an argument recorded with batches ``[a]``, ``[b]`` and ``[a, b]``:
    ``same``: the value of every batch; ``batch``: a (1, ...) value expanded to (B, ...).

    Raises:
        UnsupportedModelError: the argument depends on the tokens, or on the batch otherwise
            than by a leading batch dimension.
    """
    if isinstance(one, (tuple, list)):
        if not (isinstance(two, type(one)) and len(one) == len(other) == len(two)):
            raise UnsupportedModelError(f"the draft layers' argument {name} changes with the batch")
        parts = [_template(f"{name}[{i}]", *values)
                 for i, values in enumerate(zip(one, other, two, strict=True))]
        return "nested", (type(one), parts)
    if not isinstance(one, Tensor):
        return _SAME, one
    if not (isinstance(other, Tensor) and isinstance(two, Tensor)) or not torch.equal(one, other):
        raise UnsupportedModelError(
            f"the draft layers' argument {name} depends on the tokens, so the branch input "
            "alone does not determine the draft hidden state; train without --cache-features")
    if one.shape == two.shape and torch.equal(one, two):
        return _SAME, one
    if one.dim() >= 1 and one.shape[0] == 1 and two.shape == (2, *one.shape[1:]) \
            and torch.equal(two, one.expand_as(two)):
        return _BATCH, one
    raise UnsupportedModelError(f"the draft layers' argument {name} changes with the batch in a "
                                "way feature caching cannot reproduce; train without "
                                "--cache-features")


def _build(how: str, value: Any, batch: int) -> Any:
    if how == "nested":
        kind, parts = value
        return kind(_build(h, v, batch) for h, v in parts)
    if how == _BATCH:
        return value.expand(batch, *value.shape[1:])
    return value


@dataclass(frozen=True)
class BranchArguments:
    """The draft layers' arguments other than the hidden state, for sequences of ``length``
    tokens: recorded from cache-free forwards of two different sequences, one at a time and
    together, so an argument that depends on the tokens (refused) is told from one that only
    grows with the batch (expanded to the batch at use).

    Attributes:
        length: L, the sequence length the arguments are for.
        layers: per draft layer, ``(positional, args, kwargs)``: whether the hidden state is the
            first positional argument (else the ``hidden_states`` keyword), and the templates of
            the other arguments.
    """

    length: int
    layers: tuple[tuple[bool, list[tuple[str, Any]], dict[str, tuple[str, Any]]], ...]

    @classmethod
    def record(cls, backbone: HFBackbone, row: Tensor) -> BranchArguments:
        """Record the arguments for sequences like ``row`` (L,) (any valid ids of that length).

        Raises:
            ValueError: the backbone has no draft branch.
            UnsupportedModelError: an argument depends on the tokens, or on the batch otherwise
                than by a leading batch dimension.
        """
        if backbone.lora_layers == 0:
            raise ValueError("a backbone without LoRA draft layers has no draft branch to run")
        row = row.reshape(-1).long()
        other = (row + 1) % backbone.vocab_size
        records = [_branch_calls(_recorded(backbone, tokens), backbone)
                   for tokens in (row[None], other[None], torch.stack([row, other]))]
        layers = []
        for (a1, k1), (a2, k2), (a3, k3) in zip(*records, strict=True):
            if len(a1) != len(a3) or set(k1) != set(k3):
                raise UnsupportedModelError("the draft layers are called differently for one "
                                            "and for two sequences")
            args = [_template(f"#{i}", x, y, z)
                    for i, (x, y, z) in enumerate(zip(a1[1:], a2[1:], a3[1:], strict=True))]
            kwargs = {name: _template(name, k1[name], k2[name], k3[name]) for name in k1
                      if name != "hidden_states" or a1}
            layers.append((bool(a1), args, kwargs))
        return cls(int(row.shape[0]), tuple(layers))

    def run(self, backbone: HFBackbone, hidden: Tensor) -> Tensor:
        """(B, L, d) branch inputs (:func:`branch_input`) -> (B, L, d) draft hidden states, with
        gradients for the LoRA parameters: the draft layers and the final norm, nothing else.

        Raises:
            ValueError: ``hidden`` is not (B, length, d).
        """
        if hidden.dim() != 3 or hidden.shape[1] != self.length:
            raise ValueError(f"branch inputs must be (B, {self.length}, d), got "
                             f"{tuple(hidden.shape)}")
        batch, first = hidden.shape[0], backbone.num_layers - backbone.lora_layers
        cap = Capture()
        for offset, (positional, args, kwargs) in enumerate(self.layers):
            built_args = tuple(_build(how, value, batch) for how, value in args)
            built_kwargs = {name: _build(how, value, batch) for name, (how, value) in kwargs.items()}
            if positional:
                built_args = (hidden, *built_args)
            else:
                built_kwargs["hidden_states"] = hidden
            cap.layer_calls.append((first + offset, built_args, built_kwargs))
        parts = backbone._parts
        return draft_output(cap, backbone.num_layers, backbone.draft_layers, parts.final_norm,
                            parts.lm_head, None, None)
