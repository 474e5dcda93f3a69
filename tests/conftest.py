"""Shared test helpers: the wire and hash vectors, kept in tests/vectors as identical copies of
the shared ones, so a clone placed anywhere runs its tests."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from hypothesis import settings

from tests.strategies import EXAMPLES_SCALE

pytest_plugins = ["pytester"]  # the plugin's own failures are tested in a project of their own

VECTORS = Path(__file__).resolve().parent / "vectors"

# A shell starts a background job with Ctrl-C ignored, and an ignored signal stays ignored in
# every process started from it: the tests that end a tool with SIGINT would wait for nothing.
# A handler of our own is reset to the default in each child, so each child hears it again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# No property fails for taking long: timing is the benchmarks' business, and a loaded CI
# machine (or the sanitizers) would otherwise trip hypothesis's per-example deadline. The
# properties that name no count of their own are scaled with TSKV_EXAMPLES_SCALE.
settings.register_profile("tskv", deadline=None, max_examples=100 * EXAMPLES_SCALE)
settings.load_profile("tskv")


def load_vectors(name: str) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = json.loads((VECTORS / name).read_text())["cases"]
    return cases
