"""Idle upkeep of the shard leases, counted as Firestore bills it (``MemoryDocuments`` counts reads
and writes as billed, a Listen's reads included): 3 pods, S = 16, each with the Listen on the lease
documents the sidecar runs (``sidecar.wiring.subscription``), over many rounds of steady state.

What a round costs is a count, not a time: per pod and round, one read of its own member document
and of each other pod's (P reads), one write (its beat), and nothing on the Listens (no lease
document changes). Nothing grows with S. docs/leases.md, "Figures", turns these counts into
operations a second for the default lease (a round every half lease): (3 + 1) / 5 s = 0.8.

The clock the database and the pods share stands still (``FakeTime``): the rounds come on the
event loop's own timer, so no lease or margin can run out however slowly they come."""

from __future__ import annotations

from lease_harness import FakeTime, Member, balanced, wait_until

from sidecar.store.memory_documents import MemoryDocuments

LEASE_MS = 600
SHARDS = 16
PODS = 3
ROUNDS = 8
"""Rounds each pod runs in the counted stretch (one every half lease of the event loop's time)."""


async def test_idle_upkeep_per_pod_and_round_is_one_read_per_pod_and_one_write_and_nothing_grows_with_s() -> None:
    clock = FakeTime()
    documents = MemoryDocuments(clock_us=clock.clock_us)
    members = [
        Member(documents, f"pod-{i}", SHARDS, lease_ms=LEASE_MS, monotonic_ms=clock.monotonic_ms) for i in range(PODS)
    ]
    for member in members:
        member.start()
    try:
        await wait_until(lambda: balanced(members, SHARDS), "3 pods balanced over 16 shards")
        settled = [m.leases.stats.rounds + 2 for m in members]  # every full round the balancing asked for is over
        await wait_until(
            lambda: all(m.leases.stats.rounds >= n for m, n in zip(members, settled, strict=True)), "settled"
        )
        held = {m.name: m.leases.owned() for m in members}
        start = [m.leases.stats.rounds for m in members]
        reads, writes = documents.reads, documents.writes
        await wait_until(
            lambda: all(m.leases.stats.rounds >= n + ROUNDS for m, n in zip(members, start, strict=True)),
            f"{ROUNDS} more rounds of every pod",
        )
        read, written = documents.reads - reads, documents.writes - writes
        ran = sum(m.leases.stats.rounds for m in members) - sum(start)
        assert {m.name: m.leases.owned() for m in members} == held  # nothing changed hands
        # A round whose read was counted but not its write (or not yet counted at all) may straddle
        # either end of the stretch: one per pod at each end.
        assert abs(written - ran) <= 2 * PODS
        assert abs(read - PODS * ran) <= 2 * PODS * PODS
        assert read + written <= (PODS + 1) * (ran + 2 * PODS)  # no lease document read, nothing on the Listens
    finally:
        for member in members:
            await member.stop()
