"""Running the decoders from ``model.generate`` (transformers' ``custom_generate`` callable).

transformers 5 lets ``generate`` take a callable ``custom_generate``: it prepares the inputs, the
generation config, the logits processors and the stopping criteria as usual, then hands them to
the callable instead of its own decoding loop. :func:`speculative_generate` is such a callable::

    decoder = SpeculativeDecoder(model, head, lora_layers=1)
    out = model.generate(input_ids, custom_generate=speculative_generate, decoder=decoder,
                         do_sample=True, temperature=0.8, top_p=0.9, max_new_tokens=64)

The target law is the one ``generate`` would sample: the logits processors and warpers it
prepared are applied as they are, not re-implemented. The decoder's backbone is wrapped
(:class:`ProcessedBackbone`) so that the verifier's logits at every position are the float32
logits processed by that list with the exact prefix ``generate`` would pass at that position;
the decoder then samples ``softmax`` of them (``do_sample``) or takes their argmax (greedy), with
no warping of its own. Drafts are accepted against this law, so speculative decoding stays exact
for every processor that is a function of the prefix and the scores alone
(:data:`PREFIX_PROCESSORS`: temperature, top-k/p/h, min-p, typical, epsilon/eta, repetition
penalty, no-repeat n-grams, bad words, sequence bias, min length, forced BOS/EOS, suppressed
tokens, ...). Processors with state of their own (classifier-free guidance, watermarks, audio
models') raise :class:`~circuits_llm.decoding.decoder.DecoderError` instead of silently decoding from
another law.

The stopping criteria it is given are honoured exactly (:mod:`circuits_llm.decoding.stopping`):
``max_length`` / ``max_new_tokens``, the EOS ids of :class:`EosTokenCriteria` and the stop strings
of :class:`StopStringCriteria` (the output is cut after the token that completes one, as
``generate`` does); other criteria raise. transformers 5.23 drops ``generate``'s ``tokenizer=``
keyword when ``custom_generate`` is a callable, so give stop strings as a criterion:
``stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, ["\\n\\n"])])``.

Returns ``generate``'s usual ``(1, L + T)`` tensor; extra outputs (``return_dict_in_generate``,
scores) and beams are not supported. Batch size 1.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from circuits_llm.decoding.decoder import AutoregressiveDecoder, DecoderError
from circuits_llm.decoding.exclusive import exclusive
from circuits_llm.decoding.stopping import StopCondition
from circuits_llm.protocols import BackboneStep

#: Processors that read only the scores: one batched call covers every position of a block.
POSITION_FREE_PROCESSORS: tuple[type, ...] = (
    lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.TopHLogitsWarper,
    lp.MinPLogitsWarper, lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper, lp.EtaLogitsWarper,
    lp.InfNanRemoveLogitsProcessor, lp.LogitNormalization, lp.SuppressTokensLogitsProcessor,
)
#: Processors whose output is a function of ``(prefix, scores)`` alone: the decoder stays exact.
PREFIX_PROCESSORS: tuple[type, ...] = (
    *POSITION_FREE_PROCESSORS, lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor,
    lp.RepetitionPenaltyLogitsProcessor, lp.NoRepeatNGramLogitsProcessor,
    lp.SequenceBiasLogitsProcessor, lp.NoBadWordsLogitsProcessor,
    lp.PrefixConstrainedLogitsProcessor, lp.ForcedBOSTokenLogitsProcessor,
    lp.ForcedEOSTokenLogitsProcessor, lp.ExponentialDecayLengthPenalty,
    lp.SuppressTokensAtBeginLogitsProcessor,
)
_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria)


class ProcessedBackbone:
    """A :class:`~circuits_llm.protocols.Backbone` whose verifier logits went through ``generate``'s
    logits processors.

    It keeps the token ids its caches hold (``reset``, ``extend`` and ``crop`` follow the wrapped
    backbone), so row ``k`` of a block of ``m`` new tokens is processed with the prefix up to and
    including the ``k``-th of them: ``processors(prefix (1, t), logits (1, V) float32)``, as in
    ``generate``'s loop. Everything else is the wrapped backbone's.
    """

    def __init__(self, backbone: Any, processors: lp.LogitsProcessorList) -> None:
        self.inner = backbone
        self.processors = processors
        self.position_free = all(isinstance(p, POSITION_FREE_PROCESSORS) for p in processors)
        self.tokens: list[int] = []

    def __getattr__(self, name: str) -> Any:  # vocab_size, hidden_size, device, model, ...
        return getattr(self.inner, name)

    @property
    def length(self) -> int:
        return int(self.inner.length)

    def reset(self) -> None:
        self.inner.reset()
        self.tokens = []

    def crop(self, length: int) -> None:
        self.inner.crop(length)
        del self.tokens[length:]

    def extend(self, tokens: Tensor) -> BackboneStep:
        """The wrapped ``extend``, with (1, m, V) float32 processed verifier logits."""
        step = self.inner.extend(tokens)
        base = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens.reshape(-1).tolist())
        raw = step.verifier_logits[0].to(dtype=torch.float32, copy=True)  # (m, V)
        if not len(self.processors):
            return BackboneStep(raw[None], step.draft_hidden)
        ids = torch.tensor([self.tokens], dtype=torch.long, device=raw.device)
        if self.position_free:  # the prefix is not read: one call for every row
            processed = self.processors(ids.expand(raw.shape[0], -1), raw)
        else:
            processed = torch.cat([self.processors(ids[:, :base + k + 1], raw[k:k + 1])
                                   for k in range(raw.shape[0])])
        return BackboneStep(processed[None], step.draft_hidden)


def _stop_condition(stopping_criteria: StoppingCriteriaList, prompt_length: int,
                    generation_config: GenerationConfig) -> StopCondition:
    """The :class:`StopCondition` of ``generate``'s prepared criteria (max length, EOS, strings)."""
    others = [type(c).__name__ for c in stopping_criteria if not isinstance(c, _CRITERIA)]
    if others:
        raise DecoderError(f"stopping criteria {others} are not supported; only max length / "
                           "max_new_tokens, eos_token_id and stop_strings are")
    max_length = int(generation_config.max_length)
    eos: list[int] = []
    strings: list[StopStringCriteria] = []
    for criterion in stopping_criteria:
        if isinstance(criterion, MaxLengthCriteria):
            max_length = min(max_length, int(criterion.max_length))
        elif isinstance(criterion, EosTokenCriteria):
            eos.extend(int(t) for t in criterion.eos_token_id.reshape(-1).tolist())
        elif isinstance(criterion, StopStringCriteria):
            strings.append(criterion)
    return StopCondition.from_criteria(max(max_length - prompt_length, 0), tuple(eos), strings)


def speculative_generate(model: Any, input_ids: Tensor, logits_processor: lp.LogitsProcessorList,
                         stopping_criteria: StoppingCriteriaList,
                         generation_config: GenerationConfig,
                         decoder: AutoregressiveDecoder | None = None,
                         generator: torch.Generator | None = None, **model_kwargs: Any) -> Tensor:
    """The decoding loop ``model.generate(..., custom_generate=speculative_generate)`` runs.

    Args:
        model: the model ``generate`` was called on; ``decoder``'s backbone must wrap it.
        input_ids: (1, L) prepared prompt.
        logits_processor, stopping_criteria, generation_config: prepared by ``generate``.
        decoder: a :class:`~circuits_llm.decoding.decoder.SpeculativeDecoder` (or the autoregressive
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
    backbone = decoder.backbone
    if getattr(backbone, "model", None) is not model:
        raise DecoderError("the decoder's backbone does not wrap the model generate() was called on")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise DecoderError(f"speculative_generate decodes one sequence; got input_ids of shape "
                           f"{tuple(input_ids.shape)} (after num_return_sequences expansion)")
    if generation_config.num_beams not in (None, 1) or generation_config.return_dict_in_generate:
        raise DecoderError("speculative_generate supports neither beam search nor "
                           "return_dict_in_generate")
    others = [type(p).__name__ for p in logits_processor if not isinstance(p, PREFIX_PROCESSORS)]
    if others:
        raise DecoderError(f"logits processors {others} have state of their own or are not known "
                           "to depend on the prefix alone, so the decoder cannot stay exact with "
                           "them; drop the option that adds them")
    prompt = input_ids[0].tolist()
    stop = _stop_condition(stopping_criteria, len(prompt), generation_config)
    hosted = copy.copy(decoder)  # the same head and programs, over the processed logits
    hosted.backbone = ProcessedBackbone(backbone, logits_processor)
    temperature = 1.0 if generation_config.do_sample else 0.0  # the processors warp
    with exclusive(decoder=decoder, backbone=backbone):
        result = hosted.generate(input_ids, stop.max_new_tokens, temperature, None, None,
                                 generator, stop=stop)
    new = result.tokens.to(input_ids.device)
    return torch.cat([input_ids, new[None]], dim=1)
