"""Delivery-layer throughput: a no-op app on loopback through the real gRPC server and a MemoryStore.

    .venv/bin/python -m bench.delivery_bench [--hot-messages 3000] [--keys 1000] [--per-key 20]

Scenarios (DESIGN §6 contract, issue 5 targets):
- ``hot-key``: one key, ``max_in_flight_per_key: 1``: every message costs a full round trip
  (deliver -> app ack -> commit_acks -> next message). Target 1,500 messages/s.
- ``1000-keys``: 1,000 keys, one stream with the default budget: responses carry many messages
  and acks group-commit. Target 15,000 messages/s.

The server runs in this process; the app runs in a child process (the same script with ``--app``),
so the two share the machine's cores the way a sidecar and its app do. Messages are stored before
the app connects: the figure is delivery throughput, not ingest. The MemoryStore is not durable: a
Firestore commit adds its own latency per group commit.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from pubsub_sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc
from sidecar.engine.types import EngineConfig, Message
from sidecar.store.api import IncomingMessage, PersistOutcome
from sidecar.store.memory import MemoryStore

if TYPE_CHECKING:
    from sidecar.pipeline.runtime import SubscriptionRuntime

_PERSIST_CHUNK = 1000
"""Messages persisted and handed to the runtime per call while preloading."""

_PAYLOAD = b"x" * 100
"""A small, typical event payload."""


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _NoDeadLetters:
    async def publish(self, subscription: str, message: Message, reason: str, attempts: int) -> None:
        raise RuntimeError(f"benchmark should not dead-letter ({reason})")


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    keys: int
    per_key: int
    target_per_second: float


# ---- the app (child process) ---------------------------------------------------------------------


async def _app(address: str, subscription: str, expected: int) -> dict[str, float]:
    """Receive ``expected`` messages, acking each response at once; wait for the last confirmation."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = sidecar_pb2_grpc.OrderedDeliveryStub(channel).Subscribe()
        started = time.perf_counter()
        await call.write(sidecar_pb2.SubscribeRequest(open=sidecar_pb2.Open(subscription=subscription)))
        received = confirmed = responses = 0
        first_message_at = 0.0
        while confirmed < expected:
            response = await call.read()
            if response is grpc.aio.EOF:
                raise SystemExit(f"stream ended early: {await call.code()} {await call.details()}")
            responses += 1
            confirmed += len(response.ack_confirmations)
            if response.messages:
                if not received:
                    first_message_at = time.perf_counter()
                received += len(response.messages)
                ids = [m.delivery_id for m in response.messages]
                await call.write(sidecar_pb2.SubscribeRequest(ack=sidecar_pb2.Ack(delivery_ids=ids)))
        finished = time.perf_counter()
        call.cancel()
    return {
        "messages": received,
        "seconds": finished - started,
        "first_message_seconds": first_message_at - started,
        "responses": responses,
    }


# ---- the sidecar side (this process) -------------------------------------------------------------


async def _preload(store: MemoryStore, runtime: SubscriptionRuntime, scenario: Scenario) -> None:
    batch: list[IncomingMessage] = []
    for seq in range(1, scenario.per_key + 1):
        for key_index in range(scenario.keys):
            key = f"key-{key_index}"
            batch.append(
                IncomingMessage(
                    key=key,
                    dedup_id=f"{key}/{seq}",
                    message_id=f"{key_index}-{seq}",
                    data=_PAYLOAD,
                    attributes={"seq": str(seq)},
                    ordering_key=key,
                    publish_time_ms=_now_ms(),
                    known_fingerprint=hashlib.sha256(f"{key}/{seq}".encode()).digest(),
                    sequence=seq,
                )
            )
            if len(batch) >= _PERSIST_CHUNK:
                await _persist(store, runtime, batch)
                batch = []
    if batch:
        await _persist(store, runtime, batch)


async def _persist(store: MemoryStore, runtime: SubscriptionRuntime, batch: list[IncomingMessage]) -> None:
    results = await store.persist(runtime.name, batch, _now_ms())
    runtime.on_stored([r.message for r in results if r.outcome is PersistOutcome.STORED])


async def run_scenario(scenario: Scenario) -> dict[str, float]:
    # Imported here: the app process only needs the generated stubs, like a real app.
    from sidecar.delivery.server import GrpcServer
    from sidecar.pipeline.runtime import SubscriptionRuntime

    store = MemoryStore()
    runtime = SubscriptionRuntime(scenario.name, EngineConfig(mode="sequence"), store, _NoDeadLetters())
    await runtime.recover()
    await runtime.start()
    server = GrpcServer({scenario.name: runtime}, "127.0.0.1:0")
    try:
        address = await server.start()
        await server.set_serving()
        await _preload(store, runtime, scenario)
        expected = scenario.keys * scenario.per_key
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.delivery_bench",
            "--app",
            address,
            scenario.name,
            str(expected),
            stdout=asyncio.subprocess.PIPE,
        )
        stdout, _ = await child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"app process failed with exit code {child.returncode}")
        result = json.loads(stdout)
        status, _ = runtime.status(0)
        result["acked"] = status.counts.get("acked", 0)
        result["ack_commits"] = runtime.counters.ack_commits
        return result
    finally:
        await server.stop(0)
        await runtime.stop(0)


def _report(scenario: Scenario, result: dict[str, float]) -> bool:
    rate = result["messages"] / result["seconds"]
    ok = rate >= scenario.target_per_second
    print(
        f"{scenario.name:>10}: {int(result['messages']):>7} messages in {result['seconds']:6.2f} s = "
        f"{rate:>9,.0f} msg/s (target {scenario.target_per_second:,.0f}: {'met' if ok else 'MISSED'}); "
        f"{int(result['responses'])} responses, {int(result['ack_commits'])} ack commits"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hot-messages", type=int, default=3000, help="messages on the single hot key")
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--per-key", type=int, default=20, help="messages per key in the many-keys scenario")
    parser.add_argument("--app", nargs=3, metavar=("ADDRESS", "SUBSCRIPTION", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.app:
        address, subscription, count = args.app
        print(json.dumps(asyncio.run(_app(address, subscription, int(count)))))
        return 0
    scenarios = [
        Scenario("hot-key", keys=1, per_key=args.hot_messages, target_per_second=1_500),
        Scenario(f"{args.keys}-keys", keys=args.keys, per_key=args.per_key, target_per_second=15_000),
    ]
    all_met = True
    for scenario in scenarios:
        all_met &= _report(scenario, asyncio.run(run_scenario(scenario)))
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
