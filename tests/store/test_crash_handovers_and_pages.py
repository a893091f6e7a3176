"""Crash simulation with several owners and recovery by pages: a paused owner advances nothing, intake
by another pod reaches the owner, commits over two shards, and pages racing acks and intake.
"""

from __future__ import annotations

from crash_sim import Simulation
from crash_sim_support import _finish
from sim_world import SimConfig


def test_k_a_paused_owner_that_wakes_advances_nothing() -> None:
    """p0 holds k0/1 in flight; its lease goes to p1, which loads the shard and confirms 1 and 2. p0
    wakes, its app acks 1: the Commit is fenced, nothing of it applies, and p0 drops the shard."""
    sim = Simulation(SimConfig(keys=1, per_key=3, pods=2))
    sim.ingest_all()
    (old,) = sim.take()
    assert old.message.sequence == 1
    sim.step("lose_lease", 0)  # p1 takes shard 0 (epoch 2) behind p0's back
    assert sim.take() == [], "p0 delivered a shard whose lease it lost"
    sim.step("take_over", 0)  # focus moves to p1, which loads shard 0
    assert sim.active == 1 and sim.handovers == 1
    (again,) = sim.take()
    assert again.message.sequence == 1  # p0's delivery was never confirmed: delivered again (G3 allows)
    sim.ack("k0", 1)
    sim.settle()
    assert ("k0", 1) in sim.confirmed
    sim.step("focus", 0)
    sim.step("app_ack", 0)  # p0's app acks its copy of 1: accepted by p0's engine...
    tombstones = sim.snapshot_of_messages()
    sim.step("commit_acks", 0)  # ...but refused by Firestore: p0's epoch is no longer current
    assert sim.fenced_writes == 1 and 0 not in sim.life.engines and sim.snapshot_of_messages() == tombstones
    sim.step("flush", 0)
    sim.step("focus", 1)
    assert [d.message.sequence for d in sim.take()] == [2]
    _finish(sim)


def test_l_intake_by_another_pod_reaches_the_owner_through_its_inbox() -> None:
    """p1 ingests k0's messages while p0 owns shard 0: stored with ``inbox``, handed over by p0's Listen."""
    sim = Simulation(SimConfig(keys=1, per_key=2, pods=2))
    sim.step("focus", 1)
    sim.ingest_all()
    pending = [f for f in sim.documents.docs.values() if f.get("state") == "pending"]
    assert len(pending) == 2 and all(f["inbox"] == 0 and f["shard"] == 0 for f in pending)
    assert sim.take() == []  # p1 does not deliver shard 0
    sim.step("focus", 0)
    assert sim.take() == [], "p0 knew of the messages without its Listen"
    sim.step("listen", 0)
    assert [d.message.sequence for d in sim.take()] == [1]
    _finish(sim)


def test_m_a_commit_over_two_shards_applies_the_one_still_held() -> None:
    """Acks of k0 (shard 0) and k2 (shard 1) in one call after shard 1 was lost: k0's ack is durable
    and confirmed, k2's is not (ShardLost names shard 1) and its new owner delivers it again."""
    sim = Simulation(SimConfig(keys=3, per_key=1, pods=2, shards=2))
    sim.ingest_all()
    sim.take("c0", 10)
    sim.ack("k0", 1)
    sim.ack("k2", 1)
    sim.step("lose_lease", 1)  # shard 1 to p1
    sim.step("commit_acks", 0)
    assert ("k0", 1) in sim.confirmed and ("k2", 1) not in sim.confirmed
    assert sim.fenced_writes == 1 and set(sim.life.engines) == {0}
    sim.step("take_over", 1)
    assert [d.message.key for d in sim.take()] == ["k2"]
    _finish(sim)


def test_n_a_copy_ingested_by_a_non_owner_addresses_a_pending_document_to_the_owner() -> None:
    """p0 stored k0/1 as its owner (no ``inbox``); a redelivered copy ingested by p1, which does not own
    shard 0, finds the document pending without ``inbox`` and merges it in before it is acked."""
    sim = Simulation(SimConfig(keys=1, per_key=1, pods=2))
    sim.ingest_all()  # p0 owns shard 0: no inbox
    (path,) = [p for p, f in sim.documents.docs.items() if f.get("state") == "pending"]
    assert "inbox" not in sim.documents.docs[path]
    sim.step("redeliver", 0)
    sim.step("focus", 1)
    sim.ingest_all()  # p1 does not own shard 0: its copy finds the pending document
    assert sim.documents.docs[path]["inbox"] == 0
    _finish(sim)


# ---- recovery by pages --------------------------------------------------------------------------


def test_p_pages_race_acks_and_intake_and_each_record_reaches_the_engine_once() -> None:
    """Crash with 2..4 pending, recover by pages of one document: before any page is read a
    redelivered copy of 3 is handed over by the intake (its page then leaves it out), and each page
    is delivered and acked (tombstone and cursor written) before the next page is read."""
    sim = Simulation(SimConfig(keys=1, per_key=4, paged=True, page_size=1))
    sim.finish_loads()  # the first start's load: nothing stored yet
    sim.ingest_all()
    sim.take()
    sim.ack("k0", 1)
    sim.settle()
    sim.step("crash", 0)
    assert sim.life.engine.loading and sim.take() == [], "delivered before its page was read"
    sim.step("redeliver", 2)  # a copy of k0/3: ALREADY_EXISTS, still pending, handed to the engine
    sim.ingest_all()
    assert sim.left_out == 0 and sim.take() == [], "3 went out before 2"
    delivered = []
    for _ in range(10):
        sim.step("page", 0)
        for delivery in sim.take():
            delivered.append((delivery.message.sequence, sim.life.engine.loading))
            sim.ack("k0", delivery.message.sequence)  # type: ignore[arg-type]
            sim.settle()  # its tombstone and the cursor are written while later pages are unread
        if not sim.life.loads:
            break
    assert not sim.life.loads and sim.pages_restored == 3 and sim.left_out == 1
    # 2 as soon as its page was restored; 3, stored meanwhile, at the end of the load; 4 after 3.
    assert delivered == [(2, True), (3, False)]
    assert [d.message.sequence for d in sim.take()] == [4]
    sim.ack("k0", 4)
    sim.settle()
    assert {("k0", seq) for seq in (1, 2, 3, 4)} <= sim.confirmed
    _finish(sim)
