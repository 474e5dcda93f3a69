"""The core decides and does no I/O: importing any core module, with everything it imports in
turn, never brings in trio or zmq (checked in a fresh interpreter, the package __init__ aside)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CORE = [
    "config",
    "events",
    "codec",
    "frames",
    "endpoints",
    "sequencer",
    "replay_buffer",
    "replay_limits",
    "replay_server",
    "snapshot",
    "prefix_index",
    "errors",
]

# Load tskv/<module>.py and what it imports without running tskv/__init__.py (which re-exports
# the shells), then list what came in.
PROBE = """
import importlib.util, pathlib, sys, types
root = pathlib.Path({root!r})
package = types.ModuleType("tskv")
package.__path__ = [str(root / "tskv")]
sys.modules["tskv"] = package
importlib.import_module("tskv.{module}")
print(" ".join(sorted(name for name in sys.modules if name.split(".")[0] in ("trio", "zmq"))))
"""


@pytest.mark.parametrize("module", CORE)
def test_a_core_module_never_reaches_trio_or_zmq(module: str) -> None:
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    code = PROBE.format(root=root, module=module)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], f"tskv.{module} brings in {done.stdout.strip()}"
