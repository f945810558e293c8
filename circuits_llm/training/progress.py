"""The training loop's progress: when it stops early, and the progress bar.

The loop runs until its step limit unless the time budget is spent or a stop signal arrived
(:func:`agreed_stop`). Under DDP every rank must leave the loop at the same step (a rank that
stopped alone would leave the others waiting in an all-reduce), so both are agreed across ranks:
true if true on any rank. The progress bar (:func:`progress_bar`, :func:`show_step`) is tqdm's, on
rank 0 only and only when asked for; it shows the loss, the latest validation bits, the tokens per
second of this session and the step's peak memory.

Nothing here changes what a step computes: the trainer (:mod:`circuits_llm.training.trainer`)
asks, and decides.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from circuits_llm.training.distributed import DistributedContext
from circuits_llm.training.signals import StopSignals


def agreed_stop(context: DistributedContext, deadline: float | None,
                signals: StopSignals) -> tuple[bool, bool]:
    """``(time budget spent, stop signal received)``, each true if true on any rank."""
    late = deadline is not None and time.perf_counter() >= deadline
    flags = context.all_sum(torch.tensor([float(late), float(signals.received is not None)]))
    return bool(flags[0] > 0), bool(flags[1] > 0)


@contextmanager
def progress_bar(enabled: bool, limit: int, done: int) -> Iterator[Any]:
    """A tqdm bar of ``limit`` steps, ``done`` of them already (None unless ``enabled``), closed
    however the loop ends."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm
    bar = tqdm(total=limit, initial=min(done, limit), desc="train-head", unit="step",
               dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def show_step(bar: Any, loss: float, validation_bits: float, tokens: int, seconds: float,
              peak_bytes: int) -> None:
    """Advance ``bar`` (None: nothing) by one step: ``tokens`` trained on in ``seconds`` this
    session, the step's ``peak_bytes``."""
    if bar is None:
        return
    bar.set_postfix(loss=f"{loss:.3f}", val_bits=f"{validation_bits:.3f}",
                    tokens_s=f"{tokens / max(seconds, 1e-9):,.0f}",
                    peak_mib=f"{peak_bytes / 2 ** 20:,.0f}")
    bar.update(1)
