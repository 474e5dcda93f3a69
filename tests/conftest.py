"""Shared test helpers: the wire and hash vectors, kept in tests/vectors as identical copies of
the shared ones, so a clone placed anywhere runs its tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VECTORS = Path(__file__).resolve().parent / "vectors"


def load_vectors(name: str) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = json.loads((VECTORS / name).read_text())["cases"]
    return cases
