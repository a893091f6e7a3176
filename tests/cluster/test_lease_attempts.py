"""Delivery attempts travel in the lease write that gives a shard up (``writes``: no write of their
own): the pod that takes the shard gets what the document held before its load, and its take
writes the document without them."""

from __future__ import annotations

from lease_harness import SUB_PATH, FakeTime, Member, balanced, wait_until

from sidecar.cluster.leases.layout import lease_path
from sidecar.store.memory_documents import MemoryDocuments

LEASE_MS = 600
SHARDS = 4


class Recorder:
    """An ``Attempts`` carrier: hands ``a<shard>`` for every shard given up, records what it inherits."""

    def __init__(self) -> None:
        self.handed: list[int] = []
        self.inherited: dict[int, str] = {}

    def handed_attempts(self, shard: int) -> str:
        self.handed.append(shard)
        return f"a{shard}"

    def inherit_attempts(self, shard: int, encoded: str) -> None:
        assert shard not in self.inherited, f"shard {shard} inherited twice"
        self.inherited[shard] = encoded


async def test_a_hand_over_records_the_attempts_and_the_pod_that_takes_the_shard_gets_them() -> None:
    clock = FakeTime()
    documents = MemoryDocuments(clock_us=clock.clock_us)
    giving, taking = Recorder(), Recorder()
    leaving = Member(documents, "pod-a", SHARDS, lease_ms=LEASE_MS, monotonic_ms=clock.monotonic_ms, attempts=giving)
    staying = Member(documents, "pod-b", SHARDS, lease_ms=LEASE_MS, monotonic_ms=clock.monotonic_ms, attempts=taking)
    leaving.start()
    try:
        await wait_until(lambda: len(leaving.leases.owned()) == SHARDS, "pod-a holds every shard")
        assert giving.inherited == {}  # documents created free: nothing recorded in them
        staying.start()
        await wait_until(lambda: balanced([leaving, staying], SHARDS), "2 pods balanced")
        balanced_to_b = set(staying.leases.owned())
        assert balanced_to_b and set(giving.handed) >= balanced_to_b
        assert taking.inherited == {shard: f"a{shard}" for shard in balanced_to_b}  # balancing hand-overs

        async def drain(shards: set[int]) -> None:
            return None

        await leaving.leases.release_all(drain)  # SIGTERM
        staying.leases.poke()  # as a Listen on the lease documents would
        await wait_until(lambda: len(staying.leases.owned()) == SHARDS, "pod-b holds every shard")
        assert taking.inherited == {shard: f"a{shard}" for shard in range(SHARDS)}
        # The takes wrote the documents without them: handed on once.
        stored = documents.snapshot()
        assert all("attempts" not in stored[lease_path(SUB_PATH, shard)] for shard in range(SHARDS))
    finally:
        await leaving.stop()
        await staying.stop()
