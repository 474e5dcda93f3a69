"""Whether this process uses the compiled core (`tskv/core/_compiled.c`), no I/O.

One decision for the whole package, as `_msgspec` makes one for the codec: `core` is the
compiled module (the key walk, a plain run's keys, `KeyTable` for the holders map and `BlockMap`
for each worker's blocks), or None and the pure-Python modules, the reference, do all the work.
It is used only where it was built (`pip install .` with a C compiler), not turned off with
`TSKV_PURE_PYTHON=1`, and when it gives Python's own keys for a sample of blocks at import (it
computes CPython's tuple hash without making the tuples; a CPython that changed that hash would
make other keys). `TSKV_PURE_PYTHON=0` asks for it: where it is not there, one warning on the
`tskv` logger says so and why.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from tskv.core import block_keys

logger = logging.getLogger("tskv")

SAMPLE_TOKENS = [7, -1, 2**40, 0, 300, -(2**62), 2**61 - 1, 12]  # -1 and big ints hash apart


def agrees(module: ModuleType) -> bool:
    """Whether `module`'s keys are Python's for a sample of blocks (roots across the int range,
    tokens whose hashes are not themselves) and its walk finds what they hold."""
    roots = [0, 1, -2, 2**61 - 2, 2**61, -(2**63), 2**63 - 1, hash(("tskv", 1))]
    for root in roots:
        blocks = [tuple(SAMPLE_TOKENS[:4]), tuple(SAMPLE_TOKENS[4:]), (5,) * 4]
        expected = block_keys.chain(root, blocks)
        if module.chain(root, blocks) != expected:
            return False
        table = module.KeyTable()  # its walk hashes a key as an int itself: checked here too
        first, second = expected[0], expected[1]
        assert first is not None and second is not None  # every sample block has a parent
        table.update({first: 3, second: 1})
        for holders in ({first: 3, second: 1}, table):
            walked: list[int] = []
            tokens = [t for b in blocks for t in b]
            changes = module.walk(holders, None, root, tokens, 4, walked)
            if walked != expected[:3] or changes != ([(0, 3), (1, 1), (2, 0)], 3):
                return False
    return True


def _load() -> ModuleType | None:
    wanted = os.environ.get("TSKV_PURE_PYTHON", "")
    if wanted == "1":
        return None
    try:
        module = importlib.import_module("tskv.core._compiled")
    except ImportError as exc:
        if wanted == "0":
            logger.warning(
                "TSKV_PURE_PYTHON=0 asks for the compiled core, but it is not built here "
                "(%s); the pure-Python modules run (reinstall with a C compiler: pip install .)",
                exc,
            )
        return None
    if not agrees(module):
        logger.warning(
            "the compiled core gives other keys than this Python's hash(); the pure-Python "
            "modules run (a CPython whose tuple hash changed: please report it)"
        )
        return None
    return module


core = _load()


def chain(key: int | None, blocks: Sequence[Any]) -> list[int | None]:
    """`block_keys.chain`, in C where this process has the core and the blocks are plain
    (tuples of exact ints): the keys of a stored run, made for every event filed."""
    if core is not None:
        keys: list[int | None] | None = core.chain(key, blocks)
        if keys is not None:
            return keys
    return block_keys.chain(key, blocks)
