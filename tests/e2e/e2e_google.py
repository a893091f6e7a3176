"""Google's official clients against the emulators: Pub/Sub topics, subscriptions, publishing and
pulling (``PubSub``), and every Firestore document dumped for a failed run (``dump_firestore``).

Rules: a client reads ``*_EMULATOR_HOST`` when it is built, so clients are built inside
``emulator_env``, which sets the variables only for that and one thread at a time. Blocking client
calls run in threads, and waits on them poll with deadlines (``e2e_waits``).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from e2e_config import PROJECT
from e2e_waits import WAIT_SECONDS, async_wait_until_threaded
from google.api_core import exceptions as api_exceptions
from google.cloud import pubsub_v1


def dump_firestore(env: Mapping[str, str], path: Path) -> None:
    """Every document of the emulated Firestore, as JSON lines (``path``, fields): a failed run's state."""
    from google.cloud import firestore  # only for this diagnostic, so the suite does not load it

    with emulator_env(env):
        client = firestore.Client(project=PROJECT)
    with path.open("w", encoding="utf-8") as out:

        def walk(collections: Any) -> None:
            for collection in collections:
                for snapshot in collection.stream():
                    record = {"path": snapshot.reference.path, **(snapshot.to_dict() or {})}
                    out.write(json.dumps(record, default=repr) + "\n")
                    walk(snapshot.reference.collections())

        walk(client.collections())
    client.close()  # type: ignore[no-untyped-call]


_ENV_LOCK = threading.Lock()


@contextmanager
def emulator_env(env: Mapping[str, str]) -> Iterator[None]:
    """The official clients read ``PUBSUB_EMULATOR_HOST`` at construction: set it just for that.

    Serialised: ``patch.dict`` restores the environment it saw on entry, so two threads patching at
    once would leave the variable set for good (and later suites would take it for an external
    emulator)."""
    with _ENV_LOCK, mock.patch.dict(os.environ, dict(env)):
        yield


@dataclass(frozen=True, slots=True)
class Pulled:
    data: bytes
    attributes: dict[str, str]
    message_id: str


class PubSub:
    """Topics, subscriptions, publishing and pulling on the emulator, with the official clients."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = dict(env)
        with emulator_env(env):
            self.publisher = pubsub_v1.PublisherClient()
            self.subscriber = pubsub_v1.SubscriberClient()
        self._ordered_publisher: Any = None

    def close(self) -> None:
        self.publisher.stop()
        if self._ordered_publisher is not None:
            self._ordered_publisher.stop()
        self.subscriber.close()

    @property
    def ordered_publisher(self) -> Any:
        """A publisher with message ordering enabled (needed to publish with ordering keys), made on
        first use: ``emulator_env`` patches the process environment, so no more clients are built
        in ``__init__`` than every test needs (tests build ``PubSub`` objects in parallel threads)."""
        if self._ordered_publisher is None:
            with emulator_env(self._env):
                self._ordered_publisher = pubsub_v1.PublisherClient(
                    publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True)
                )
        return self._ordered_publisher

    def topic(self, prefix: str) -> str:
        path = f"projects/{PROJECT}/topics/{prefix}-{uuid.uuid4().hex[:8]}"
        self.publisher.create_topic(name=path)
        return path

    def subscription(self, topic: str, ack_deadline_seconds: int = 10, enable_message_ordering: bool = False) -> str:
        path = topic.replace("/topics/", "/subscriptions/")
        self.subscriber.create_subscription(
            request={
                "name": path,
                "topic": topic,
                "ack_deadline_seconds": ack_deadline_seconds,
                "enable_message_ordering": enable_message_ordering,
            }
        )
        return path

    async def publish(self, topic: str, data: bytes, **attributes: str) -> str:
        """Publish one message; returns its message id once the emulator accepted it."""
        return await asyncio.wrap_future(self.publisher.publish(topic, data, **attributes))

    async def publish_all(self, topic: str, messages: list[tuple[bytes, dict[str, str]]]) -> list[str]:
        """Publish in the given order (the client batches them); returns the message ids."""
        futures = [self.publisher.publish(topic, data, **attrs) for data, attrs in messages]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    async def publish_ordered(self, topic: str, messages: list[tuple[str, bytes, dict[str, str]]]) -> list[str]:
        """Publish (ordering key, data, attributes) in the given order with the ordering publisher."""
        publish = self.ordered_publisher.publish
        futures = [publish(topic, data, ordering_key=key, **attrs) for key, data, attrs in messages]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def pull_available(self, subscription: str) -> list[Pulled]:
        """One unary Pull of what is there, acked (a dead-letter topic's subscription)."""
        try:
            # Pull waits for messages up to its deadline: a short one keeps the polling loop lively.
            response = self.subscriber.pull(subscription=subscription, max_messages=100, retry=None, timeout=2.0)
        except api_exceptions.DeadlineExceeded:
            return []
        if response.received_messages:
            self.subscriber.acknowledge(
                subscription=subscription, ack_ids=[m.ack_id for m in response.received_messages]
            )
        return [
            Pulled(m.message.data, dict(m.message.attributes), m.message.message_id) for m in response.received_messages
        ]

    async def pull_until(
        self, subscription: str, count: int, what: str, within_seconds: float = WAIT_SECONDS
    ) -> list[Pulled]:
        """Pull until at least ``count`` messages arrived (from a thread; the loop keeps running)."""
        pulled: list[Pulled] = []

        def enough() -> bool:
            pulled.extend(self.pull_available(subscription))
            return len(pulled) >= count

        await async_wait_until_threaded(enough, what, within_seconds)
        return pulled
