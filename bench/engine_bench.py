"""Benchmark of the pure engine (issue 4): throughput, memory per held message, O(log n) scaling.

Workload: N messages over K keys in sequence mode, 10% displaced (swapped with a neighbour of the
same key, so they arrive out of order), 1% duplicated; everything is stored, then taken and acked
round by round (``max_in_flight_per_key: 1`` gives one message per key per round).

    .venv/bin/python -m bench.engine_bench            # 1,000,000 messages over 10,000 keys
    .venv/bin/python -m bench.engine_bench --messages 100000 --keys 1000

Prints messages/s through the engine (store + take + ack + ack_durable), and the engine's own
memory per held message measured with tracemalloc (messages are built before measuring, so payload
and Message objects are not counted).
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc

from sidecar.engine import Engine, EngineConfig, Message

_FINGERPRINT = b"f" * 16


def build_stream(messages: int, keys: int, seed: int = 7) -> tuple[list[Message], int]:
    """Round-robin over keys with sequence 1.., 10% swapped with the next message of their key,
    1% sent twice. Returns the stream and the number of distinct messages."""
    rng = random.Random(seed)
    per_key = messages // keys
    by_key = []
    for k in range(keys):
        name = f"key-{k}"
        seqs = [
            Message(name, f"{name}/{s}", f"m-{k}-{s}", 0, sequence=s, known_fingerprint=_FINGERPRINT)
            for s in range(1, per_key + 1)
        ]
        for i in range(len(seqs) - 1):
            if rng.random() < 0.10:
                seqs[i], seqs[i + 1] = seqs[i + 1], seqs[i]
        by_key.append(seqs)
    stream: list[Message] = []
    for i in range(per_key):
        for seqs in by_key:
            stream.append(seqs[i])
            if rng.random() < 0.01:
                stream.append(seqs[i])
    return stream, per_key * keys


def run(messages: int, keys: int, *, freeze_input: bool = True) -> None:
    stream, distinct = build_stream(messages, keys)
    if freeze_input:
        # The input stream is the caller's data (a million Message objects): exclude it from the
        # cyclic GC's scans so the figure measures the engine, not repeated scans of the input.
        gc.collect()
        gc.freeze()
    engine = Engine(EngineConfig(mode="sequence"), id_prefix="b-")

    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    started = time.perf_counter()
    for message in stream:
        engine.on_stored(message, 0)
    stored_seconds = time.perf_counter() - started
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    held_bytes = sum(stat.size_diff for stat in after.compare_to(before, "filename"))

    # tracemalloc slows allocation down: time the full run again without it.
    engine = Engine(EngineConfig(mode="sequence"), id_prefix="b-")
    started = time.perf_counter()
    for message in stream:
        engine.on_stored(message, 0)
    store_done = time.perf_counter()
    acked = 0
    now = 1
    while True:
        deliveries = engine.take("bench", 1_000_000, now)
        if not deliveries:
            break
        ids = [engine.ack("bench", d.delivery_id, now).delivery_id for d in deliveries]
        engine.ack_durable(ids, now)
        acked += len(ids)
        now += 1
    total = time.perf_counter() - started
    status, _ = engine.status(now, max_keys=0)

    print(f"messages in stream:        {len(stream):,} ({distinct:,} distinct, {len(stream) - distinct:,} duplicates)")
    print(f"keys:                      {keys:,}")
    print(f"acked:                     {acked:,} (buffered left: {status.buffered})")
    print(f"on_stored only:            {len(stream) / (store_done - started):,.0f} msg/s")
    print(f"end to end (store+take+ack+durable): {len(stream) / total:,.0f} msg/s ({total:.2f} s)")
    print(
        f"engine memory while held:  {held_bytes / distinct:,.0f} bytes/message (tracemalloc, store phase "
        f"{stored_seconds:.1f} s under tracing)"
    )
    if acked != distinct:
        raise SystemExit(f"lost messages: acked {acked} of {distinct}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--no-freeze", action="store_true", help="leave the input stream to the cyclic GC")
    args = parser.parse_args()
    run(args.messages, args.keys, freeze_input=not args.no_freeze)


if __name__ == "__main__":
    main()
