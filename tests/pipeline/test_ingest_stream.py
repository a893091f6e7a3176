"""The stream intake (``sidecar.pipeline.ingest_stream``) on its own, against the Pub/Sub emulator:
what the official subscriber does that the sidecar relies on, each shown where the emulator (or a
fault injected into it) can show it.

The callback here only collects what is handed over; the tests settle messages themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from google.protobuf import empty_pb2
from pubsub_admin import PubSubAdmin, wait_until

from sidecar.config.model import FlowControlConfig
from sidecar.pipeline.ingest_stream import StreamIntake
from sidecar.pipeline.ingest_stream_message import IntakeMessage
from sidecar.pipeline.pull_health import PullHealth

pytestmark = pytest.mark.timeout(120)


class Taken:
    """What the intake handed over, in order."""

    def __init__(self) -> None:
        self.messages: list[IntakeMessage] = []

    def __call__(self, message: IntakeMessage) -> None:
        self.messages.append(message)

    def data(self) -> list[bytes]:
        return [m.data for m in self.messages]


MakeIntake = Callable[..., tuple[StreamIntake, Taken]]


@pytest.fixture
async def make_intake(admin: PubSubAdmin) -> AsyncIterator[MakeIntake]:
    made: list[StreamIntake] = []
    loop = asyncio.get_running_loop()

    def make(subscription: str, **flow: Any) -> tuple[StreamIntake, Taken]:
        options = {k: flow.pop(k) for k in ("heartbeat_seconds", "max_lease_duration_seconds") if k in flow}
        intake = StreamIntake(
            "orders",
            subscription,
            FlowControlConfig.model_validate({"max_outstanding_messages": 100, **flow}),
            PullHealth(lambda: 0),
            max_lease_duration_seconds=options.pop("max_lease_duration_seconds", 3600.0),
            **options,
        )
        taken = Taken()
        intake.make_client()
        intake.subscribe(loop, taken)
        made.append(intake)
        return intake, taken

    yield make
    for intake in made:
        await intake.shut_down()
        await intake.close_client()


async def _subscription(admin: PubSubAdmin, name: str = "orders", *, ack_deadline_seconds: int = 10) -> tuple[str, str]:
    topic = await admin.create_topic(name)
    return topic, await admin.create_subscription(name, topic, ack_deadline_seconds=ack_deadline_seconds)


async def _publish(admin: PubSubAdmin, topic: str, count: int, prefix: str = "m") -> None:
    for i in range(count):
        await admin.publish(topic, f"{prefix}{i}".encode())


async def test_the_stream_names_its_subscription_client_and_limits_and_keeps_the_client_id_across_reconnects(
    admin: PubSubAdmin, make_intake: MakeIntake
) -> None:
    topic, sub = await _subscription(admin)
    intake, taken = make_intake(sub, max_outstanding_messages=7, max_outstanding_bytes=70_000)
    await _publish(admin, topic, 1)
    await wait_until(lambda: len(taken.messages) == 1, "the first message handed over")
    [stream] = await admin.report("streams", sub)
    assert stream["routing"] == f"subscription={sub}"
    assert stream["client_id"] == intake.client_id and intake.client_id
    assert (stream["max_outstanding_messages"], stream["max_outstanding_bytes"]) == (7, 70_000)
    assert stream["deadline_seconds"] == 10
    message = taken.messages[0]
    assert message.data == b"m0" and message.delivery_attempt is None and message.publish_time_ms > 0
    assert message.publish_time.timestamp() * 1000 == pytest.approx(message.publish_time_ms, abs=1)

    await admin.break_streams("UNAVAILABLE")  # retryable: a new stream, the same client id
    await wait_until(lambda: intake.leases.max_messages == 7 and len(intake._opens) >= 2, "a second stream opened")
    await _publish(admin, topic, 1, prefix="after")
    await wait_until(lambda: len(taken.messages) == 2, "a message over the new stream")
    [stream] = await admin.report("streams", sub)
    assert stream["client_id"] == intake.client_id
    assert intake.done is not None and not intake.done.done()


async def test_every_message_gets_a_receipt_modack_to_the_capped_deadline_and_is_extended_while_held(
    admin: PubSubAdmin, make_intake: MakeIntake
) -> None:
    # The subscription's deadline is 60 s: the receipt modack brings it to the 10 s cap, and the
    # lease loop extends it while the message is held, so it is not redelivered after 10 s.
    topic, sub = await _subscription(admin, ack_deadline_seconds=60)
    await admin.reset_counters()
    _intake, taken = make_intake(sub, max_lease_extension="10s")
    await _publish(admin, topic, 1)
    await wait_until(lambda: len(taken.messages) == 1, "the message handed over")

    async def lease() -> dict[str, Any]:
        leases = await admin.report("leases", sub)
        assert len(leases) == 1, leases
        return dict(leases[0])

    # The stream asked for the capped deadline, and the receipt modack sets it again.
    await wait_until_async(lambda: _seconds_left_at_most(lease, 10.5), "the 10 s deadline applied")
    await wait_until_async(lambda: _modacked(admin), "the receipt modack")
    await wait_until_async(lambda: _extended(lease), "an extension", within_seconds=15)
    held_for = 12.0
    await asyncio.sleep(held_for)  # past the 10 s deadline: the extensions keep it leased here
    assert (await lease())["delivery_attempt"] == 1
    assert len(taken.messages) == 1, "redelivered although leased"
    taken.messages[0].ack()
    await wait_until_async(lambda: _no_leases(admin, sub), "the ack applied")


async def _seconds_left_at_most(lease: Callable[[], Any], seconds: float) -> bool:
    return float((await lease())["seconds_left"]) <= seconds


async def _modacked(admin: PubSubAdmin) -> bool:
    return (await admin.counters())["modify_ack_deadline_ack_ids"] >= 1


async def _extended(lease: Callable[[], Any]) -> bool:
    return int((await lease())["extensions"]) >= 2  # the receipt modack, then an extension


async def _no_leases(admin: PubSubAdmin, sub: str) -> bool:
    return not await admin.report("leases", sub)


async def wait_until_async(predicate: Callable[[], Any], what: str, within_seconds: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_seconds
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def test_flow_control_hands_over_at_most_the_maximum_and_the_next_as_acks_free_room(
    admin: PubSubAdmin, make_intake: MakeIntake
) -> None:
    topic, sub = await _subscription(admin)
    intake, taken = make_intake(sub, max_outstanding_messages=3)
    await _publish(admin, topic, 8)
    await wait_until(lambda: len(taken.messages) == 3, "three handed over")
    await asyncio.sleep(0.3)  # more are pulled than handed over only if the limit is not kept
    assert len(taken.messages) == 3
    for message in taken.messages[:2]:
        message.ack()
    await wait_until(lambda: len(taken.messages) == 5, "two more once two were acked")
    while len(taken.messages) < 8:
        unsettled = [m for m in taken.messages if m.ack_id in intake.leases]
        assert len(unsettled) <= 3
        unsettled[0].ack()
        await wait_until(lambda: intake.leases.load() < 1.0 or len(taken.messages) == 8, "room again")
        await asyncio.sleep(0.05)
    for message in taken.messages:
        if message.ack_id in intake.leases:
            message.ack()
    assert sorted(taken.data()) == sorted(f"m{i}".encode() for i in range(8))
    await wait_until_async(lambda: _nothing_unacked(admin, sub), "everything acked")


async def _nothing_unacked(admin: PubSubAdmin, sub: str) -> bool:
    return not await admin.report("unacked", sub)


async def test_acks_made_while_the_stream_is_broken_reach_pubsub(admin: PubSubAdmin, make_intake: MakeIntake) -> None:
    topic, sub = await _subscription(admin)
    intake, taken = make_intake(sub)
    await _publish(admin, topic, 5)
    await wait_until(lambda: len(taken.messages) == 5, "five handed over")
    await admin.add_fault(method="StreamingPull", code="UNAVAILABLE")
    await admin.break_streams("UNAVAILABLE")
    await wait_until(lambda: intake._call is None or len(intake._opens) >= 2, "the stream broken")
    for message in taken.messages:
        message.ack()  # no stream now: the acks are unary calls and do not wait for one
    await wait_until_async(lambda: _nothing_unacked(admin, sub), "the acks applied with no stream open")
    await admin.clear_faults()


async def test_what_ingest_gives_back_at_shutdown_is_available_again_at_once(
    admin: PubSubAdmin, make_intake: MakeIntake
) -> None:
    topic, sub = await _subscription(admin, ack_deadline_seconds=60)
    intake, taken = make_intake(sub)
    await _publish(admin, topic, 3)
    await wait_until(lambda: len(taken.messages) == 3, "three handed over")
    taken.messages[0].ack()
    assert await intake.shut_down(), "the ack flushed at shutdown"
    await intake.nack_ids([m.ack_id for m in taken.messages[1:]])  # what ingest gives back
    await intake.close_client()
    # The two are available again at once, not after the 60 s deadline; the acked one is gone.
    await wait_until_async(lambda: _available(admin, sub, 2), "both given back", within_seconds=5)


async def _leased(admin: PubSubAdmin, sub: str, count: int) -> bool:
    return len(await admin.report("leases", sub)) == count


async def _available(admin: PubSubAdmin, sub: str, count: int) -> bool:
    return len(await admin.pull_available(sub)) == count


async def test_an_idle_stream_gets_heartbeats(admin: PubSubAdmin, make_intake: MakeIntake) -> None:
    _topic, sub = await _subscription(admin)
    make_intake(sub, heartbeat_seconds=0.1)

    async def beats() -> bool:
        streams = await admin.report("streams", sub)
        return bool(streams) and int(streams[0]["heartbeats"]) >= 3

    await wait_until_async(beats, "three heartbeats on the idle stream")


async def test_a_terminal_error_closes_the_pull_for_good_with_the_pubsub_error(
    admin: PubSubAdmin, make_intake: MakeIntake
) -> None:
    intake, _taken = make_intake(admin.subscription_path("missing"))
    assert intake.done is not None
    await asyncio.wait({intake.done}, timeout=10)
    error = intake.done.exception()
    assert error is not None and "NotFound" in type(error).__name__ and "does not exist" in str(error)


class FakePubsub:
    """A Subscriber service of our own, for what the emulator does not do: Pub/Sub sending past a
    stream's flow-control limits (which it treats as advisory), and an exactly-once subscription
    (which the emulator refuses, as it cannot keep its promise). It answers the first request of
    each stream with ``response`` and records the acks and deadline changes it is sent."""

    def __init__(self, response: Any) -> None:
        from sidecar.pipeline import ingest_pubsub_rpc as rpc

        self.rpc = rpc
        self.response = response
        self.acked: list[str] = []
        self.modacks: list[tuple[int, list[str]]] = []
        self.server = grpc.aio.server()
        self.port = 0

    async def __aenter__(self) -> FakePubsub:
        rpc = self.rpc

        async def streaming_pull(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await anext(requests)
            yield self.response
            await asyncio.sleep(60)

        async def acknowledge(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.acked.extend(request.ack_ids)
            return empty_pb2.Empty()

        async def modify_ack_deadline(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.modacks.append((request.ack_deadline_seconds, list(request.ack_ids)))
            return empty_pb2.Empty()

        def unary(handler: Any, request_class: Any) -> Any:
            return grpc.unary_unary_rpc_method_handler(
                handler, request_deserializer=request_class.FromString, response_serializer=_serialize
            )

        handlers = {
            "StreamingPull": grpc.stream_stream_rpc_method_handler(
                streaming_pull, request_deserializer=rpc.StreamingPullRequest.FromString, response_serializer=_serialize
            ),
            "Acknowledge": unary(acknowledge, rpc.AcknowledgeRequest),
            "ModifyAckDeadline": unary(modify_ack_deadline, rpc.ModifyAckDeadlineRequest),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("google.pubsub.v1.Subscriber", handlers),)
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop(None)

    def intake(self, name: str, **flow: Any) -> tuple[StreamIntake, Taken]:
        intake = StreamIntake(
            name,
            f"projects/p/subscriptions/{name}",
            FlowControlConfig.model_validate(flow),
            PullHealth(lambda: 0),
            max_lease_duration_seconds=3600,
            channel_factory=lambda: grpc.aio.insecure_channel(f"127.0.0.1:{self.port}"),
        )
        taken = Taken()
        intake.make_client()
        intake.subscribe(asyncio.get_running_loop(), taken)
        return intake, taken

    def nacked(self) -> list[str]:
        return [ack_id for seconds, ids in self.modacks if seconds == 0 for ack_id in ids]


def _serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def _response(count: int) -> Any:
    from sidecar.pipeline import ingest_pubsub_rpc as rpc

    response = rpc.StreamingPullResponse()
    for i in range(count):
        item = response.received_messages.add()
        item.ack_id = f"ack-{i}"
        item.message.message_id = f"id-{i}"
        item.message.data = f"m{i}".encode()
    return response


async def test_past_the_limit_pubsub_sent_is_held_back_handed_over_as_room_frees_and_nacked_at_shutdown() -> None:
    async with FakePubsub(_response(6)) as pubsub:
        intake, taken = pubsub.intake("orders", max_outstanding_messages=2)
        await wait_until(lambda: len(taken.messages) == 2, "two handed over")
        await asyncio.sleep(0.2)
        assert len(taken.messages) == 2 and intake.handoff_buffered == 4
        await wait_until(lambda: len([s for s, _ids in pubsub.modacks if s > 0]) >= 1, "the receipt modack")
        assert sorted(pubsub.modacks[0][1]) == [f"ack-{i}" for i in range(6)], "all six leased at receipt"
        taken.messages[0].ack()
        await wait_until(lambda: len(taken.messages) == 3, "a third once one was acked")
        assert intake.handoff_buffered == 3
        assert await intake.shut_down()
        assert pubsub.acked == ["ack-0"]
        assert sorted(pubsub.nacked()) == ["ack-3", "ack-4", "ack-5"], "the held back are nacked at shutdown"
        await intake.close_client()


async def test_an_exactly_once_subscription_is_refused_with_a_clear_reason() -> None:
    response = _response(1)
    response.subscription_properties.exactly_once_delivery_enabled = True
    async with FakePubsub(response) as pubsub:
        intake, taken = pubsub.intake("payments")
        assert intake.done is not None
        await asyncio.wait({intake.done}, timeout=10)
        error = intake.done.exception()
        assert error is not None and type(error).__name__ == "FailedPrecondition"
        assert "exactly-once" in str(error) and "intake: client" in str(error) and "'payments'" in str(error)
        assert taken.messages == []
        await intake.shut_down()
        await intake.close_client()
