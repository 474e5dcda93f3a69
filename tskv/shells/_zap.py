"""The ZAP handler of one ZeroMQ context, as a Trio task: CURVE's who-may-connect, enforced."""

from __future__ import annotations

import trio
import zmq

from tskv.core.errors import TskvRuntimeError
from tskv.curve.policy import zap_reply
from tskv.curve.security import ServerSecurity
from tskv.shells._ratelimit import LogLimiter
from tskv.shells._trio_zmq import TrioSocket

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class ZapHandler:
    """The ZAP endpoint of one ZeroMQ context, served by a Trio task over the shim."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], security: ServerSecurity) -> None:
        sock = context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)  # must happen before any CURVE socket of this context binds
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TskvRuntimeError(
                f"cannot serve ZAP in this ZeroMQ context ({exc.strerror}): a context has one "
                "ZAP handler; let tskv make a context for an encrypted publisher (pass none)"
            ) from None
        self._sock = TrioSocket(sock)
        self._security = security
        self._refusals = LogLimiter()
        self.refused = 0

    @trio.lowlevel.enable_ki_protection
    async def run(self) -> None:
        while True:
            request = await self._sock.receive()
            reply, ok = zap_reply(request, self._security.allowed)
            if not ok:
                self.refused += 1
                self._refusals.warning(
                    "refused a client: %s (%d refused so far)", reply[3].decode(), self.refused
                )
            await self._sock.send(reply)

    def close(self) -> None:
        self._sock.close()
