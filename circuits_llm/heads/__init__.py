"""Circuit MTP heads: hidden states of an LLM -> parameters of a circuit over future tokens.

:class:`MTPHead` implements :class:`circuits_llm.protocols.DraftHead` for any smooth, decomposable
circuit over variables ``0 .. window-1`` (build one by name with :meth:`MTPHead.from_name`: the
templates ``ff``, ``cp``, ``hmm``, ``btree`` or a kind added with :func:`register_head_kind`), in
two variants (:class:`HeadVariant`): FULL (per-unit unembeddings, the MTPC paper's) and LEAN
(the frozen LM head on per-unit low-rank transforms). Save/load: :func:`save_head`,
:func:`load_head` (:mod:`circuits_llm.heads.io`).

A head may draft over a compressed vocabulary, the ``K`` most frequent tokens of its data
(``MTPHead(..., draft_vocab=frequent_tokens(counts, K))``, :mod:`circuits_llm.heads.vocab`); a
head built by name on a vocabulary above 16,384 ids does so by default over its first 4,096 ids
and EOS (``draft_vocab="full"`` opts out; :class:`DraftVocab`); its training loss reads the input
units in tiles (:mod:`circuits_llm.heads.chunked`); default sizes keep a head within 5% of its
backbone (:mod:`circuits_llm.heads.sizing`). The heads shipped in the package are head
directories like any other (:mod:`circuits_llm.heads.shipped`).
"""

from circuits_llm.heads.config import FORMAT_VERSION, HeadConfig, HeadConfigError, HeadVariant
from circuits_llm.heads.head import MTPHead, check_head_circuit, parameter_count
from circuits_llm.heads.io import load_head, save_head
from circuits_llm.heads.kinds import HeadKind, head_kind, head_kind_names, register_head_kind
from circuits_llm.heads.sizing import HeadBudgetWarning, HeadSize, fit_head_size
from circuits_llm.heads.vocab import DraftVocab, TokenCounts, frequent_tokens, token_counts

__all__ = [
    "FORMAT_VERSION", "DraftVocab", "HeadBudgetWarning", "HeadConfig", "HeadConfigError",
    "HeadKind", "HeadSize", "HeadVariant", "MTPHead", "TokenCounts", "check_head_circuit", "fit_head_size",
    "frequent_tokens", "head_kind", "head_kind_names", "load_head", "parameter_count",
    "register_head_kind", "save_head", "token_counts",
]
