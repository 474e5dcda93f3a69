"""A block's content key: what the prefix index files a block under, no I/O.

A block's key is Python's hash of its parent's key and its content: its token ids (with its
identity beside the tokens, when it has one: its extra keys, its multimodal items, and with
vLLM's lookahead hashing the tokens after it that its hash covers). At the root, the LoRA name
and the cache salt (SGLang's and vLLM's per-tenant namespace). Everything that makes a block's
identity in its engine is in its key, so one tenant's query never matches another tenant's
salted blocks, whatever hashing scheme the engine uses (TokenSpeed's FNV, vLLM's SHA-256 or
xxHash, the simulator's). This module is the one place keys are made in Python, the
reference: one block's (`block_key`), a stored run's (`chain`), a request's (`request_contents`
chained) and the reference walk's, one at a time (`walk_keys`). The compiled core makes the
same keys in C (`tskv/core/_compiled_lib/`); `compiled` checks it against this module before
it is used and chooses it for a run's keys where it is built (`compiled.chain`), and
`tests/core/test_block_keys.py` and `tests/core/test_compiled.py` hold them equal.

A key is the same in every process: a watcher's reader processes key the blocks and the
router's process matches against them. Ints and tuples of ints hash alike in any interpreter of
one build, but strings, bytes and None hash by a per-process seed or address, so each of those
is replaced by a digest of it first (`stable`): in identities and at the root always, and in
token ids (TensorRT-LLM's string placeholders) when there are any.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any

from tskv.core.events import MMKey

Identity = Any  # extra keys and multimodal items of one block, as a hashable value, or None
_NONE = 0x6E6F6E65  # what None stands for: its hash is its address, which differs by process


@functools.lru_cache(maxsize=4096)
def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def stable(value: Any) -> Any:
    """`value` as something hashable whose hash is the same in every process: strings and
    bytes as digests of them, None as a constant, lists and dicts as tuples (they arrive as
    lists from the wire)."""
    if isinstance(value, str):
        return _digest(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, (bytes, bytearray)):
        return _digest(b"\x00" + bytes(value))  # not the digest of the same text as a string
    if value is None:
        return _NONE
    if isinstance(value, (list, tuple)):
        return tuple(stable(item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((stable(key), stable(item)) for key, item in value.items()))
    return value


_ROOT = stable("tskv-prefix-root")


@functools.lru_cache(maxsize=1024)
def root_key(lora_name: str | None, cache_salt: str | None = None) -> int:
    """The key a chain hangs from: prefixes cached under different LoRA adapters, or under
    different cache salts, differ."""
    return hash((_ROOT, stable(lora_name), stable(cache_salt)))


PLAIN_ROOT = root_key(None)  # what a request or event naming no LoRA and no salt hangs from


def int_tokens(tokens: Sequence[Any]) -> tuple[Sequence[int], bool]:
    """The token ids as ints (the sequence itself when they are; else a list, a string one
    as its digest), and whether there was a string among them. Typed Any: it runs for every
    event, and a `cast` is a call."""
    try:
        sum(tokens)  # refuses a string, at C speed
    except TypeError:
        return [t if type(t) is int else stable(t) for t in tokens], True
    return tokens, False


def block_identity(
    extra_keys: Sequence[Any] | None,
    mm_keys: Sequence[Sequence[MMKey]] | None,
    index: int,
    lookahead: Sequence[Any] | None = None,
) -> Identity:
    """What, beside its tokens, makes block `index` what it is: its extra keys, its multimodal
    items (content hash and offset; the uuid only names the item) and the lookahead tokens its
    hash covers (`lookahead`: this block's). None when it has none of them, so such a block's
    key is the plain one."""
    extra = extra_keys[index] if extra_keys is not None and index < len(extra_keys) else None
    items = mm_keys[index] if mm_keys is not None and index < len(mm_keys) else None
    media = None if not items else tuple((stable(i.hash), i.start_offset) for i in items)
    if lookahead is not None:
        return (stable(extra), media, ("lookahead", stable(lookahead)))
    if media is None:
        return None if extra is None else stable(extra)
    return (stable(extra), media)


def identities(
    extra_keys: Sequence[Any] | None,
    mm_keys: Sequence[Sequence[MMKey]] | None,
    count: int,
    lookahead: Sequence[Sequence[Any]] | None = None,
) -> list[Identity] | None:
    """Each of `count` blocks' identity, or None when no block has one (the usual event)."""
    if extra_keys is None and mm_keys is None and lookahead is None:
        return None
    found = [
        block_identity(
            extra_keys,
            mm_keys,
            index,
            None if lookahead is None or index >= len(lookahead) else lookahead[index],
        )
        for index in range(count)
    ]
    return None if all(identity is None for identity in found) else found


def contents(
    tokens: Sequence[int | str], idents: Sequence[Identity] | None, count: int, size: int
) -> tuple[list[Any], bool]:
    """Each of `count` blocks' content, as `chain` hashes it under its parent's key: its token
    ids as a tuple, with its identity when it has one; None for a block whose tokens fall short
    (no query can reach it). And whether a token id was a string."""
    ints, strings = int_tokens(tokens)
    whole = min(count, len(ints) // size)
    blocks = blocks_of(ints, size)  # tokens beyond `count` blocks are no block's: cut them off
    found: list[Any] = list(blocks if whole == len(ints) // size else islice(blocks, whole))
    if idents is not None:
        pairs = zip(found, idents[:whole], strict=True)
        found = [chunk if ident is None else (chunk, ident) for chunk, ident in pairs]
    if whole < count:
        found.extend([None] * (count - whole))
    return found, strings


def blocks_of(tokens: Sequence[Any], size: int) -> Iterator[tuple[Any, ...]]:
    """The full blocks' token ids, a tuple each: zip makes them at C speed, two and a half
    times as fast as slicing them out one by one (a short last block is left out)."""
    return zip(*[iter(tokens)] * size)  # noqa: B905 - the short block is what is left out


def block_key(parent: int, content: Any) -> int:
    """The key of a block under `parent`: its tokens, or (tokens, identity) where it has one."""
    return hash((parent, content))


def chain(key: int | None, blocks: Sequence[Any]) -> list[int | None]:
    """The keys of consecutive blocks under parent `key`: None from the first block no query
    can reach (no parent known, or its tokens short) on."""
    keys: list[int | None] = []
    for content in blocks:
        key = None if key is None or content is None else block_key(key, content)
        keys.append(key)
    return keys


def request_contents(
    token_ids: Sequence[Any],
    size: int,
    count: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    extra_keys: Sequence[Any] | None = None,
    mm_keys: Sequence[Sequence[MMKey]] | None = None,
    lookahead: int = 0,
) -> tuple[int, list[Any]]:
    """A request's root key and the contents of its first `count` blocks (fewer, if it has
    fewer), as an engine with `lookahead` tokens after each block in its hashes would key
    them: `chain` of the two is the request's keys."""
    count = min(count, max(0, (len(token_ids) - lookahead) // size))
    after = None
    if lookahead:
        ends = [(depth + 1) * size for depth in range(count)]
        after = [token_ids[end : end + lookahead] for end in ends]
    found, _ = contents(token_ids, identities(extra_keys, mm_keys, count, after), count, size)
    return root_key(lora_name, cache_salt), found


def walk_keys(
    key: int,
    token_ids: Sequence[Any],
    size: int,
    extra_keys: Sequence[Any] | None = None,
    mm_keys: Sequence[Sequence[MMKey]] | None = None,
    lookahead: int = 0,
) -> Iterator[int]:
    """A request's block keys under root `key`, one at a time, for the reference walk: most
    queries stop after a few blocks, so the rest are never keyed (nor their tokens copied)."""
    plain = extra_keys is None and mm_keys is None and not lookahead
    blocks = max(0, (len(token_ids) - lookahead) // size)
    for depth, chunk in enumerate(blocks_of(token_ids, size)):
        if plain:
            key = block_key(key, chunk)
        else:
            if depth >= blocks:
                return  # the tokens after it that its key covers are not in the request
            after = token_ids[(depth + 1) * size : (depth + 1) * size + lookahead]
            identity = block_identity(extra_keys, mm_keys, depth, after if lookahead else None)
            key = block_key(key, chunk if identity is None else (chunk, identity))
        yield key
