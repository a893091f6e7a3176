"""The relay against the project's Firestore and Pub/Sub emulators, with Google's own clients: an app
writes orders and their outbox entries in transactions, two relays (two pods) publish them, a
subscriber pulls. Every event once per number, numbers 1..n per order in commit order, the outbox
empty; a failing Publish only delays; an unpublishable entry blocks its key only; a topic this
process cannot publish to refuses the relay at start."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from google.cloud import firestore, pubsub_v1

from sidecar.config.relays import RelayConfig
from sidecar.emulators.faults import FaultRule
from sidecar.emulators.stack import EmulatorStack
from sidecar.publishing.publisher import PubsubPublisher
from sidecar.publishing.relay import Relay, RelayRefused
from sidecar.store.firestore import FirestoreDocuments

_DEADLINE_SECONDS = 60.0


def relay_config(topic: str, **overrides: Any) -> RelayConfig:
    return RelayConfig.model_validate(
        {
            "name": "orders-out",
            "outbox": {"collection": "outbox"},
            "topic": topic,
            "key_attribute": "order_id",
            "sequence": {"attribute": "seq"},
            "shards": 4,
            "lease_duration": "1s",
            **overrides,
        }
    )


def make_topic(project: str) -> tuple[str, str]:
    topic = f"projects/{project}/topics/orders"
    subscription = f"projects/{project}/subscriptions/orders"
    publisher = pubsub_v1.PublisherClient()
    publisher.create_topic(name=topic)
    subscriber = pubsub_v1.SubscriberClient()
    subscriber.create_subscription(name=subscription, topic=topic)
    publisher.transport.close()  # type: ignore[no-untyped-call]
    subscriber.close()
    return topic, subscription


class Received:
    """What the subscription got: (key, seq) -> the message's (data, attributes), and every copy."""

    def __init__(self, subscription: str) -> None:
        self._subscription = subscription
        self._client = pubsub_v1.SubscriberClient()
        self.copies: list[tuple[str, int, bytes, dict[str, str]]] = []

    def pull(self) -> None:
        answer = self._client.pull(
            request={"subscription": self._subscription, "max_messages": 500}, timeout=5, retry=None
        )
        ack_ids = []
        for received in answer.received_messages:
            m = received.message
            attributes = dict(m.attributes)
            self.copies.append((attributes["order_id"], int(attributes["seq"]), bytes(m.data), attributes))
            ack_ids.append(received.ack_id)
        if ack_ids:
            self._client.acknowledge(request={"subscription": self._subscription, "ack_ids": ack_ids})

    def by_number(self) -> dict[tuple[str, int], bytes]:
        found: dict[tuple[str, int], bytes] = {}
        for key, seq, data, _ in self.copies:
            assert found.setdefault((key, seq), data) == data, f"{key} #{seq}: two different messages"
        return found

    def close(self) -> None:
        self._client.close()


async def until(what: str, check: Callable[[], Awaitable[bool]], state: Callable[[], object] = str) -> None:
    """Poll ``check`` until true; past the deadline, fail with ``state()`` (what the relays say)."""
    deadline = time.monotonic() + _DEADLINE_SECONDS
    while not await check():
        assert time.monotonic() < deadline, f"not within {_DEADLINE_SECONDS}s: {what}; {state()}"
        await asyncio.sleep(0.05)


def relay_state(pods: Pods, received: Received | None = None) -> dict[str, object]:
    """The relays' counters, shards and views and the distinct events received: a timeout's context."""
    state: dict[str, object] = {
        f"relay {n}": {**r.counts(), "snapshots": r.snapshots, "waiting": [w.reason for w in r.waiting()]}
        for n, r in enumerate(pods.relays)
    }
    if received is not None:
        state["received"] = sorted(received.by_number())
    return state


@contextlib.asynccontextmanager
async def running(relays: list[Relay]) -> AsyncIterator[None]:
    tasks = [asyncio.ensure_future(r.run()) for r in relays]
    try:
        yield
    finally:
        for relay, task in zip(relays, tasks, strict=True):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            await relay.close_workers()


class Pods:
    """Relay pods on one project: each its own Firestore client and publisher, as processes have."""

    def __init__(self, project: str, config: RelayConfig) -> None:
        self._project = project
        self._config = config
        self.relays: list[Relay] = []
        self._closers: list[Callable[[], Awaitable[None]]] = []

    def add(self, name: str) -> Relay:
        documents = FirestoreDocuments(self._project)
        publisher = PubsubPublisher()
        relay = Relay(
            self._config, project=self._project, root="sidecar", documents=documents, publisher=publisher, pod_id=name
        )
        self._closers += [documents.close, publisher.aclose]
        self.relays.append(relay)
        return relay

    async def close(self) -> None:
        for close in self._closers:
            await close()


async def write_order_events(db: firestore.AsyncClient, order_id: str, events: list[str]) -> None:
    """Each event in its own transaction with the order's business change, as a checkout app does."""
    for event in events:
        transaction = db.transaction()

        @firestore.async_transactional
        async def change(transaction: Any, event: str = event) -> None:
            order = db.collection("orders").document(order_id)
            transaction.set(order, {"status": "CANCELLED" if event == "OrderCancelled" else "PENDING"})
            transaction.set(
                db.collection("outbox").document(),
                {"key": order_id, "data": f"{order_id}:{event}".encode(), "attributes": {"type": event}},
            )

        await change(transaction)


async def outbox_empty(db: firestore.AsyncClient) -> bool:
    return not [d async for d in db.collection("outbox").stream()]


@pytest.mark.asyncio
async def test_two_pods_publish_every_event_once_per_number_in_commit_order(project: str) -> None:
    topic, subscription = make_topic(project)
    pods = Pods(project, relay_config(topic))
    pods.add("pod-a")
    pods.add("pod-b")
    db = firestore.AsyncClient(project=project)
    received = Received(subscription)
    events = ["OrderCreated", "OrderPaid", "OrderCancelled"]
    orders = [f"order-{n}" for n in range(12)]
    try:
        async with running(pods.relays):
            await asyncio.gather(*(write_order_events(db, order, events) for order in orders))

            async def all_received() -> bool:
                await asyncio.get_running_loop().run_in_executor(None, received.pull)
                return len(received.by_number()) == len(orders) * len(events)

            await until("every event published", all_received, lambda: relay_state(pods, received))
            await until("the outbox empty", lambda: outbox_empty(db), lambda: relay_state(pods))
        found = received.by_number()
        for order in orders:
            assert [found[(order, n)] for n in (1, 2, 3)] == [f"{order}:{e}".encode() for e in events]
        assert sum(r.counts()["relay_published"] for r in pods.relays) >= len(found)
    finally:
        received.close()
        await pods.close()


@pytest.mark.asyncio
async def test_a_failing_publish_delays_and_never_reorders(project: str, stack: EmulatorStack) -> None:
    topic, subscription = make_topic(project)
    pods = Pods(project, relay_config(topic, shards=1))
    relay = pods.add("pod-a")
    db = firestore.AsyncClient(project=project)
    received = Received(subscription)
    stack.injector.add(FaultRule("pubsub", "Publish", grpc.StatusCode.UNAVAILABLE, remaining=6))
    try:
        async with running(pods.relays):
            await asyncio.gather(*(write_order_events(db, f"o{n}", ["A", "B", "C"]) for n in range(4)))

            async def all_received() -> bool:
                await asyncio.get_running_loop().run_in_executor(None, received.pull)
                return len(received.by_number()) == 12

            await until("every event published after the faults", all_received, lambda: relay_state(pods, received))
        found = received.by_number()
        for n in range(4):
            assert [found[(f"o{n}", s)] for s in (1, 2, 3)] == [f"o{n}:{e}".encode() for e in "ABC"]
        assert relay.counts()["relay_publish_failures"] > 0
    finally:
        received.close()
        await pods.close()


@pytest.mark.asyncio
async def test_an_unpublishable_entry_blocks_its_key_only(project: str) -> None:
    topic, subscription = make_topic(project)
    pods = Pods(project, relay_config(topic, shards=2))
    relay = pods.add("pod-a")
    db = firestore.AsyncClient(project=project)
    received = Received(subscription)
    try:
        async with running(pods.relays):
            await write_order_events(db, "good", ["A"])
            await db.collection("outbox").document().set({"key": "bad", "data": b"x", "attributes": {"seq": "7"}})
            await db.collection("outbox").document().set({"key": 456, "data": b"x"})
            await write_order_events(db, "bad", ["B"])
            await write_order_events(db, "good", ["C"])

            async def good_received() -> bool:
                await asyncio.get_running_loop().run_in_executor(None, received.pull)
                return len(received.by_number()) == 2

            await until("the good key's events published", good_received, lambda: relay_state(pods, received))
            reasons = {str(w.key): w.reason for w in relay.waiting()}
            assert set(reasons) == {"bad", "None"}
            assert "set by the relay" in reasons["bad"]
            assert "int, not a string" in reasons["None"]
            assert relay.counts()["relay_blocked_keys"] == 1
        assert sorted(received.by_number()) == [("good", 1), ("good", 2)]
    finally:
        received.close()
        await pods.close()


@pytest.mark.asyncio
async def test_a_topic_that_takes_no_publishes_refuses_the_relay(project: str, stack: EmulatorStack) -> None:
    pods = Pods(project, relay_config(f"projects/{project}/topics/missing"))
    relay = pods.add("pod-a")
    try:
        with pytest.raises(RelayRefused, match="does not exist"):
            await relay.check()
        topic, _ = make_topic(project)
        denied = Pods(project, relay_config(topic)).add("pod-b")
        await denied.check()  # the topic exists and the emulator grants publishing
        stack.injector.add(FaultRule("pubsub", "TestIamPermissions", grpc.StatusCode.PERMISSION_DENIED))
        with pytest.raises(RelayRefused, match="PermissionDenied"):
            await denied.check()
    finally:
        await pods.close()
