"""The repository's vectors stay byte-identical to the shared ones they were copied from."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import VECTORS

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "vectors"


@pytest.mark.skipif(not SHARED.is_dir(), reason="no shared/ beside this clone to compare with")
def test_every_shared_vector_file_has_an_identical_copy_here() -> None:
    shared = sorted(path.name for path in SHARED.glob("*.json"))
    assert shared, "shared/vectors holds no vector files"
    for name in shared:
        copy = VECTORS / name
        assert copy.exists(), f"tests/vectors/{name} is missing: copy it from {SHARED}"
        assert copy.read_bytes() == (SHARED / name).read_bytes(), f"tests/vectors/{name} differs"
