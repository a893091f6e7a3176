"""Latency from a commit to ``on_change`` on the store seam's ``listen``, and listen reads per change.

One ``FirestoreDocuments`` commits ``--commits`` message documents one at a time into the inbox a
``listen`` watches (``inbox == 3 and state == "pending"``, the sharding spec's query) and waits for
each to reach ``on_change``: the time from just before the commit to the callback on the loop, as
median and p99. Each message then leaves the result as the owner's tombstone makes it leave (a
replace without ``inbox``), so the result stays as small as a real inbox; ``--keep`` lets the result
grow instead: the official watch sorts and copies its whole result set on every snapshot, so its
latency grows with the result size (median about 70 ms once 1,000 documents are in it). The emulator
runs in a child process (``bench/emulator_firestore.py --serve``), so client and server do not
share one GIL. Reads per change are counted in a second, shorter run
against an in-process emulator (the child has no admin port): added, changed, removed by a change,
deleted, and a write outside the result.

    .venv/bin/python bench/listen_latency.py [--commits 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from sidecar.store import documents as docs
from sidecar.store.firestore import FirestoreDocuments

_PARENT = "pubsub-sidecar/orders"
_MESSAGES = f"{_PARENT}/messages"
_WHERE = [docs.Filter("inbox", "EQUAL", 3), docs.Filter("state", "EQUAL", "pending")]


async def _latencies(commits: int, keep: bool) -> list[float]:
    store = FirestoreDocuments(f"listen-bench-{uuid.uuid4().hex[:8]}")
    arrived: dict[str, float] = {}
    wake = asyncio.Event()

    def on_change(change: docs.Change) -> None:
        now = time.perf_counter()
        for doc_id, _, _ in change.upserts:
            arrived.setdefault(doc_id, now)
        wake.set()

    def on_error(error: Exception) -> None:
        raise SystemExit(f"listen failed: {error}")

    listening = store.listen(_PARENT, "messages", _WHERE, on_change, on_error)
    await _until(wake, lambda: True)
    samples = []
    try:
        for i in range(commits):
            doc_id = f"m{i:06d}"
            started = time.perf_counter()
            await store.commit([docs.replace(f"{_MESSAGES}/{doc_id}", {"inbox": 3, "state": "pending", "n": i})])
            await _until(wake, lambda doc_id=doc_id: doc_id in arrived)
            samples.append(arrived[doc_id] - started)
            if not keep:
                await store.commit([docs.replace(f"{_MESSAGES}/{doc_id}", {"state": "done", "n": i})])
    finally:
        await listening.close()
        await store.close()
    return samples


async def _until(wake: asyncio.Event, done: Callable[[], bool]) -> None:
    while not done():
        wake.clear()
        await asyncio.wait_for(wake.wait(), 30)


async def _reads_per_change() -> dict[str, int]:
    from sidecar.emulators.faults import FaultInjector
    from sidecar.emulators.firestore import FirestoreEmulator
    from sidecar.emulators.firestore.threaded import ServerThread

    injector = FaultInjector()
    emulator = FirestoreEmulator(injector)
    thread = ServerThread(emulator, injector)
    thread.start()
    thread.ready.wait(30)
    previous = os.environ.get("FIRESTORE_EMULATOR_HOST")
    os.environ["FIRESTORE_EMULATOR_HOST"] = f"127.0.0.1:{thread.port}"
    store = FirestoreDocuments(f"listen-reads-{uuid.uuid4().hex[:8]}")
    seen: list[docs.Change] = []
    wake = asyncio.Event()

    def on_change(change: docs.Change) -> None:
        seen.append(change)
        wake.set()

    costs: dict[str, int] = {}
    marker = f"{_MESSAGES}/marker"
    try:
        await store.commit([docs.replace(marker, {"inbox": 3, "state": "pending", "n": 0})])
        before = emulator.counters["reads"]
        listening = store.listen(_PARENT, "messages", _WHERE, on_change, lambda error: None)
        await _until(wake, lambda: bool(seen))
        costs["start (1 document)"] = emulator.counters["reads"] - before
        steps = {
            "added": docs.replace(f"{_MESSAGES}/a", {"inbox": 3, "state": "pending"}),
            "changed": docs.replace(f"{_MESSAGES}/a", {"inbox": 3, "state": "pending", "n": 1}),
            "outside the result": docs.replace(f"{_MESSAGES}/x", {"inbox": 4, "state": "pending"}),
            "removed by a change": docs.merge(f"{_MESSAGES}/a", {"state": "done"}, ["state"]),
            "deleted": docs.delete(f"{_MESSAGES}/a"),
        }
        for step, (name, write) in enumerate(steps.items(), start=1):
            before = emulator.counters["reads"]
            await store.commit([write])
            # The marker's change comes after the step's and costs one read: a barrier.
            await store.commit([docs.replace(marker, {"inbox": 3, "state": "pending", "n": step})])
            await _until(wake, lambda n=step: any(f.get("n") == n for c in seen for _, f, _ in c.upserts))
            costs[name] = emulator.counters["reads"] - before - 1
        await listening.close()
    finally:
        await store.close()
        if previous is None:
            os.environ.pop("FIRESTORE_EMULATOR_HOST", None)
        else:
            os.environ["FIRESTORE_EMULATOR_HOST"] = previous
        thread.stop()
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=1000)
    parser.add_argument("--keep", action="store_true", help="leave every message in the result (it grows)")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    child = subprocess.Popen(
        [sys.executable, str(root / "bench" / "emulator_firestore.py"), "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert child.stdout is not None and child.stdin is not None
    port = child.stdout.readline().strip()
    if not port:
        raise SystemExit("emulator child process did not start")
    os.environ["FIRESTORE_EMULATOR_HOST"] = f"127.0.0.1:{port}"
    try:
        samples = asyncio.run(_latencies(args.commits, args.keep))
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    del os.environ["FIRESTORE_EMULATOR_HOST"]
    ms = sorted(sample * 1000 for sample in samples)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    shape = "growing result" if args.keep else "result kept small"
    median = statistics.median(ms)
    print(f"commit -> on_change over {len(ms)} commits ({shape}): median {median:.2f} ms, p99 {p99:.2f} ms")
    for name, reads in asyncio.run(_reads_per_change()).items():
        print(f"listen reads, {name}: {reads}")


if __name__ == "__main__":
    main()
