"""Bad requests get a clear status, or are counted and ignored; the server keeps serving either way."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest
from delivery_harness import WAIT_SECONDS, Harness, Subscriber

from pubsub_sidecar.v1 import sidecar_pb2
from sidecar.delivery.servicer import MAX_OUTSTANDING_LIMIT

_probe_keys = itertools.count()


async def _assert_still_serves(harness: Harness) -> None:
    """A fresh stream still gets a message and its ack confirmation."""
    subscriber = await harness.subscribe("orders")
    (stored,) = await harness.publish("orders", [(f"probe-{next(_probe_keys)}", 1)])
    (message,) = await subscriber.next_messages(1)
    assert message.dedup_id == stored.dedup_id
    await subscriber.ack([message.delivery_id])
    await subscriber.wait_confirmed([message.delivery_id])
    await subscriber.close()


async def test_first_request_must_be_open(harness: Harness) -> None:
    stream = harness.raw_stream()
    await stream.write(sidecar_pb2.SubscribeRequest(ack=sidecar_pb2.Ack(delivery_ids=["x"])))

    code, details = await stream.wait_end()

    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "first request must be open" in details
    await _assert_still_serves(harness)


async def test_second_open_ends_the_stream_with_invalid_argument(harness: Harness) -> None:
    subscriber = await harness.subscribe("orders")
    await subscriber.open("orders")

    code, details = await subscriber.wait_end()

    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "open may be sent only once" in details
    await _assert_still_serves(harness)


async def test_empty_subscription_name_is_invalid_argument_naming_the_choices(harness: Harness) -> None:
    subscriber = await harness.subscribe("")

    code, details = await subscriber.wait_end()

    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "open.subscription is required" in details and "orders" in details


async def test_unknown_subscription_is_not_found_naming_it(harness: Harness) -> None:
    subscriber = await harness.subscribe("invoices")

    code, details = await subscriber.wait_end()

    assert code is grpc.StatusCode.NOT_FOUND
    assert "'invoices'" in details and "orders" in details


@pytest.mark.parametrize("requested", [MAX_OUTSTANDING_LIMIT + 1, 2**31 - 1, -1])
async def test_out_of_range_max_outstanding_is_invalid_argument(harness: Harness, requested: int) -> None:
    subscriber = await harness.subscribe("orders", max_outstanding=requested)

    code, details = await subscriber.wait_end()

    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "max_outstanding_messages" in details and str(requested) in details
    await _assert_still_serves(harness)


async def test_ack_and_nack_of_unknown_ids_are_counted_and_ignored(harness: Harness) -> None:
    subscriber = await harness.subscribe("orders")
    await subscriber.ack(["never-sent", ""])
    await subscriber.nack(["also-never-sent"])
    await harness.publish("orders", [("k", 1)])
    (message,) = await subscriber.next_messages(1)

    await subscriber.ack([message.delivery_id, message.delivery_id])  # the repeat is unknown by now

    await subscriber.wait_confirmed([message.delivery_id])
    assert harness.server is not None
    assert harness.server.servicer.counters.unknown_ids == 4
    assert harness.runtimes["orders"].counters.unknown_ids == 4


async def test_ack_of_another_streams_delivery_is_ignored(harness: Harness) -> None:
    first = await harness.subscribe("orders")
    second = await harness.subscribe("orders")
    arrived = asyncio.Event()
    first.on_message = second.on_message = lambda _message: arrived.set()
    await harness.publish("orders", [("k", 1)])
    # Either open stream may get the message: the one that did owns it.
    await asyncio.wait_for(arrived.wait(), WAIT_SECONDS)
    owner, other = (first, second) if first.received else (second, first)
    (message,) = await owner.next_messages(1)

    await other.ack([message.delivery_id])
    await owner.ack([message.delivery_id])

    await owner.wait_confirmed([message.delivery_id])
    assert other.confirmed == []


async def test_negative_retry_after_is_invalid_argument(harness: Harness) -> None:
    subscriber = await harness.subscribe("orders")
    await harness.publish("orders", [("k", 1)])
    (message,) = await subscriber.next_messages(1)

    await subscriber.nack([message.delivery_id], retry_after_ms=-5)
    code, details = await subscriber.wait_end()

    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "retry_after" in details
    # The stream's message went back at once: the next stream gets it.
    again = await harness.subscribe("orders")
    (redelivered,) = await again.next_messages(1)
    assert redelivered.dedup_id == message.dedup_id


async def test_stream_that_closes_before_open_is_harmless(harness: Harness) -> None:
    stream: Subscriber = harness.raw_stream()
    await stream.call.done_writing()

    code, _ = await stream.wait_end()

    assert code is grpc.StatusCode.OK
    await _assert_still_serves(harness)
