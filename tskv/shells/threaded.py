"""Drop-in publishers for schedulers that are not Trio programs (TokenSpeed's API).

`ZmqEventPublisher` runs `open_publisher` in a Trio loop on its own thread. `publish()` encodes
in the caller's thread, takes one of `max_queue_size` slots (waiting while none is free, as
TokenSpeed's `Queue.put` does), and hands the payload over; a slot is given back when the
publish task takes the batch off its queue. It takes TokenSpeed's own event and batch objects
as well as tskv's, sends empty batches as TokenSpeed does, and, like TokenSpeed's, shuts down
at interpreter exit so that what was queued is sent. If the loop dies, every call raises at
once with the loop's own error as the cause.
"""

from __future__ import annotations

import abc
import atexit
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import attrs
import trio
import zmq

from tskv.core.codec import DroppedFields, encode_batch
from tskv.core.config import KVEventsConfig, did_you_mean, field_names
from tskv.core.endpoints import offset_endpoint_port
from tskv.core.errors import ConfigError, TskvLookupError
from tskv.core.events import KVEventBatch
from tskv.core.frames import END_FRAME
from tskv.core.scheduler import foreign_batch
from tskv.shells._publish_task import Queued
from tskv.shells._trio_thread import LoopFailedError, TrioThread
from tskv.shells.publisher import (
    Publisher,
    PublisherClosedError,
    PublisherStatistics,
    open_publisher,
)

logger = logging.getLogger(__name__)
_DEFAULTS = KVEventsConfig()  # TokenSpeed's positional defaults are the config's, defined once


class PublisherFailedError(PublisherClosedError):
    """The threaded publisher's background loop stopped on an error (`__cause__`); batches
    can no longer be published. Create a new publisher."""


class EventPublisher(abc.ABC):
    """TokenSpeed's publisher base class: one per data-parallel rank, `publish` and
    `shutdown`. Register your own with `EventPublisherFactory.register_publisher`."""

    def __init__(self, attn_dp_rank: int = 0) -> None:
        self.attn_dp_rank = attn_dp_rank

    @abc.abstractmethod
    def publish(self, events: Any) -> None:
        """Send one batch, in order."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Send what is queued and close."""


class NullEventPublisher(EventPublisher):
    """Accepts batches and sends nothing: what an engine uses with KV events disabled."""

    def __init__(self, attn_dp_rank: int = 0, **_: Any) -> None:
        super().__init__(attn_dp_rank)

    def publish(self, events: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ZmqEventPublisher(EventPublisher):
    """TokenSpeed's publisher interface, backed by the Trio publisher on a thread of its own.

    The positional arguments are TokenSpeed's; every other `KVEventsConfig` key (CURVE, replay
    limits, timeouts, `bind`) is accepted as a keyword, or pass a whole config to `from_config`.
    """

    SHUTDOWN_TIMEOUT: ClassVar[float] = KVEventsConfig().shutdown_timeout  # TokenSpeed's 1.0
    END_SEQ: ClassVar[bytes] = END_FRAME  # the replay end marker's seq frame
    offset_endpoint_port = staticmethod(offset_endpoint_port)

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
            named = ", ".join(f"{key}{did_you_mean(key, field_names())}" for key in unknown)
            raise ConfigError(
                f"ZmqEventPublisher got unknown settings {named}; it takes the "
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
        super().__init__(attn_dp_rank)
        self._context = context
        self._slots = threading.Semaphore(max_queue_size)
        self._lock = threading.Lock()
        self._handoff: deque[Queued] = deque()
        self._handoff_scheduled = False
        self._lost_in_handoff = 0  # handed over as the publisher died: counted unsent
        self._dropped = DroppedFields(logger.warning)
        self._closed = False
        self._loop = TrioThread(
            self._open, f"tskv-publisher-{attn_dp_rank}", on_failure=self._loop_failed
        )
        self._publisher: Publisher = self._loop.value
        # As TokenSpeed's does: a script that returns without shutdown() still sends its batches.
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        self.shutdown(raise_on_failure=False)

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
        # A context of its own unless given one: terminating it waits (until the shutdown
        # deadline) for ZeroMQ to send what it holds. A script's process ends right after
        # shutdown(), and the process's shared context would be dropped with its last batches.
        context = zmq.Context() if self._context is None else self._context
        try:
            async with open_publisher(
                self.config, self.attn_dp_rank, context=context, on_dequeue=self._slots.release
            ) as publisher:
                yield publisher
                self._move_handoff()  # what was handed over just before shutdown still goes
        finally:
            if self._context is None:
                context.destroy(linger=0)  # only the PUB, closed lingering, is left

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
        try:  # in the loop's thread, which alone may count subscriptions off the socket
            stats = self._loop.run_sync(self._publisher.statistics)
        except (LoopFailedError, trio.RunFinishedError):
            stats = self._publisher.statistics()  # the loop has ended: its counts are final
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

    async def _wait_for_subscriber(self, count: int, seconds: float) -> bool:
        with trio.move_on_after(seconds):
            await self._publisher.wait_for_subscriber(count)
            return True
        return False

    def wait_for_subscriber(self, timeout: float, count: int = 1) -> bool:
        """Wait until `count` subscriptions for this topic have arrived, at most `timeout`
        seconds; False if they did not. ZeroMQ drops what a PUB sends before a subscription
        reaches it: scripts and tests wait here instead of sleeping."""
        self._check_usable()
        return self._loop.run(self._wait_for_subscriber, count, timeout)

    def publish(self, events: Any) -> None:
        """Send one batch: tskv's `KVEventBatch` or TokenSpeed's (any object with `ts`,
        `events` and `attn_dp_rank`, its events tskv's or TokenSpeed's). A missing rank is
        filled in, on the caller's object when it can be changed, as TokenSpeed does; an empty
        batch is sent too. Waits while the queue is full."""
        self._check_usable()
        if isinstance(events, KVEventBatch) and events.attn_dp_rank is not None:
            batch = events  # tskv's own, complete: nothing to translate
        else:
            ts, listed, rank = foreign_batch(events)
            if rank is None:
                rank = self.attn_dp_rank
                if not isinstance(events, KVEventBatch):  # tskv's batch is frozen
                    events.attn_dp_rank = rank
            batch = KVEventBatch(ts, listed, rank)
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

    def shutdown(self, *, raise_on_failure: bool = True) -> None:
        """Send what is queued (within the shutdown timeout), close, and join the thread.

        Raises PublisherFailedError if the loop had stopped on an error. What could not be
        sent in time is logged with its count (`statistics().unsent_at_shutdown`)."""
        with self._lock:
            first = not self._closed
            self._closed = True
        if first:
            atexit.unregister(self._at_exit)
            # Handoffs scheduled before this run first: the loop runs its callbacks in order.
            wait = self.config.shutdown_timeout + 5.0
            if not self._loop.close(wait):
                logger.error("tskv publisher thread did not stop within %.1f s", wait)
        if self._loop.failure is not None and raise_on_failure:
            raise PublisherFailedError(
                f"the tskv publisher on {self.endpoint} had stopped: {self._loop.failure!r}"
            ) from self._loop.failure


class EventPublisherFactory:
    """Build the publisher a `--kv-events-config` asks for, as TokenSpeed's factory does."""

    _registry: ClassVar[dict[str, Callable[..., EventPublisher]]] = {
        "null": NullEventPublisher,
        "zmq": ZmqEventPublisher,
    }

    @classmethod
    def register_publisher(cls, name: str, ctor: Callable[..., EventPublisher]) -> None:
        """Make `"publisher": name` build `ctor(attn_dp_rank=..., **the other keys)`."""
        if name in cls._registry:
            raise TskvLookupError(f"publisher {name!r} is already registered; pick another name")
        cls._registry[name] = ctor

    @staticmethod
    def _config(config_json: str | None) -> KVEventsConfig | None:
        # None or "" means no config at all, as TokenSpeed reads it: events off
        return KVEventsConfig.from_json(config_json, logger.warning) if config_json else None

    @classmethod
    def is_enabled(cls, config_json: str | None) -> bool:
        config = cls._config(config_json)
        return config is not None and config.enabled

    @classmethod
    def create(cls, config_json: str | None, attn_dp_rank: int = 0) -> EventPublisher:
        config = cls._config(config_json)
        if config is None or not config.enabled:
            return NullEventPublisher(attn_dp_rank)
        kind = config.publisher or "zmq"
        if kind not in cls._registry:
            names = " or ".join(f'"{name}"' for name in sorted(cls._registry))
            raise ConfigError(
                f"publisher = {kind!r}: use {names} (or register it with "
                "EventPublisherFactory.register_publisher first), or null for the default"
            )
        if kind == "zmq":
            return ZmqEventPublisher.from_config(config, attn_dp_rank)
        options = config.to_mapping()
        for key in ("publisher", "enable_kv_cache_events"):
            options.pop(key)
        return cls._registry[kind](attn_dp_rank=attn_dp_rank, **options)
