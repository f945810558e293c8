"""Regular expressions of the JSON numbers in an interval: integers in ``[0, 150]``, numbers in ``(0, 5]``.

``outlines-core`` turns ``{"type": "integer"}`` into ``-?(0|[1-9][0-9]*)`` and ignores
``minimum`` / ``maximum``; :mod:`circuits_llm.constraints.schema_support` splices the regexes
built here in its place so that the automaton itself enforces the bounds. Integers follow JSON's
grammar: no leading zeros, no ``+``, and no ``-0`` (zero is spelled ``0``). Bounded numbers
(:func:`number_range_regex`, whole-number bounds) are spelled without an exponent, a subset of
JSON's grammar (every spelling allowed is valid; ``1e2`` is not offered).

The construction splits the interval by number of digits; within one length it is the classic
digit-by-digit split of a range of equal-length strings (``[lo, hi]`` becomes "same first digit,
then recurse", or "lo's first digit then anything above lo's rest", "the digits strictly between,
then any digits", "hi's first digit then anything up to hi's rest"). Only character classes,
groups, alternation and counted repetition are used, the subset shared by Rust's ``regex`` crate
(which ``outlines-core`` compiles) and Python's ``re`` (which the tests use as the oracle).

Alternatives are listed longest first. ``outlines-core`` compiles with leftmost-first priority:
once an earlier alternative has matched the whole text, later ones are dropped, so ``1|12``
allows only ``1``, while ``12|1`` allows both. The alternatives of one length never share a
prefix, so only the order between lengths matters.
"""

from __future__ import annotations

from dataclasses import dataclass

from circuits_llm.constraints.errors import ConstraintError


def integer_range_regex(low: int | None, high: int | None) -> str:
    """The regex matching exactly the decimal JSON spellings of the integers in ``[low, high]``.

    Args:
        low: the smallest allowed integer, or None for no lower bound.
        high: the largest allowed integer, or None for no upper bound.

    Returns:
        a parenthesised regex, e.g. ``integer_range_regex(0, 150)`` matches ``0`` ... ``150``.

    Raises:
        ConstraintError: ``low > high`` (no integer is allowed).
    """
    if low is not None and high is not None and low > high:
        raise ConstraintError(f"no integer lies in [{low}, {high}]: the lower bound is above the upper "
                              "one; fix the schema's minimum / maximum")
    alternatives = []
    negative_top = -1 if high is None else min(high, -1)
    if low is None or low <= negative_top:
        # v in [low, negative_top]  <=>  -v in [-negative_top, -low]
        alternatives.append("-" + _nonnegative(-negative_top, None if low is None else -low))
    nonnegative_low = 0 if low is None else max(low, 0)
    if high is None or high >= nonnegative_low:
        alternatives.append(_nonnegative(nonnegative_low, high))
    return "(" + "|".join(alternatives) + ")"


def _nonnegative(low: int, high: int | None) -> str:
    """A parenthesised regex of the integers in ``[low, high]`` (``high`` None: unbounded), low >= 0."""
    alternatives = []
    shortest = len(str(low))
    longest = shortest if high is None else len(str(high))
    if high is None:
        # every number with more digits than ``low`` is larger than it
        alternatives.append(f"[1-9][0-9]{{{shortest},}}")
    for length in range(longest, shortest - 1, -1):  # longest first: see the module docstring
        smallest = 0 if length == 1 else 10 ** (length - 1)
        largest = 10 ** length - 1
        start = max(low, smallest)
        end = largest if high is None else min(high, largest)
        alternatives.append(_same_length(str(start), str(end)))
    return "(" + "|".join(alternatives) + ")"


def _same_length(low: str, high: str) -> str:
    """A regex of the digit strings of one length from ``low`` to ``high`` (``low <= high``)."""
    if low == high:
        return low
    if len(low) == 1:
        return f"[{low}-{high}]"
    rest = len(low) - 1
    if low[0] == high[0]:
        return low[0] + "(" + _same_length(low[1:], high[1:]) + ")"
    low_rest_is_zeros = low[1:] == "0" * rest
    high_rest_is_nines = high[1:] == "9" * rest
    alternatives = []
    first_free = int(low[0]) if low_rest_is_zeros else int(low[0]) + 1
    last_free = int(high[0]) if high_rest_is_nines else int(high[0]) - 1
    if not low_rest_is_zeros:
        alternatives.append(low[0] + "(" + _same_length(low[1:], "9" * rest) + ")")
    if first_free <= last_free:
        alternatives.append(f"[{first_free}-{last_free}][0-9]{{{rest}}}")
    if not high_rest_is_nines:
        alternatives.append(high[0] + "(" + _same_length("0" * rest, high[1:]) + ")")
    return alternatives[0] if len(alternatives) == 1 else "(" + "|".join(alternatives) + ")"


@dataclass(frozen=True)
class Bound:
    """One end of an interval of numbers: ``value`` and whether the interval contains it."""

    value: int
    inclusive: bool = True


def number_range_regex(low: Bound | None, high: Bound | None) -> str:
    """The regex of decimal JSON numbers ``[-]I[.F]`` (no exponent) with a value between the bounds.

    Args:
        low, high: whole-number bounds (None: unbounded on that side).

    Returns:
        a parenthesised regex; e.g. ``number_range_regex(Bound(0, False), Bound(5))`` matches
        ``0.25``, ``3``, ``5.00`` and not ``0``, ``5.01`` or ``-1``.

    Raises:
        ConstraintError: no number lies between the bounds.

    A value ``v = I + 0.F`` with a whole-number bound ``L`` satisfies ``v >= L`` exactly when
    ``I >= L`` (``v >= 0``), and ``v > L`` when ``I > L`` or ``I = L`` with a non-zero fraction;
    ``v <= H`` when ``I < H``, or ``I = H`` with a zero fraction. A negative value is ``-m`` and
    the bounds swap sides on ``m``. Each side is a union of "an integer range, any fraction" and
    at most two single integer parts with a zero or non-zero fraction.
    """
    if low is not None and high is not None and (
            low.value > high.value or (low.value == high.value
                                       and not (low.inclusive and high.inclusive))):
        raise ConstraintError(f"no number lies in {'[' if low.inclusive else '('}{low.value}, "
                              f"{high.value}{']' if high.inclusive else ')'}; fix the schema's "
                              "minimum / maximum")
    alternatives = []
    # v < 0, v = -m with m > 0: lower bound on m from ``high``, upper bound on m from ``low``
    if low is None or low.value < 0:
        m_low = None if high is None else Bound(-high.value, high.inclusive)
        m_high = None if low is None else Bound(-low.value, low.inclusive)
        negative = _magnitudes(m_low, m_high, exclude_zero=True)
        if negative:
            alternatives.append("-(" + "|".join(negative) + ")")
    if high is None or high.value > 0 or (high.value == 0 and high.inclusive):
        alternatives.extend(_magnitudes(low, high, exclude_zero=False))
    return "(" + "|".join(alternatives) + ")"


ANY_FRACTION = r"(\.[0-9]+)?"
ZERO_FRACTION = r"(\.0+)?"
NONZERO_FRACTION = r"\.[0-9]*[1-9][0-9]*"


def _magnitudes(low: Bound | None, high: Bound | None, exclude_zero: bool) -> list[str]:
    """Alternatives spelling ``m = I + 0.F >= 0`` between the bounds (``exclude_zero``: m > 0).

    Single-integer alternatives come first: outlines-core's alternation is leftmost-first, and
    an integer part of the range can be a prefix of them (``1`` of ``15`` in ``[0, 15]``).
    """
    if exclude_zero:
        low = _tighter_low(low, Bound(0, False))
    first_any = 0 if low is None else max(low.value if low.inclusive else low.value + 1, 0)
    last_any = None if high is None else high.value - 1
    alternatives = []
    if high is not None and high.inclusive and high.value >= 0 and _above(high.value, low):
        alternatives.append(str(high.value) + ZERO_FRACTION)  # I = H, v = H exactly
    if low is not None and not low.inclusive and low.value >= 0 \
            and (high is None or low.value <= high.value - 1):
        alternatives.append(str(low.value) + NONZERO_FRACTION)  # I = L, v just above L
    if last_any is None or first_any <= last_any:
        alternatives.append(integer_range_regex(first_any, last_any) + ANY_FRACTION)
    return alternatives


def _above(value: int, low: Bound | None) -> bool:
    """Whether ``value`` satisfies the lower bound ``low``."""
    return low is None or value > low.value or (value == low.value and low.inclusive)


def _tighter_low(low: Bound | None, other: Bound) -> Bound:
    """The stricter of two lower bounds."""
    if low is None or other.value > low.value or (other.value == low.value and not other.inclusive):
        return other
    return low
