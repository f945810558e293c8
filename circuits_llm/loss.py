"""Deprecated path of :mod:`circuits_llm.training.loss`
(kept for one release; see :mod:`circuits_llm._moved`)."""

from circuits_llm._moved import alias_moved_module

alias_moved_module(__name__, "circuits_llm.training.loss")
