"""The relay scenario: the outbox relay (docs/publishing.md) as a relay-only sidecar pod, in one run.

    python -m bench --quick --scenario relay

One ``pubsub-sidecar run`` process with a ``relays:`` section only (16 shards, the default lease),
on the run's emulators process, a topic and subscription of its own and a fresh Firestore root and
outbox collection per phase. The bench process plays the app (entries written with the store's
Firestore seam, the official client underneath) and the subscriber (pulls with the official client).

1. **Throughput, 100 keys and one hot key**: ``messages`` entries written as fast as the app can
   (500 per Commit, the keys interleaved), then pulled; msg/s = messages / (last publish time - first
   write). Billed Firestore operations from the first write until the outbox is empty and every
   message published, minus the app's own writes of the entries, per message (the lease upkeep of
   that window included: it is what the relay costs).
2. **Commit-to-publish latency**: ``latency_messages`` entries, each in its own Commit at
   ``latency_rate_per_second``; for each, the Pub/Sub publish time (the emulator's clock, the same
   machine) minus the time just before its Commit was sent: p50 and p99.
3. **Idle cost per relay pod**: the pod with an empty outbox for ``IDLE_SECONDS``: billed operations
   per minute (lease rounds; the Listens cost nothing while nothing changes).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Any

import yaml

from bench.emulators_process import billed_operations
from bench.harness import PROJECT, BenchError, cpu_seconds, percentile, wait_until
from bench.pubsub_clients import _emulator_env, subscriber_client
from bench.run_context import RunContext
from bench.scenarios import Result, Scenario
from bench.sidecar_process import Sidecar
from sidecar.store import documents as docs
from sidecar.store.firestore import FirestoreDocuments

SHARDS = 16
IDLE_SECONDS = 30.0
"""Ten lease rounds at the default 10 s lease: enough to average out their phase."""
_BATCH = 500
_PHASE_TIMEOUT_SECONDS = 600.0


def _config(ctx: RunContext, name: str, root: str, outbox: str, topic: str) -> Any:
    path = ctx.workdir / f"{name}.yaml"
    relay = {
        "name": "bench-out",
        "outbox": {"collection": outbox},
        "topic": topic,
        "key_attribute": "order_id",
        "sequence": {"attribute": "seq"},
        "shards": SHARDS,
    }
    body = {"project": PROJECT, "listen": "127.0.0.1:0", "http": "127.0.0.1:0", "firestore": {"root": root}}
    path.write_text(yaml.safe_dump({**body, "relays": [relay]}, sort_keys=False))
    return path


class _Pulled:
    """The subscription's messages: (key, seq) -> Pub/Sub publish time (seconds since the epoch)."""

    def __init__(self, subscription: str, env: dict[str, str]) -> None:
        self._subscription = subscription
        with _emulator_env(env):
            self._client = subscriber_client()
        self.published: dict[tuple[str, int], float] = {}

    def pull(self) -> int:
        answer = self._client.pull(request={"subscription": self._subscription, "max_messages": 1000}, timeout=10)
        ack_ids = []
        for received in answer.received_messages:
            m = received.message
            self.published.setdefault((m.attributes["order_id"], int(m.attributes["seq"])), m.publish_time.timestamp())
            ack_ids.append(received.ack_id)
        if ack_ids:
            self._client.acknowledge(request={"subscription": self._subscription, "ack_ids": ack_ids})
        return len(self.published)

    def close(self) -> None:
        self._client.close()


async def _write(documents: FirestoreDocuments, outbox: str, keys: Sequence[str]) -> None:
    """One entry per key in ``keys`` (in that order), 500 per Commit, as fast as the app can."""
    for start in range(0, len(keys), _BATCH):
        writes = [
            docs.create(f"{outbox}/{uuid.uuid4().hex[:20]}", {"key": key, "data": b"x" * 100})
            for key in keys[start : start + _BATCH]
        ]
        await documents.commit(writes)


async def _phase(ctx: RunContext, name: str, keys: Sequence[str], rate: float | None) -> dict[str, Any]:
    """One relay pod drains ``keys`` (one entry each): what it took, and at what cost."""
    subscription = ctx.new_subscription(f"relay-{name}")
    topic = subscription.replace("/subscriptions/", "/topics/")
    root, outbox = f"bench-relay-{uuid.uuid4().hex[:8]}", f"outbox-{uuid.uuid4().hex[:8]}"
    pod = Sidecar(_config(ctx, f"relay-{name}", root, outbox, topic), dict(ctx.emulators.env))
    pod.start()
    pulled = _Pulled(subscription, dict(ctx.emulators.env))
    with _emulator_env(ctx.emulators.env):
        documents = FirestoreDocuments(PROJECT)
    try:
        await asyncio.to_thread(pod.wait_ready)
        wait_until(lambda: pod.metric("pubsub_sidecar_relay_shards_held") >= SHARDS, 60, "the relay's leases")
        ctx.emulators.reset_firestore_counters()
        cpu_before = cpu_seconds(pod.pid)
        sent: dict[tuple[str, int], float] = {}
        started = time.time()
        if rate is None:
            await _write(documents, outbox, keys)
        else:
            counts: dict[str, int] = {}
            for index, key in enumerate(keys):
                await asyncio.sleep(max(0.0, started + index / rate - time.time()))
                counts[key] = counts.get(key, 0) + 1
                sent[(key, counts[key])] = time.time()
                await _write(documents, outbox, [key])
        await asyncio.to_thread(
            wait_until, lambda: pulled.pull() >= len(keys), _PHASE_TIMEOUT_SECONDS, f"{len(keys)} messages published"
        )
        await asyncio.to_thread(
            wait_until,
            lambda: pod.metric("pubsub_sidecar_relay_pending_entries") == 0,
            _PHASE_TIMEOUT_SECONDS,
            "the outbox empty",
        )
        operations = billed_operations(ctx.emulators.firestore_counters()) - len(keys)
        figures: dict[str, Any] = {
            "messages": len(keys),
            "seconds": max(pulled.published.values()) - started,
            "operations_per_message": operations / len(keys),
            "cpu_seconds": cpu_seconds(pod.pid) - cpu_before,
        }
        if sent:
            latencies = [(pulled.published[k] - t) * 1000 for k, t in sent.items() if k in pulled.published]
            figures["p50_ms"] = percentile(latencies, 0.5)
            figures["p99_ms"] = percentile(latencies, 0.99)
        if name == "100keys":
            ctx.emulators.reset_firestore_counters()
            await asyncio.sleep(IDLE_SECONDS)
            idle = billed_operations(ctx.emulators.firestore_counters())
            figures["idle_operations_per_minute"] = idle * 60 / IDLE_SECONDS
        return figures
    finally:
        pulled.close()
        await documents.close()
        pod.stop()


async def run_relay(ctx: RunContext, scenario: Scenario) -> Result:
    sizes = ctx.sizes
    many = [f"order-{i % 100}" for i in range(sizes.messages)]
    hot = ["order-hot"] * sizes.hot_key_messages
    paced = [f"order-{i % 100}" for i in range(sizes.latency_messages)]
    throughput = await _phase(ctx, "100keys", many, None)
    hot_key = await _phase(ctx, "1key", hot, None)
    latency = await _phase(ctx, "latency", paced, sizes.latency_rate_per_second)
    if latency.get("p99_ms") is None:
        raise BenchError("no latency measured: no message of the paced phase was published")
    per_second = throughput["messages"] / throughput["seconds"]
    return Result(
        scenario=scenario.name,
        description=scenario.description,
        messages=throughput["messages"],
        messages_per_second=per_second,
        p50_ms=latency["p50_ms"],
        p99_ms=latency["p99_ms"],
        cpu_seconds_per_10k=throughput["cpu_seconds"] * 10_000 / throughput["messages"],
        extra={
            "hot_key_messages": hot_key["messages"],
            "hot_key_messages_per_second": hot_key["messages"] / hot_key["seconds"],
            "operations_per_message_beyond_the_app": throughput["operations_per_message"],
            "hot_key_operations_per_message_beyond_the_app": hot_key["operations_per_message"],
            "idle_operations_per_minute_per_pod": throughput["idle_operations_per_minute"],
            "latency_messages": latency["messages"],
            "latency_rate_per_second": sizes.latency_rate_per_second,
        },
    )
