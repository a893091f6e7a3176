"""End to end with awkward input: malformed messages, odd keys, a 3 MB message, an app that holds one key.

Malformed messages go to the dead-letter topic with ``sidecar_reason`` (and are acked, so they do not
come back); keys are hashed into document ids, so any text works; a message larger than a Firestore
document is split across documents and arrives intact.
"""

from __future__ import annotations

import hashlib
import os

import pytest
from conftest import Scenario
from e2e_config import order_message
from e2e_waits import async_wait_until

pytestmark = pytest.mark.e2e

ODD_KEYS = (
    "tenant/a/order/1",  # '/' would be a path separator in a raw document id
    "заказ-注文-🔑",
    "é" * 512,  # 1024 bytes of text: Pub/Sub's limit on an attribute value
    "__reserved__",
)
"""Pub/Sub caps attribute values at 1024 bytes, so that is the longest key an attribute can carry."""

BIG_BYTES = 3 * 1024 * 1024


async def test_malformed_messages_are_dead_lettered_with_a_reason_and_odd_keys_and_big_messages_work(
    scenario: Scenario,
) -> None:
    sub = scenario.add_subscription("orders")
    sidecar = await scenario.start_sidecar()
    # The app never acks key "stuck": that blocks only its own key.
    app = scenario.app(sub, lambda message: "hold" if message.key == "stuck" else "ack")
    malformed = {
        "no key": (b"no key", {"seq": "1"}),
        "no sequence": (b"no sequence", {"order_id": "m"}),
        "negative": order_message("m", "-5"),
        "exponent": order_message("m", "1e3"),
        "too large": order_message("m", "99999999999999999999"),
        "fraction": order_message("m", "1.5"),
    }
    big = os.urandom(BIG_BYTES)
    for data, attributes in malformed.values():
        await scenario.pubsub.publish(sub.topic, data, **attributes)
    for seq in (2, 1):
        for key in (*ODD_KEYS, "stuck"):
            data, attributes = order_message(key, seq)
            await scenario.pubsub.publish(sub.topic, data, **attributes)
    await scenario.pubsub.publish(sub.topic, big, order_id="big", seq="1")

    assert sub.dead_letter_subscription is not None
    dead = await scenario.pubsub.pull_until(sub.dead_letter_subscription, len(malformed), "the malformed messages")
    assert sorted(d.data for d in dead) == sorted(data for data, _ in malformed.values())
    for letter in dead:
        assert letter.attributes["sidecar_reason"], letter
        assert letter.attributes["sidecar_subscription"] == sub.name
    reasons = {letter.data: letter.attributes["sidecar_reason"] for letter in dead}
    assert "order_id" in reasons[b"no key"]
    assert "seq" in reasons[malformed["exponent"][0]]

    await async_wait_until(
        lambda: (
            all(len([s for s in app.seen if s.key == key]) == 2 for key in ODD_KEYS)
            and any(s.key == "big" for s in app.seen)
        ),
        "the odd keys and the big message",
    )
    for key in ODD_KEYS:
        assert [(s.sequence, s.data) for s in app.seen if s.key == key] == [
            (1, f"{key}#1".encode()),
            (2, f"{key}#2".encode()),
        ]
    [received_big] = [s for s in app.seen if s.key == "big"]
    assert len(received_big.data) == BIG_BYTES
    assert hashlib.sha256(received_big.data).digest() == hashlib.sha256(big).digest()

    # The held key got its first message only; every other key went on.
    assert [s.sequence for s in app.seen if s.key == "stuck"] == [1]
    assert sidecar.metric("pubsub_sidecar_malformed_total", subscription=sub.name) >= len(malformed)
    assert not {s.key for s in app.seen} & {"", "m"}
