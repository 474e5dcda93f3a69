"""Drop-in publishers for schedulers that are not Trio programs (TokenSpeed's API).

`ZmqEventPublisher` runs `open_publisher` in a Trio loop on its own thread. `publish()` encodes
in the caller's thread, takes one of `max_queue_size` slots (waiting while none is free, where
TokenSpeed's and vLLM's raise `queue.Full`), and hands the payload over; a slot is given back
when the publish task takes the batch off its queue.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from tskv._trio_thread import TrioThread
from tskv.codec import encode_batch
from tskv.config import KVEventsConfig
from tskv.events import KVEventBatch
from tskv.publisher import Publisher, PublisherClosedError, PublisherStatistics, open_publisher

logger = logging.getLogger("tskv")


class NullEventPublisher:
    """Accepts batches and sends nothing: what an engine uses with KV events disabled."""

    def __init__(self, attn_dp_rank: int = 0, **_: Any) -> None:
        self.attn_dp_rank = attn_dp_rank

    def publish(self, batch: KVEventBatch) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ZmqEventPublisher:
    """TokenSpeed's publisher interface, backed by the Trio publisher on a thread of its own."""

    def __init__(
        self,
        attn_dp_rank: int,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        shutdown_timeout: float = 1.0,
    ) -> None:
        self.attn_dp_rank = attn_dp_rank
        self._config = KVEventsConfig(
            publisher="zmq",
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            buffer_steps=buffer_steps,
            hwm=hwm,
            max_queue_size=max_queue_size,
            topic=topic,
        )
        self._shutdown_timeout = shutdown_timeout
        self._slots = threading.Semaphore(max_queue_size)
        self._lock = threading.Lock()
        self._handoff: deque[bytes] = deque()
        self._handoff_scheduled = False
        self._closed = False
        self._loop = TrioThread(self._open, f"tskv-publisher-{attn_dp_rank}")
        self._publisher: Publisher = self._loop.value

    @asynccontextmanager
    async def _open(self) -> AsyncIterator[Publisher]:
        async with open_publisher(
            self._config, self.attn_dp_rank, shutdown_timeout=self._shutdown_timeout
        ) as publisher:
            publisher._on_dequeue = self._slots.release
            yield publisher
            self._move_handoff()  # what was handed over just before shutdown still goes

    @property
    def endpoint(self) -> str:
        return self._publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._publisher.replay_endpoint

    def statistics(self) -> PublisherStatistics:
        return self._publisher.statistics()

    def publish(self, batch: KVEventBatch) -> None:
        """Send `batch` (its rank filled in if missing); waits while the queue is full."""
        if self._closed:
            raise PublisherClosedError("publish() after shutdown(); create a new publisher")
        if batch.attn_dp_rank is None:
            batch = attrs.evolve(batch, attn_dp_rank=self.attn_dp_rank)
        if not batch.events:
            return
        payload = encode_batch(batch)
        while not self._slots.acquire(timeout=0.1):  # backpressure, never a drop
            if self._closed:
                raise PublisherClosedError("the publisher was shut down while publish() waited")
        with self._lock:
            if self._closed:
                self._slots.release()
                raise PublisherClosedError("publish() after shutdown(); create a new publisher")
            self._handoff.append(payload)
            schedule = not self._handoff_scheduled
            self._handoff_scheduled = True
        if schedule:
            # If shutdown() won the race, its final hand-off already took this payload.
            with contextlib.suppress(trio.RunFinishedError):
                self._loop.run_sync_soon(self._move_handoff)

    def _move_handoff(self) -> None:
        """In the Trio thread: move handed-over payloads into the publisher's queue."""
        with self._lock:
            payloads = list(self._handoff)
            self._handoff.clear()
            self._handoff_scheduled = False
        for payload in payloads:  # never full: slots bound what is in flight
            self._publisher._queue_payload_nowait(payload)

    def shutdown(self) -> None:
        """Send what is queued (within the shutdown timeout), close, and join the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # Handoffs scheduled before this run first: the loop runs its callbacks in order.
        if not self._loop.close(self._shutdown_timeout + 5.0):
            logger.error("tskv publisher thread did not stop within %.1f s", self._shutdown_timeout)


class EventPublisherFactory:
    """Build the publisher a `--kv-events-config` asks for, as TokenSpeed's factory does."""

    @staticmethod
    def _config(config_json: str | None) -> KVEventsConfig | None:
        return None if config_json is None else KVEventsConfig.from_json(config_json)

    @classmethod
    def is_enabled(cls, config_json: str | None) -> bool:
        config = cls._config(config_json)
        return config is not None and config.enabled

    @classmethod
    def create(
        cls, config_json: str | None, attn_dp_rank: int = 0
    ) -> ZmqEventPublisher | NullEventPublisher:
        config = cls._config(config_json)
        if config is None or not config.enabled:
            return NullEventPublisher(attn_dp_rank)
        return ZmqEventPublisher(
            attn_dp_rank,
            endpoint=config.endpoint,
            replay_endpoint=config.replay_endpoint,
            buffer_steps=config.buffer_steps,
            hwm=config.hwm,
            max_queue_size=config.max_queue_size,
            topic=config.topic,
        )
