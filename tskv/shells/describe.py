"""Ask a publisher what it is: one request on its replay endpoint, one reply.

A tskv publisher answers with its `Descriptor`; any other (TokenSpeed's and vLLM's, as their
wheels' replay code reads) takes the request for a replay past its newest seq and answers with
the end marker alone, which is returned as None: nothing is known, and the caller goes on as
it would have without asking.
"""

from __future__ import annotations

import zmq

from tskv.core import frames
from tskv.core.codec import WireError
from tskv.core.descriptor import MAX_DESCRIPTOR_BYTES, Descriptor
from tskv.core.endpoints import check_endpoint
from tskv.core.errors import TskvRuntimeError
from tskv.curve.security import ClientSecurity
from tskv.shells._trio_zmq import TrioSocket, attach


async def describe_publisher(
    replay_endpoint: str,
    *,
    curve_server_key: str | None = None,
    curve_secret_key: str | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> Descriptor | None:
    """The descriptor of the publisher whose replay endpoint this is, or None for a publisher
    that does not describe itself. It waits for the answer as long as it takes (a publisher
    not yet up is waited for, as ZeroMQ does): bound it with `trio.fail_after`.

    Raises:
      EndpointError: the endpoint is not a ZeroMQ address.
      KeyFileError: a CURVE key file is missing, unreadable or not a key.
      TskvRuntimeError: the publisher refused the request (its replay limits): ask later.
      WireError: the answer is not a descriptor (a ValueError naming what was wrong).
    """
    check_endpoint(replay_endpoint)
    security = None
    if curve_server_key is not None:
        security = ClientSecurity.from_files(curve_server_key, curve_secret_key)
    return await _ask(replay_endpoint, security, context or zmq.Context.instance())


async def _ask(
    endpoint: str,
    security: ClientSecurity | None,
    context: zmq.Context[zmq.Socket[bytes]],
) -> Descriptor | None:
    sock = context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_DESCRIPTOR_BYTES + 64)
        if security is not None:
            security.apply(sock)
        attach(sock, endpoint, bind=False)
        dealer = TrioSocket(sock)
    except BaseException:
        sock.close(linger=0)
        raise
    try:
        await dealer.send(frames.describe_request())
        while True:
            try:
                reply = frames.parse_replay_reply(await dealer.receive())
            except frames.FrameError as exc:
                raise WireError(f"the answer to a describe request is not one: {exc}") from None
            if isinstance(reply, frames.DescriptorReply):
                return Descriptor.decode(reply.payload)
            if isinstance(reply, frames.ReplayReply) and reply.is_end:
                if reply.refusal is not None:
                    raise TskvRuntimeError(
                        f"the publisher on {endpoint} refused to say what it is "
                        f"({reply.refusal}): ask again later"
                    )
                return None  # a publisher that knows no descriptors
    finally:
        dealer.close()
