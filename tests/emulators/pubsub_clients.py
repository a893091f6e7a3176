"""Helpers for the Pub/Sub conformance tests: a recording callback, a subscribe() block, a raw stream.

Named ``pubsub_clients`` (test directories have no ``__init__.py``, so helper modules share one
namespace across the test tree).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from google.cloud import pubsub_v1
from google.pubsub_v1 import types


@dataclass
class PrivateEmulators:
    """Emulators of one test module alone (for tests that move the emulator's clock), with their clients.

    ``emulators`` is the conftest's ``Emulators`` (addresses, project, admin API)."""

    emulators: Any
    publisher: Any
    subscriber: Any


class Inbox:
    """Thread-safe record of what a subscriber callback saw; ``should_ack`` decides ack or nack."""

    def __init__(self, should_ack: Callable[[Any], bool] = lambda message: True) -> None:
        self._should_ack = should_ack
        self._cond = threading.Condition()
        self.messages: list[Any] = []
        self.arrived_at: list[float] = []
        self.decisions: list[bool] = []

    def __call__(self, message: Any) -> None:
        ack = self._should_ack(message)
        with self._cond:
            self.messages.append(message)
            self.arrived_at.append(time.monotonic())
            self.decisions.append(ack)
            self._cond.notify_all()
        if ack:
            message.ack()
        else:
            message.nack()

    def wait_for(self, predicate: Callable[[list[Any]], bool], timeout: float, what: str) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.messages), timeout):
                pytest.fail(f"timed out after {timeout} s waiting for {what}; got {len(self.messages)} messages")

    def data(self) -> list[bytes]:
        with self._cond:
            return [m.data for m in self.messages]


@contextmanager
def subscribed(subscriber: Any, subscription: str, inbox: Inbox, **flow: Any) -> Iterator[Any]:
    """Run ``subscriber.subscribe`` for the block; stop it and wait for its threads afterwards."""
    future = subscriber.subscribe(subscription, inbox, flow_control=pubsub_v1.types.FlowControl(**flow) if flow else ())
    try:
        yield future
    finally:
        future.cancel()
        future.result(timeout=30)


class Requests:
    """A StreamingPull request iterator the test feeds; ``close()`` half-closes the stream."""

    def __init__(self, first: types.StreamingPullRequest) -> None:
        self._queue: queue.Queue[types.StreamingPullRequest | None] = queue.Queue()
        self._queue.put(first)

    def send(self, request: types.StreamingPullRequest) -> None:
        self._queue.put(request)

    def close(self) -> None:
        self._queue.put(None)

    def __iter__(self) -> Iterator[types.StreamingPullRequest]:
        while (request := self._queue.get()) is not None:
            yield request


def first_request(subscription: str, **fields: Any) -> types.StreamingPullRequest:
    return types.StreamingPullRequest(**{"subscription": subscription, "stream_ack_deadline_seconds": 60, **fields})


@contextmanager
def raw_stream(subscriber: Any, subscription: str, **fields: Any) -> Iterator[tuple[Requests, Iterator[Any]]]:
    """A StreamingPull through the official client's GAPIC call: (requests to feed, responses)."""
    requests = Requests(first_request(subscription, **fields))
    responses = subscriber.streaming_pull(requests=iter(requests))
    try:
        yield requests, responses
    finally:
        requests.close()
        responses.cancel()


def publish_all(publisher: Any, topic: str, payloads: list[bytes], **attributes: str) -> list[str]:
    """Publish and wait for every message id."""
    return [future.result(timeout=30) for future in [publisher.publish(topic, d, **attributes) for d in payloads]]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
