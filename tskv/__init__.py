"""tskv: KV-cache events from an LLM scheduler over ZeroMQ, published from Trio, with replay."""

from tskv.core.codec import WireError, codec_name, decode_batch, encode_batch
from tskv.core.config import KVEventsConfig, SubscriberConfig
from tskv.core.descriptor import Descriptor, GroupInfo
from tskv.core.endpoints import EndpointError, offset_endpoint_port
from tskv.core.errors import ConfigError, HandshakeError, TskvError, TskvWarning
from tskv.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
    MMKey,
    UnknownEvent,
)
from tskv.core.groups import CacheGroup
from tskv.core.losses import Loss, LossReason
from tskv.core.prefix_index import Match, PrefixIndex
from tskv.core.replay_server import ReplayStatistics
from tskv.core.routing import (
    Choice,
    LoadAwarePolicy,
    LongestPrefixPolicy,
    Policy,
    RandomPolicy,
    RoundRobinPolicy,
)
from tskv.core.scheduler import (
    drain_scheduler_kv_events,
    foreign_event_to_wire_event,
    scheduler_kv_event_to_wire_event,
    scheduler_kv_events_to_wire_events,
)
from tskv.core.version import VERSION
from tskv.curve.key_files import KeyFileError
from tskv.shells.describe import describe_publisher
from tskv.shells.publisher import (
    Publisher,
    PublisherClosedError,
    PublisherStatistics,
    open_publisher,
)
from tskv.shells.subscriber import Subscriber, SubscriberStatistics, open_subscriber
from tskv.shells.threaded import (
    EventPublisher,
    EventPublisherFactory,
    NullEventPublisher,
    PublisherFailedError,
    ZmqEventPublisher,
)
from tskv.shells.watcher import Watcher, WorkerStatus, open_watcher

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheGroup",
    "Choice",
    "ConfigError",
    "Descriptor",
    "EndpointError",
    "EventBatch",
    "EventPublisher",
    "EventPublisherFactory",
    "GroupInfo",
    "HandshakeError",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "KVEventsConfig",
    "KeyFileError",
    "LoadAwarePolicy",
    "LongestPrefixPolicy",
    "Loss",
    "LossReason",
    "MMKey",
    "Match",
    "NullEventPublisher",
    "Policy",
    "PrefixIndex",
    "Publisher",
    "PublisherClosedError",
    "PublisherFailedError",
    "PublisherStatistics",
    "RandomPolicy",
    "ReplayStatistics",
    "RoundRobinPolicy",
    "Subscriber",
    "SubscriberConfig",
    "SubscriberStatistics",
    "TskvError",
    "TskvWarning",
    "UnknownEvent",
    "Watcher",
    "WireError",
    "WorkerStatus",
    "ZmqEventPublisher",
    "codec_name",
    "decode_batch",
    "describe_publisher",
    "drain_scheduler_kv_events",
    "encode_batch",
    "foreign_event_to_wire_event",
    "offset_endpoint_port",
    "open_publisher",
    "open_subscriber",
    "open_watcher",
    "scheduler_kv_event_to_wire_event",
    "scheduler_kv_events_to_wire_events",
]

__version__ = VERSION
