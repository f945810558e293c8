"""The decode path: the speculative and autoregressive decoders, the round programs (draft and
accept), stopping like ``generate``, logits warping, per-round metrics and the ``generate`` bridge.

One speculative round, file by file: :mod:`~circuits_llm.decoding.decoder` (the loop) ->
:mod:`~circuits_llm.decoding.round` (draft and accept programs) -> :mod:`~circuits_llm.decoding.warping`
(the target law) -> :mod:`~circuits_llm.decoding.stopping` -> :mod:`~circuits_llm.decoding.metrics`.
Uses heads and backbones; never training or the application."""
