"""Benchmark-only tools for speculative decoding.

* :class:`ForcedAcceptance`: a backbone wrapper whose verifier accepts every draft, for the
  accept-all throughput bound (the MTPC paper's ``max_tok/s``; :mod:`benchmarks.decoder_bench`).
* :func:`decode_prompts`: a warm-up, then every prompt decoded once with its own seed, timed as
  one loop (:mod:`benchmarks.block_step_bench`, :mod:`benchmarks.draft_depth_bench`).
* :func:`compare_on_prompts`: several decoders through :func:`decode_prompts` in each mode, as
  ratios to the first (:mod:`benchmarks.draft_depth_bench`, :mod:`experiments.third_party_code`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.metrics import DecodeResult
from circuits_llm.protocols import BackboneStep


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


@dataclass
class DecodedPrompts:
    """What :func:`decode_prompts` measured: each prompt's result and the loop's wall seconds."""

    results: list[DecodeResult]
    seconds: float

    @property
    def outputs(self) -> list[list[int]]:
        """Each prompt's tokens (what greedy decoders must agree on)."""
        return [result.tokens.tolist() for result in self.results]

    @property
    def tokens(self) -> int:
        return sum(len(result.tokens) for result in self.results)

    @property
    def rounds(self) -> int:
        return sum(len(result.rounds) for result in self.results)


def decode_prompts(decoder: Any, prompts: Sequence[Tensor], new_tokens: int, temperature: float,
                   after: Callable[[DecodeResult], None] | None = None) -> DecodedPrompts:
    """One warm-up decode of 8 tokens (compilation included, not timed), then every prompt
    decoded to ``new_tokens`` with the generator seeded by its index and no EOS, timed as one
    loop; ``after`` sees each result as it comes (e.g. to read the decoder's state)."""
    decoder.generate(prompts[0], 8, temperature, generator=torch.Generator().manual_seed(0),
                     eos_token_id=())
    results = []
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        result = decoder.generate(prompt, new_tokens, temperature,
                                  generator=torch.Generator().manual_seed(index), eos_token_id=())
        if after is not None:
            after(result)
        results.append(result)
    return DecodedPrompts(results, time.perf_counter() - start)


def compare_on_prompts(makers: dict[str, Callable[[], Any]], prompts: Sequence[Tensor],
                       new_tokens: int, modes: dict[str, float],
                       log: Callable[[str], None] = print,
                       after: Callable[[str, str, Any, DecodeResult], None] | None = None
                       ) -> dict[str, dict[str, float]]:
    """Each decoder ``makers`` builds (the first: the baseline) decodes ``prompts`` in every mode
    (name -> temperature) with :func:`decode_prompts`; rows ``"<mode>, <name>"`` with tokens a
    second, tokens a round and ``speedup_vs_autoregressive`` (over the first decoder in the same
    mode). ``after(mode, name, decoder, result)`` sees each result.

    Raises:
        AssertionError: a greedy mode (temperature 0) whose outputs differ between decoders.
    """
    rows: dict[str, dict[str, float]] = {}
    baseline = next(iter(makers))
    for mode, temperature in modes.items():
        outputs = {}
        for name, make in makers.items():
            decoder = make()
            seen = None if after is None else \
                (lambda result, m=mode, n=name, d=decoder: after(m, n, d, result))
            decoded = decode_prompts(decoder, prompts, new_tokens, temperature, seen)
            outputs[name] = decoded.outputs
            rows[f"{mode}, {name}"] = {"tokens_per_second": decoded.tokens / decoded.seconds,
                                       "tokens_per_round": decoded.tokens / decoded.rounds}
        base = rows[f"{mode}, {baseline}"]["tokens_per_second"]
        for name in makers:
            row = rows[f"{mode}, {name}"]
            row["speedup_vs_autoregressive"] = row["tokens_per_second"] / base
            log(f"{mode:>6} {name:<26} {row['tokens_per_round']:.2f} tokens a round, "
                f"{row['speedup_vs_autoregressive']:.3f}x")
        if temperature == 0 and any(out != outputs[baseline] for out in outputs.values()):
            raise AssertionError(f"greedy outputs differ between the decoders ({mode})")
    return rows
