"""pubsub_sidecar_client against a fake servicer over real gRPC on loopback (and a Unix socket)."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from fake_ordered_delivery import FakeSidecar, serve
from google.protobuf import duration_pb2, timestamp_pb2

from pubsub_sidecar.v1 import sidecar_pb2
from pubsub_sidecar_client import Message, NotConfirmed, OrderedSubscriber, SubscriptionError, get_status

DEADLINE_SECONDS = 10.0
"""Generous: other engineers' test suites share this 2-core machine."""

pytestmark = pytest.mark.timeout(30)


def ordered(delivery_id: str, key: str = "order-1", sequence: int = 1, **fields: object) -> sidecar_pb2.OrderedMessage:
    fields.setdefault("delivery_attempt", 1)
    return sidecar_pb2.OrderedMessage(
        delivery_id=delivery_id,
        key=key,
        message_id=f"m-{delivery_id}",
        dedup_id=f"d-{key}-{sequence}",
        data=f"{key}:{sequence}".encode(),
        sequence=sequence,
        **fields,
    )


def subscriber(target: str, subscription: str = "orders", **kwargs: object) -> OrderedSubscriber:
    # Short backoff so reconnection tests stay fast; the defaults are for production.
    return OrderedSubscriber(
        target,
        subscription,
        reconnect_backoff_initial_seconds=0.05,
        reconnect_backoff_max_seconds=0.5,
        **kwargs,  # type: ignore[arg-type]
    )


async def next_message(sub: OrderedSubscriber) -> Message:
    return await asyncio.wait_for(anext(sub), DEADLINE_SECONDS)


async def next_request(fake: FakeSidecar) -> sidecar_pb2.SubscribeRequest:
    return await asyncio.wait_for(fake.received.get(), DEADLINE_SECONDS)


async def next_stream(fake: FakeSidecar) -> asyncio.Queue[sidecar_pb2.SubscribeResponse]:
    return await asyncio.wait_for(fake.opened.get(), DEADLINE_SECONDS)


async def poll(condition: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE_SECONDS
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_open_names_the_subscription_and_flow_control(fake: FakeSidecar) -> None:
    async with serve(fake) as target, subscriber(target, max_outstanding_messages=7):
        await next_stream(fake)
    assert [(o.subscription, o.max_outstanding_messages) for o in fake.open_attempts] == [("orders", 7)]


async def test_messages_arrive_as_plain_python_values(fake: FakeSidecar) -> None:
    publish = timestamp_pb2.Timestamp(seconds=1_700_000_000, nanos=123_000_000)
    event = timestamp_pb2.Timestamp(seconds=1_700_000_001)
    full = ordered(
        "d1",
        sequence=9,
        attributes={"order_id": "order-1", "seq": "9"},
        publish_time=publish,
        event_time=event,
        late=True,
        skipped=[sidecar_pb2.SkippedRange(first=5, last=6), sidecar_pb2.SkippedRange(first=8, last=8)],
    )
    bare = ordered("d2", key="order-2")
    async with serve(fake) as target, subscriber(target) as sub:
        outbox = await next_stream(fake)
        await outbox.put(sidecar_pb2.SubscribeResponse(messages=[full, bare]))
        first = await next_message(sub)
        second = await next_message(sub)

    assert (first.delivery_id, first.key, first.message_id, first.dedup_id) == ("d1", "order-1", "m-d1", "d-order-1-9")
    assert first.data == b"order-1:9"
    assert first.attributes == {"order_id": "order-1", "seq": "9"}
    assert first.publish_time == datetime(2023, 11, 14, 22, 13, 20, 123_000, tzinfo=UTC)
    assert first.event_time == datetime(2023, 11, 14, 22, 13, 21, tzinfo=UTC)
    assert (first.sequence, first.delivery_attempt, first.late) == (9, 1, True)
    assert first.skipped == ((5, 6), (8, 8))
    # Unset timestamps are None, not the epoch.
    assert (second.key, second.publish_time, second.event_time, second.late, second.skipped) == (
        "order-2",
        None,
        None,
        False,
        (),
    )


async def test_ack_is_confirmed_only_when_the_sidecar_says_so(fake: FakeSidecar) -> None:
    fake.confirm_acks.clear()
    confirmed_by_callback: list[str] = []
    async with (
        serve(fake) as target,
        subscriber(target, on_ack_confirmed=confirmed_by_callback.append) as sub,
    ):
        outbox = await next_stream(fake)
        confirmations = sub.ack_confirmations()
        next_confirmation = asyncio.ensure_future(anext(confirmations))
        await outbox.put(sidecar_pb2.SubscribeResponse(messages=[ordered("d1")]))
        msg = await next_message(sub)
        waiter = asyncio.create_task(msg.confirmed())
        by_id = asyncio.create_task(sub.wait_confirmed("d1"))

        assert await msg.ack() is True
        request = await next_request(fake)
        assert list(request.ack.delivery_ids) == ["d1"]
        # The sidecar has the ack but has not confirmed it: nothing may report it as confirmed.
        assert not waiter.done() and not by_id.done() and not next_confirmation.done()
        assert not msg.is_confirmed and confirmed_by_callback == []

        fake.confirm_acks.set()
        await asyncio.wait_for(asyncio.gather(waiter, by_id), DEADLINE_SECONDS)
        assert await asyncio.wait_for(next_confirmation, DEADLINE_SECONDS) == "d1"
        assert msg.is_confirmed and confirmed_by_callback == ["d1"]
        await sub.wait_confirmed("d1")  # already confirmed: returns at once
    # Closing the subscriber ends the confirmation stream.
    assert [delivery_id async for delivery_id in confirmations] == []


async def test_acks_queued_together_go_out_as_one_request(fake: FakeSidecar) -> None:
    async with serve(fake) as target, subscriber(target) as sub:
        outbox = await next_stream(fake)
        await outbox.put(sidecar_pb2.SubscribeResponse(messages=[ordered(f"d{i}", key=f"k{i}") for i in range(3)]))
        messages = [await next_message(sub) for _ in range(3)]
        for msg in messages:
            await msg.ack()
        request = await next_request(fake)
        assert list(request.ack.delivery_ids) == ["d0", "d1", "d2"]
        assert await messages[0].ack() is False  # a second ack of the same message is not sent


async def test_nack_sends_retry_after_and_dead_letter(fake: FakeSidecar) -> None:
    async with serve(fake) as target, subscriber(target) as sub:
        outbox = await next_stream(fake)
        await outbox.put(sidecar_pb2.SubscribeResponse(messages=[ordered(f"d{i}", key=f"k{i}") for i in range(4)]))
        first, second, third, fourth = [await next_message(sub) for _ in range(4)]

        with pytest.raises(ValueError, match="retry_after must not be negative"):
            await first.nack(retry_after=-1)
        assert await first.nack(retry_after=timedelta(seconds=1, milliseconds=500)) is True
        assert await second.nack(retry_after=2) is True
        assert await third.nack() is True
        assert await fourth.nack(dead_letter=True) is True
        nacks = [(await next_request(fake)).nack for _ in range(4)]

        assert [list(n.delivery_ids) for n in nacks] == [["d0"], ["d1"], ["d2"], ["d3"]]
        assert nacks[0].retry_after == duration_pb2.Duration(seconds=1, nanos=500_000_000)
        assert nacks[1].retry_after == duration_pb2.Duration(seconds=2)
        assert not nacks[2].HasField("retry_after") and not nacks[2].dead_letter
        assert nacks[3].dead_letter and not nacks[3].HasField("retry_after")
        with pytest.raises(NotConfirmed, match="nacked"):
            await first.confirmed()


async def test_reconnects_after_the_sidecar_restarts_on_the_same_port(fake: FakeSidecar) -> None:
    restarted = FakeSidecar()
    sub: OrderedSubscriber | None = None
    try:
        async with serve(fake) as target:
            sub = subscriber(target)
            sub.start()
            outbox = await next_stream(fake)
            await outbox.put(sidecar_pb2.SubscribeResponse(messages=[ordered("old-1"), ordered("old-2", key="k2")]))
            in_hand = await next_message(sub)
            waiter = asyncio.create_task(in_hand.confirmed())
            await poll(lambda: len(sub._ready) == 1, "the second message to be buffered")
        # The first sidecar is gone: its stream's messages go back to the sidecar, so the client
        # drops acks for them and never hands out the one the app had not picked up yet.
        await poll(lambda: not sub.connected.is_set(), "the client to notice the broken stream")
        assert await in_hand.ack() is False
        with pytest.raises(NotConfirmed, match="stream"):
            await asyncio.wait_for(waiter, DEADLINE_SECONDS)

        async with serve(restarted, target):
            outbox = await next_stream(restarted)
            assert [o.subscription for o in restarted.open_attempts] == ["orders"]
            redelivered = ordered("new-1", delivery_attempt=2)
            await outbox.put(sidecar_pb2.SubscribeResponse(messages=[redelivered]))
            msg = await next_message(sub)
            assert (msg.delivery_id, msg.delivery_attempt) == ("new-1", 2)
            assert await msg.ack() is True
            assert list((await next_request(restarted)).ack.delivery_ids) == ["new-1"]
            await asyncio.wait_for(msg.confirmed(), DEADLINE_SECONDS)
            assert sub.reconnects >= 1
        # Nothing from the old stream reached the new one.
        assert fake.received.empty()
    finally:
        if sub is not None:
            await sub.close()


async def test_not_found_is_raised_to_the_app_and_not_retried(fake: FakeSidecar) -> None:
    async with serve(fake) as target, subscriber(target, "no-such-subscription") as sub:
        with pytest.raises(SubscriptionError, match=r"NOT_FOUND.*no-such-subscription") as raised:
            await next_message(sub)
        assert raised.value.code is grpc.StatusCode.NOT_FOUND
        assert not sub.is_running
        assert [o.subscription for o in fake.open_attempts] == ["no-such-subscription"]
        # Acting on the subscriber after the failure repeats the error instead of hanging.
        with pytest.raises(SubscriptionError):
            await next_message(sub)


async def test_refusal_is_one_error_line_naming_target_code_and_reason(
    fake: FakeSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pubsub_sidecar_client")
    async with serve(fake) as target, subscriber(target, "no-such-subscription") as sub:
        with pytest.raises(SubscriptionError) as raised:
            await next_message(sub)
    line = str(raised.value)
    assert "\n" not in line
    assert line == (
        f"sidecar at {target} refused subscription 'no-such-subscription': "
        "NOT_FOUND: unknown subscription 'no-such-subscription'"
    )
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [(r.levelname, r.getMessage()) for r in errors] == [("ERROR", line)]


async def test_a_sidecar_not_ready_yet_is_retried_with_one_warning_line(
    fake: FakeSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pubsub_sidecar_client")
    fake.refusals_left = 4
    async with serve(fake) as target, subscriber(target) as sub:
        outbox = await next_stream(fake)
        await outbox.put(sidecar_pb2.SubscribeResponse(messages=[ordered("d1")]))
        msg = await next_message(sub)
        assert msg.delivery_id == "d1" and fake.refusals_left == 0
        assert len(fake.open_attempts) == 5 and sub.reconnects == 4
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("pubsub_sidecar_client")]
    reason = "UNAVAILABLE: subscription 'orders' is still recovering; retry shortly"
    refused = f"sidecar at {target} is not serving subscription 'orders' ({reason}); retrying with backoff"
    # Four refusals: one WARNING, the repeats at DEBUG, then one INFO once messages flow.
    assert [r for r in records if r[0] != "DEBUG"] == [
        ("WARNING", refused),
        ("INFO", f"sidecar at {target} serves subscription 'orders' again"),
    ]
    assert records.count(("DEBUG", refused)) == 3


async def test_invalid_argument_is_raised_to_the_app_and_not_retried(fake: FakeSidecar) -> None:
    async with serve(fake) as target, subscriber(target, max_outstanding_messages=1_000_000) as sub:
        with pytest.raises(SubscriptionError, match=r"INVALID_ARGUMENT.*max_outstanding_messages"):
            await next_message(sub)
        assert not sub.is_running and len(fake.open_attempts) == 1


async def test_close_waits_for_sent_acks_to_be_confirmed(fake: FakeSidecar) -> None:
    fake.confirm_acks.clear()
    async with serve(fake) as target:
        sub = subscriber(target, close_timeout_seconds=DEADLINE_SECONDS)
        sub.start()
        try:
            outbox = await next_stream(fake)
            await outbox.put(sidecar_pb2.SubscribeResponse(messages=[ordered("d1")]))
            msg = await next_message(sub)
            await msg.ack()
            await next_request(fake)
            closing = asyncio.create_task(sub.close())
            await poll(lambda: sub._closing, "close() to start")
            assert not closing.done()
            fake.confirm_acks.set()
            await asyncio.wait_for(closing, DEADLINE_SECONDS)
            assert msg.is_confirmed
        finally:
            await sub.close()


async def test_works_over_a_unix_socket(fake: FakeSidecar) -> None:
    # A short directory of our own: Unix socket paths are limited to about 100 bytes.
    with tempfile.TemporaryDirectory(prefix="sc-", dir="/tmp") as directory:
        target = f"unix://{Path(directory) / 'sidecar.sock'}"
        async with serve(fake, target), subscriber(target) as sub:
            outbox = await next_stream(fake)
            await outbox.put(sidecar_pb2.SubscribeResponse(messages=[ordered("d1")]))
            msg = await next_message(sub)
            await msg.ack()
            await asyncio.wait_for(msg.confirmed(), DEADLINE_SECONDS)


async def test_get_status_returns_the_sidecars_answer(fake: FakeSidecar) -> None:
    fake.status = sidecar_pb2.GetStatusResponse(
        subscriptions=[sidecar_pb2.SubscriptionStatus(name="orders", mode="sequence", buffered=3, keys_blocked=1)]
    )
    async with serve(fake) as target:
        status = await get_status(target, "orders", max_keys=5)
        assert [(s.name, s.buffered, s.keys_blocked) for s in status.subscriptions] == [("orders", 3, 1)]
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await get_status(target, "nope")
        assert raised.value.code() is grpc.StatusCode.NOT_FOUND


def test_bad_arguments_are_refused_up_front() -> None:
    with pytest.raises(ValueError, match="target"):
        OrderedSubscriber("", "orders")
    with pytest.raises(ValueError, match="subscription"):
        OrderedSubscriber("127.0.0.1:1", "")
    with pytest.raises(ValueError, match="max_outstanding_messages"):
        OrderedSubscriber("127.0.0.1:1", "orders", max_outstanding_messages=-1)
