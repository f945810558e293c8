"""Make a JSON schema's regex enforce what the schema says, or refuse the schema with the reason.

``outlines-core`` translates a JSON schema into a regex by looking, in each subschema, at the
first of a fixed list of keywords (``properties``, ``allOf``, ``anyOf``, ``oneOf``,
``prefixItems``, ``enum``, ``const``, ``$ref``, ``type``) and reading only the keywords that
branch knows. Everything else is silently dropped, and some of what it drops makes the regex
*wider* than the schema: ``{"type": "integer", "maximum": 150}`` becomes ``-?(0|[1-9][0-9]*)``,
which allows 1800. A constrained generation could then fail validation, which is the one thing a
user of ``--json-schema`` must be able to rely on.

:func:`prepare_schema` walks the schema the way ``outlines-core`` will and

* **encodes numeric bounds** (``minimum``, ``maximum``, ``exclusiveMinimum``,
  ``exclusiveMaximum``, in any draft's spelling) on ``"type": "integer"`` and, when the bounds
  are whole numbers, on ``"type": "number"``: the subschema is replaced by a unique placeholder
  string constant, and :meth:`PreparedSchema.apply` splices the regex of the range
  (:mod:`circuits_llm.constraints.numeric_range`) into the translated regex in its place;
* **refuses**, in one :class:`ConstraintError` that lists them all with their JSON pointers, the
  keywords the translation would drop although they constrain the document (fractional bounds
  on a ``number``, ``multipleOf``, ``uniqueItems``, ``not``, ``if``, a ``oneOf`` whose branches
  could overlap, an ``allOf`` of several subschemas (which ``outlines-core`` concatenates),
  ``required`` names without a property, ``minLength`` next to ``pattern``, and so on).

Dropping a keyword that only *narrows* what is allowed (``additionalProperties``, ``items`` after
``prefixItems``, an unanchored ``pattern`` matched in full) is kept, as ``outlines-core`` intends:
the generations are still valid. Annotations (``title``, ``description``, ``default``,
``format`` ...) and unknown keywords constrain nothing in JSON Schema and pass.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from circuits_llm.constraints.errors import ConstraintError
from circuits_llm.constraints.numeric_range import Bound, integer_range_regex, number_range_regex

#: The keywords ``outlines-core`` dispatches on, in the order it tries them.
DISPATCH_ORDER = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref", "type")

JSON_TYPES = frozenset({"string", "number", "integer", "array", "object", "boolean", "null"})

#: Validation keywords that apply to one kind of instance only (vacuous on the others).
KEYWORD_TYPES: dict[str, frozenset[str]] = {
    **dict.fromkeys(("minLength", "maxLength", "pattern"), frozenset({"string"})),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
                    frozenset({"number", "integer"})),
    **dict.fromkeys(("items", "prefixItems", "additionalItems", "unevaluatedItems", "minItems",
                     "maxItems", "uniqueItems", "contains", "minContains", "maxContains"),
                    frozenset({"array"})),
    **dict.fromkeys(("properties", "required", "additionalProperties", "patternProperties",
                     "minProperties", "maxProperties", "propertyNames", "dependentRequired",
                     "dependentSchemas", "dependencies", "unevaluatedProperties"),
                    frozenset({"object"})),
}

#: Every keyword that constrains a document (JSON Schema drafts 4 to 2020-12).
CONSTRAINING = frozenset(KEYWORD_TYPES) | {
    "type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref",
    "$dynamicRef", "$recursiveRef"}

BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

#: What to write instead, for the keywords users meet most.
_ADVICE = {
    "oneOf": "use anyOf when no document can match two of the branches",
    "allOf": "merge the subschemas into one",
    "required": "declare every required name under properties",
}


@dataclass(frozen=True)
class PreparedSchema:
    """A schema ready for ``outlines-core``, and the regexes to splice into its translation.

    Attributes:
        schema: the schema with every bounded integer or number subschema replaced by
            ``{"const": P}``.
        ranges: ``(P, regex)`` pairs: placeholder string and the regex of the range.
    """

    schema: dict[str, Any]
    ranges: tuple[tuple[str, str], ...]

    def apply(self, regex: str) -> str:
        """``regex`` (the translation of :attr:`schema`) with each placeholder replaced by its range.

        ``outlines-core`` spells a string constant as the escaped JSON string, i.e. the placeholder
        in double quotes (placeholders are letters and digits only, which escaping leaves alone).
        """
        for placeholder, range_regex in self.ranges:
            regex = regex.replace(json.dumps(placeholder), range_regex)
        return regex


def prepare_schema(schema: dict[str, Any]) -> PreparedSchema:
    """Check ``schema`` against what the regex can enforce and encode its numeric bounds.

    Raises:
        ConstraintError: the schema uses keywords the regex would not enforce (all are listed,
            each with its JSON pointer and what to do), or bounds no value meets.
    """
    walker = _Walker(json.dumps(schema))
    prepared = walker.visit(schema, "#")
    if walker.problems:
        listed = "\n".join(f"  - {problem}" for problem in walker.problems)
        raise ConstraintError(
            "this JSON schema uses keywords the constraint cannot enforce (outlines-core's "
            "translation drops them), so generations could break the schema:\n" + listed +
            "\nRestate them as advised, or remove them and check those rules after generation")
    return PreparedSchema(prepared, tuple(walker.ranges))


class _Walker:
    """One pass over a schema: the rewritten schema, the placeholders, the problems found."""

    def __init__(self, schema_text: str) -> None:
        self.schema_text = schema_text
        self.problems: list[str] = []
        self.ranges: list[tuple[str, str]] = []

    def visit(self, node: Any, path: str) -> Any:
        """The rewritten ``node`` (a subschema at JSON pointer ``path``)."""
        if not isinstance(node, dict) or not node:
            return node
        node = dict(node)
        for definitions in ("$defs", "definitions"):
            if isinstance(node.get(definitions), dict):
                node[definitions] = {name: self.visit(sub, f"{path}/{definitions}/{_escape(name)}")
                                     for name, sub in node[definitions].items()}
        branch = next((keyword for keyword in DISPATCH_ORDER if keyword in node), None)
        if branch is None:
            return node  # outlines-core refuses it with its own message
        if branch == "type" and self._bounds_apply(node):
            return self._bounded(node, path)
        consumed, emitted = self._branch(node, branch, path)
        self._report_dropped(node, consumed, emitted, path)
        return self._descend(node, branch, path)

    # ------------------------------------------------------------------ what a branch reads
    def _branch(self, node: dict[str, Any], branch: str, path: str) -> tuple[set[str], frozenset[str]]:
        """The keywords ``outlines-core``'s ``branch`` enforces, and the JSON types it can emit."""
        types = _types(node.get("type"))
        if branch == "properties":
            declared = node["properties"] if isinstance(node["properties"], dict) else {}
            required = node.get("required")
            missing = [name for name in required if name not in declared] \
                if isinstance(required, list) else []
            if missing:
                self.problems.append(f"{path}/required: {missing} have no entry under properties, so "
                                     f"they would never be generated; {_ADVICE['required']}")
            consumed = {"properties", "required", "additionalProperties", "unevaluatedProperties"}
            return consumed | ({"type"} if types is None or "object" in types else set()), \
                frozenset({"object"})
        if branch in ("allOf", "oneOf"):
            entries = node[branch]
            if isinstance(entries, list) and len(entries) > 1:
                self.problems.append(f"{path}/{branch}: {len(entries)} subschemas are translated as "
                                     f"{'one after another' if branch == 'allOf' else 'anyOf'}; "
                                     f"{_ADVICE[branch]}")
            return {branch}, JSON_TYPES
        if branch in ("anyOf", "$ref"):
            return {branch}, JSON_TYPES
        if branch == "prefixItems":
            count = len(node["prefixItems"]) if isinstance(node["prefixItems"], list) else 0
            consumed = {"prefixItems", "items", "additionalItems", "unevaluatedItems"}
            if types is None or "array" in types:
                consumed.add("type")
            minimum, maximum = node.get("minItems", 0), node.get("maxItems", count)
            if isinstance(minimum, int) and minimum <= count:
                consumed.add("minItems")
            if isinstance(maximum, int) and maximum >= count:
                consumed.add("maxItems")
            return consumed, frozenset({"array"})
        if branch in ("enum", "const"):
            values = node["enum"] if branch == "enum" and isinstance(node["enum"], list) \
                else [node.get(branch)]
            emitted = frozenset(_type_of(value) for value in values)
            consumed = {branch}
            if types is None or all(_allowed(value, types) for value in values):
                consumed.add("type")
            return consumed, emitted
        return self._type_branch(node, types or frozenset())

    @staticmethod
    def _type_branch(node: dict[str, Any], types: frozenset[str]) -> tuple[set[str], frozenset[str]]:
        """What ``outlines-core`` reads for ``"type": ...`` (each listed type's own keywords)."""
        consumed = {"type"}
        if "string" in types:
            if "minLength" in node or "maxLength" in node:
                consumed |= {"minLength", "maxLength"}
            elif "pattern" in node:
                consumed.add("pattern")
        if "array" in types:
            consumed |= {"items", "minItems", "maxItems"}
        if "object" in types:
            consumed |= {"minProperties", "maxProperties", "additionalProperties"}
        return consumed, types

    def _report_dropped(self, node: dict[str, Any], consumed: set[str], emitted: frozenset[str],
                        path: str) -> None:
        """Record each constraining keyword of ``node`` the branch drops, unless it is vacuous."""
        for keyword in node:
            if keyword not in CONSTRAINING or keyword in consumed:
                continue
            applies_to = KEYWORD_TYPES.get(keyword)
            if applies_to is not None and not _overlaps(applies_to, emitted):
                continue  # e.g. minLength next to an enum of integers: it constrains nothing emitted
            advice = _ADVICE.get(keyword, "remove it or move it where the translation reads it")
            self.problems.append(f"{path}/{_escape(keyword)} is not enforced next to "
                                 f"{_describe(node, consumed)}; {advice}")

    # ------------------------------------------------------------------ rewriting
    def _descend(self, node: dict[str, Any], branch: str, path: str) -> dict[str, Any]:
        """``node`` with the subschemas the branch translates rewritten."""
        if branch == "properties" and isinstance(node["properties"], dict):
            node["properties"] = {name: self.visit(sub, f"{path}/properties/{_escape(name)}")
                                  for name, sub in node["properties"].items()}
        elif branch in ("allOf", "anyOf", "oneOf", "prefixItems") and isinstance(node[branch], list):
            node[branch] = [self.visit(sub, f"{path}/{branch}/{index}")
                            for index, sub in enumerate(node[branch])]
        elif branch == "type":
            for keyword in ("items", "additionalProperties"):
                if isinstance(node.get(keyword), dict):
                    node[keyword] = self.visit(node[keyword], f"{path}/{keyword}")
        return node

    @staticmethod
    def _bounds_apply(node: dict[str, Any]) -> bool:
        """Whether ``node`` is a typed subschema allowing numbers with a bound to encode."""
        types = _types(node.get("type"))
        return types is not None and bool(types & {"integer", "number"}) \
            and any(key in node for key in BOUNDS)

    def _bounded(self, node: dict[str, Any], path: str) -> Any:
        """A bounded integer or number subschema as a placeholder constant whose regex is the
        range's (several types: an anyOf split, one subschema per type)."""
        types = _types(node["type"]) or frozenset()
        if len(types) > 1:
            # {"type": ["integer", "null"], "minimum": 0} -> anyOf of one subschema per type
            # (problems are reported at the user's own path, not at an anyOf they never wrote)
            return {"anyOf": [self.visit({**node, "type": name}, path) for name in sorted(types)]}
        kind = next(iter(types))
        digits = [k for k in node if k.startswith(("minDigits", "maxDigits"))]
        for keyword in digits:
            self.problems.append(f"{path}/{keyword} (outlines-core's digit count) cannot be "
                                 "combined with minimum / maximum; keep one of them")
        low, high = _read_bounds(node, path, self.problems)
        self._report_dropped(node, {"type", *BOUNDS, *digits}, frozenset({kind}), path)
        if kind == "integer":
            low_int = None if low is None else \
                math.ceil(low[0]) if low[1] else math.floor(low[0]) + 1
            high_int = None if high is None else \
                math.floor(high[0]) if high[1] else math.ceil(high[0]) - 1
            range_regex = _at(path, "integer", integer_range_regex, low_int, high_int)
        else:
            fractional = [value for value, _ in filter(None, (low, high)) if not value.is_integer()]
            if fractional:
                self.problems.append(
                    f"{path}: the bound {fractional[0]:g} on a number is not a whole number; "
                    "number bounds are enforced when they are whole numbers (or use an integer "
                    "in smaller units, or an enum)")
                return node
            lower = None if low is None else Bound(int(low[0]), low[1])
            upper = None if high is None else Bound(int(high[0]), high[1])
            range_regex = _at(path, "number", number_range_regex, lower, upper)
        placeholder = self._placeholder()
        self.ranges.append((placeholder, range_regex))
        return {"const": placeholder}

    def _placeholder(self) -> str:
        """A letters-and-digits string that occurs nowhere in the schema text."""
        index = len(self.ranges)
        salt = 0
        while f"circuitsnumericrange{index}x{salt}" in self.schema_text:
            salt += 1
        return f"circuitsnumericrange{index}x{salt}"


def _at(path: str, kind: str, build: Callable[[Any, Any], str], low: Any, high: Any) -> str:
    """``build(low, high)``, its empty-interval error prefixed with the subschema's pointer."""
    try:
        return build(low, high)
    except ConstraintError as error:
        raise ConstraintError(f"{path} allows no {kind}: {error}") from None


def _read_bounds(node: dict[str, Any], path: str, problems: list[str]
                 ) -> tuple[tuple[float, bool] | None, tuple[float, bool] | None]:
    """The tightest lower and upper bounds of a subschema, each ``(value, inclusive)`` or None.

    Reads ``minimum`` / ``maximum`` and ``exclusiveMinimum`` / ``exclusiveMaximum`` as numbers
    (drafts 6+) or as draft 4's booleans next to ``minimum`` / ``maximum``.
    """
    def number(keyword: str) -> float | None:
        value = node.get(keyword)
        if value is None or isinstance(value, bool):
            return None
        if not isinstance(value, int | float) or not math.isfinite(value):
            problems.append(f"{path}/{keyword} must be a finite number, got {value!r}")
            return None
        return float(value)

    lows, highs = [], []
    if (minimum := number("minimum")) is not None:
        lows.append((minimum, node.get("exclusiveMinimum") is not True))
    if (exclusive := number("exclusiveMinimum")) is not None:
        lows.append((exclusive, False))
    if (maximum := number("maximum")) is not None:
        highs.append((maximum, node.get("exclusiveMaximum") is not True))
    if (exclusive := number("exclusiveMaximum")) is not None:
        highs.append((exclusive, False))
    # tightest: the largest lower bound (exclusive first on a tie), the smallest upper one
    low = max(lows, key=lambda bound: (bound[0], not bound[1])) if lows else None
    high = min(highs, key=lambda bound: (bound[0], bound[1])) if highs else None
    return low, high


def _types(value: object) -> frozenset[str] | None:
    """The type names of a ``type`` keyword (None when absent or malformed)."""
    if isinstance(value, str):
        return frozenset({value})
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return frozenset(value)
    return None


def _type_of(value: object) -> str:
    """The JSON type of a Python value read from JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _allowed(value: object, types: Iterable[str]) -> bool:
    """Whether ``value`` is an instance of one of ``types`` (an integer is also a number)."""
    kind = _type_of(value)
    return any(kind == name or (kind == "integer" and name == "number") for name in types)


def _overlaps(applies_to: frozenset[str], emitted: frozenset[str]) -> bool:
    """Whether a keyword for ``applies_to`` can constrain an instance of one of ``emitted``."""
    return bool(applies_to & emitted) or ("integer" in emitted and "number" in applies_to)


def _describe(node: dict[str, Any], consumed: set[str]) -> str:
    """The keywords the translation reads in ``node``, for messages."""
    read = [f"'type': {json.dumps(node[keyword])}" if keyword == "type" else f"'{keyword}'"
            for keyword in node if keyword in consumed]
    return ", ".join(read) if read else "this subschema"


def _escape(name: str) -> str:
    """``name`` as one JSON-pointer segment."""
    return name.replace("~", "~0").replace("/", "~1")
