"""``pubsub-sidecar run`` with ``relays:`` as a real process against the emulators: a relay-only pod
publishes the outbox and stops cleanly on SIGTERM; a relay naming a topic it cannot publish to stops
the start with one line and exit 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from google.cloud import firestore, pubsub_v1

from sidecar.emulators.stack import EmulatorStack

_START_SECONDS = 60.0


def write_config(tmp_path: Path, project: str, topic: str, listen: str = "127.0.0.1:0") -> Path:
    config = {
        "project": project,
        "listen": listen,
        "http": "127.0.0.1:0",
        "relays": [
            {
                "name": "orders-out",
                "outbox": {"collection": "outbox"},
                "topic": topic,
                "key_attribute": "order_id",
                "sequence": {"attribute": "seq"},
                "shards": 2,
                "lease_duration": "2s",
            }
        ],
    }
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def sidecar(config: Path, stack: EmulatorStack) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sidecar", "run", "--config", str(config), "--log-format", "text"],
        env={**os.environ, **stack.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_missing_topic_is_one_line_and_exit_2(tmp_path: Path, stack: EmulatorStack, project: str) -> None:
    process = sidecar(write_config(tmp_path, project, "missing"), stack)
    _, stderr = process.communicate(timeout=_START_SECONDS)
    assert process.returncode == 2
    lines = [line for line in stderr.splitlines() if line.startswith("pubsub-sidecar:")]
    assert lines == [f"pubsub-sidecar: relay 'orders-out': topic projects/{project}/topics/missing does not exist"]


def test_a_relay_only_pod_publishes_and_stops_on_sigterm(tmp_path: Path, stack: EmulatorStack, project: str) -> None:
    topic = f"projects/{project}/topics/orders"
    subscription = f"projects/{project}/subscriptions/orders"
    pubsub_v1.PublisherClient().create_topic(name=topic)
    subscriber = pubsub_v1.SubscriberClient()
    subscriber.create_subscription(name=subscription, topic=topic)
    db = firestore.Client(project=project)
    for n in range(3):
        db.collection("outbox").document().set({"key": "456", "data": f"event {n}".encode()})
    process = sidecar(write_config(tmp_path, project, "orders"), stack)
    try:
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + _START_SECONDS
        while len(got) < 3:
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the relay published nothing in time"
            answer = subscriber.pull(request={"subscription": subscription, "max_messages": 10}, timeout=2)
            for received in answer.received_messages:
                got[int(received.message.attributes["seq"])] = bytes(received.message.data)
            if answer.received_messages:
                ack_ids = [r.ack_id for r in answer.received_messages]
                subscriber.acknowledge(request={"subscription": subscription, "ack_ids": ack_ids})
        assert [got[n] for n in (1, 2, 3)] == [b"event 0", b"event 1", b"event 2"]  # commit order
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=_START_SECONDS)
        subscriber.close()
    assert process.returncode == 0
