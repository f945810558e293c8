"""Shared pytest configuration: deterministic hypothesis, and ``import factories`` from tests/."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:  # works with and without tests/__init__.py
    sys.path.insert(0, _TESTS)

# Tiny tensors: intra-op threads only add synchronisation cost (and contend on shared CI cores).
torch.set_num_threads(1)

# Deterministic in CI and locally: the same examples on every run, no wall-clock deadline
# (circuit compilation time varies with machine load), no database of past failures.
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=(HealthCheck.too_slow, HealthCheck.data_too_large),
)
settings.load_profile("ci")


def _mend_triton_interpreter() -> None:
    """Under ``TRITON_INTERPRET=1`` with triton < 3.7: read scalar kernel arguments as triton 3.7 does.

    triton 3.6's interpreter turns a kernel's integer argument into a one-element array and reads
    it back with ``int(array)`` (e.g. ``for c0 in range(0, C, BLOCK)``); numpy >= 2.4 refuses that
    ("only 0-dimensional arrays can be converted to Python scalars"). triton 3.7 squeezes first.
    This applies the same one-line change for the interpreted tests only; compiled kernels never
    run the interpreter, and the cubin tests compile every launch under triton 3.6 unchanged.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_squeezes_scalars", False):
        return

    def patch_lang_tensor(tensor: object, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))  # type: ignore[attr-defined]

    patch_lang_tensor._squeezes_scalars = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


_mend_triton_interpreter()


@pytest.fixture(autouse=True)
def _seed_global_rng() -> None:
    """Tests that draw from torch's global RNG see the same numbers whatever ran before them."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _private_corpus_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tokenised corpora go to a directory of this run, never to the user's ~/.cache: a test
    cannot read a stale cache left by another checkout, and leaves nothing behind."""
    from circuits_llm.text.corpus import CACHE_ENV
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("corpus-cache"))
    yield
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before
