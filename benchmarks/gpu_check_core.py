"""The pieces every row of :mod:`benchmarks.gpu_check` shares: its types, its settings, the timed
and guarded run of one row, the compiler choice and the goodness-of-fit test.

A row is one check on the device: a :class:`Group`, a name, a :class:`Status` (PASS, FAIL or
SKIP with a :class:`SkipReason`), the numbers it measured (one human-readable line for the table
and a JSON-ready mapping), and the seconds it took. :func:`run_row` runs a check function, times
it (synchronised on CUDA), turns any exception into a FAIL that names it (one broken check never
hides the others) and fails a row whose compiled programs fell back to eager
(:func:`~circuits_llm.runtime.compiling.compile_fallbacks`): such a row did not check what it
claims to.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch

from circuits_llm.runtime.compiling import Compilation, Compiler, compile_fallbacks, use_compiler
from circuits_llm.runtime.timing import synchronize


class Status(Enum):
    """The verdict of one row."""

    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


class SkipReason(Enum):
    """Why a row did not run. The CPU smoke test accepts only the first two."""

    NO_CIRKIT = "libcirkit is not importable (optional: pip install libcirkit, or carry its wheel)"
    NEEDS_CUDA = "needs CUDA"
    BUDGET = "time budget spent (--budget-s)"


class Group(Enum):
    """The row groups of the table, in the order they run."""

    QUERIES = "circuit queries"
    SAMPLING = "circuit sampling"
    MAP = "circuit MAP"
    LEARN = "learn.fit EM"
    DECODER_LAW = "decoder law"
    GREEDY = "greedy = generate"
    SPEED = "SmolLM2-shaped speed"
    BLOCK_SPEED = "draft-block speed"
    BATCH = "batched decoding"
    CIRKIT = "vs libcirkit"


class CompilerChoice(Enum):
    """What compiles the decoder's programs (the backbone's steps and the round programs).

    ``INDUCTOR``: the shipped default, :func:`~circuits_llm.runtime.compiling.torch_compiler`
    (``torch.compile``; CUDA graphs on CUDA). ``AOT_EAGER``: dynamo and AOTAutograd trace every
    program whole (``fullgraph``: a graph break is still an error) but no code is generated; the
    CPU ``--quick`` smoke run uses it, since inductor's C++ compilation takes minutes there.
    """

    INDUCTOR = "inductor"
    AOT_EAGER = "aot_eager"


def aot_eager_compiler(fn: Callable[..., Any], *, name: str, device: torch.device) -> Compilation:
    """A :class:`~circuits_llm.runtime.compiling.Compiler`: whole-graph ``torch.compile`` with the
    ``aot_eager`` backend (outputs are ordinary tensors, never static). ``name`` is unused."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")
    return Compilation(compiled, static_outputs=False)


@contextlib.contextmanager
def compiler_scope(choice: CompilerChoice) -> Iterator[None]:
    """Build the decoders and backbones of a ``with`` block with ``choice``'s compiler."""
    if choice is CompilerChoice.INDUCTOR:
        yield
        return
    compiler: Compiler = aot_eager_compiler
    with use_compiler(compiler):
        yield


@dataclass(frozen=True)
class Settings:
    """One run of the check.

    Attributes:
        device: where every checked computation runs (the references run on the CPU).
        quick: shrink everything (tiny model shapes, fewer samples): the CPU smoke run.
        compiler: what compiles the decoders' programs.
        seed: seeds every random choice.
        budget_s: a group that would start after this many seconds is skipped instead.
    """

    device: torch.device
    quick: bool
    compiler: CompilerChoice
    seed: int = 0
    budget_s: float = 450.0

    @property
    def cuda(self) -> bool:
        """Whether the checked device is a GPU."""
        return self.device.type == "cuda"

    def generator(self, seed: int) -> torch.Generator:
        """A generator on the checked device, seeded with ``self.seed + seed``."""
        return torch.Generator(device=self.device).manual_seed(self.seed + seed)


@dataclass(frozen=True)
class Outcome:
    """What a check function returns: its verdict, the table's line of numbers, the JSON detail,
    and for a FAIL or SKIP the reason."""

    status: Status
    numbers: str
    values: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""
    skip: SkipReason | None = None

    @classmethod
    def verdict(cls, ok: bool, numbers: str, values: Mapping[str, Any], why: str) -> Outcome:
        """PASS when ``ok``, else FAIL with ``why``."""
        return cls(Status.PASS if ok else Status.FAIL, numbers, values, "" if ok else why)

    @classmethod
    def skipped(cls, skip: SkipReason, detail: str = "") -> Outcome:
        """A SKIP whose reason starts with ``skip``'s text."""
        reason = skip.value + (f": {detail}" if detail else "")
        return cls(Status.SKIP, "", {}, reason, skip)


@dataclass(frozen=True)
class Row:
    """One line of the table (see the module docstring)."""

    group: Group
    name: str
    status: Status
    numbers: str
    seconds: float
    reason: str = ""
    skip: SkipReason | None = None
    values: Mapping[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The row as JSON-ready data."""
        return {"group": self.group.value, "name": self.name, "status": self.status.value,
                "numbers": self.numbers, "seconds": round(self.seconds, 3), "reason": self.reason,
                "skip": None if self.skip is None else self.skip.name, "values": dict(self.values)}


def run_row(group: Group, name: str, check: Callable[[], Outcome], device: torch.device) -> Row:
    """Run ``check`` as one row: timed (synchronised on CUDA), an exception becomes a FAIL naming
    it, and a compiled program that fell back to eager during the check makes it a FAIL."""
    before = len(compile_fallbacks())
    start = time.perf_counter()
    try:
        outcome = check()
        synchronize(device)
    except Exception as error:  # a broken check is a FAIL row, never a crash of the table
        where = traceback.extract_tb(error.__traceback__)[-1]
        first = (str(error).strip().splitlines() or [""])[0][:300]
        outcome = Outcome(Status.FAIL, "", {}, f"{type(error).__name__}: {first} "
                          f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})")
    seconds = time.perf_counter() - start
    fallbacks = compile_fallbacks()[before:]
    if fallbacks and outcome.status is Status.PASS:
        names = "; ".join(f"{f.program}: {f.error}" for f in fallbacks)
        outcome = Outcome(Status.FAIL, outcome.numbers, outcome.values,
                          f"compiled program(s) fell back to eager: {names}")
    return Row(group, name, outcome.status, outcome.numbers, seconds, outcome.reason,
               outcome.skip, outcome.values)


# ------------------------------------------------------------------ goodness of fit
#: reject a sampler below this p-value (the threshold of tests/test_sampling.py)
ALPHA = 1e-4
#: cells with fewer expected counts are pooled into one (the chi-square approximation needs it)
MIN_EXPECTED = 5.0


def g_test(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of a G-test of ``counts`` (S,) against ``probs`` (S,) (the test of
    ``tests/test_sampling.py``): a count on a zero-probability cell gives 0; cells with fewer
    than :data:`MIN_EXPECTED` expected counts are pooled; p = ``gammaincc(df / 2, G / 2)``."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    if counts[probs <= 0].any():
        return 0.0
    expected = probs / probs.sum() * counts.sum()
    small = expected < MIN_EXPECTED
    observed_bins = [*counts[~small], *([counts[small].sum()] if small.any() else [])]
    expected_bins = [*expected[~small], *([expected[small].sum()] if small.any() else [])]
    obs, exp = np.array(observed_bins), np.array(expected_bins)
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if len(obs) < 2:
        return 1.0
    positive = obs > 0
    g = 2.0 * float((obs[positive] * np.log(obs[positive] / exp[positive])).sum())
    p = torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0, dtype=torch.float64),
                                torch.tensor(max(g, 0.0) / 2.0, dtype=torch.float64))
    return float(p)


def total_variation(counts: np.ndarray, probs: np.ndarray) -> float:
    """Total variation between the empirical law of ``counts`` and ``probs``."""
    counts = np.asarray(counts, dtype=np.float64)
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())
