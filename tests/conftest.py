"""Shared test helpers: the vectors in ../shared/vectors, read in place, never copied."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

VECTORS = Path(__file__).resolve().parent.parent.parent / "shared" / "vectors"


def load_vectors(name: str) -> list[dict[str, Any]]:
    path = VECTORS / name
    if not path.exists():
        pytest.fail(f"test vectors not found at {path}; shared/ must sit beside the project")
    cases: list[dict[str, Any]] = json.loads(path.read_text())["cases"]
    return cases
