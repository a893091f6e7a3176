"""Benchmark: publish and streaming-pull N messages through the Pub/Sub emulator with the official clients.

Starts ``pubsub-sidecar emulators`` as a subprocess (so the emulator does not share this process's
GIL with the clients, as in real use), publishes N messages with the publisher's batching while a
``subscribe()`` streaming pull acks them, and prints messages/s for the whole round trip (first
publish to last message received). Usage::

    python -m bench.emulator_pubsub [--messages 50000] [--size 100]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from google.cloud import pubsub_v1

_REPO = Path(__file__).resolve().parent.parent
_PROJECT = "bench"


def _start_emulators() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "emulators", "--pubsub-port", "0", "--firestore-port", "0",
         "--monitoring-port", "0", "--admin-port", "0"],
        cwd=_REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("export PUBSUB_EMULATOR_HOST="):
            return proc, line.strip().partition("=")[2]
    raise RuntimeError(f"emulators exited with {proc.wait()} before printing their address")


def run(messages: int, size: int) -> float:
    """Publish and receive ``messages`` messages of ``size`` bytes; returns messages per second."""
    publisher = pubsub_v1.PublisherClient()
    subscriber = pubsub_v1.SubscriberClient()
    topic = publisher.create_topic(name=publisher.topic_path(_PROJECT, "bench")).name
    subscription = subscriber.create_subscription(
        name=subscriber.subscription_path(_PROJECT, "bench"), topic=topic
    ).name
    done = threading.Event()
    lock = threading.Lock()
    seen: set[bytes] = set()

    def on_message(message: pubsub_v1.subscriber.message.Message) -> None:
        message.ack()
        with lock:
            seen.add(message.data[:12])
            if len(seen) >= messages:
                done.set()

    future = subscriber.subscribe(subscription, on_message, flow_control=pubsub_v1.types.FlowControl(max_messages=5000))
    padding = b"x" * max(0, size - 12)
    started = time.perf_counter()
    publishes = [publisher.publish(topic, b"%012d" % i + padding) for i in range(messages)]
    for publish in publishes:
        publish.result(timeout=120)
    published = time.perf_counter()
    if not done.wait(timeout=300):
        raise RuntimeError(f"only {len(seen)} of {messages} messages arrived")
    elapsed = time.perf_counter() - started
    future.cancel()
    future.result(timeout=30)
    subscriber.close()
    print(f"published {messages} x {size} B in {published - started:.2f} s; all received after {elapsed:.2f} s")
    return messages / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--size", type=int, default=100, help="payload bytes per message (>= 12)")
    args = parser.parse_args()
    proc, host = _start_emulators()
    os.environ["PUBSUB_EMULATOR_HOST"] = host
    try:
        rate = run(args.messages, args.size)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    print(f"emulator publish+streaming-pull: {rate:,.0f} messages/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
