"""How long a kill -9 hides the messages a sidecar had pulled, and what the lease cap costs in modacks.

    .venv/bin/python -m bench.lease_redelivery [--extension null --extension 10s] [--slow-persist 25]
        [--slow-batches 6] [--hold 60] [--victims 20] [--flow-messages 2000]

For each ``--extension`` (the config's ``flow_control.max_lease_extension``; ``null`` leaves the
Pub/Sub client's default, i.e. the code before the cap) this starts sidecars on fresh subscriptions
of one emulators process, with the official publisher and the project's app client
(``pubsub_sidecar_client.OrderedSubscriber``):

1. **flow** (its own sidecar, default flow control): ``--flow-messages`` messages, app acks at once;
   ModifyAckDeadline calls and ack ids per 1,000 messages (receipt modacks plus lease extensions).
2. **slow acks** (a second sidecar, ``max_undelivered_messages: 1``): ``--slow-batches`` messages
   in separate batches while each Firestore BatchWrite takes ``--slow-persist`` s, so they queue
   for the two persist slots and the last is acked after about slow-persist x batches / 2. The
   client's ack-time histogram, which sizes its lease extensions, now holds those figures: what a
   stretch of slow Firestore commits does in production.
3. **hold**: the app holds two messages unacked, so ingest pauses (over ``max_undelivered``) and
   ``--victims`` messages stay pulled and unpersisted; modacks over ``--hold`` s, per minute.
4. **kill -9**: the leases' time left, read from the Pub/Sub emulator; then a restarted sidecar, the
   app acking again, and the time from the kill until every victim reached the app.

Modacks are counted at the Pub/Sub emulator (``GET /pubsub/counters``), so the client is measured as
it ships. Each phase waits on what it needs (a poll with a deadline); the hold phase is a timed
measurement window by design.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))

from e2e_app import App
from e2e_config import order_message, subscription_entry, write_config
from e2e_google import PubSub
from e2e_processes import EmulatorsProcess, SidecarProcess
from e2e_waits import async_poll, async_wait_until

from pubsub_sidecar_client import Message


@dataclass(frozen=True, slots=True)
class Figures:
    extension: str
    flow_modack_calls_per_1k: float
    flow_modack_ids_per_1k: float
    slowest_ack_s: float
    hold_modack_calls_per_minute: float
    hold_modack_ids_per_minute: float
    lease_left_at_kill_s: float
    kill_to_redelivery_s: float


def _modacks(emulators: EmulatorsProcess) -> tuple[int, int]:
    counters = emulators.pubsub_counters()
    return counters["modify_ack_deadline_calls"], counters["modify_ack_deadline_ack_ids"]


class _World:
    """One subscription with its config file, sidecar and app; stopped and removed by ``close``."""

    def __init__(
        self, emulators: EmulatorsProcess, pubsub: PubSub, extension: str, delivery: dict[str, Any], **flow: Any
    ) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="lease-", dir="/tmp"))
        self.topic = pubsub.topic("lease")
        self.subscription = pubsub.subscription(self.topic)
        lease_cap = None if extension == "null" else extension
        flow_control = {"max_lease_extension": lease_cap, **flow}
        entry = subscription_entry("orders", self.subscription, delivery=delivery, flow_control=flow_control)
        self.listen = f"unix://{self.workdir}/sidecar.sock"
        root = f"lease-{uuid.uuid4().hex[:8]}"
        config = write_config(self.workdir / "sidecar.yaml", listen=self.listen, root=root, subscriptions=[entry])
        self.sidecar = SidecarProcess(config, dict(emulators.env))
        self.app: App | None = None

    async def start(self, decide: Callable[[Message], str] | None = None) -> App:
        await asyncio.to_thread(self.sidecar.start)
        self.app = App(self.listen, "orders", decide).start()
        return self.app

    async def close(self) -> None:
        if self.app is not None:
            await self.app.stop()
        self.sidecar.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


async def _flow(emulators: EmulatorsProcess, pubsub: PubSub, extension: str, messages: int) -> tuple[float, float]:
    world = _World(emulators, pubsub, extension, {})
    try:
        app = await world.start()
        calls0, ids0 = _modacks(emulators)
        await pubsub.publish_all(world.topic, [order_message(f"f{i % 50}", i // 50 + 1) for i in range(messages)])
        await async_wait_until(lambda: len(app.seen) >= messages, "the flow messages", 300)
        calls1, ids1 = _modacks(emulators)
        return (calls1 - calls0) * 1000 / messages, (ids1 - ids0) * 1000 / messages
    finally:
        await world.close()


async def measure(emulators: EmulatorsProcess, pubsub: PubSub, extension: str, args: argparse.Namespace) -> Figures:
    flow_calls, flow_ids = await _flow(emulators, pubsub, extension, args.flow_messages)
    holding = False
    # The app holds the gate messages for the whole hold phase: no redelivery or dead letter meanwhile.
    world = _World(emulators, pubsub, extension, {"ack_deadline": "30m"}, max_undelivered_messages=1)
    try:
        app = await world.start(lambda m: "hold" if holding and m.key.startswith("gate") else "ack")
        topic = world.topic

        # 2. slow acks: separate batches queue for the two persist slots
        emulators.add_fault(
            service="firestore", method="BatchWrite", code=None, delay_seconds=args.slow_persist, writes_to="/messages/"
        )
        started = time.monotonic()
        for index in range(args.slow_batches):
            data, attributes = order_message(f"slow{index}", 1)
            await pubsub.publish(topic, data, **attributes)
            await asyncio.sleep(0.05)  # past the 10 ms batch window: one batch each
        wait = args.slow_persist * args.slow_batches + 120
        await async_wait_until(lambda: len(app.seen) >= args.slow_batches, "the slow messages", wait)
        slowest = time.monotonic() - started
        emulators.clear_faults()

        # 3. hold: two held deliveries pause ingest, victims stay pulled and unpersisted
        holding = True
        await pubsub.publish_all(topic, [order_message("gate1", 1), order_message("gate2", 1)])
        await async_wait_until(lambda: len(app.held) >= 2, "the app to hold two messages")
        victim_ids = set(await pubsub.publish_all(topic, [order_message(f"v{i}", 1) for i in range(args.victims)]))

        async def leases() -> list[dict[str, Any]] | None:
            found = [lease for lease in emulators.leases(world.subscription) if lease["message_id"] in victim_ids]
            return found if len(found) == len(victim_ids) else None

        await async_poll(leases, "the victims to be leased")
        calls2, ids2 = _modacks(emulators)
        await asyncio.sleep(args.hold)  # the measurement window itself
        calls3, ids3 = _modacks(emulators)
        if any(seen.key.startswith("v") for seen in app.seen):
            raise RuntimeError("a victim was persisted and delivered before the kill; the hold did not hold")

        # 4. kill -9, then a restarted sidecar and an app that acks everything again
        world.sidecar.kill9()
        killed_at = time.monotonic()
        left = max(float(lease["seconds_left"]) for lease in await async_poll(leases, "the dead leases"))
        holding = False
        await asyncio.to_thread(world.sidecar.start, False)
        keys = {f"v{i}" for i in range(args.victims)}
        await async_wait_until(lambda: keys <= {s.key for s in app.seen}, "the victims after the restart", 900)
        redelivered = max(s.at for s in app.seen if s.key in keys) - killed_at
        per_minute = 60 / args.hold
        return Figures(
            extension=extension,
            flow_modack_calls_per_1k=flow_calls,
            flow_modack_ids_per_1k=flow_ids,
            slowest_ack_s=slowest,
            hold_modack_calls_per_minute=(calls3 - calls2) * per_minute,
            hold_modack_ids_per_minute=(ids3 - ids2) * per_minute,
            lease_left_at_kill_s=left,
            kill_to_redelivery_s=redelivered,
        )
    finally:
        emulators.clear_faults()
        await world.close()


async def main_async(args: argparse.Namespace) -> list[Figures]:
    emulators = EmulatorsProcess(metric_period=1.0, metric_delay=2.0)
    emulators.start()
    pubsub = PubSub(emulators.env)
    try:
        results = []
        for extension in args.extension or ["null", "10s"]:
            figures = await measure(emulators, pubsub, extension, args)
            print(json.dumps(asdict(figures)), flush=True)
            results.append(figures)
        return results
    finally:
        pubsub.close()
        emulators.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extension", action="append", help="max_lease_extension to run (null = client default)")
    parser.add_argument("--slow-persist", type=float, default=25.0, help="seconds each slow BatchWrite takes")
    parser.add_argument("--slow-batches", type=int, default=6, help="slow messages, one batch each")
    parser.add_argument("--hold", type=float, default=60.0, help="seconds to hold the victims before the kill")
    parser.add_argument("--victims", type=int, default=20)
    parser.add_argument("--flow-messages", type=int, default=2000)
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    header = ("max_lease_extension", "modack calls/1k msgs", "slowest ack s", "modack calls/min held",
              "lease left at kill s", "kill -> redelivery s")  # fmt: skip
    print("  ".join(header))
    for r in results:
        print(
            f"{r.extension:>19}  {r.flow_modack_calls_per_1k:>20.1f}  {r.slowest_ack_s:>13.0f}  "
            f"{r.hold_modack_calls_per_minute:>21.1f}  {r.lease_left_at_kill_s:>20.1f}  {r.kill_to_redelivery_s:>20.1f}"
        )


if __name__ == "__main__":
    main()
