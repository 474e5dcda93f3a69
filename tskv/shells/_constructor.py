"""Classes only the library builds, as trio does it: the public way in is a function."""

from __future__ import annotations

from typing import Any, TypeVar

from tskv.core.errors import TskvTypeError

T = TypeVar("T")


class NoPublicConstructor(type):
    """`Cls(...)` raises, naming the function that makes one; the library calls
    `Cls._create(...)`.

    A publisher or subscriber is worth having only with its tasks running and its sockets
    open, which its `open_*` function arranges; a bare constructor call would give a husk.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        opener = f"open_{cls.__name__.lower()}"
        raise TskvTypeError(
            f"tskv.{cls.__qualname__} has no public constructor; use `async with "
            f"tskv.{opener}(...) as {cls.__name__.lower()}:`, which opens its sockets and "
            "runs its tasks"
        )

    def _create(cls: type[T], *args: Any, **kwargs: Any) -> T:
        made: T = super().__call__(*args, **kwargs)  # type: ignore[misc]
        return made
