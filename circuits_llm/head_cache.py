"""Deprecated path of :mod:`circuits_llm.app.head_cache` (kept for one release; see
:mod:`circuits_llm._moved`). ``python -m circuits_llm.head_cache ship`` still runs it."""

import sys
import warnings

from circuits_llm._moved import alias_moved_module, moved_message

if __name__ == "__main__":
    warnings.warn(moved_message("circuits_llm.head_cache", "circuits_llm.app.head_cache"),
                  DeprecationWarning, stacklevel=1)
    from circuits_llm.app.head_cache import main
    sys.exit(main())
else:
    alias_moved_module(__name__, "circuits_llm.app.head_cache")
