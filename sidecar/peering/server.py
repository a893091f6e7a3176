"""The owner's side of the peer channel: the ``PeerIntake`` gRPC server on the peer port.

Rules (docs/forwarding.md; G1-G3 in DESIGN §1 depend on the first two):

- **Credentials first.** A call without the shared secret, or with another, ends at once with
  UNAUTHENTICATED and is counted (``PeerStats.unauthenticated``); nothing of it is read.
- **The sender's view is checked, at once.** A forwarded message names its shard and the owner's
  epoch as the sender knows it: not held here -> REFUSED ``NOT_OWNER``; held at another epoch ->
  ``STALE_EPOCH``; an unknown subscription is ``NOT_OWNER`` too. The answer comes without waiting.
- **Own intake, unchanged.** A message admitted is handed to the subscription's ingest
  (``LocalIntake.take``: ``Ingestor.take_forwarded``) as a ``ForwardedMessage``: the fast path, the
  store, dedup and dead letters treat it as a message of this pod's own pull. Its answer is sent
  when ingest settles it: ACCEPTED when ingest would have acked it with Pub/Sub (its outcome is
  durable), REFUSED ``FAILED`` when ingest gives it back (a store failure, the shard lost meanwhile).
  An ingest that does not run (stopping, not started) -> ``STOPPING``.
- **Bounded.** At most ``LocalIntake.max_in_flight`` forwarded messages of a subscription are in
  flight here at once (the subscription's ``flow_control.max_outstanding_messages``: others may make
  this pod hold as much again as its own pull); past it a message is REFUSED ``OVERLOADED`` at once.
  Nothing waits in a queue of ours: answers wait only for their messages to settle.
- Frames are bounded (``max_message_bytes``, both ways); a larger one ends the call with
  RESOURCE_EXHAUSTED (gRPC's own check). Payloads never appear in logs; ids, counts, reasons do.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from sidecar.ops.listening import GRPC_SERVER_OPTIONS, ListenError, ensure_tcp_port_free
from sidecar.peering.auth import PeerCredentials
from sidecar.peering.proto import peer_pb2, peer_pb2_grpc
from sidecar.pipeline.ingest_forwarded import ForwardedMessage

_LOGGER = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""A frame's bound, both ways: a Pub/Sub message is at most 10 MB; its attributes and the envelope fit
in the rest. The sender's batches stay far below it (``sidecar.peering.client``)."""


Outcome = peer_pb2.Outcome


@dataclass(frozen=True, slots=True)
class LocalIntake:
    """One subscription's intake as the peer server sees it (``sidecar.wiring.peering`` makes it)."""

    held_epoch: Callable[[int], int | None]
    """Shard -> the epoch this pod delivers it under now; None when it does not."""
    take: Callable[[ForwardedMessage], bool]
    """``Ingestor.take_forwarded``: False when ingest does not run."""
    max_in_flight: int


@dataclass
class PeerStats:
    """What the peer server did since it started (metrics, tests)."""

    unauthenticated: int = 0
    """Calls refused with UNAUTHENTICATED (no secret, or a wrong one)."""
    accepted: int = 0
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    """Refused forwarded messages by reason (``not_owner``, ``stale_epoch``, ...)."""
    in_flight: collections.Counter[str] = field(default_factory=collections.Counter)
    """Forwarded messages taken by ingest and not settled yet, by subscription."""


class PeerServer:
    """The peer port: authenticated ``PeerIntake.Forward`` into the subscriptions' ingest."""

    def __init__(
        self, listen: str, credentials: PeerCredentials, *, max_message_bytes: int = MAX_MESSAGE_BYTES
    ) -> None:
        self._listen = listen
        self._credentials = credentials
        self._max_message_bytes = max_message_bytes
        self._intakes: dict[str, LocalIntake] = {}
        self._server: grpc.aio.Server | None = None
        self.stats = PeerStats()
        self.address: str | None = None

    def register(self, subscription: str, intake: LocalIntake) -> None:
        self._intakes[subscription] = intake

    async def start(self) -> str:
        """Bind and serve; returns the bound ``host:port`` (port 0 picks one). ``ListenError`` when taken."""
        if self._server is not None:
            raise RuntimeError("PeerServer.start() called twice")
        host, sep, port_text = self._listen.rpartition(":")
        if not sep or not port_text.isdigit():
            raise ListenError(f"peering: cannot listen on {self._listen!r}: expected host:port")
        ensure_tcp_port_free(host, int(port_text), "peering.port")
        server = grpc.aio.server(
            options=[
                *GRPC_SERVER_OPTIONS,
                ("grpc.max_receive_message_length", self._max_message_bytes),
                ("grpc.max_send_message_length", self._max_message_bytes),
            ]
        )
        peer_pb2_grpc.add_PeerIntakeServicer_to_server(_Servicer(self), server)
        try:
            port = server.add_insecure_port(self._listen)
        except RuntimeError as exc:
            raise ListenError(f"cannot listen on {self._listen} (peering.port): the address is in use") from exc
        await server.start()
        self._server = server
        self.address = f"{host}:{port}"
        _LOGGER.info(
            "peer server listening on %s (%s)",
            self.address,
            "trusted network, no secret" if self._credentials.trusted_network else "shared secret required",
        )
        return self.address

    async def stop(self, grace_seconds: float = 1.0) -> None:
        """Stop serving: open calls end (their senders fall back); idempotent."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_seconds)

    # ---- one call ----------------------------------------------------------------------------

    def admits(self, context: grpc.aio.ServicerContext) -> bool:
        if self._credentials.admits(context.invocation_metadata()):
            return True
        self.stats.unauthenticated += 1
        _LOGGER.warning("peer call from %s refused: no valid credentials", context.peer())
        return False

    def admit(self, subscription: str, message: peer_pb2.ForwardedMessage, answer: Callable[[Outcome], None]) -> None:
        """Check ``message`` and hand it to ingest, or refuse it at once; ``answer`` gets its outcome."""
        local_id = message.local_id
        intake = self._intakes.get(subscription)
        held = intake.held_epoch(message.shard) if intake is not None else None
        if intake is None or held is None:
            answer(self._refusal(local_id, Outcome.NOT_OWNER, "not_owner"))
            return
        if held != message.epoch:
            answer(self._refusal(local_id, Outcome.STALE_EPOCH, "stale_epoch"))
            return
        in_flight = self.stats.in_flight
        if in_flight[subscription] >= intake.max_in_flight:
            answer(self._refusal(local_id, Outcome.OVERLOADED, "overloaded"))
            return

        def settled(accepted: bool) -> None:
            in_flight[subscription] -= 1
            if accepted:
                self.stats.accepted += 1
                answer(Outcome(local_id=local_id, verdict=Outcome.ACCEPTED))
            else:
                answer(self._refusal(local_id, Outcome.FAILED, "failed"))

        forwarded = ForwardedMessage(
            message_id=message.message_id,
            data=message.data,
            attributes=dict(message.attributes),
            ordering_key=message.ordering_key,
            publish_time=message.publish_time.ToDatetime(tzinfo=datetime.UTC),
            delivery_attempt=message.delivery_attempt,
            on_settled=settled,
        )
        in_flight[subscription] += 1
        if not intake.take(forwarded):
            in_flight[subscription] -= 1
            answer(self._refusal(local_id, Outcome.STOPPING, "stopping"))

    def _refusal(self, local_id: int, reason: peer_pb2.Outcome.Reason, name: str) -> Outcome:
        self.stats.refused[name] += 1
        return Outcome(local_id=local_id, verdict=Outcome.REFUSED, reason=reason)


class _Servicer(peer_pb2_grpc.PeerIntakeServicer):
    def __init__(self, server: PeerServer) -> None:
        self._server = server

    async def Forward(
        self, request_iterator: AsyncIterator[peer_pb2.ForwardRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[peer_pb2.ForwardResponse]:
        if not self._server.admits(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "peer call without valid credentials")
            return
        # One entry per message admitted: bounded by the messages the sender has in flight.
        answers: asyncio.Queue[Outcome | None] = asyncio.Queue()
        outstanding = 0

        def answer(outcome: Outcome) -> None:
            answers.put_nowait(outcome)

        async def read() -> None:
            nonlocal outstanding
            try:
                async for request in request_iterator:
                    for message in request.messages:
                        outstanding += 1
                        self._server.admit(request.subscription, message, answer)
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read(), name="peer-forward-read")
        reading = True
        try:
            while reading or outstanding:
                first = await answers.get()
                batch: list[Outcome] = []
                for item in [first, *_drain(answers)]:
                    if item is None:
                        reading = False
                    else:
                        batch.append(item)
                outstanding -= len(batch)
                if batch:
                    yield peer_pb2.ForwardResponse(outcomes=batch)
            await reader  # raises what ended the reading, if anything did
        finally:
            if not reader.done():
                reader.cancel()


def _drain(queue: asyncio.Queue[Outcome | None]) -> list[Outcome | None]:
    items: list[Outcome | None] = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
