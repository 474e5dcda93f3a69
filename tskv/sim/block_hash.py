"""TokenSpeed's block hash: chained FNV-1a 64, so consumers can recompute hashes from tokens."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

FNV_OFFSET = 14695981039346656037
FNV_PRIME = 1099511628211
_MASK = 2**64 - 1


def fnv1a_64(data: bytes, state: int = FNV_OFFSET) -> int:
    for byte in data:
        state = ((state ^ byte) * FNV_PRIME) & _MASK
    return state


def block_hash(token_ids: Sequence[int], parent: int | None) -> int:
    """Hash one block: a flag byte (1 with a parent), the parent as u64 LE (only if there is
    one), the token count as u64 LE, then each token as int32 LE."""
    if parent is None:
        header = struct.pack("<BQ", 0, len(token_ids))
    else:
        header = struct.pack("<BQQ", 1, parent & _MASK, len(token_ids))
    return fnv1a_64(header + struct.pack(f"<{len(token_ids)}i", *token_ids))


def chain_hashes(
    token_ids: Sequence[int], block_size: int, parent: int | None = None
) -> Iterable[int]:
    """The hashes of every full block of `token_ids`, each chained on the one before."""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(token_ids[start : start + block_size], parent)
        yield parent
