"""Sampling seeds as the model gateway in front of TokenSpeed resolves them, and n > 1 fan-out.

A request may carry `sampling_seed` (unsigned 64-bit) and the older OpenAI `seed`; the first
wins when both are set, and then the second is not looked at. Choice i of an n-choice request
gets `seed + i` (mod 2**64), so every choice is reproducible and no two choices share a stream.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from tskv.core._checks import int_at_least
from tskv.core.errors import TskvError

SEED_LIMIT = 2**64


class SamplingSeedError(TskvError, ValueError):
    """A seed that is not an unsigned 64-bit integer."""


def _check_seed(value: int | None, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        raise SamplingSeedError(
            f"sampling seed must be an unsigned integer below 2**64; {name} = {value!r}"
        )
    return value


def resolve_sampling_seed(sampling_seed: int | None, legacy_seed: int | None) -> int | None:
    """The seed a request samples with: `sampling_seed`, else the legacy `seed`, else None.

    0 is a seed like any other, not "absent". The legacy seed is looked at (and refused when
    negative) only when `sampling_seed` is absent: a gateway that fills in both, the legacy one
    as -1 for "unset", still gets the explicit seed.
    """
    if sampling_seed is not None:
        return _check_seed(sampling_seed, "sampling_seed")
    return _check_seed(legacy_seed, "seed")


def _seed_field(value: int | None) -> int | None:
    return _check_seed(value, "seed")


def _prompt(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _check_n(_: object, __: object, value: int) -> None:
    int_at_least("n (choices per request)", value, 1)


@attrs.frozen
class SamplingParams:
    """The part of a request that decides what it decodes: its seed and how many choices."""

    seed: int | None = attrs.field(default=None, converter=_seed_field)
    n: int = attrs.field(default=1, validator=_check_n)


@attrs.frozen
class GenerateRequest:
    """One generation request: an id, its prompt's token ids, and how to sample."""

    rid: str
    prompt_ids: tuple[int, ...] = attrs.field(converter=_prompt)
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 64


def fan_out(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    """One request per choice: ids `"{rid}-{i}"`, seeds `seed + i` wrapping at 2**64.

    With no seed every choice has no seed (the engine picks one per choice). n <= 1 gives the
    request back unchanged.
    """
    if n <= 1:
        return [request]
    seed = request.sampling.seed
    return [
        attrs.evolve(
            request,
            rid=f"{request.rid}-{i}",
            sampling=SamplingParams(None if seed is None else (seed + i) % SEED_LIMIT, 1),
        )
        for i in range(n)
    ]
