"""Drop-in publishers for schedulers that are not Trio programs (TokenSpeed's API).

`ZmqEventPublisher` runs `open_publisher` in a Trio loop on its own thread. `publish()` encodes
in the caller's thread, takes one of `max_queue_size` slots (waiting while none is free, where
TokenSpeed's and vLLM's raise `queue.Full`), and hands the payload over; a slot is given back
when the publish task takes the batch off its queue. If the loop dies, every call raises at
once with the loop's own error as the cause.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import zmq

from tskv._trio_thread import TrioThread
from tskv.codec import DroppedFields, encode_batch
from tskv.config import ConfigError, KVEventsConfig, field_names
from tskv.events import KVEventBatch
from tskv.publisher import (
    Publisher,
    PublisherClosedError,
    PublisherStatistics,
    Queued,
    open_publisher,
)

logger = logging.getLogger("tskv")
_DEFAULTS = KVEventsConfig()  # TokenSpeed's positional defaults are the config's, defined once


class PublisherFailedError(PublisherClosedError):
    """The threaded publisher's background loop stopped on an error (`__cause__`); batches
    can no longer be published. Create a new publisher."""


class NullEventPublisher:
    """Accepts batches and sends nothing: what an engine uses with KV events disabled."""

    def __init__(self, attn_dp_rank: int = 0, **_: Any) -> None:
        self.attn_dp_rank = attn_dp_rank

    def publish(self, batch: KVEventBatch) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ZmqEventPublisher:
    """TokenSpeed's publisher interface, backed by the Trio publisher on a thread of its own.

    The positional arguments are TokenSpeed's; every other `KVEventsConfig` key (CURVE, replay
    limits, timeouts) is accepted as a keyword, or pass a whole config to `from_config`.
    """

    def __init__(
        self,
        attn_dp_rank: int,
        endpoint: str = _DEFAULTS.endpoint,
        replay_endpoint: str | None = _DEFAULTS.replay_endpoint,
        buffer_steps: int = _DEFAULTS.buffer_steps,
        hwm: int = _DEFAULTS.hwm,
        max_queue_size: int = _DEFAULTS.max_queue_size,
        topic: str = _DEFAULTS.topic,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - field_names())
        if unknown:
            raise ConfigError(
                f"ZmqEventPublisher got unknown settings {', '.join(unknown)}; it takes the "
                f"KVEventsConfig keys: {', '.join(sorted(field_names()))}"
            )
        options.setdefault("publisher", "zmq")
        self.config = KVEventsConfig(
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            buffer_steps=buffer_steps,
            hwm=hwm,
            max_queue_size=max_queue_size,
            topic=topic,
            **options,
        )
        self.attn_dp_rank = attn_dp_rank
        self._context = context
        self._slots = threading.Semaphore(max_queue_size)
        self._lock = threading.Lock()
        self._handoff: deque[Queued] = deque()
        self._handoff_scheduled = False
        self._lost_in_handoff = 0  # handed over as the publisher died: counted unsent
        self._dropped = DroppedFields()
        self._closed = False
        self._loop = TrioThread(
            self._open, f"tskv-publisher-{attn_dp_rank}", on_failure=self._loop_failed
        )
        self._publisher: Publisher = self._loop.value

    @classmethod
    def from_config(
        cls,
        config: KVEventsConfig,
        attn_dp_rank: int = 0,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> ZmqEventPublisher:
        """A publisher with every key of `config`, as EventPublisherFactory builds it."""
        return cls(attn_dp_rank, context=context, **config.to_mapping())

    @asynccontextmanager
    async def _open(self) -> AsyncIterator[Publisher]:
        async with open_publisher(
            self.config, self.attn_dp_rank, context=self._context, on_dequeue=self._slots.release
        ) as publisher:
            yield publisher
            self._move_handoff()  # what was handed over just before shutdown still goes

    def _loop_failed(self, _: BaseException) -> None:
        # Wake every publish() waiting for a slot: each then sees the failure and raises.
        self._slots.release(self.config.max_queue_size)

    def _check_usable(self) -> None:
        if self._loop.failure is not None:
            raise PublisherFailedError(
                f"the tskv publisher on {self.endpoint} stopped: {self._loop.failure!r}; "
                "create a new publisher"
            ) from self._loop.failure
        if self._closed:
            raise PublisherClosedError("publish() after shutdown(); create a new publisher")

    @property
    def endpoint(self) -> str:
        return self._publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._publisher.replay_endpoint

    def statistics(self) -> PublisherStatistics:
        """The publisher's statistics, counting batches still being handed over: accepted ==
        published + queued + unsent_at_shutdown holds here too."""
        stats = self._publisher.statistics()
        with self._lock:
            handed = len(self._handoff)
        ended = self._loop.failure is not None or self._closed
        unsent = self._lost_in_handoff + (handed if ended else 0)
        return attrs.evolve(
            stats,
            events_with_dropped_fields=self._dropped.events,
            accepted=stats.accepted + handed + self._lost_in_handoff,
            queued=stats.queued + (0 if ended else handed),
            unsent_at_shutdown=stats.unsent_at_shutdown + unsent,
        )

    def publish(self, batch: KVEventBatch) -> None:
        """Send `batch` (its rank filled in if missing); waits while the queue is full."""
        self._check_usable()
        if batch.attn_dp_rank is None:
            batch = KVEventBatch(batch.ts, batch.events, self.attn_dp_rank)
        if not batch.events:
            return
        config = self.config
        payload = encode_batch(
            batch, config.wire_format, strict=config.strict, dropped=self._dropped
        )
        while not self._slots.acquire(timeout=0.1):  # backpressure, never a drop
            self._check_usable()
        with self._lock:
            try:
                self._check_usable()
            except PublisherClosedError:
                self._slots.release()
                raise
            self._handoff.append((payload, batch.events))
            schedule = not self._handoff_scheduled
            self._handoff_scheduled = True
        if schedule:
            try:
                self._loop.run_sync_soon(self._move_handoff)
            except trio.RunFinishedError:
                # The loop has ended: if it failed, say so; if shutdown() won the race, its
                # final hand-off already took this payload.
                self._check_usable()

    def _move_handoff(self) -> None:
        """In the Trio thread: move handed-over payloads into the publisher's queue."""
        with self._lock:
            payloads = list(self._handoff)
            self._handoff.clear()
            self._handoff_scheduled = False
        for index, (payload, events) in enumerate(payloads):  # never full: slots bound these
            try:
                self._publisher.publish_encoded_nowait(payload, events)
            except PublisherClosedError:  # the publish task has died: these never go out
                self._lost_in_handoff += len(payloads) - index
                return

    def shutdown(self) -> None:
        """Send what is queued (within the shutdown timeout), close, and join the thread.

        Raises PublisherFailedError if the loop had stopped on an error."""
        with self._lock:
            first = not self._closed
            self._closed = True
        if first:
            # Handoffs scheduled before this run first: the loop runs its callbacks in order.
            wait = self.config.shutdown_timeout + 5.0
            if not self._loop.close(wait):
                logger.error("tskv publisher thread did not stop within %.1f s", wait)
        if self._loop.failure is not None:
            raise PublisherFailedError(
                f"the tskv publisher on {self.endpoint} had stopped: {self._loop.failure!r}"
            ) from self._loop.failure


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
        return ZmqEventPublisher.from_config(config, attn_dp_rank)
