"""Old import paths of modules that moved into rooms (kept for one release, with a warning).

``circuits_llm`` was reorganised into rooms by job (``decoding/``, ``text/``, ``training/``,
``app/``, ``runtime/``; see docs/architecture.md). The README and the tutorials of 0.1 imported
a few modules by their old top-level paths (``circuits_llm.decoder``, ``circuits_llm.models``, ...).
Each such path is now a three-line module that calls :func:`alias_moved_module`, which warns once
and makes the old name *the same module object* as the new one, so monkeypatching or ``isinstance``
through either name sees one module.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

#: The release that removes the old paths.
REMOVED_IN = "0.3"


def moved_message(old: str, new: str) -> str:
    """The warning text for an import of ``old``, which now lives at ``new``."""
    return (f"{old} moved to {new}; import from there or from the package face "
            f"(`import circuits_llm`). The old path is removed in {REMOVED_IN}.")


def alias_moved_module(old: str, new: str) -> ModuleType:
    """Warn that ``old`` moved, import ``new`` and register it under ``old`` in ``sys.modules``."""
    warnings.warn(moved_message(old, new), DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module
