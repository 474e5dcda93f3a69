"""Read a tskv stream with nothing but pyzmq and msgpack, as a consumer in any language would."""

import sys

import msgpack
import zmq

sub = zmq.Context.instance().socket(zmq.SUB)
sub.connect(sys.argv[1])
sub.setsockopt(zmq.SUBSCRIBE, b"")
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 6):
    topic, seq, payload = sub.recv_multipart()
    ts, events, rank = msgpack.unpackb(payload)
    print(int.from_bytes(seq, "big"), rank, [event[0] for event in events], flush=True)
