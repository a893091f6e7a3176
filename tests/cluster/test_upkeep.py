"""Idle upkeep of the shard leases, counted as Firestore bills it (``MemoryDocuments`` counts reads
and writes as billed, a Listen's reads included): 3 pods, S = 16, each with the Listen on the lease
documents the sidecar runs (``sidecar.wiring.subscription``), over several leases of steady state.

What a round costs is a count, not a time: per pod and round, S + 1 reads (the lease documents and
the pod's member document), one write per held lease plus the member document's beat; the Listens
read each renewal once per pod (at most: a Listen may fold two changes of a document into one).
docs/leases.md, "Figures", turns these counts into operations a second for the default lease."""

from __future__ import annotations

import pytest
from lease_harness import SUB_PATH, FakeTime, Member, balanced, pass_time, wait_until

from sidecar.store import documents as docs
from sidecar.store.memory_documents import MemoryDocuments
from sidecar.wiring.subscription import _listen_leases

LEASE_MS = 600
SHARDS = 16
PODS = 3


@pytest.mark.parametrize("leases", [4])
async def test_idle_upkeep_per_round_is_the_leases_and_the_member_document_read_and_the_held_leases_and_a_beat_written(
    leases: int,
) -> None:
    clock = FakeTime()
    documents = MemoryDocuments(clock_us=clock.clock_us)
    members = [
        Member(documents, f"pod-{i}", SHARDS, lease_ms=LEASE_MS, monotonic_ms=clock.monotonic_ms) for i in range(PODS)
    ]
    listens: list[docs.Listening] = []
    for member in members:
        listens.append(_listen_leases(documents, member.leases, SUB_PATH, "orders"))
        member.start()
    try:
        await wait_until(lambda: balanced(members, SHARDS), "3 pods balanced over 16 shards")
        await pass_time(clock, members, LEASE_MS, LEASE_MS)  # settled: every lease renewed since
        held = {m.name: len(m.leases.owned()) for m in members}
        reads, writes = documents.reads, documents.writes
        rounds = {m.name: m.leases.stats.rounds for m in members}
        renewals = sum(m.leases.stats.renewals for m in members)
        await pass_time(clock, members, LEASE_MS * leases, LEASE_MS)
        await wait_until(lambda: all(m.leases.stats.rounds > rounds[m.name] for m in members), "rounds ran")
        # Every round of the stretch is whole (pass_time waits for them), and nothing changed owner.
        assert {m.name: len(m.leases.owned()) for m in members} == held
        ran = {m.name: m.leases.stats.rounds - rounds[m.name] for m in members}
        renewed = sum(m.leases.stats.renewals for m in members) - renewals
        assert renewed == sum(ran[name] * held[name] for name in ran)
        round_reads = sum(ran.values()) * (SHARDS + 1)
        listen_reads = documents.reads - reads - round_reads
        assert 0 <= listen_reads <= PODS * renewed
        assert documents.writes - writes == renewed + sum(ran.values())  # the renewals, and one beat a round
    finally:
        for listen in listens:
            await listen.close()
        for member in members:
            await member.stop()
