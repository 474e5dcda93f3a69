"""Ctrl-C and a dying background loop: every accepted batch ends published or counted unsent,
and nobody waits forever."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

import pytest
import zmq

from tests.processes import killed_after
from tskv import BlockRemoved, KVEventBatch, ZmqEventPublisher
from tskv.shells.threaded import PublisherFailedError

LOOPBACK = "tcp://127.0.0.1:*"

PUBLISHING_UNTIL_INTERRUPTED = textwrap.dedent(
    """
    import json, trio, tskv

    publisher = None

    async def main():
        global publisher
        config = tskv.KVEventsConfig(endpoint="tcp://127.0.0.1:*")
        async with tskv.open_publisher(config) as publisher:
            events = [tskv.BlockRemoved([n]) for n in range(10)]
            for n in range(10_000_000):
                await publisher.publish(events)
                if n == 1000:
                    print("publishing", flush=True)

    try:
        trio.run(main)
    except KeyboardInterrupt:
        stats = publisher.statistics()
        names = ("accepted", "published", "queued", "unsent_at_shutdown")
        print(json.dumps({name: getattr(stats, name) for name in names}), flush=True)
    """
)


@pytest.mark.parametrize("attempt", range(3))
def test_ctrl_c_while_publishing_leaves_every_accepted_batch_accounted_for(attempt: int) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", PUBLISHING_UNTIL_INTERRUPTED],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    with killed_after(60, process):
        assert process.stdout.readline() == "publishing\n"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate()
    stats = json.loads(out)
    assert stats["accepted"] > 1000, err
    assert stats["queued"] == 0
    assert stats["accepted"] == stats["published"] + stats["unsent_at_shutdown"], err
    assert "Traceback" not in err


def test_a_dead_background_loop_makes_publish_and_shutdown_raise_at_once() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    publisher = ZmqEventPublisher(0, endpoint=LOOPBACK, max_queue_size=4, context=context)
    # Elsewhere in the process, the context is terminated under the running publisher.
    terminator = threading.Thread(target=context.term)
    terminator.start()
    with pytest.raises(PublisherFailedError) as failed:
        for n in range(100_000):  # far more than the queue holds: it must not block forever
            publisher.publish(KVEventBatch(1.0, [BlockRemoved([n])]))
    cause = failed.value.__cause__
    if isinstance(cause, BaseExceptionGroup):  # several of its tasks met the same end
        assert cause.subgroup(zmq.ContextTerminated) is not None
    else:
        assert isinstance(cause, zmq.ContextTerminated)
    assert "stopped" in str(failed.value) and "Context was terminated" in str(failed.value)
    with pytest.raises(PublisherFailedError) as again:
        publisher.publish(KVEventBatch(1.0, [BlockRemoved([1])]))
    assert again.value.__cause__ is failed.value.__cause__
    with pytest.raises(PublisherFailedError):
        publisher.shutdown()
    terminator.join(10)
    assert not terminator.is_alive()
    stats = publisher.statistics()
    assert stats.accepted == stats.published + stats.queued + stats.unsent_at_shutdown
    assert not any(
        t.name.startswith("tskv-publisher") and t.is_alive() for t in threading.enumerate()
    )
