"""The ``Publish`` RPC (apps without Firestore) on a relay-only sidecar process, with the Python
client: each call answers once the entry is durable, the relay publishes the events in the order
they were written with numbers 1..n, a retry with the same ``entry_id`` writes nothing twice, and an
unknown relay or an event that can never be published is refused with its reason."""

from __future__ import annotations

import asyncio
import shlex
import signal
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from google.cloud import firestore, pubsub_v1
from google.protobuf import json_format
from test_relay_process import sidecar, write_config

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc
from pubsub_sidecar_client import get_status, publish
from sidecar.commands.status import format_table
from sidecar.emulators.stack import EmulatorStack

_DEADLINE_SECONDS = 60.0


async def _until_serving(target: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + _DEADLINE_SECONDS
    while True:
        assert process.poll() is None, process.communicate()[1]
        try:
            await publish(target, "no-such-relay", "k", b"", timeout_seconds=2)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return
        assert time.monotonic() < deadline, "the sidecar did not serve in time"
        await asyncio.sleep(0.2)


DOC = Path(__file__).resolve().parents[2] / "docs" / "publishing.md"


async def _doc_recipe(target: str) -> dict[str, object]:
    """docs/publishing.md's grpcurl recipe: its JSON read into the request as grpcurl does."""
    text = await asyncio.to_thread(DOC.read_text)
    (line,) = [line for line in text.splitlines() if line.startswith("grpcurl ") and "/Publish" in line]
    args = shlex.split(line)
    request = json_format.Parse(args[args.index("-d") + 1], sidecar_pb2.PublishRequest())
    async with grpc.aio.insecure_channel(target) as channel:
        response = await sidecar_pb2_grpc.OrderedDeliveryStub(channel).Publish(request, timeout=30)
    return json_format.MessageToDict(response, preserving_proto_field_name=True)


async def test_publish_rpc(stack: EmulatorStack, project: str) -> None:
    topic = f"projects/{project}/topics/orders"
    subscription = f"projects/{project}/subscriptions/orders"
    pubsub_v1.PublisherClient().create_topic(name=topic)
    subscriber = pubsub_v1.SubscriberClient()
    subscriber.create_subscription(name=subscription, topic=topic)
    workdir = Path(tempfile.mkdtemp(prefix="publish-", dir="/tmp"))
    target = f"unix://{workdir}/sidecar.sock"
    process = sidecar(write_config(workdir, project, "orders", listen=target), stack)
    try:
        await _until_serving(target, process)
        first = await publish(target, "orders-out", "456", b"OrderCreated", attributes={"type": "created"})
        again = await publish(target, "orders-out", "456", b"OrderCancelled", entry_id="cancel-456")
        assert again == "cancel-456"
        assert await publish(target, "orders-out", "456", b"OrderCancelled", entry_id="cancel-456") == again

        assert await _doc_recipe(target) == {"entry_id": "456-created"}  # the grpcurl recipe, as grpcurl sends it

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await publish(target, "orders-out", "456", b"x", attributes={"seq": "3"})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "set by the relay" in (refused.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await publish(target, "payments-out", "456", b"x")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert "orders-out" in (unknown.value.details() or "")

        got: dict[int, tuple[bytes, str]] = {}
        deadline = time.monotonic() + _DEADLINE_SECONDS
        while len(got) < 3:
            assert time.monotonic() < deadline, f"published: {got}"
            answer = subscriber.pull(request={"subscription": subscription, "max_messages": 10}, timeout=2)
            for received in answer.received_messages:
                m = received.message
                got[int(m.attributes["seq"])] = (bytes(m.data), m.attributes.get("type", ""))
            if answer.received_messages:
                ack_ids = [r.ack_id for r in answer.received_messages]
                subscriber.acknowledge(request={"subscription": subscription, "ack_ids": ack_ids})
        assert got[1] == (b"OrderCreated", "created") and got[2] == (b"OrderCancelled", "")

        # GetStatus and `pubsub-sidecar status` show the relay and its waiting room.
        blocker = firestore.Client(project=project).collection("outbox").document()
        blocker.set({"key": "789", "data": b"x", "attributes": {"googx": "1"}})
        deadline = time.monotonic() + _DEADLINE_SECONDS
        while True:
            status = await get_status(target, max_keys=10)
            (relay,) = status.relays
            if relay.waiting:
                break
            assert time.monotonic() < deadline, "the waiting entry not in GetStatus"
            await asyncio.sleep(0.1)
        assert (relay.name, relay.shards_held, relay.blocked_keys) == ("orders-out", 2, 1)
        assert [(w.entry_id, w.key, w.retry_helps) for w in relay.waiting] == [(blocker.id, "789", False)]
        table = format_table(status, datetime.now(UTC), target)
        assert f"orders-out: entry {blocker.id} (key 789) waits: attribute 'googx'" in table
        assert "pubsub-sidecar outbox discard" in table
        db = firestore.Client(project=project)
        deadline = time.monotonic() + _DEADLINE_SECONDS
        while [d for d in db.collection("outbox").stream() if d.get("key") == "456"]:
            assert time.monotonic() < deadline, "the outbox did not empty"
            await asyncio.sleep(0.1)
        assert first
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=_DEADLINE_SECONDS)
        subscriber.close()
    assert process.returncode == 0
