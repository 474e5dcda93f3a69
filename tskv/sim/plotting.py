"""matplotlib, when it is installed (`pip install 'tskv-trio[plot]'`): the demos' charts are
optional, and drawing one needs no display."""

from __future__ import annotations

import importlib
from typing import Any


def pyplot() -> Any | None:
    """matplotlib's pyplot on a backend that writes files, or None without matplotlib."""
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
    except ImportError:
        return None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
