"""A fake OrderedDelivery servicer at the seam the client owns, served by a real grpc.aio server.

The fake follows the contract's rules that matter to a client (first request `open`, NOT_FOUND
for an unknown subscription, INVALID_ARGUMENT for bad values) and lets each test decide what a
stream sends and when acks are confirmed. It knows nothing about ordering: that is the real
servicer's job, tested in tests/delivery/.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc

MAX_OUTSTANDING_LIMIT = 10_000


class FakeSidecar(sidecar_pb2_grpc.OrderedDeliveryServicer):
    def __init__(self, subscriptions: tuple[str, ...] = ("orders",)) -> None:
        self.subscriptions = subscriptions
        self.open_attempts: list[sidecar_pb2.Open] = []
        self.received: asyncio.Queue[sidecar_pb2.SubscribeRequest] = asyncio.Queue()
        """Every ack and nack any stream received, in order."""
        self.opened: asyncio.Queue[asyncio.Queue[sidecar_pb2.SubscribeResponse]] = asyncio.Queue()
        """One outbox per accepted stream: put responses in it to send them."""
        self.confirm_acks = asyncio.Event()
        """While set, every ack is confirmed at once; while clear, confirmations wait for it."""
        self.confirm_acks.set()
        self.status = sidecar_pb2.GetStatusResponse()
        self.refusals_left = 0
        """Refuse this many opens with UNAVAILABLE, as the sidecar does while a subscription recovers."""

    async def Subscribe(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF or not first.HasField("open"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first request must be `open`")
        self.open_attempts.append(first.open)
        if self.refusals_left > 0:
            self.refusals_left -= 1
            reason = f"subscription {first.open.subscription!r} is still recovering; retry shortly"
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
        if first.open.subscription not in self.subscriptions:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown subscription {first.open.subscription!r}")
        if not 0 <= first.open.max_outstanding_messages <= MAX_OUTSTANDING_LIMIT:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_outstanding_messages must be 0..{MAX_OUTSTANDING_LIMIT}",
            )
        outbox: asyncio.Queue[sidecar_pb2.SubscribeResponse] = asyncio.Queue()
        reader = asyncio.create_task(self._read(context, outbox))
        await self.opened.put(outbox)
        try:
            while not reader.done():
                get = asyncio.create_task(outbox.get())
                await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    break
                await context.write(get.result())
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(
        self, context: grpc.aio.ServicerContext, outbox: asyncio.Queue[sidecar_pb2.SubscribeResponse]
    ) -> None:
        while True:
            request = await context.read()
            if request is grpc.aio.EOF:
                return
            await self.received.put(request)
            if request.HasField("ack"):
                await self.confirm_acks.wait()
                await outbox.put(sidecar_pb2.SubscribeResponse(ack_confirmations=request.ack.delivery_ids))

    async def GetStatus(
        self, request: sidecar_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.GetStatusResponse:
        if request.subscription and request.subscription not in self.subscriptions:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown subscription {request.subscription!r}")
        return self.status


@asynccontextmanager
async def serve(fake: FakeSidecar, address: str = "127.0.0.1:0") -> AsyncIterator[str]:
    """Serve ``fake`` on ``address``; yields the target clients should dial."""
    server = grpc.aio.server()
    sidecar_pb2_grpc.add_OrderedDeliveryServicer_to_server(fake, server)
    port = server.add_insecure_port(address)
    await server.start()
    try:
        yield address if address.startswith("unix:") else f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)
