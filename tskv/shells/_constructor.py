"""Classes only the library builds, as trio does it: the public way in is a function."""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


class NoPublicConstructor(type):
    """`Cls(...)` raises; the library calls `Cls._create(...)`.

    A publisher is worth having only with its tasks running and its sockets open, which
    `open_publisher` arranges; a bare constructor call would give a husk.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} has no public constructor; "
            f"use the function that opens one (open_publisher)"
        )

    def _create(cls: type[T], *args: Any, **kwargs: Any) -> T:
        made: T = super().__call__(*args, **kwargs)  # type: ignore[misc]
        return made
