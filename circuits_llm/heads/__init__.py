"""Circuit MTP heads: hidden states of an LLM -> parameters of a circuit over future tokens.

:class:`MTPHead` implements :class:`circuits_llm.protocols.DraftHead` for any smooth, decomposable
circuit over variables ``0 .. window-1`` (build one by name with :meth:`MTPHead.from_name`: the
templates ``ff``, ``cp``, ``hmm``, ``btree`` or a kind added with :func:`register_head_kind`), in
two variants (:class:`HeadVariant`): FULL (per-unit unembeddings, the MTPC paper's) and LEAN
(the frozen LM head on per-unit low-rank transforms). Save/load: :func:`save_head`,
:func:`load_head` (:mod:`circuits_llm.heads.io`).
"""

from circuits_llm.heads.config import FORMAT_VERSION, HeadConfig, HeadConfigError, HeadVariant
from circuits_llm.heads.head import MTPHead, check_head_circuit, parameter_count
from circuits_llm.heads.io import load_head, save_head
from circuits_llm.heads.kinds import HeadKind, head_kind, head_kind_names, register_head_kind

__all__ = [
    "FORMAT_VERSION", "HeadConfig", "HeadConfigError", "HeadKind", "HeadVariant", "MTPHead",
    "check_head_circuit", "head_kind", "head_kind_names", "load_head", "parameter_count",
    "register_head_kind", "save_head",
]
