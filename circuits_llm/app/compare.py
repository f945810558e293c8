"""Decoders compared on the same prompts: every decoder, greedy then sampling, prompt by prompt
(or batch by batch: ``batch_size`` prompts decoded together, each row exactly as alone).

:func:`compare_decoders` is the decoding part of ``circuits-llm demo | bench`` and of the head
study (``benchmarks/study.py``). The decoders run interleaved prompt by prompt, so machine-load
drift hits them alike, with the same seed per prompt. :class:`Comparison` pools the results into
:class:`~circuits_llm.app.rows.DecoderRow` rows and checks that greedy decoding gave every decoder
the autoregressive tokens.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from circuits_llm.app.rows import BASELINE, DecodeMode, DecoderRow, with_speedups
from circuits_llm.decoding.metrics import (
    BatchResult,
    DecodeResult,
    aggregate,
    pool_batches,
    single_row_batch,
)


@dataclass
class Comparison:
    """Every decoder's results, per mode, in prompt order."""

    results: dict[DecodeMode, dict[str, list[DecodeResult]]]
    #: with a batch size above 1, each decoder's batches per mode (their rows are in ``results``)
    batches: dict[DecodeMode, dict[str, list[BatchResult]]] = field(default_factory=dict)

    def rows(self) -> list[DecoderRow]:
        """Pooled rows with speed-ups (see :mod:`circuits_llm.app.rows`); decoded in batches,
        timed per batch round (:func:`~circuits_llm.decoding.metrics.pool_batches`)."""
        rows = [DecoderRow.from_summary(
                    name, mode, len(results),
                    pool_batches(self.batches[mode][name]) if self.batches else aggregate(results))
                for mode, by_decoder in self.results.items() for name, results in by_decoder.items()]
        return with_speedups(rows)

    def greedy_identical(self) -> dict[str, Any]:
        """Whether every decoder's greedy output equals the autoregressive one, prompt by prompt."""
        by_decoder = self.results.get(DecodeMode.GREEDY, {})
        reference = by_decoder.get(BASELINE, [])
        mismatches = []
        for name, results in by_decoder.items():
            for index, (ours, ref) in enumerate(zip(results, reference, strict=True)):
                if not torch.equal(ours.tokens, ref.tokens):
                    diff = (ours.tokens != ref.tokens).nonzero()
                    first = int(diff[0, 0]) if diff.numel() else min(len(ours.tokens),
                                                                     len(ref.tokens))
                    mismatches.append({"decoder": name, "prompt": index, "first_difference": first})
        return {"all": bool(reference) and not mismatches, "prompts": len(reference),
                "decoders": sorted(by_decoder), "mismatches": mismatches}


def compare_decoders(decoders: dict[str, Any], prompts: list[Tensor], new_tokens: int,
                     temperature: float, seed: int, progress: bool = True,
                     batch_size: int = 1) -> Comparison:
    """Decode every prompt with every decoder, greedy then sampling (seed ``seed + i``).

    Each decoder first runs one short warm-up generation per mode (not recorded). The seeded
    generators live on each decoder's device (sampling on CUDA needs a CUDA generator). With
    ``batch_size`` above 1 the prompts are decoded ``batch_size`` at a time (a batch per
    ``generate`` call, prompt ``i`` with its own generator seeded ``seed + i``: the tokens it
    gets alone), and the rows report tokens over the batch per second.
    """
    if batch_size > 1:
        return _compare_batches(decoders, prompts, new_tokens, temperature, seed, progress,
                                batch_size)
    modes = {DecodeMode.GREEDY: 0.0, DecodeMode.SAMPLING: temperature}
    results: dict[DecodeMode, dict[str, list[DecodeResult]]] = {}
    bar = tqdm(total=len(modes) * len(decoders) * len(prompts), desc="decode", unit="run",
               disable=not progress, file=sys.stderr)
    with bar:
        for mode, temp in modes.items():
            for decoder in decoders.values():
                decoder.generate(prompts[0], min(8, new_tokens), temp,
                                 generator=_generator(decoder, seed), eos_token_id=())
            results[mode] = {name: [] for name in decoders}
            for index, prompt in enumerate(prompts):
                for name, decoder in decoders.items():
                    generator = _generator(decoder, seed + index)
                    # a fixed length on every decoder (no EOS stop), so the timings compare
                    results[mode][name].append(decoder.generate(prompt, new_tokens, temp,
                                                                generator=generator,
                                                                eos_token_id=()))
                    bar.update(1)
    return Comparison(results)


def _compare_batches(decoders: dict[str, Any], prompts: list[Tensor], new_tokens: int,
                     temperature: float, seed: int, progress: bool, batch_size: int
                     ) -> Comparison:
    """:func:`compare_decoders` in batches of ``batch_size`` prompts (the last may be smaller)."""
    modes = {DecodeMode.GREEDY: 0.0, DecodeMode.SAMPLING: temperature}
    results: dict[DecodeMode, dict[str, list[DecodeResult]]] = {}
    batches: dict[DecodeMode, dict[str, list[BatchResult]]] = {}
    starts = range(0, len(prompts), batch_size)
    bar = tqdm(total=len(modes) * len(decoders) * len(starts), desc="decode", unit="batch",
               disable=not progress, file=sys.stderr)
    with bar:
        for mode, temp in modes.items():
            for decoder in decoders.values():  # warm-up: the first batch, a few tokens
                first = prompts[:batch_size]
                decoder.generate(first, min(8, new_tokens), temp, eos_token_id=(),
                                 generator=[_generator(decoder, seed + i) for i in range(len(first))])
            results[mode] = {name: [] for name in decoders}
            batches[mode] = {name: [] for name in decoders}
            for start in starts:
                chunk = prompts[start:start + batch_size]
                for name, decoder in decoders.items():
                    generators = [_generator(decoder, seed + start + i) for i in range(len(chunk))]
                    batch = decoder.generate(chunk, new_tokens, temp, generator=generators,
                                             eos_token_id=())
                    if isinstance(batch, DecodeResult):  # one prompt: the single-prompt path
                        batch = single_row_batch(batch)
                    batches[mode][name].append(batch)
                    results[mode][name].extend(batch.rows)
                    bar.update(1)
    return Comparison(results, batches)


def _generator(decoder: Any, seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` on the decoder's device (the CPU if it names none)."""
    device = getattr(decoder, "device", None)
    return torch.Generator(device=device if isinstance(device, torch.device) else "cpu"
                           ).manual_seed(seed)
