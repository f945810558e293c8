"""Constraints on generated text, compiled into automata over a model's token ids.

A :class:`Regex` or :class:`JsonSchema` (:mod:`~circuits_llm.constraints.spec`) is built, with
``outlines-core``, into a :class:`TokenAutomaton` over a Hugging Face tokenizer's ids
(:mod:`~circuits_llm.constraints.automaton`); :func:`token_bytes` reads the bytes each id spells
(:mod:`~circuits_llm.constraints.vocabulary`). The decoder masks the verifier's logits with
:meth:`TokenAutomaton.mask` and restricts the draft circuit to :meth:`TokenAutomaton.window`.
JSON schemas are first checked against what the regex can enforce, and their integer bounds
encoded (:mod:`~circuits_llm.constraints.schema_support`). Inside the room the order is
errors -> numeric_range -> schema_support -> spec -> vocabulary -> automaton.
"""

from circuits_llm.constraints.automaton import TokenAutomaton, WindowTable, clear_cache
from circuits_llm.constraints.spec import Constraint, ConstraintError, JsonSchema, Regex
from circuits_llm.constraints.vocabulary import (
    TokenizerVocabulary,
    TokenSpelling,
    build_vocabulary,
    detect_spelling,
    token_bytes,
)

__all__ = [
    "Constraint",
    "ConstraintError",
    "JsonSchema",
    "Regex",
    "TokenAutomaton",
    "TokenSpelling",
    "TokenizerVocabulary",
    "WindowTable",
    "build_vocabulary",
    "clear_cache",
    "detect_spelling",
    "token_bytes",
]
