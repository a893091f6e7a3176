"""DeadLetterPublisher against the Pub/Sub emulator: attributes, limits, failures, closing."""

from __future__ import annotations

import asyncio

import pytest
from pubsub_admin import PubSubAdmin, wait_until

from sidecar.dead_letters.publisher import DeadLetterPublisher, DeadLetterPublishError, NoDeadLetterTopic
from sidecar.engine.types import Message, Payload

pytestmark = pytest.mark.timeout(60)


def stored_message(key: str, data: bytes, attributes: dict[str, str], ordering_key: str = "") -> Message:
    return Message(
        key=key,
        dedup_id="d-1",
        message_id="m-1",
        known_fingerprint=b"f",
        stored_at_ms=1,
        sequence=7,
        payload=Payload(data=data, attributes=attributes, publish_time_ms=1, ordering_key=ordering_key),
    )


async def test_engine_message_is_published_with_original_data_and_sidecar_attributes(admin: PubSubAdmin) -> None:
    topic = await admin.create_topic("dl")
    collector = admin.collect(await admin.create_subscription("dl", topic))
    publisher = DeadLetterPublisher({"orders": topic})
    try:
        await publisher.publish(
            "orders",
            stored_message("order-9", b"\x00payload", {"order_id": "order-9", "seq": "7"}, ordering_key="ok"),
            "max_delivery_attempts",
            5,
        )
        await wait_until(lambda: len(collector.messages) == 1, "the dead letter")
    finally:
        await publisher.aclose()
    [letter] = collector.messages
    assert letter.data == b"\x00payload"
    assert letter.attributes == {
        "order_id": "order-9",
        "seq": "7",
        "sidecar_reason": "max_delivery_attempts",
        "sidecar_subscription": "orders",
        "sidecar_key": "order-9",
        "sidecar_delivery_attempts": "5",
        "sidecar_message_id": "m-1",
        "sidecar_ordering_key": "ok",
        "sidecar_sequence": "7",
    }
    assert (publisher.published, publisher.failures) == (1, 0)


async def test_attributes_named_like_publish_parameters_survive(admin: PubSubAdmin) -> None:
    topic = await admin.create_topic("dl")
    collector = admin.collect(await admin.create_subscription("dl", topic))
    publisher = DeadLetterPublisher({"orders": topic})
    original = {"timeout": "30", "data": "x", "topic": "t", "retry": "no", "ordering_key": "k"}
    try:
        await publisher.publish_raw(
            "orders", data=b"raw", attributes=original, reason="malformed: no key", message_id="m-2"
        )
        await wait_until(lambda: len(collector.messages) == 1, "the dead letter")
    finally:
        await publisher.aclose()
    [letter] = collector.messages
    assert letter.data == b"raw"
    assert {name: letter.attributes[name] for name in original} == original
    assert letter.attributes["sidecar_reason"] == "malformed: no key"


async def test_long_key_is_cut_to_the_attribute_limit_without_splitting_characters(admin: PubSubAdmin) -> None:
    topic = await admin.create_topic("dl")
    collector = admin.collect(await admin.create_subscription("dl", topic))
    publisher = DeadLetterPublisher({"orders": topic})
    key = "ключ/" * 400  # 4,000 bytes of UTF-8 with a slash: a key the sidecar accepts
    try:
        await publisher.publish("orders", stored_message(key, b"d", {}), "late", 1)
        await wait_until(lambda: len(collector.messages) == 1, "the dead letter")
    finally:
        await publisher.aclose()
    sidecar_key = collector.messages[0].attributes["sidecar_key"]
    assert len(sidecar_key.encode()) <= 1024
    assert key.startswith(sidecar_key) and len(sidecar_key.encode()) > 1000


async def test_publish_without_a_topic_raises_no_dead_letter_topic(admin: PubSubAdmin) -> None:
    publisher = DeadLetterPublisher({"prices": None})
    try:
        with pytest.raises(NoDeadLetterTopic, match="'prices' has no dead_letter_topic"):
            await publisher.publish("prices", stored_message("k", b"d", {}), "late", 1)
        with pytest.raises(NoDeadLetterTopic, match="'unknown'"):
            await publisher.publish_raw("unknown", data=b"", attributes={}, reason="r", message_id="m")
    finally:
        await publisher.aclose()


async def test_failed_publish_raises_promptly_so_the_caller_can_retry(admin: PubSubAdmin) -> None:
    topic = await admin.create_topic("dl")
    publisher = DeadLetterPublisher({"orders": topic})
    try:
        await admin.add_fault(method="Publish", code="UNAVAILABLE", rate=1.0)
        # No 10-minute client retry loop: the failure surfaces within seconds.
        with pytest.raises(DeadLetterPublishError, match="ServiceUnavailable"):
            await asyncio.wait_for(publisher.publish("orders", stored_message("k", b"d", {}), "late", 1), 10)
        assert publisher.failures == 1
    finally:
        await admin.clear_faults()
        await publisher.aclose()


async def test_close_is_idempotent_and_publishing_after_close_fails_clearly(admin: PubSubAdmin) -> None:
    topic = await admin.create_topic("dl")
    publisher = DeadLetterPublisher({"orders": topic})
    await publisher.aclose()
    await publisher.aclose()
    with pytest.raises(DeadLetterPublishError, match="closed"):
        await publisher.publish("orders", stored_message("k", b"d", {}), "late", 1)
