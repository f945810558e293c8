"""What a constrained generation must produce: a regular expression or a JSON schema.

Both are frozen, hashable values (a JSON schema is kept as its canonical JSON text), so they key
the in-process cache of built automata (:mod:`circuits_llm.constraints.automaton`). Each one turns
itself into the regular expression ``outlines-core`` compiles (:meth:`Regex.regex`,
:meth:`JsonSchema.regex`); the regex dialect is Rust's ``regex`` crate (no look-around, no
back-references), matched against the UTF-8 text of the whole generation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from circuits_llm.constraints.errors import ConstraintError
from circuits_llm.constraints.schema_support import prepare_schema

#: The recursion depth ``outlines-core`` unrolls recursive JSON schemas to (its own default).
DEFAULT_MAX_RECURSION_DEPTH = 3


def _check_optional_pattern(value: object, name: str) -> None:
    """Raise :class:`ConstraintError` unless ``value`` is None or a non-empty string."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ConstraintError(f"{name} must be a non-empty regular expression string or None, "
                              f"got {value!r}")


@dataclass(frozen=True)
class Regex:
    """Generations whose whole text fully matches ``pattern`` (Rust ``regex`` syntax).

    Attributes:
        pattern: the regular expression, anchored at both ends by construction (the automaton
            accepts a generation only when all of its text matches).

    Matching follows ``outlines-core``'s index, which differs from a plain full match in two
    ways at the end of the pattern: alternation is leftmost-first (once an earlier branch of a
    ``|`` has matched the whole text, later branches are not followed: ``1|12`` allows only
    ``1``; write ``12|1``), and once the text matches, it is continued only through texts that
    match too (``6(\\.3)?`` allows ``6`` but not ``6.3``). Inside a pattern both work as usual
    (``6(\\.3)?;`` allows ``6;`` and ``6.3;``). Every text the automaton allows matches the
    pattern.
    """

    pattern: str

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise ConstraintError(f"Regex pattern must be a str, got {type(self.pattern).__name__}; "
                                  "pass the regular expression as text, e.g. Regex(r'[0-9]+')")
        if not self.pattern:
            raise ConstraintError("Regex pattern is empty: it would only allow the empty generation; "
                                  "pass a pattern that describes the text to generate")

    def regex(self) -> str:
        """The regular expression ``outlines-core`` compiles: the pattern itself."""
        return self.pattern

    def describe(self) -> str:
        """A one-line description for logs and error messages."""
        return f"regex {_shorten(self.pattern)!r}"


@dataclass(frozen=True, init=False)
class JsonSchema:
    """Generations that are JSON documents valid under ``schema``.

    ``outlines-core`` translates the schema into a regex; keywords its translation would drop
    although they constrain the document are refused when the constraint is made (one
    :class:`ConstraintError` listing them), except integer bounds, which are encoded. See
    :mod:`circuits_llm.constraints.schema_support`.

    Attributes:
        schema: the schema, given as JSON text or as a mapping; stored as compact JSON text
            (``json.dumps(..., separators=(",", ":"))``) so that equal schemas are equal
            constraints whatever their whitespace. Keys are *not* sorted: ``outlines-core``
            emits an object's properties in the order the schema lists them, so the order is
            part of the constraint.
        whitespace_pattern: the regex of the whitespace allowed between JSON tokens (None:
            ``outlines-core``'s default, at most one space), e.g. ``r"[ \\n]{0,2}"``.
        max_recursion_depth: how deep recursive schemas (``$ref`` cycles) are unrolled.
    """

    schema: str
    whitespace_pattern: str | None = None
    max_recursion_depth: int = DEFAULT_MAX_RECURSION_DEPTH

    def __init__(self, schema: str | Mapping[str, Any], whitespace_pattern: str | None = None,
                 max_recursion_depth: int = DEFAULT_MAX_RECURSION_DEPTH) -> None:
        object.__setattr__(self, "schema", _canonical_schema(schema))
        prepare_schema(json.loads(self.schema))  # refuse what the regex could not enforce, now
        _check_optional_pattern(whitespace_pattern, "JsonSchema whitespace_pattern")
        object.__setattr__(self, "whitespace_pattern", whitespace_pattern)
        if isinstance(max_recursion_depth, bool) or not isinstance(max_recursion_depth, int) \
                or max_recursion_depth < 0:
            raise ConstraintError(f"JsonSchema max_recursion_depth must be an int >= 0, "
                                  f"got {max_recursion_depth!r}")
        object.__setattr__(self, "max_recursion_depth", max_recursion_depth)

    def regex(self) -> str:
        """The regular expression of the schema's documents (``outlines-core``'s translation).

        Integer ``minimum`` / ``maximum`` bounds, which ``outlines-core`` drops, are spliced in
        (:mod:`circuits_llm.constraints.schema_support`), so every match validates.

        Raises:
            ConstraintError: the schema uses something ``outlines-core`` does not support.
        """
        from outlines_core.json_schema import build_regex_from_schema
        prepared = prepare_schema(json.loads(self.schema))
        text = json.dumps(prepared.schema, separators=(",", ":"), ensure_ascii=False)
        try:
            return prepared.apply(build_regex_from_schema(text, self.whitespace_pattern,
                                                          self.max_recursion_depth))
        except ValueError as error:
            raise ConstraintError(
                f"JSON schema {_shorten(self.schema)} cannot be turned into a regular expression: "
                f"{error}. Use the JSON Schema features outlines-core supports (type, properties, "
                "required, enum, const, items, anyOf/oneOf/allOf, $ref to #/$defs, string formats)"
            ) from error

    def describe(self) -> str:
        """A one-line description for logs and error messages."""
        return f"JSON schema {_shorten(self.schema)}"


#: A constraint on the text of a generation.
Constraint: TypeAlias = Regex | JsonSchema


def _canonical_schema(schema: object) -> str:
    """``schema`` (JSON text or a mapping) as compact JSON text of a JSON object, keys in order."""
    if isinstance(schema, str):
        try:
            value = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ConstraintError(f"JsonSchema text is not valid JSON ({error}): pass the schema as "
                                  "a JSON object text or as a dict") from error
    elif isinstance(schema, Mapping):
        value = dict(schema)
    else:
        raise ConstraintError(f"JsonSchema takes a JSON string or a mapping, got {type(schema).__name__}")
    if not isinstance(value, dict):
        raise ConstraintError(f"A JSON schema must be a JSON object, got {type(value).__name__} "
                              f"{_shorten(json.dumps(value))}; wrap it, e.g. {{\"type\": \"string\"}}")
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise ConstraintError(f"JsonSchema mapping is not JSON-serialisable ({error}): use only "
                              "dicts, lists, strings, numbers, booleans and None") from error


def _shorten(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters (with an ellipsis) for messages."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
