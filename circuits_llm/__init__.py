"""circuits_llm: circuit multi-token-prediction heads and lossless speculative decoding.

What a user needs first, one import away::

    import circuits_llm as cl

    loaded = cl.load_model("embedded")          # or "smollm2", an HF directory, a .gguf file
    head = cl.MTPHead.from_name("btree", window=8, rank=16, hidden_size=..., vocab_size=...)
    head = cl.shipped_head("smollm2", "btree")  # a trained head that ships with the package
    result = cl.SpeculativeDecoder(loaded.model, head).generate(prompt_ids, max_new_tokens=64)
    # a shipped draft block that reads the context (recursive "block", or "btree-block")
    drafter = cl.shipped_drafter(loaded, "btree-block")
    cl.SpeculativeDecoder(loaded.model, drafter).generate(prompt_ids, max_new_tokens=64)
    # exact options: verify only confident drafts; mix a copy of the context into the drafts
    cl.SpeculativeDecoder(loaded.model, head, lookup=cl.ContextLookup(),
                          draft_length=cl.DraftLength.confident(0.3, minimum=0))

The rooms behind this face (docs/architecture.md walks them): :mod:`circuits_llm.heads` (circuit
heads), :mod:`circuits_llm.backbone` (causal LMs with KV caches), :mod:`circuits_llm.text` (models,
tokenizers, corpora), :mod:`circuits_llm.decoding` (the decoders and the round),
:mod:`circuits_llm.training` (training heads), :mod:`circuits_llm.app` (the command line, demo,
reports) and :mod:`circuits_llm.runtime` (timing, devices, checkpoints).
"""

from circuits_llm.app.head_cache import shipped_drafter, shipped_head
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.decoding.draft_length import DraftLength
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.decoding.stopping import StopCondition
from circuits_llm.heads import MTPHead, load_head, register_head_kind, save_head
from circuits_llm.text.models import load_model

__all__ = [
    "AutoregressiveDecoder",
    "ContextLookup",
    "DraftLength",
    "MTPHead",
    "SpeculativeDecoder",
    "StopCondition",
    "load_head",
    "load_model",
    "register_head_kind",
    "save_head",
    "shipped_drafter",
    "shipped_head",
]
