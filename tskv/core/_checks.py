"""The value checks every layer shares, each written once, each naming the value and the fix.

Callers pass the error class their users expect (ConfigError for config keys, TskvValueError
for arguments), so the wording is the same everywhere.
"""

from __future__ import annotations

import math
from typing import Any

from tskv.core.errors import TskvError, TskvValueError


def int_at_least(
    name: str,
    value: object,
    lowest: int,
    error: type[TskvError] = TskvValueError,
    type_error: type[TskvError] | None = None,
) -> int:
    """`value` if it is an int (not a bool) of at least `lowest`; a value of another type
    raises `type_error` (by default the same `error`)."""
    if isinstance(value, bool) or not isinstance(value, int):
        wrong_type: type[TskvError] = type_error or error
        raise wrong_type(f"{name} = {value!r}: must be an integer")
    if value < lowest:
        raise error(f"{name} = {value}: must be at least {lowest}")
    return value


def number_at_least(
    name: str,
    value: object,
    lowest: float,
    *,
    above: bool = False,
    error: type[TskvError] = TskvValueError,
) -> float:
    """`value` as a float if it is a finite number (not a bool) >= `lowest` (> it with `above`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{name} = {value!r}: must be a number")
    if not math.isfinite(value) or value < lowest or (above and value == lowest):
        bound = f"greater than {lowest:g}" if above else f"at least {lowest:g}"
        raise error(f"{name} = {value!r}: must be a finite number {bound}")
    return float(value)


def at_least(lowest: float, above: bool = False, error: type[TskvError] = TskvValueError) -> Any:
    """An attrs validator: a finite number >= `lowest` (> it with `above`), named by its field."""

    def check(_: object, attribute: Any, value: object) -> None:
        number_at_least(attribute.name, value, lowest, above=above, error=error)

    return check
