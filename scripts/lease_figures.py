"""Measure shard-lease upkeep and hand-over time against our Firestore emulator (real gRPC).

    .venv/bin/python scripts/lease_figures.py [--shards 16] [--pods 3] [--lease-ms 10000] [--seconds 60]

Starts the emulator in a thread and ``--pods`` lease managers (each with its own client) in this
process, waits until they are balanced, then counts the emulator's billed operations (reads,
writes, deletes) for ``--seconds`` of steady state: upkeep per pod per minute. Then one pod calls
``release_all`` and the others are poked (as a Listen on the lease documents would): the time until
the others hold every shard is the hand-over time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "leases"))

from lease_harness import Member, balanced, wait_until

from sidecar.emulators.faults import FaultInjector
from sidecar.emulators.firestore import FirestoreEmulator
from sidecar.emulators.firestore.threaded import ServerThread
from sidecar.store.firestore import FirestoreDocuments


async def measure(emulator: FirestoreEmulator, shards: int, pods: int, lease_ms: int, seconds: float) -> None:
    project = f"lease-figures-{uuid.uuid4().hex[:8]}"
    members = [Member(FirestoreDocuments(project), f"pod-{i}", shards, lease_ms=lease_ms) for i in range(pods)]
    for member in members:
        member.start()
    try:
        settle = await wait_until(lambda: balanced(members, shards), "balanced", timeout_seconds=10 * lease_ms / 1000)
        print(f"balanced {shards} shards over {pods} pods in {settle:.2f} s")
        before = dict(emulator.counters)
        start = time.monotonic()
        await asyncio.sleep(seconds)
        elapsed = time.monotonic() - start
        after = dict(emulator.counters)
        used = {name: after[name] - before[name] for name in after}
        per_pod_minute = {name: value / pods / elapsed * 60 for name, value in used.items()}
        total = sum(per_pod_minute.values())
        shown = ", ".join(f"{name} {value:.0f}" for name, value in per_pod_minute.items())
        print(f"upkeep per pod per minute (lease {lease_ms} ms): {total:.0f} operations ({shown})")
        leaving, staying = members[0], members[1:]

        async def drain(held: set[int]) -> None:
            return None

        start = time.monotonic()
        await leaving.leases.release_all(drain)
        for member in staying:
            member.leases.poke()
        await wait_until(lambda: balanced(staying, shards), "the others hold every shard")
        print(f"hand-over after release_all: {(time.monotonic() - start) * 1000:.0f} ms (from the call to held)")
    finally:
        for member in members:
            await member.stop()
            await member.documents.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--pods", type=int, default=3)
    parser.add_argument("--lease-ms", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    injector = FaultInjector(seed=1)
    emulator = FirestoreEmulator(injector)
    thread = ServerThread(emulator, injector)
    thread.start()
    if not thread.ready.wait(30) or thread.error is not None:
        raise SystemExit(f"emulator did not start: {thread.error!r}")
    os.environ["FIRESTORE_EMULATOR_HOST"] = f"127.0.0.1:{thread.port}"
    try:
        asyncio.run(measure(emulator, args.shards, args.pods, args.lease_ms, args.seconds))
    finally:
        thread.stop()


if __name__ == "__main__":
    main()
