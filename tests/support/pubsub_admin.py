"""Pub/Sub emulator helpers for the ingest tests: topics, subscriptions, publishing, collectors, faults.

Uses the official clients (made while PUBSUB_EMULATOR_HOST points at the test's emulator stack).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.cloud import pubsub_v1

from sidecar.emulators.stack import EmulatorStack

WAIT_SECONDS = 20.0
"""Generous: other engineers' suites share the 2 cores."""

PROJECT = "ingest-tests"


async def wait_until(predicate: Callable[[], bool], what: str, within_seconds: float = WAIT_SECONDS) -> None:
    """Poll with a deadline, for state with no event a test could wait on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_seconds
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within_seconds}s waiting for {what}")
        await asyncio.sleep(0.02)


def block_loop_until(predicate: Callable[[], bool], what: str, within_seconds: float = WAIT_SECONDS) -> None:
    """Keep the event loop's thread busy on purpose, polling with a deadline, until ``predicate``
    holds: what the client's threads hand over meanwhile waits for one wake-up of the loop, so a
    batch is certain rather than likely on a busy machine."""
    deadline = time.monotonic() + within_seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_seconds}s waiting for {what}")
        time.sleep(0.005)


@dataclass(frozen=True, slots=True)
class Received:
    data: bytes
    attributes: dict[str, str]
    message_id: str
    ordering_key: str = ""


class Collector:
    """A plain official subscriber that records (and acks) everything it receives."""

    def __init__(self, client: pubsub_v1.SubscriberClient, subscription: str) -> None:
        self._lock = threading.Lock()
        self._messages: list[Received] = []
        self._future = client.subscribe(subscription, callback=self._on_message)

    def _on_message(self, message: Any) -> None:
        with self._lock:
            self._messages.append(Received(message.data, dict(message.attributes), message.message_id))
        message.ack()

    @property
    def messages(self) -> list[Received]:
        with self._lock:
            return list(self._messages)

    async def stop(self) -> None:
        self._future.cancel()
        # The client's future reports itself cancelled after cancel(): wait, do not await.
        await asyncio.wait({asyncio.wrap_future(self._future)}, timeout=WAIT_SECONDS)


class PubSubAdmin:
    """Topics, subscriptions, publishing and fault switches on the emulator, for one test."""

    def __init__(self, stack: EmulatorStack, prefix: str) -> None:
        self.stack = stack
        self.prefix = prefix
        self.publisher = pubsub_v1.PublisherClient()
        self.subscriber = pubsub_v1.SubscriberClient()
        self._collectors: list[Collector] = []

    def topic_path(self, name: str) -> str:
        return f"projects/{PROJECT}/topics/{self.prefix}-{name}"

    def subscription_path(self, name: str) -> str:
        return f"projects/{PROJECT}/subscriptions/{self.prefix}-{name}"

    async def create_topic(self, name: str) -> str:
        path = self.topic_path(name)
        await asyncio.to_thread(self.publisher.create_topic, name=path)
        return path

    async def create_subscription(self, name: str, topic: str, ack_deadline_seconds: int = 10) -> str:
        path = self.subscription_path(name)
        await asyncio.to_thread(
            self.subscriber.create_subscription,
            name=path,
            topic=topic,
            ack_deadline_seconds=ack_deadline_seconds,
        )
        return path

    async def publish(self, topic: str, data: bytes, **attributes: str) -> str:
        return await asyncio.wrap_future(self.publisher.publish(topic, data, **attributes))

    async def pull_available(self, subscription: str) -> list[Received]:
        """What a unary Pull gets right now (leases it for 10 s): messages neither acked nor leased."""

        def pull() -> Any:
            # return_immediately is deprecated for production, but it is exactly the question here.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return self.subscriber.pull(subscription=subscription, max_messages=100, return_immediately=True)

        response = await asyncio.to_thread(pull)
        return [
            Received(r.message.data, dict(r.message.attributes), r.message.message_id, r.message.ordering_key)
            for r in response.received_messages
        ]

    def collect(self, subscription: str) -> Collector:
        collector = Collector(self.subscriber, subscription)
        self._collectors.append(collector)
        return collector

    async def add_fault(self, **rule: Any) -> None:
        await asyncio.to_thread(self._post, "/faults", {"service": "pubsub", **rule})

    async def break_streams(self, code: str = "UNAVAILABLE") -> None:
        await asyncio.to_thread(self._post, "/streams/break", {"service": "pubsub", "code": code})

    async def clear_faults(self) -> None:
        await asyncio.to_thread(self._request, "DELETE", "/faults", None)

    async def report(self, what: str, subscription: str) -> Any:
        """The emulator's ``/pubsub/<what>`` report (streams, leases, unacked) of ``subscription``."""
        query = urllib.parse.urlencode({"subscription": subscription})
        return await asyncio.to_thread(self._get_json, f"/pubsub/{what}?{query}")

    async def counters(self) -> dict[str, int]:
        """Acknowledge and ModifyAckDeadline traffic since the last ``reset_counters``."""
        counters: dict[str, int] = await asyncio.to_thread(self._get_json, "/pubsub/counters")
        return counters

    async def reset_counters(self) -> None:
        await asyncio.to_thread(self._post, "/pubsub/counters/reset", {})

    def _get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.stack.admin_url + path, timeout=10) as response:
            return json.loads(response.read())

    def _post(self, path: str, body: dict[str, Any]) -> None:
        self._request("POST", path, body)

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> None:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.stack.admin_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    async def close(self) -> None:
        await self.clear_faults()
        for collector in self._collectors:
            await collector.stop()
        self.publisher.stop()
        self.publisher.transport.close()
        self.subscriber.close()
