"""The value checks every layer shares, each written once, each naming the value and the fix.

Callers pass the error class their users expect (ConfigError for config keys, ValueError for
arguments, argparse's error for flags), so the wording is the same everywhere.
"""

from __future__ import annotations

import math


def int_at_least(
    name: str,
    value: object,
    lowest: int,
    error: type[Exception] = ValueError,
    type_error: type[Exception] | None = None,
) -> int:
    """`value` if it is an int (not a bool) of at least `lowest`; a value of another type
    raises `type_error` (by default the same `error`)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise (type_error or error)(f"{name} = {value!r}: must be an integer")
    if value < lowest:
        raise error(f"{name} = {value}: must be at least {lowest}")
    return value


def number_at_least(
    name: str,
    value: object,
    lowest: float,
    *,
    above: bool = False,
    error: type[Exception] = ValueError,
) -> float:
    """`value` as a float if it is a finite number (not a bool) >= `lowest` (> it with `above`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{name} = {value!r}: must be a number")
    if not math.isfinite(value) or value < lowest or (above and value == lowest):
        bound = f"greater than {lowest:g}" if above else f"at least {lowest:g}"
        raise error(f"{name} = {value!r}: must be a finite number {bound}")
    return float(value)
