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


# --- version_sensitive: the tests CI reruns on the newest Python, without triton, on the floors ---
#
# `make test` runs the whole suite once, on the README's Python and pinned versions. The other CI
# configurations (scripts/test_python.sh: the newest Python with and without triton;
# scripts/test_floors.sh: the oldest supported versions) run only `-m version_sensitive`: the tests
# of code whose behaviour depends on the interpreter or on a dependency's release (triton's
# interpreter and compiler, transformers' KV caches and generate, peft, tokenizers/GGUF,
# outlines-core, torch.compile, serialization, numpy/networkx, real processes and signals).
# The marker is given here, by module, from tests/version_sensitive.txt (which says why for each
# module), so test files need no edit; a test may also carry @pytest.mark.version_sensitive itself.
# When the marker is selected, a listed module that does not exist or a name filter that names no
# test function is a usage error (exit status 4), checked on the source before collection (so in
# the controller under pytest-xdist too): a rename cannot silently shrink the selection. An empty
# selection (a typo in `-m`) is pytest's exit status 5.

VERSION_SENSITIVE = "version_sensitive"
_VERSION_SENSITIVE_LIST = Path(_TESTS) / "version_sensitive.txt"
_ENTRIES_KEY = pytest.StashKey[dict[str, tuple[str, ...]]]()


def _version_sensitive_entries() -> dict[str, tuple[tuple[str, ...], str]]:
    """``{module file name: (name filters, where listed)}`` from tests/version_sensitive.txt.

    A line is ``test_module.py`` (every test of the module) or ``test_module.py::part|part``: then
    only the test functions whose name contains one of the parts. ``#`` starts a comment.
    """
    entries: dict[str, tuple[tuple[str, ...], str]] = {}
    for number, raw in enumerate(_VERSION_SENSITIVE_LIST.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        module, _, names = line.partition("::")
        where = f"tests/{_VERSION_SENSITIVE_LIST.name}:{number}"
        if module in entries:
            raise pytest.UsageError(f"{where}: tests/{module} is listed twice")
        parts = tuple(p.strip() for p in names.split("|") if p.strip())
        if names and not parts:
            raise pytest.UsageError(f"{where}: empty name filter after '::'")
        entries[module] = (parts, where)
    return entries


def _check_version_sensitive(entries: dict[str, tuple[tuple[str, ...], str]]) -> None:
    """Every listed module exists and every name filter names one of its test functions."""
    import ast

    for module, (parts, where) in entries.items():
        path = Path(_TESTS) / module
        if not path.is_file():
            raise pytest.UsageError(f"{where}: no test module tests/{module}")
        if not parts:
            continue
        names = [node.name for node in ast.walk(ast.parse(path.read_text(), str(path)))
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                 and node.name.startswith("test")]
        stale = [part for part in parts if not any(part in name for name in names)]
        if stale:
            raise pytest.UsageError(
                f"{where}: no test function of tests/{module} has {' or '.join(stale)} in its name")


def pytest_configure(config: pytest.Config) -> None:
    entries = _version_sensitive_entries()
    selected = VERSION_SENSITIVE in (config.option.markexpr or "")
    if selected and not hasattr(config, "workerinput"):  # once, not in every xdist worker
        _check_version_sensitive(entries)
    config.stash[_ENTRIES_KEY] = {module: parts for module, (parts, _) in entries.items()}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    entries = config.stash[_ENTRIES_KEY]
    for item in items:
        parts = entries.get(item.path.name)
        if parts is None:
            continue
        name = getattr(item, "originalname", item.name)  # the function's name, without parameters
        if not parts or any(part in name for part in parts):
            item.add_marker(VERSION_SENSITIVE)
