"""`pubsub-sidecar demo`: emulators, the sidecar, a publisher and a consumer app in one process.

A publisher sends order events (created, paid, packed, shipped, delivered or cancelled) for a number of
orders, each stamped with a per-order sequence number, **shuffled and with duplicates** (some
re-published with new message ids, as a publisher retry would). The sidecar runs in sequence mode
against the embedded emulators; the consumer app receives through the project's Python client, checks
that every order's events arrive in order and once, and acks them. On a terminal the per-order
progress is redrawn in place; otherwise each delivery is one plain line. A summary ends the run.

Everything talks over real gRPC on loopback: the official Pub/Sub and Firestore clients, the
sidecar's servers and the app client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pubsub_sidecar_client import OrderedSubscriber
from sidecar.commands.demo_pubsub import DemoPubSub
from sidecar.commands.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from sidecar.config.model import load_config
from sidecar.emulators.main import index_file
from sidecar.emulators.stack import EmulatorStack
from sidecar.ops.logs import setup_logging
from sidecar.wiring.app import Sidecar

PROJECT = "demo-project"
TOPIC = "orders"
SUBSCRIPTION = "orders"
DEAD_LETTER_TOPIC = "orders-dead-letter"

_FINISH_TIMEOUT_SECONDS = 45.0
"""The demo must end by itself within a minute, whatever happens."""

_HAPPY_PATH = ("created", "paid", "packed", "shipped", "delivered")
_CANCELLED = ("created", "paid", "cancelled")

_CONFIG_TEMPLATE = """\
project: {project}
listen: 127.0.0.1:{grpc_port}
http: 127.0.0.1:{http_port}
firestore: {{database: "(default)", root: pubsub-sidecar-demo}}
subscriptions:
  - name: {name}
    subscription: projects/{project}/subscriptions/{subscription}
    ordering:
      mode: sequence
      key: {{attribute: order_id}}
      sequence: {{attribute: seq, start: 1}}
    dedup: {{by: message_id, ttl: 7d}}
    delivery: {{max_in_flight_per_key: 1, ack_deadline: 30s, max_delivery_attempts: 5,
               backoff: {{initial: 100ms, maximum: 5s}}, on_dead_letter: block}}
    dead_letter_topic: projects/{project}/topics/{dead_letter_topic}
"""


@dataclass(frozen=True, slots=True)
class OrderEvent:
    order_id: str
    seq: int
    event: str


def plan_orders(count: int, rng: random.Random) -> list[OrderEvent]:
    """Each order's events in their true order; about one order in five is cancelled."""
    events: list[OrderEvent] = []
    for n in range(1, count + 1):
        order_id = f"order-{n:03d}"
        steps = _CANCELLED if rng.random() < 0.2 else _HAPPY_PATH
        events.extend(OrderEvent(order_id, seq, name) for seq, name in enumerate(steps, start=1))
    return events


def shuffled_with_duplicates(events: Sequence[OrderEvent], rng: random.Random) -> list[OrderEvent]:
    """The events shuffled, with about 20% sent twice (a publisher retry: a new message id)."""
    sent = list(events) + [e for e in events if rng.random() < 0.2]
    rng.shuffle(sent)
    return sent


@dataclass
class Consumer:
    """The app: checks order per key, counts what it saw."""

    expected: dict[str, int]
    seen: dict[str, list[str]] = field(default_factory=dict)
    last_seq: dict[str, int] = field(default_factory=dict)
    delivered: int = 0
    redelivered: int = 0
    out_of_order: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def receive(self, key: str, seq: int, event: str) -> str:
        last = self.last_seq.get(key, 0)
        if seq <= last:
            self.redelivered += 1  # an unconfirmed ack's redelivery (G3); not a new event
            return "again"
        if seq != last + 1:
            self.out_of_order += 1
        self.last_seq[key] = seq
        self.seen.setdefault(key, []).append(event)
        self.delivered += 1
        if self.delivered >= sum(self.expected.values()):
            self.done.set()
        return "ok" if seq == last + 1 else "OUT OF ORDER"


class Display:
    """Live per-order progress on a terminal; plain lines otherwise."""

    def __init__(self, consumer: Consumer, stream: object = sys.stdout) -> None:
        self._consumer = consumer
        self._out = stream
        self._live = bool(getattr(stream, "isatty", lambda: False)())
        self._drawn_lines = 0

    def delivered(self, key: str, seq: int, event: str, verdict: str) -> None:
        if self._live:
            self._redraw()
        else:
            self._print(f"app received {key} #{seq} {event:<10} {verdict}")

    def _redraw(self) -> None:
        lines = []
        for key in sorted(self._consumer.expected):
            got = self._consumer.seen.get(key, [])
            total = self._consumer.expected[key]
            bar = "#" * len(got) + "." * (total - len(got))
            lines.append(f"  {key}  [{bar}]  {' > '.join(got)}")
        if self._drawn_lines:
            self._print(f"\x1b[{self._drawn_lines}F", end="")
        for line in lines:
            self._print(f"\x1b[2K{line}")
        self._drawn_lines = len(lines)

    def _print(self, text: str, end: str = "\n") -> None:
        print(text, end=end, file=self._out, flush=True)  # type: ignore[call-overload]


async def run_demo(orders: int, seed: int | None = None) -> int:
    rng = random.Random(seed)
    stack = EmulatorStack(metric_period=1.0, metric_delay=2.0, firestore_indexes=index_file(None))
    await stack.start()
    try:
        os.environ.update(stack.env)
        os.environ["GOOGLE_CLOUD_PROJECT"] = PROJECT
        pubsub = DemoPubSub(PROJECT)
        try:
            return await _run(stack, pubsub, orders, rng)
        finally:
            pubsub.close()
    finally:
        await stack.stop()


async def _run(stack: EmulatorStack, pubsub: DemoPubSub, orders: int, rng: random.Random) -> int:
    await asyncio.to_thread(pubsub.create_topic_and_subscription, TOPIC, SUBSCRIPTION, DEAD_LETTER_TOPIC)
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "sidecar.yaml"
        grpc_port, http_port = _free_port(), _free_port()
        config_path.write_text(
            _CONFIG_TEMPLATE.format(
                project=PROJECT,
                grpc_port=grpc_port,
                http_port=http_port,
                name=SUBSCRIPTION,
                subscription=SUBSCRIPTION,
                dead_letter_topic=DEAD_LETTER_TOPIC,
            )
        )
        config = load_config(config_path)
    sidecar = Sidecar(config, grace_seconds=5.0)
    serving = asyncio.create_task(sidecar.serve(), name="sidecar")
    target = f"127.0.0.1:{grpc_port}"
    try:
        events = plan_orders(orders, rng)
        sent = shuffled_with_duplicates(events, rng)
        expected: dict[str, int] = {}
        for event in events:
            expected[event.order_id] = expected.get(event.order_id, 0) + 1
        consumer = Consumer(expected)
        display = Display(consumer)
        print(
            f"publishing {len(sent)} order events for {orders} orders, shuffled, "
            f"{len(sent) - len(events)} of them duplicates ..."
        )
        started = time.monotonic()
        await asyncio.to_thread(
            pubsub.publish_all,
            TOPIC,
            [(b"", {"order_id": e.order_id, "seq": str(e.seq), "event": e.event}) for e in sent],
        )
        async with OrderedSubscriber(target, SUBSCRIPTION) as sub:
            app = asyncio.create_task(_consume(sub, consumer, display), name="demo-app")
            try:
                await asyncio.wait_for(consumer.done.wait(), _FINISH_TIMEOUT_SECONDS)
            except TimeoutError:
                print(f"demo: not everything arrived within {_FINISH_TIMEOUT_SECONDS:.0f}s", file=sys.stderr)
            finally:
                app.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await app
        elapsed = time.monotonic() - started
        duplicates_dropped = await _scrape_counter(http_port, "pubsub_sidecar_duplicates_total")
    finally:
        sidecar.request_stop()
        await serving
    total = sum(expected.values())
    print()
    print("summary")
    print(f"  published:            {len(sent)} ({total} events + {len(sent) - total} duplicates)")
    print(f"  duplicates dropped:   {duplicates_dropped} (the sidecar's own count)")
    print(f"  delivered:            {consumer.delivered} of {total} in {elapsed * 1000:.0f} ms")
    print(f"  redelivered:          {consumer.redelivered}")
    print(f"  out of order:         {consumer.out_of_order}")
    ok = consumer.delivered == total and consumer.out_of_order == 0 and sidecar.failure is None
    print("  result:               " + ("OK" if ok else "FAILED"))
    return EXIT_OK if ok else EXIT_FAILED


async def _consume(sub: OrderedSubscriber, consumer: Consumer, display: Display) -> None:
    async for msg in sub:
        verdict = consumer.receive(msg.key, msg.sequence, msg.attributes.get("event", "?"))
        display.delivered(msg.key, msg.sequence, msg.attributes.get("event", "?"), verdict)
        await msg.ack()


async def _scrape_counter(http_port: int, name: str) -> int:
    """Read one counter from the sidecar's /metrics, as Prometheus would."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{http_port}/metrics") as response:
            text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("subscription") == SUBSCRIPTION:
                return int(sample.value)
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_command(args: argparse.Namespace) -> int:
    if args.orders < 1:
        print("pubsub-sidecar demo: --orders must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(args.log_format, "WARNING")
    return asyncio.run(run_demo(args.orders))
