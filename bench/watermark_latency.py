"""Watermark mode: publish-to-app latency against the backlog metric's sampling period and delay.

    .venv/bin/python -m bench.watermark_latency [--messages 300] [--keys 10] [--rate 50]
        [--metric 1:2 --metric 2:4] [--margin 0] [--poll 0.5]

For each ``--metric P:D`` (sampling period P seconds, visibility delay D seconds) this starts the
project's emulators and a sidecar as real processes (``tests/e2e/e2e_processes.py``), configured with
``max_metric_delay = P + D`` (the rule's requirement, docs/watermark.md), publishes ``--messages``
messages over ``--keys`` keys at a steady ``--rate`` with the official client, and measures, in the
app (``pubsub_sidecar_client.OrderedSubscriber``), ``arrival wall clock - publish_time``.

The goal (issue 7) is p99 <= P + D + margin + 1 s: the mode adds nothing of its own beyond what the
metric imposes. The emulators, sidecar and app share one host clock, so the latency has no clock
offset in it. Also counts per-key order violations (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))

from e2e_config import subscription_entry, write_config
from e2e_google import PubSub
from e2e_processes import EmulatorsProcess, SidecarProcess

from pubsub_sidecar_client import OrderedSubscriber


@dataclass(frozen=True, slots=True)
class Run:
    period_s: float
    delay_s: float
    margin_s: float
    poll_s: float
    messages: int
    keys: int
    rate: float


@dataclass(frozen=True, slots=True)
class Result:
    latencies_ms: list[int]
    out_of_order: int

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000


def _parse_metric(text: str) -> tuple[float, float]:
    try:
        period, delay = (float(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--metric: expected PERIOD:DELAY in seconds, e.g. 1:2, got {text!r}"
        ) from None
    if period <= 0 or delay < 0:
        raise argparse.ArgumentTypeError(f"--metric: period must be > 0 and delay >= 0, got {text!r}")
    return period, delay


async def _consume(target: str, name: str, expected: int, timeout_s: float) -> Result:
    latencies: list[int] = []
    last: dict[str, tuple[int, str]] = {}
    out_of_order = 0
    async with OrderedSubscriber(target, name) as subscriber:
        async with asyncio.timeout(timeout_s):
            async for message in subscriber:
                arrival_ms = time.time_ns() // 1_000_000
                assert message.publish_time is not None and message.event_time is not None
                latencies.append(arrival_ms - int(message.publish_time.timestamp() * 1000))
                position = (int(message.event_time.timestamp() * 1000), message.dedup_id)
                if message.key in last and position < last[message.key]:
                    out_of_order += 1
                last[message.key] = position
                await message.ack()
                if len(latencies) >= expected:
                    break
    return Result(latencies, out_of_order)


async def _publish_steadily(pubsub: PubSub, topic: str, run: Run) -> None:
    interval = 1 / run.rate
    start = time.monotonic()
    futures = []
    for i in range(run.messages):
        # Paced against the start, not the previous send: a slow call does not slow the rate down.
        await asyncio.sleep(max(0.0, start + i * interval - time.monotonic()))
        futures.append(asyncio.wrap_future(pubsub.publisher.publish(topic, f"m{i}".encode(), key=f"k{i % run.keys}")))
    await asyncio.gather(*futures)


async def measure(run: Run) -> Result:
    emulators = EmulatorsProcess(metric_period=run.period_s, metric_delay=run.delay_s)
    emulators.start()
    workdir = Path(tempfile.mkdtemp(prefix="wmbench-", dir="/tmp"))
    pubsub = PubSub(emulators.env)
    sidecar: SidecarProcess | None = None
    try:
        topic = pubsub.topic("wm-bench")
        subscription = pubsub.subscription(topic)
        ordering = {
            "key": {"attribute": "key"},
            "timestamp": {"source": "publish_time"},
            "watermark": {
                "poll_interval": f"{int(run.poll_s * 1000)}ms",
                "safety_margin": f"{int(run.margin_s * 1000)}ms",
                "max_metric_delay": f"{int((run.period_s + run.delay_s) * 1000)}ms",
            },
        }
        entry = subscription_entry("bench", subscription, mode="watermark", ordering=ordering)
        listen = f"unix://{workdir}/sidecar.sock"
        config = write_config(
            workdir / "sidecar.yaml", listen=listen, root=f"bench-{uuid.uuid4().hex[:8]}", subscriptions=[entry]
        )
        sidecar = SidecarProcess(config, dict(emulators.env))
        sidecar.start()
        timeout_s = run.messages / run.rate + 10 * (run.period_s + run.delay_s) + 60
        consumer = asyncio.create_task(_consume(listen, "bench", run.messages, timeout_s))
        await _publish_steadily(pubsub, topic, run)
        return await consumer
    finally:
        if sidecar is not None:
            sidecar.stop()
        pubsub.close()
        emulators.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--keys", type=int, default=10)
    parser.add_argument("--rate", type=float, default=50.0, help="messages per second")
    parser.add_argument("--metric", type=_parse_metric, action="append", help="PERIOD:DELAY seconds (repeatable)")
    parser.add_argument("--margin", type=float, default=0.0, help="safety_margin in seconds")
    parser.add_argument("--poll", type=float, default=0.5, help="poll_interval in seconds")
    args = parser.parse_args(argv)
    if args.messages <= 0 or args.keys <= 0 or args.rate <= 0 or args.poll <= 0 or args.margin < 0:
        parser.error("--messages, --keys, --rate and --poll must be positive, --margin not negative")
    metrics = args.metric or [(1.0, 2.0), (2.0, 4.0)]

    print(f"{'P':>4} {'D':>4} {'margin':>6} {'poll':>5} {'n':>5} {'p50 s':>7} {'p99 s':>7} {'max s':>7} "
          f"{'bound s':>8} {'ok':>4} {'out-of-order':>12}")  # fmt: skip
    all_ok = True
    for period, delay in metrics:
        run = Run(period, delay, args.margin, args.poll, args.messages, args.keys, args.rate)
        result = asyncio.run(measure(run))
        bound = period + delay + args.margin + 1.0
        p50, p99 = result.percentile(0.50), result.percentile(0.99)
        mean = statistics.mean(result.latencies_ms) / 1000
        ok = p99 <= bound and result.out_of_order == 0
        all_ok &= ok
        print(
            f"{period:>4g} {delay:>4g} {args.margin:>6g} {args.poll:>5g} {len(result.latencies_ms):>5} "
            f"{p50:>7.2f} {p99:>7.2f} {max(result.latencies_ms) / 1000:>7.2f} {bound:>8.2f} "
            f"{'yes' if ok else 'NO':>4} {result.out_of_order:>12}  (mean {mean:.2f} s)",
            flush=True,
        )
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
