"""One trace from checkout to payment (issue 31 item 3, DESIGN §12), every part a real process on the
emulators: a checkout app writes order 456 and its ``OrderCreated`` outbox entry, with the W3C
``traceparent`` of its checkout span, in one transaction; a relay-only sidecar publishes the entry
(the context travels as the message's ``traceparent``/``tracestate`` attributes); a subscriber-side
sidecar in sequence mode, tracing on and exporting over OTLP/gRPC to a receiver this test runs
(``bench.otlp_receiver``), delivers it to the payment worker.

The worker's ``OrderedMessage.traceparent`` is in the checkout's trace, and the sidecar's span of the
message is in that trace too, the child of the checkout span and linked to it. The relay records no
span of its own: it only carries the context (docs/publishing.md says why).

The harness is the order story's (``test_order_story_e2e.Story``: the processes, the config files).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.cloud import firestore

from bench.otlp_receiver import OtlpReceiver, ReceivedSpan
from pubsub_sidecar_client import Message

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))

import test_order_story_e2e
from e2e_app import App
from e2e_processes import SidecarProcess
from e2e_waits import async_wait_until
from test_order_story_e2e import Story, until

pytestmark = pytest.mark.e2e

CHECKOUT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
"""The trace the checkout app started (chosen by the test)."""
CHECKOUT_SPAN_ID = "00f067aa0ba902b7"
"""The checkout app's span that wrote the order and its entry."""
TRACEPARENT = f"00-{CHECKOUT_TRACE_ID}-{CHECKOUT_SPAN_ID}-01"
TRACESTATE = "checkout=web-7"

story = test_order_story_e2e.story
"""The order story's fixture: its emulators and processes, closed after the test."""


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    server = OtlpReceiver().start()
    try:
        yield server
    finally:
        server.stop()


def traced(process: SidecarProcess, receiver: OtlpReceiver) -> SidecarProcess:
    """``process`` with ``tracing: {enabled: true}``, exporting to ``receiver`` (standard ``OTEL_*``)."""
    body: dict[str, Any] = yaml.safe_load(process.config_path.read_text())
    body["tracing"] = {"enabled": True}
    process.config_path.write_text(yaml.safe_dump(body, sort_keys=False))
    process.env.update({**receiver.env(), "OTEL_BSP_SCHEDULE_DELAY": "200"})
    return process


async def checkout(db: firestore.AsyncClient, outbox: str, order_id: str) -> None:
    """The checkout app: order ``order_id`` PENDING and its event, with the checkout span's context,
    in ONE transaction."""

    @firestore.async_transactional
    async def create(transaction: Any) -> None:
        transaction.create(db.collection("orders").document(order_id), {"status": "PENDING", "amount": 4200})
        entry = {
            "key": order_id,
            "data": json.dumps({"type": "OrderCreated", "order_id": order_id}).encode(),
            "attributes": {"type": "OrderCreated"},
            "traceparent": TRACEPARENT,
            "tracestate": TRACESTATE,
        }
        transaction.set(db.collection(outbox).document(), entry)

    await create(db.transaction())


def span_of(receiver: OtlpReceiver, key: str, sequence: int) -> ReceivedSpan | None:
    for received in receiver.spans():
        if received.attributes.get("sidecar.key") == key and received.attributes.get("sidecar.sequence") == sequence:
            return received
    return None


async def test_the_payment_worker_continues_the_checkouts_trace(story: Story, receiver: OtlpReceiver) -> None:
    started = time.monotonic()
    subscriber = traced(story.subscriber_sidecar(), receiver)
    relay = story.relay_pod(0)
    for process in (subscriber, relay):
        process.start(wait_ready=False)
    for process in (subscriber, relay):
        await process.async_wait_ready()
    contexts: dict[tuple[str, int], dict[str, str]] = {}

    def pay(message: Message) -> str:
        contexts[(message.key, message.sequence)] = dict(message.trace_context)
        return "ack"

    story.app = App(f"unix://{story.workdir}/subscriber.sock", "payments", pay).start()

    await checkout(story.db, story.outbox, "456")
    story.written["456"] = ["OrderCreated"]
    await until("order 456's OrderCreated at the payment worker", story.delivered_in_order, seconds=60)
    story.check()
    await until("the outbox empty", story.outbox_empty, seconds=60)

    # The context travelled through the relay as the published message's attributes, unchanged.
    (seen,) = story.app.by_key()["456"]
    assert seen.attributes["traceparent"] == TRACEPARENT
    assert seen.attributes["tracestate"] == TRACESTATE

    # The sidecar's span of the message: in the checkout's trace, the checkout span's child, linked to it.
    await async_wait_until(lambda: span_of(receiver, "456", 1) is not None, "the sidecar's span of 456#1")
    received = span_of(receiver, "456", 1)
    assert received is not None
    span = received.span
    assert span.trace_id.hex() == CHECKOUT_TRACE_ID
    assert span.parent_span_id.hex() == CHECKOUT_SPAN_ID
    assert [(link.trace_id.hex(), link.span_id.hex()) for link in span.links] == [(CHECKOUT_TRACE_ID, CHECKOUT_SPAN_ID)]
    assert span.name == "process payments"
    assert received.attributes["sidecar.outcome"] == "acked"
    assert received.attributes["sidecar.key"] == "456"

    # The payment worker continues the same trace, under the sidecar's span, sampled as checkout said.
    traceparent = contexts[("456", 1)]["traceparent"]
    assert traceparent == f"00-{CHECKOUT_TRACE_ID}-{span.span_id.hex()}-01"
    assert subscriber.metric("pubsub_sidecar_trace_context_invalid_total", subscription="payments") == 0
    print(f"checkout -> relay -> sidecar -> payment in one trace, {time.monotonic() - started:.1f} s")
