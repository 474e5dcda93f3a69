"""Whether this process uses msgspec: importable, and not turned off with TSKV_CODEC=msgpack.

One decision for the whole package: the events are msgspec Structs and the codec encodes and
decodes with msgspec exactly when `msgspec` here is not None. `TSKV_CODEC=msgpack` runs tskv as
a machine without msgspec would (for comparison, and so the tests cover that path too).
"""

from __future__ import annotations

import os
from types import ModuleType

from tskv.core.errors import TskvImportError

CHOICES = ("msgspec", "msgpack")


def _load() -> ModuleType | None:
    wanted = os.environ.get("TSKV_CODEC", "")
    if wanted and wanted not in CHOICES:
        raise TskvImportError(
            f"TSKV_CODEC={wanted!r} is not available here; choose one of {list(CHOICES)} "
            "(pip install 'tskv-trio[fast]' for msgspec)"
        )
    if wanted == "msgpack":
        return None
    try:
        import msgspec
    except ImportError:
        if wanted == "msgspec":
            raise TskvImportError(
                "TSKV_CODEC='msgspec' but msgspec is not installed; pip install 'tskv-trio[fast]'"
            ) from None
        return None
    return msgspec


msgspec = _load()
