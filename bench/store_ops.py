"""Benchmark of the Firestore store against the Firestore emulator: throughput, load time, cost.

    .venv/bin/python -m bench.store_ops [--keys 100] [--per-key 50] [--pending 100000]

Steady state: persist batches of ``--keys`` messages (one per key) and ack them, with a simulated
clock at 10 messages/s per key, then reports document reads, writes and deletes per delivered
message from the emulator's counters. Then it stores ``--pending`` messages and times ``load``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import time
import uuid

from sidecar.emulators.stack import EmulatorStack
from sidecar.engine.types import AckIntent
from sidecar.store.api import IncomingMessage, PersistOutcome, SubscriptionStoreConfig
from sidecar.store.firestore import FirestoreStore


def _incoming(key: str, sequence: int) -> IncomingMessage:
    data = f"{key}:{sequence}".encode() * 8
    return IncomingMessage(
        key=key,
        dedup_id=f"{key}:{sequence}",
        message_id=uuid.uuid4().hex,
        data=data,
        attributes={"order_id": key, "seq": str(sequence)},
        ordering_key="",
        publish_time_ms=1_700_000_000_000,
        known_fingerprint=hashlib.sha256(data).digest(),
        sequence=sequence,
    )


async def _run(stack: EmulatorStack, keys: int, per_key: int, pending: int) -> None:
    emulator = stack.firestore
    clock = [1_000_000]
    store = FirestoreStore(
        f"bench-{uuid.uuid4().hex[:8]}", {"orders": SubscriptionStoreConfig(mode="sequence")}, clock_ms=lambda: clock[0]
    )
    try:
        await store.load("orders", clock[0])
        before = emulator.counters
        started = time.perf_counter()
        for seq in range(1, per_key + 1):
            clock[0] += 100  # every key gets a message each 100 ms of simulated time
            results = await store.persist("orders", [_incoming(f"key-{k}", seq) for k in range(keys)], clock[0])
            assert all(r.outcome is PersistOutcome.STORED for r in results)
            acks = [AckIntent(f"d{seq}", r.message, seq + 1) for r in results]
            await store.commit_acks("orders", acks, clock[0])
        elapsed = time.perf_counter() - started
        delivered = keys * per_key
        spent = {name: emulator.counters[name] - before[name] for name in before}
        print(
            f"steady state: {delivered} messages persisted+acked in {elapsed:.2f}s = {delivered / elapsed:,.0f} msg/s"
        )
        print(
            f"  per delivered message: writes+deletes {(spent['writes'] + spent['deletes']) / delivered:.3f}, "
            f"reads {spent['reads'] / delivered:.3f}  ({spent})"
        )
        batch = [_incoming(f"p-{i % 1000}", 1_000 + i // 1000) for i in range(pending)]
        started = time.perf_counter()
        for i in range(0, pending, 2000):
            await store.persist("orders", batch[i : i + 2000], clock[0])
        print(f"persisted {pending} pending in {time.perf_counter() - started:.2f}s")
        started = time.perf_counter()
        snapshot = await FirestoreStore(
            store._client.project, {"orders": SubscriptionStoreConfig(mode="sequence")}
        ).load("orders", clock[0])
        print(
            f"load: {len(snapshot.pending)} pending, {len(snapshot.cursors)} cursors in "
            f"{time.perf_counter() - started:.2f}s"
        )
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--per-key", type=int, default=50)
    parser.add_argument("--pending", type=int, default=100_000)
    args = parser.parse_args()
    stack = EmulatorStack()
    stack.start_in_thread()
    try:
        os.environ.update(stack.env)
        asyncio.run(_run(stack, args.keys, args.per_key, args.pending))
    finally:
        stack.stop_thread()


if __name__ == "__main__":
    main()
