"""A block's key is the same in every process: a watcher's reader processes key the blocks the
router's process matches against."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgpack

from tskv import BlockStored, KVEvent, MMKey
from tskv.core.block_keys import stable
from tskv.core.prefix_index import PrefixIndex

HOME = Path(__file__).resolve().parents[2]


def events() -> list[KVEvent]:
    """Blocks whose identity holds every kind of value that hashes differently by process:
    a LoRA name and a salt, string multimodal hashes, string token ids, None in extra keys."""
    return [
        BlockStored([1, 2], None, [5, 6, 7, 8], 2, lora_name="adapter", cache_salt="tenant"),
        BlockStored([3], 2, ["<image>", 9], 2, mm_keys=[[MMKey("sha:abc", 0)]]),
        BlockStored([4], None, [5, 6], 2, extra_keys=[[None, "k", b"raw"]]),
    ]


KEYED_ELSEWHERE = """
import sys, msgpack
from tests.core.test_block_keys import events
from tskv.core.journal_index import JournalIndex
index = JournalIndex(2)
index.apply("w", events())
sys.stdout.buffer.write(msgpack.packb([index.take_changes("w"), index.seen_strings]))
"""


def test_keys_made_in_a_process_with_another_hash_seed_match_here() -> None:
    mirror = PrefixIndex(2)
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(HOME)}
        out = subprocess.run(
            [sys.executable, "-c", KEYED_ELSEWHERE], env=env, capture_output=True, check=True
        ).stdout
        (runs, ops), strings = msgpack.unpackb(out)
        mirror.apply_changes(seed, runs, ops, strings=strings)
    here = PrefixIndex(2)
    here.apply("w", events())
    lora = {"lora_name": "adapter", "cache_salt": "tenant"}
    mm: list[list[MMKey]] = [[], [], [MMKey("sha:abc", 0)]]
    assert here.match([5, 6, 7, 8, "<image>", 9], mm_keys=mm, **lora) == {"w": 3}
    assert mirror.match([5, 6, 7, 8, "<image>", 9], mm_keys=mm, **lora) == {"1": 3, "2": 3}
    assert mirror.match([5, 6], extra_keys=[[None, "k", b"raw"]]) == {"1": 1, "2": 1}
    assert mirror.match([5, 6, 7, 8], lora_name="adapter") == {}  # the salt is its identity


def test_stable_values_keep_apart_what_differs() -> None:
    assert stable("x") != stable(b"x") and stable(None) != stable("None")
    assert stable(["a", [1, None]]) == stable(("a", (1, None)))
    assert stable({"b": 1, "a": 2}) == stable({"a": 2, "b": 1})
