"""Running the decoders from ``model.generate`` (transformers' ``custom_generate`` callable).

transformers 5 lets ``generate`` take a callable ``custom_generate``: it prepares the inputs, the
generation config, the logits processors and the stopping criteria as usual, then hands them to
the callable instead of its own decoding loop. :func:`speculative_generate` is such a callable::

    decoder = SpeculativeDecoder(model, head, lora_layers=1)
    out = model.generate(input_ids, custom_generate=speculative_generate, decoder=decoder,
                         do_sample=True, temperature=0.8, top_p=0.9, max_new_tokens=64)

It reads the sampling options from the prepared ``generation_config`` and checks that the
prepared logits processors are exactly the warps the decoder reproduces (temperature, top-k,
top-p) and the stopping criteria are max-length / EOS: anything else (repetition penalty,
min-length, stop strings, beams...) changes the target law in ways the decoder does not
implement, and raises :class:`~circuits_llm.decoder.DecoderError` instead of silently decoding
from another law. It returns ``generate``'s usual ``(1, L + T)`` tensor; extra outputs
(``return_dict_in_generate``, scores) are not supported. Batch size 1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
)

from circuits_llm.decoder import AutoregressiveDecoder, DecoderError

_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)


def speculative_generate(model: Any, input_ids: Tensor, logits_processor: LogitsProcessorList,
                         stopping_criteria: StoppingCriteriaList,
                         generation_config: GenerationConfig,
                         decoder: AutoregressiveDecoder | None = None,
                         generator: torch.Generator | None = None, **model_kwargs: Any) -> Tensor:
    """The decoding loop ``model.generate(..., custom_generate=speculative_generate)`` runs.

    Args:
        model: the model ``generate`` was called on; ``decoder``'s backbone must wrap it.
        input_ids: (1, L) prepared prompt.
        logits_processor, stopping_criteria, generation_config: prepared by ``generate``.
        decoder: a :class:`~circuits_llm.decoder.SpeculativeDecoder` (or the autoregressive
            baseline) built on ``model``; pass it as a ``generate`` keyword.
        generator: randomness source for sampling (a ``generate`` keyword as well).
        model_kwargs: ``generate``'s prepared model inputs (attention mask, its cache...); the
            decoder keeps its own caches and ignores them.

    Returns:
        (1, L + T) long: the prompt followed by the generated tokens.
    """
    del model_kwargs
    if decoder is None:
        raise DecoderError("pass decoder=SpeculativeDecoder(model, head) to generate() along with "
                           "custom_generate=speculative_generate")
    if getattr(decoder.backbone, "model", None) is not model:
        raise DecoderError("the decoder's backbone does not wrap the model generate() was called on")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise DecoderError(f"speculative_generate decodes one sequence; got input_ids of shape "
                           f"{tuple(input_ids.shape)} (after num_return_sequences expansion)")
    if generation_config.num_beams not in (None, 1) or generation_config.return_dict_in_generate:
        raise DecoderError("speculative_generate supports neither beam search nor "
                           "return_dict_in_generate")
    others = [type(p).__name__ for p in logits_processor if not isinstance(p, _WARPERS)]
    if others:
        raise DecoderError(f"logits processors {others} change the target law and are not "
                           "supported; only temperature, top_k and top_p are")
    stops = [type(c).__name__ for c in stopping_criteria if not isinstance(c, _CRITERIA)]
    if stops:
        raise DecoderError(f"stopping criteria {stops} are not supported; only max length / "
                           "max_new_tokens and eos_token_id are")
    temperature, top_k, top_p = 0.0, None, None
    if generation_config.do_sample:
        temperature = generation_config.temperature if generation_config.temperature is not None \
            else 1.0
        top_k = generation_config.top_k or None
        top_p = generation_config.top_p if generation_config.top_p is not None and \
            generation_config.top_p < 1.0 else None
    max_new_tokens = int(generation_config.max_length) - input_ids.shape[1]
    result = decoder.generate(input_ids, max(max_new_tokens, 0), float(temperature), top_k, top_p,
                              generator, generation_config.eos_token_id)
    return torch.cat([input_ids, result.tokens[None].to(input_ids.device)], dim=1)
