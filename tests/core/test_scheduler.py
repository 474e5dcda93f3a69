from types import SimpleNamespace

import pytest

from tskv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    drain_scheduler_kv_events,
    scheduler_kv_event_to_wire_event,
)
from tskv.core.codec import encode_round


def test_translates_each_kind() -> None:
    stored = SimpleNamespace(
        kind="BlockStored", block_hashes=[1, 2], parent_block_hash=9, token_ids=[3], block_size=4
    )
    assert scheduler_kv_event_to_wire_event(stored) == BlockStored([1, 2], 9, [3], 4)
    removed = SimpleNamespace(kind="BlockRemoved", block_hashes=[5])
    assert scheduler_kv_event_to_wire_event(removed) == BlockRemoved([5])
    cleared = SimpleNamespace(kind="AllBlocksCleared")
    assert scheduler_kv_event_to_wire_event(cleared) == AllBlocksCleared()


def test_unknown_kind_is_refused_by_name_even_with_a_known_shape() -> None:
    event = SimpleNamespace(kind="FutureEvent", block_hashes=[1])
    with pytest.raises(TypeError, match="FutureEvent"):
        scheduler_kv_event_to_wire_event(event)
    with pytest.raises(TypeError, match="None"):
        scheduler_kv_event_to_wire_event(SimpleNamespace(block_hashes=[1]))


def test_bad_values_from_the_scheduler_are_named_when_published() -> None:
    event = SimpleNamespace(kind="BlockRemoved", block_hashes=[-(2**64)])
    translated = scheduler_kv_event_to_wire_event(event)
    with pytest.raises(ValueError, match=r"events\[0\].block_hashes\[0\]"):
        encode_round(1.0, [translated], 0)


def test_optional_fields_a_native_event_carries_come_along() -> None:
    stored = SimpleNamespace(
        kind="BlockStored",
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[3],
        block_size=4,
        medium="CPU",
        lora_name="sql",
    )
    translated = scheduler_kv_event_to_wire_event(stored)
    assert translated == BlockStored([1], None, [3], 4, medium="CPU", lora_name="sql")
    removed = SimpleNamespace(kind="BlockRemoved", block_hashes=[5], medium="DISK")
    assert scheduler_kv_event_to_wire_event(removed) == BlockRemoved([5], medium="DISK")


def test_drain_when_disabled_does_not_touch_the_scheduler() -> None:
    assert drain_scheduler_kv_events(object(), enabled=False) == []


def test_drain_without_binding_says_so() -> None:
    with pytest.raises(RuntimeError, match=r"Scheduler.drain_kv_events"):
        drain_scheduler_kv_events(object(), enabled=True)


def test_drain_returns_the_schedulers_events() -> None:
    event = SimpleNamespace(kind="BlockRemoved", block_hashes=[1])
    scheduler = SimpleNamespace(drain_kv_events=lambda: (event,))
    assert drain_scheduler_kv_events(scheduler, enabled=True) == [event]
