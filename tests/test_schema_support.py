"""JSON schemas whose regex enforces what they say (circuits_llm.constraints.schema_support).

``outlines-core`` drops keywords its translation does not read; integer bounds are encoded with
:func:`integer_range_regex` (checked against every integer of a window with Python's ``re`` as the
oracle), and every other dropped constraining keyword is refused with one error naming it.
"""

from __future__ import annotations

import itertools
import json
import re
from collections import deque
from fractions import Fraction
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_constraint_automaton import byte_level_tokenizer

from circuits_llm.constraints import ConstraintError, JsonSchema, Regex, TokenAutomaton, token_bytes
from circuits_llm.constraints.numeric_range import Bound, integer_range_regex, number_range_regex
from circuits_llm.constraints.schema_support import prepare_schema

WINDOW = range(-2100, 2101)
bounds = st.one_of(st.none(), st.integers(-2000, 2000))


@settings(max_examples=150, deadline=None)
@given(low=bounds, high=bounds)
def test_integer_range_regex_matches_exactly_the_interval(low: int | None, high: int | None) -> None:
    if low is not None and high is not None and low > high:
        with pytest.raises(ConstraintError, match="no integer"):
            integer_range_regex(low, high)
        return
    pattern = re.compile(integer_range_regex(low, high))
    for value in WINDOW:
        inside = (low is None or value >= low) and (high is None or value <= high)
        assert (pattern.fullmatch(str(value)) is not None) == inside, (low, high, value)
    # only JSON's spelling: no leading zeros, no plus sign, no negative zero
    for text in ("-0", "00", "007", "+5", "1.0", "", "-"):
        assert pattern.fullmatch(text) is None, (low, high, text)
    if high is None:  # unbounded above: far beyond the window too
        assert pattern.fullmatch("9" * 30) is not None


#: Decimal spellings around small values: every fraction shape, both signs, and some non-numbers.
DECIMALS = [f"{sign}{whole}{fraction}" for whole in range(23)
            for fraction in ("", ".0", ".00", ".5", ".05", ".50", ".9", ".01", ".001")
            for sign in ("", "-")] + ["00", "01", "1.", ".5", "+1", "1e2", "-", "", "1.5.2"]
DECIMAL = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")
number_bounds = st.one_of(st.none(), st.builds(Bound, st.integers(-8, 24), st.booleans()))


def _inside(value: Fraction, low: Bound | None, high: Bound | None) -> bool:
    return (low is None or value > low.value or (value == low.value and low.inclusive)) and \
        (high is None or value < high.value or (value == high.value and high.inclusive))


@settings(max_examples=200, deadline=None)
@given(low=number_bounds, high=number_bounds)
def test_number_range_regex_matches_exactly_the_interval(low: Bound | None, high: Bound | None) -> None:
    """Every decimal spelling (no exponent, no negative zero) of a value between the bounds,
    nothing else; an empty interval is one clear error."""
    if low is not None and high is not None and not any(
            _inside(Fraction(value, 4), low, high) for value in range(4 * low.value, 4 * high.value + 1)):
        with pytest.raises(ConstraintError, match="no number"):
            number_range_regex(low, high)
        return
    pattern = re.compile(number_range_regex(low, high))
    for text in DECIMALS:
        spelled = DECIMAL.fullmatch(text) is not None and not (text.startswith("-")
                                                              and Fraction(text) == 0)
        expected = spelled and _inside(Fraction(text), low, high)
        assert (pattern.fullmatch(text) is not None) == expected, (low, high, text)


def person(age: dict[str, Any]) -> dict[str, Any]:
    """An object schema with one integer property ``age`` (as in the constrained benchmark)."""
    return {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": age},
            "required": ["name", "age"]}


@settings(max_examples=60, deadline=None)
@given(low=bounds, high=bounds, exclusive_low=st.booleans(), exclusive_high=st.booleans(),
       draft4=st.booleans())
def test_integer_bounds_are_enforced_in_the_schema_regex(low: int | None, high: int | None,
                                                         exclusive_low: bool, exclusive_high: bool,
                                                         draft4: bool) -> None:
    """The schema regex matches a document exactly when ``jsonschema`` validates it, every
    spelling of bounds included (inclusive, exclusive, draft 4's boolean exclusive)."""
    age: dict[str, Any] = {"type": "integer"}
    for bound, value, exclusive, name in ((low, low, exclusive_low, "Minimum"),
                                          (high, high, exclusive_high, "Maximum")):
        if bound is None:
            continue
        if exclusive and draft4:
            age[name.lower()] = value
            age[f"exclusive{name}"] = True
        else:
            age[f"exclusive{name}" if exclusive else name.lower()] = value
    schema = person(age)
    validator = (jsonschema.Draft4Validator if draft4 else jsonschema.Draft202012Validator)(schema)
    if low is not None and high is not None \
            and not any(validator.is_valid({"name": "Ada", "age": v}) for v in range(low, high + 1)):
        with pytest.raises(ConstraintError, match="allows no integer"):
            JsonSchema(schema)
        return
    pattern = re.compile(JsonSchema(schema).regex())
    for value in [*range(-2100, 2101, 7), *(b + d for b in (low, high) if b is not None for d in (-1, 0, 1))]:
        document = {"name": "Ada", "age": value}
        matches = pattern.fullmatch(json.dumps(document)) is not None
        assert matches == validator.is_valid(document), (age, value)


@pytest.mark.parametrize("bounds", [{"minimum": 0, "maximum": 5}, {"exclusiveMinimum": 0},
                                    {"minimum": -3, "exclusiveMaximum": 10},
                                    {"maximum": 2, "exclusiveMaximum": True, "minimum": -1}])
def test_number_bounds_are_enforced_in_the_schema_regex(bounds: dict[str, Any]) -> None:
    """A bounded number property matches exactly when ``jsonschema`` validates the document
    (decimal spellings; draft 4's boolean exclusive bound read by the draft 4 validator)."""
    schema = person({"type": "number", **bounds})
    draft4 = any(isinstance(value, bool) for value in bounds.values())
    validator = (jsonschema.Draft4Validator if draft4 else jsonschema.Draft202012Validator)(schema)
    pattern = re.compile(JsonSchema(schema).regex())
    for tenths in range(-60, 140, 3):
        for text in (f"{tenths / 10:.1f}", f"{tenths / 10:.2f}", str(tenths // 10)):
            document = f'{{"name": "Ada", "age": {text}}}'
            expected = validator.is_valid(json.loads(document)) and text not in ("-0", "-0.0", "-0.00")
            assert (pattern.fullmatch(document) is not None) == expected, (bounds, text)


@pytest.mark.parametrize(("low", "high"), [(-12, 107), (18, None), (None, -5), (0, 0), (-50, None),
                                         (7, 1003)])
def test_bounded_integer_automaton_accepts_exactly_the_range(low: int | None, high: int | None) -> None:
    """On a byte-level tokenizer (merges like "12", "34" included) the automaton of a bounded
    integer schema accepts exactly the spellings of the integers in range (up to 4 characters),
    whatever the tokenization. This runs outlines-core's own regex semantics (leftmost-first
    alternation), which Python's ``re`` does not share."""
    tokenizer = byte_level_tokenizer()
    bounds = {key: value for key, value in (("minimum", low), ("maximum", high)) if value is not None}
    automaton = TokenAutomaton.build(JsonSchema({"type": "integer", **bounds}), tokenizer)
    accepted = _accepted_texts(automaton, tokenizer, 4)
    expected = {str(value).encode() for value in range(-999, 10000)
                if (low is None or value >= low) and (high is None or value <= high)}
    assert accepted == expected


NUMBER_BOUNDS = [(Bound(0), Bound(15)), (Bound(-2, False), Bound(1, False)), (Bound(7), None)]


@pytest.mark.parametrize(("low", "high"), NUMBER_BOUNDS)
def test_bounded_number_automaton_accepts_exactly_the_range(low: Bound | None, high: Bound | None
                                                            ) -> None:
    """The token automaton of a bounded number between delimiters (as JSON uses it: ``[6.3]``)
    accepts exactly the decimal spellings in range (numbers up to 4 characters, every
    tokenization), under outlines-core's own regex semantics."""
    tokenizer = byte_level_tokenizer()
    automaton = TokenAutomaton.build(Regex(r"\[" + number_range_regex(low, high) + r"\]"), tokenizer)
    assert _accepted_texts(automaton, tokenizer, 6) == {f"[{text}]".encode()
                                                        for text in _decimals(4, low, high)}


@pytest.mark.parametrize(("low", "high"), NUMBER_BOUNDS)
def test_a_top_level_bounded_number_is_sound(low: Bound | None, high: Bound | None) -> None:
    """A bare bounded number as the whole document: every accepted text is in range, and every
    integer spelling in range is accepted. (outlines-core does not follow a fraction after a text
    that already matches at the end of the regex, ``6(\\.3)?`` allows ``6`` only; its own
    ``{"type": "number"}`` behaves the same, so decimals there are not required.)"""
    tokenizer = byte_level_tokenizer()
    bounds = {("minimum" if low.inclusive else "exclusiveMinimum"): low.value} if low else {}
    if high is not None:
        bounds["maximum" if high.inclusive else "exclusiveMaximum"] = high.value
    automaton = TokenAutomaton.build(JsonSchema({"type": "number", **bounds}), tokenizer)
    accepted = _accepted_texts(automaton, tokenizer, 3)
    allowed = {text.encode() for text in _decimals(3, low, high)}
    assert accepted <= allowed
    assert {text for text in allowed if b"." not in text} <= accepted


def _decimals(longest: int, low: Bound | None, high: Bound | None) -> set[str]:
    """Decimal spellings (no exponent, no negative zero) of at most ``longest`` characters
    whose value lies between the bounds."""
    return {text for length in range(1, longest + 1)
            for text in map("".join, itertools.product("0123456789.-", repeat=length))
            if DECIMAL.fullmatch(text) and not (text.startswith("-") and Fraction(text) == 0)
            and _inside(Fraction(text), low, high)}


def _accepted_texts(automaton: TokenAutomaton, tokenizer: Any, longest: int) -> set[bytes]:
    """Every text of at most ``longest`` bytes after which the automaton allows EOS."""
    table = token_bytes(tokenizer)
    seen = {b"": automaton.initial_state}
    accepted = set()
    queue = deque([b""])
    while queue:
        text = queue.popleft()
        state = seen[text]
        for token, target in zip(automaton.allowed(state).tolist(),
                                 automaton.next_states(state).tolist(), strict=True):
            if token == tokenizer.eos_token_id:
                accepted.add(text)
                continue
            following = text + table[token]
            if len(following) <= longest and following not in seen:
                seen[following] = target
                queue.append(following)
            assert seen.get(following, target) == target  # the state depends only on the text
    return accepted


def test_integers_in_a_type_list_and_in_definitions() -> None:
    nullable = re.compile(JsonSchema({"type": ["integer", "null"], "minimum": 0, "maximum": 9}).regex())
    assert [text for text in ("null", "0", "9", "10", "-1") if nullable.fullmatch(text)] == \
        ["null", "0", "9"]
    # a string in the same list is untouched by the bounds (they do not apply to strings)
    mixed = re.compile(JsonSchema({"type": ["string", "integer"], "maximum": 5}).regex())
    assert mixed.fullmatch('"anything"') and mixed.fullmatch("5") and not mixed.fullmatch("6")
    referenced = {"$defs": {"small": {"type": "integer", "exclusiveMaximum": 3, "minimum": 1}},
                  "type": "object", "properties": {"n": {"$ref": "#/$defs/small"}}, "required": ["n"]}
    pattern = re.compile(JsonSchema(referenced).regex())
    assert [n for n in range(-3, 6) if pattern.fullmatch(json.dumps({"n": n}))] == [1, 2]


REFUSED = [
    ({"type": "number", "minimum": 0.5}, "#: the bound 0.5", "whole numbers"),
    ({"type": "number", "multipleOf": 0.5}, "#/multipleOf", "remove it"),
    ({"type": "integer", "multipleOf": 5, "maximum": 100}, "#/multipleOf", "remove it"),
    ({"type": ["integer", "number"], "maximum": 2.5}, "#: the bound 2.5", "enum"),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "#/oneOf", "anyOf"),
    ({"allOf": [{"type": "object"}, {"required": ["x"]}]}, "#/allOf", "merge"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
     "#/required", "['b']"),
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     "#/properties/tags/uniqueItems", "remove it"),
    ({"type": "string", "pattern": "a+", "minLength": 2}, "#/pattern", "'minLength'"),
    ({"type": "object", "required": ["a"]}, "#/required", "properties"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1},
     "#/minProperties", "remove it"),
    ({"not": {"type": "string"}, "type": "integer"}, "#/not", "remove it"),
    ({"type": "array", "items": {"type": "string"}, "contains": {"const": "x"}}, "#/contains", "remove"),
    ({"properties": {"a": {"type": "string"}}, "anyOf": [{"required": ["a"]}]}, "#/anyOf", "remove"),
    ({"enum": ["a", 1], "type": "string"}, "#/type", "remove"),
    ({"enum": ["abc"], "maxLength": 2}, "#/maxLength", "remove"),
    ({"prefixItems": [{"type": "string"}], "minItems": 2}, "#/minItems", "remove"),
    ({"$defs": {"p": {"type": "number", "multipleOf": 2}}, "$ref": "#/$defs/p"},
     "#/$defs/p/multipleOf", "remove it"),
    ({"type": "integer", "minimum": 3, "minDigits": 2}, "#/minDigits", "keep one"),
    ({"$ref": "#/$defs/a", "minimum": 2, "$defs": {"a": {"type": "integer"}}}, "#/minimum", "remove"),
]


@pytest.mark.parametrize(("schema", "where", "advice"), REFUSED,
                         ids=[json.dumps(s)[:40] for s, _, _ in REFUSED])
def test_keywords_the_regex_would_drop_are_refused(schema: dict[str, Any], where: str, advice: str) -> None:
    with pytest.raises(ConstraintError, match="cannot enforce") as caught:
        JsonSchema(schema)
    message = str(caught.value)
    assert where in message and advice in message, message


def test_every_problem_is_listed_in_one_error() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "number", "maximum": 1.5},
                                               "b": {"oneOf": [{"type": "string"}, {"type": "null"}]}}}
    with pytest.raises(ConstraintError) as caught:
        JsonSchema(schema)
    assert "#/properties/a: the bound 1.5" in str(caught.value)
    assert "#/properties/b/oneOf" in str(caught.value)


ACCEPTED = [
    # narrowing only: generations still validate
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
     [{"a": "x"}, {}]),
    ({"prefixItems": [{"type": "integer", "maximum": 4}], "items": {"type": "string"}}, [[3]]),
    # vacuous: keywords for types the branch never emits
    ({"enum": [1, 2], "minLength": 3}, [1, 2]),
    ({"type": "string", "minimum": 3}, ["x"]),
    # annotations and one-entry combinators
    ({"title": "T", "description": "d", "default": 3, "type": "integer", "examples": [1]}, [5]),
    ({"oneOf": [{"type": "boolean"}], "$comment": "one entry"}, [True]),
    ({"type": "number", "minimum": 0, "maximum": 5.0}, [0, 2.5, 5, 4.99]),
    ({"allOf": [{"type": "null"}]}, [None]),
    ({"type": "string", "format": "date", "title": "day"}, ["2026-11-26"]),
]


@pytest.mark.parametrize(("schema", "documents"), ACCEPTED, ids=[json.dumps(s)[:40] for s, _ in ACCEPTED])
def test_schemas_the_regex_enforces_pass(schema: dict[str, Any], documents: list[Any]) -> None:
    pattern = re.compile(JsonSchema(schema).regex())
    for document in documents:
        jsonschema.validate(document, schema)
        assert pattern.fullmatch(json.dumps(document)) is not None, document


def test_prepared_schema_leaves_supported_schemas_alone() -> None:
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    prepared = prepare_schema(schema)
    assert prepared.schema == schema and prepared.ranges == ()
    placeholder_taken = {"const": "circuitsnumericrange0x0", "title": "a", "type": "string"}
    bounded = {"anyOf": [placeholder_taken, {"type": "integer", "maximum": 2}]}
    prepared = prepare_schema(bounded)
    assert prepared.ranges[0][0] not in json.dumps(bounded)
