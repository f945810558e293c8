"""Decoders compared on the same prompts: every decoder, greedy then sampling, prompt by prompt.

:func:`compare_decoders` is the decoding part of ``circuits-llm demo | bench`` and of the head
study (``benchmarks/study.py``). The decoders run interleaved prompt by prompt, so machine-load
drift hits them alike, with the same seed per prompt. :class:`Comparison` pools the results into
:class:`~circuits_llm.app.rows.DecoderRow` rows and checks that greedy decoding gave every decoder
the autoregressive tokens.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from circuits_llm.app.rows import BASELINE, DecodeMode, DecoderRow, with_speedups
from circuits_llm.decoding.metrics import DecodeResult, aggregate


@dataclass
class Comparison:
    """Every decoder's results, per mode, in prompt order."""

    results: dict[DecodeMode, dict[str, list[DecodeResult]]]

    def rows(self) -> list[DecoderRow]:
        """Pooled rows with speed-ups (see :mod:`circuits_llm.app.rows`)."""
        rows = [DecoderRow.from_summary(name, mode, len(results), aggregate(results))
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
                     temperature: float, seed: int, progress: bool = True) -> Comparison:
    """Decode every prompt with every decoder, greedy then sampling (seed ``seed + i``).

    Each decoder first runs one short warm-up generation per mode (not recorded). The seeded
    generators live on each decoder's device (sampling on CUDA needs a CUDA generator).
    """
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


def _generator(decoder: Any, seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` on the decoder's device (the CPU if it names none)."""
    device = getattr(decoder, "device", None)
    return torch.Generator(device=device if isinstance(device, torch.device) else "cpu"
                           ).manual_seed(seed)
