"""Pub/Sub with the official clients: topics, subscriptions, the publisher of every scenario, and
the baseline subscriber.

Rules this module keeps:
- It is the only module of the scenario run (``python -m bench``) that imports
  ``google.cloud.pubsub_v1``: the official publisher for every scenario, and the official subscriber
  with a no-op callback as the baseline (run as its own process by ``bench.baseline_process``, so
  that its CPU time is measured apart). ``bench/emulator_pubsub.py``, the emulator's own benchmark,
  is a separate program.
- The clients read ``PUBSUB_EMULATOR_HOST`` at construction: it is set just for that, never in the
  bench's own environment.
- A publisher retry is the same message (data and attributes) with a new message_id: the sidecar
  treats the same key and sequence with other content as a conflict.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from google.cloud import pubsub_v1

from bench.harness import PROJECT, BenchError, child_env


@contextmanager
def _emulator_env(env: Mapping[str, str]) -> Iterator[None]:
    """The official clients read ``PUBSUB_EMULATOR_HOST`` at construction: set it just for that."""
    with mock.patch.dict(os.environ, dict(env)):
        yield


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message to publish: its key, sequence and any extra attributes."""

    key: str
    sequence: int
    phase: str


TIMESTAMP_ATTRIBUTE = "bench_ts"
"""Wall-clock publish instant (seconds since the epoch), read by the app for publish-to-app latency."""


def message_attributes(message: Outgoing) -> dict[str, str]:
    return {
        "order_id": message.key,
        "seq": str(message.sequence),
        # Dedup id for dedup-only mode: a publisher retry has the same one, a new message_id.
        "event_id": f"{message.key}:{message.sequence}",
        "phase": message.phase,
    }


class PubSub:
    """Topics, subscriptions and publishing on the emulator; the baseline subscriber runs apart."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = dict(env)
        with _emulator_env(env):
            self.publisher = pubsub_v1.PublisherClient()
            self.subscriber = pubsub_v1.SubscriberClient()

    def close(self) -> None:
        self.publisher.stop()
        self.subscriber.close()

    def create(self, name: str) -> str:
        """A topic and its subscription, both called ``name``; returns the subscription path."""
        topic = f"projects/{PROJECT}/topics/{name}"
        subscription = f"projects/{PROJECT}/subscriptions/{name}"
        self.publisher.create_topic(name=topic)
        self.subscriber.create_subscription(name=subscription, topic=topic, ack_deadline_seconds=60)
        return subscription

    def publish(
        self,
        subscription: str,
        messages: Sequence[Outgoing],
        rate_per_second: float | None = None,
        data_bytes: int = 0,
    ) -> float:
        """Publish in order (the client batches), paced at ``rate_per_second`` if given; returns
        the wall-clock instant of the first publish once every message is accepted."""
        topic = subscription.replace("/subscriptions/", "/topics/")
        futures = []
        # A retry must be the same message (data and attributes) with a new message_id: the
        # sidecar treats the same key and sequence with other content as a conflict.
        first_published: dict[Outgoing, str] = {}
        started = time.time()
        start_mono = time.monotonic()
        for index, message in enumerate(messages):
            if rate_per_second:
                # Open-loop pacing: a late loop catches up instead of drifting.
                delay = start_mono + index / rate_per_second - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            attributes = message_attributes(message)
            attributes[TIMESTAMP_ATTRIBUTE] = first_published.setdefault(message, repr(time.time()))
            data = f"{message.key}#{message.sequence}".encode()
            if len(data) < data_bytes:
                data += b"." * (data_bytes - len(data))
            futures.append(self.publisher.publish(topic, data, **attributes))
        for future in futures:
            future.result(timeout=300)
        return started

    def start_baseline(self, subscription: str) -> tuple[BaselineResult, Callable[[int, float], None]]:
        """Start the baseline subscriber (``bench.baseline_process``, a process of its own, so that its
        CPU time is its own) now; returns its result and ``wait(expected, timeout)``."""
        result = BaselineResult()
        changed = threading.Condition()
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.baseline_process", subscription],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(self._env),
        )
        result.pid = proc.pid
        final: dict[str, Any] = {}

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                report = json.loads(line)
                with changed:
                    result.received, result.last_at = int(report["received"]), float(report["last_at"])
                    if report.get("final"):
                        final.update(report)
                    changed.notify_all()

        reader = threading.Thread(target=pump, name="baseline-reader", daemon=True)
        reader.start()

        def wait(expected: int, timeout: float) -> None:
            with changed:
                ok = changed.wait_for(lambda: result.received >= expected or proc.poll() is not None, timeout)
            if not ok or result.received < expected:
                stop()
                raise BenchError(f"baseline subscriber got {result.received} of {expected} in {timeout:.0f}s")

        def stop() -> None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reader.join(timeout=5)
            result.latencies = [float(x) for x in final.get("latencies", [])]
            if proc.returncode != 0:
                error = proc.stderr.read() if proc.stderr is not None else ""
                raise BenchError(f"baseline subscriber exited with {proc.returncode}: {error[-2000:]}")

        result.stop = stop
        return result, wait


def subscriber_client() -> Any:
    """The official subscriber client (the emulator's from ``PUBSUB_EMULATOR_HOST``): the bench's
    one importer of google-cloud-pubsub hands it to ``bench.baseline_process``."""
    return pubsub_v1.SubscriberClient()


@dataclass
class BaselineResult:
    received: int = 0
    last_at: float = 0.0
    pid: int = 0
    """The baseline subscriber's process (its CPU time is read from ``/proc``)."""
    latencies: list[float] = field(default_factory=list)
    stop: Callable[[], None] = field(default=lambda: None, repr=False)
