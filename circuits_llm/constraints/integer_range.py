"""The regular expression of the JSON integers in an interval, e.g. ``[0, 150]`` or ``[18, ∞)``.

``outlines-core`` turns ``{"type": "integer"}`` into ``-?(0|[1-9][0-9]*)`` and ignores
``minimum`` / ``maximum``; :mod:`circuits_llm.constraints.schema_support` splices the regex built
here in its place so that the automaton itself enforces the bounds. The text follows JSON's
integer grammar: no leading zeros, no ``+``, and no ``-0`` (zero is spelled ``0``).

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
