"""Read a tskv stream with nothing but pyzmq and msgpack, as a consumer in any language would.

It joins the live stream only: what was published before it connected, and any batch ZeroMQ
drops on the way, it never sees (tskv.open_subscriber repairs both, and starts from the whole
cache with start_seq="snapshot"). It ends after N batches (6 by default), or on Ctrl-C.
"""

import contextlib
import sys

import msgpack
import zmq

sub = zmq.Context.instance().socket(zmq.SUB)
sub.connect(sys.argv[1])
sub.setsockopt(zmq.SUBSCRIBE, b"")
with contextlib.suppress(KeyboardInterrupt):
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 6):
        topic, seq, payload = sub.recv_multipart()
        ts, events, rank = msgpack.unpackb(payload)
        print(int.from_bytes(seq, "big"), rank, [event[0] for event in events], flush=True)
sub.close(linger=0)
