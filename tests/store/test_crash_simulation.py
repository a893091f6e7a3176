"""Crash at any point between two store writes, recover, go on: G1-G3 and liveness hold (crash_sim.py).

The property test is deterministic (derandomized) and sized for ``make test``; set
``CRASH_SIM_EXAMPLES`` (e.g. 5000) to explore longer. Each defect the recovery rules fix is kept
below as an explicit example, named for the rule it pins down.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from crash_sim import Simulation
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_world import SUB, Crash, Published, SimConfig

from sidecar.engine.types import Message

_EXAMPLES = int(os.environ.get("CRASH_SIM_EXAMPLES", "150"))
_PAGED_EXAMPLES = int(os.environ.get("CRASH_SIM_EXAMPLES", "80"))


@st.composite
def sim_configs(draw: st.DrawFn) -> SimConfig:
    keys = draw(st.integers(1, 3))
    per_key = draw(st.integers(1, 6))
    identities = [(f"k{k}", seq) for k in range(keys) for seq in range(1, per_key + 1)]
    skip = draw(st.booleans())
    unpublished = frozenset(draw(st.sets(st.sampled_from(identities), max_size=2))) if skip else frozenset()
    conflicts = frozenset(draw(st.sets(st.sampled_from(identities), max_size=2))) - unpublished
    return SimConfig(
        keys=keys,
        per_key=per_key,
        max_in_flight=draw(st.integers(1, 3)),
        max_attempts=draw(st.integers(1, 3)),
        on_dead_letter=draw(st.sampled_from(["block", "skip"])),
        gap_timeout_ms=1_000 if skip else None,
        on_gap_timeout="skip" if skip else "hold",
        on_late=draw(st.sampled_from(["dead_letter", "deliver"])),
        unpublished=unpublished,
        conflicts=conflicts,
        malformed=draw(st.integers(0, 1)),
        tombstones_per_commit=draw(st.integers(1, 3)),
        max_held_bytes=draw(st.sampled_from([None, 0, 20])),
        max_idle_keys=draw(st.sampled_from([0, 1, 10_000])),
        pods=draw(st.integers(1, 3)),
        shards=draw(st.integers(1, 3)),
        fast_path=draw(st.booleans()),
        paged=draw(st.booleans()),
        page_size=draw(st.integers(1, 3)),
    )


_STEPS = st.lists(st.tuples(st.sampled_from(Simulation.OPS), st.integers(0, 1_000)), max_size=120)


@settings(
    max_examples=_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(config=sim_configs(), steps=_STEPS)
def test_any_crash_point_keeps_every_guarantee(config: SimConfig, steps: list[tuple[str, int]]) -> None:
    Simulation(config).run(steps)


# Paged recoveries only, in longer runs with more crashes, take-overs and pages: the short runs
# above rarely crash with messages pending, and a paged load matters only when pages race the
# acks, dead letters, drops, flushes and intake of the shard that is loading.
_PAGED_STEPS = st.lists(
    st.tuples(st.sampled_from((*Simulation.OPS, "crash", "take_over", "page", "page")), st.integers(0, 1_000)),
    min_size=30,
    max_size=120,
)


@settings(
    max_examples=_PAGED_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(config=sim_configs().map(lambda config: dataclasses.replace(config, paged=True)), steps=_PAGED_STEPS)
def test_any_crash_point_keeps_every_guarantee_while_pages_are_read(
    config: SimConfig, steps: list[tuple[str, int]]
) -> None:
    Simulation(config).run(steps)


# ---- the recovery defects, each as an explicit run ---------------------------------------------------


def _finish(sim: Simulation) -> None:
    try:
        sim.drain()
        sim.check_end()
    finally:
        sim.close()


def test_a_an_idle_key_outlives_the_dedup_ttl() -> None:
    """A key's cursor never expires: after a TTL sweep and a restart, its next message is delivered."""
    sim = Simulation(SimConfig(keys=1, per_key=2))
    sim.ingest_all()
    for seq in (1, 2):
        sim.take()
        sim.ack("k0", seq)
        sim.settle()
    sim.step("expire", 0)  # far past the dedup TTL: every tombstone is deleted
    assert not sim.finished_documents()
    sim.step("crash", 0)
    sim.publish(Published("k0", 3))
    sim.ingest_all()
    (delivery,) = sim.take()
    assert delivery.message.sequence == 3, "the key restarted at its start: its cursor expired"
    _finish(sim)


def test_b_acks_above_the_cursor_survive_a_restart() -> None:
    """Out-of-order acks with a window: 2 acked before 1, crash; once 1 is acked, 3 follows at once."""
    sim = Simulation(SimConfig(keys=1, per_key=3, max_in_flight=2))
    sim.ingest_all()
    sim.take()
    sim.ack("k0", 2)
    sim.settle()
    sim.step("crash", 0)
    # The window of 2 holds 1 (back for redelivery) and 3: 2 is already acked, nothing waits for it.
    assert [d.message.sequence for d in sim.take()] == [1, 3], "3 waits for 2, which is already acked"
    sim.ack("k0", 1)
    sim.ack("k0", 3)
    sim.settle()
    assert {("k0", 1), ("k0", 3)} <= sim.confirmed
    _finish(sim)


def test_c_a_late_dead_letter_never_blocks_its_key_after_a_restart() -> None:
    """A late message dead-lettered while its key's next message is in flight, then a crash: not blocked."""
    sim = Simulation(
        SimConfig(keys=1, per_key=3, gap_timeout_ms=1_000, on_gap_timeout="skip", unpublished=frozenset({("k0", 1)}))
    )
    sim.ingest_all()
    sim.step("tick", 2)  # the gap at 1 times out: 2 goes out with 1 skipped
    (second,) = sim.take()
    assert second.message.sequence == 2 and second.skipped
    sim.publish(Published("k0", 1))  # 1 shows up late: dead-lettered aside
    sim.ingest_all()
    sim.dead_letter_all()
    assert [reason for _, reason in sim.dead_letter_topic] == ["late"]
    sim.step("crash", 0)
    (again,) = sim.take()
    assert again.message.sequence == 2, "the key came back blocked by the late dead letter"
    _finish(sim)


def test_d_a_create_that_applied_unseen_reaches_the_engine_without_a_restart() -> None:
    """BatchWrite applied, its answer lost: the redelivered copy finds it pending and hands it over."""
    sim = Simulation(SimConfig(keys=1, per_key=2))
    sim.step("lose_answer", 0)
    sim.step("ingest", 0)  # persists k0/1 (the oldest copy) but hears a failure: not acked
    assert ("k0", 1) in sim.pending_documents() and sim.life.engine.status(sim.now_ms)[0].buffered == 0
    sim.ingest_all()  # the redelivery: ALREADY_EXISTS, pending -> the engine
    assert [d.message.sequence for d in sim.take()] == [1]
    assert sim.crashes == 0
    _finish(sim)


def test_e_a_message_from_a_forgotten_skipped_range_is_dead_lettered_not_dropped() -> None:
    """Past the skipped ranges a key remembers, an arrival from the oldest one is never lost silently."""
    gaps = frozenset(("k0", seq) for seq in range(1, 140, 2))  # 70 gaps, each skipped in turn
    sim = Simulation(SimConfig(keys=1, per_key=140, gap_timeout_ms=1_000, on_gap_timeout="skip", unpublished=gaps))
    for _ in range(70):
        sim.ingest_all()
        sim.step("tick", 2)
        for delivery in sim.take():
            sim.ack(delivery.message.key, delivery.message.sequence)  # type: ignore[arg-type]
        sim.settle()
    sim.publish(Published("k0", 1))
    sim.ingest_all()
    sim.dead_letter_all()
    assert (Published("k0", 1).incoming().message_id, "below_cursor") in {
        (m.message_id, reason) for m, reason in sim.dead_letter_topic if not isinstance(m, Published)
    }
    _finish(sim)


def test_g_a_cursor_is_never_durable_ahead_of_a_tombstone() -> None:
    """Acks of one key split over two Commits, crash between them: the later message comes back in order."""
    sim = Simulation(SimConfig(keys=1, per_key=3, max_in_flight=2, tombstones_per_commit=1))
    sim.ingest_all()
    sim.take()
    store, engine = sim.life.store, sim.life.engine
    first, second = sim.delivery_of("k0", 1), sim.delivery_of("k0", 2)
    intent_2 = engine.ack(second.consumer, second.delivery_id, sim.now_ms)
    intent_1 = engine.ack(first.consumer, first.delivery_id, sim.now_ms)
    assert intent_1.cursor == 3
    # The store must not depend on the order it is handed: 1 (cursor 3) first, 2's tombstone after.
    sim.step("arm_crash", 1)  # crash right after the first Commit applied
    try:
        sim._run(store.commit_acks("s", [intent_1, intent_2], sim.now_ms))
    except Crash:
        sim.crash()
    assert sim.crashes == 1
    deliveries = sim.take()
    assert [d.message.sequence for d in deliveries] == [2, 3], "2 was passed by a cursor and became late"
    _finish(sim)


def test_h_a_copy_of_a_confirmed_message_past_the_dedup_ttl_is_never_delivered() -> None:
    """G3 beyond the TTL: dropped as a duplicate, before a restart (the engine remembers) and after it
    (the key's cursor record says every sequence below it was finished, none skipped)."""
    sim = Simulation(SimConfig(keys=1, per_key=1, on_late="deliver"))
    sim.ingest_all()
    sim.take()
    sim.ack("k0", 1)
    sim.settle()
    sim.step("expire", 0)
    sim.step("redeliver", 0)
    sim.ingest_all()
    assert sim.take() == [] and sim.life.engine.status(sim.now_ms)[0].counts["duplicates"] == 1
    sim.settle()
    sim.step("expire", 0)
    sim.step("crash", 0)
    sim.step("redeliver", 0)
    sim.ingest_all()
    assert sim.take() == [] and sim.life.engine.status(sim.now_ms)[0].counts["duplicates"] == 1
    sim.dead_letter_all()
    assert sim.dead_letter_topic == []
    _finish(sim)


def test_o_a_copy_from_a_skipped_range_is_late_after_a_restart_and_an_acked_one_a_duplicate() -> None:
    """The cursor record keeps the ranges a gap timeout skipped: after a restart a copy from one is
    late (``on_late``), a copy of an acked sequence a duplicate."""
    sim = Simulation(
        SimConfig(keys=1, per_key=4, gap_timeout_ms=1_000, on_gap_timeout="skip", unpublished=frozenset({("k0", 2)}))
    )
    sim.ingest_all()
    sim.take()
    sim.ack("k0", 1)
    sim.settle()
    sim.step("tick", 2)  # past the gap timeout: 2 is skipped
    for seq in (3, 4):
        sim.take()
        sim.ack("k0", seq)
        sim.settle()
    sim.step("flush", 0)
    sim.step("expire", 0)  # past the dedup TTL: the tombstones are gone, only the cursor record knows
    sim.step("crash", 0)
    cursor = sim.life.store.cursor(SUB, "k0")
    assert cursor is not None and cursor.next_sequence == 5
    assert (cursor.known_from, cursor.skipped) == (1, ((2, 2),))
    sim.publish(Published("k0", 2))  # the skipped one, at last
    sim.step("redeliver", 0)  # and a copy of 1, acked long ago
    sim.ingest_all()
    sim.dead_letter_all()
    assert [(m.sequence, reason) for m, reason in sim.dead_letter_topic if isinstance(m, Message)] == [(2, "late")]
    assert sim.life.engine.status(sim.now_ms)[0].counts["duplicates"] == 1
    _finish(sim)


def test_j_recovery_ends_after_dead_letters_in_a_row() -> None:
    """skip, 2 attempts: #1 dead-lettered by the app, #2 after its attempts, #3 in flight, kill -9."""
    sim = Simulation(SimConfig(keys=1, per_key=3, on_dead_letter="skip", max_attempts=2))
    sim.ingest_all()
    sim.take()
    sim.nack("k0", 1, dead_letter=True)
    sim.dead_letter_all()
    for _ in range(2):
        sim.step("tick", 1)
        sim.take()
        sim.nack("k0", 2)
    sim.dead_letter_all()
    sim.step("tick", 1)
    (third,) = sim.take()
    assert third.message.sequence == 3
    reads = sim.documents.reads
    sim.step("crash", 0)
    assert sim.documents.reads - reads < 10, "recovery kept reading"
    (again,) = sim.take()
    assert again.message.sequence == 3
    _finish(sim)


def test_u_an_unblock_survives_crashes_before_and_after_its_write() -> None:
    """Blocked at 2 (3 in flight with a window of 2): a crash before the unblock's write leaves the key
    blocked; after it, the key is never blocked again and 3, then 4, are delivered."""
    sim = Simulation(SimConfig(keys=1, per_key=4, max_in_flight=2, on_dead_letter="block"))
    sim.ingest_all()
    assert [d.message.sequence for d in sim.take()] == [1, 2]
    sim.ack("k0", 1)
    sim.settle()
    assert [d.message.sequence for d in sim.take()] == [3]
    sim.nack("k0", 2, dead_letter=True)
    sim.dead_letter_all()
    assert sim.life.engine.is_blocked("k0")
    sim.step("crash", 0)
    assert sim.life.engine.is_blocked("k0") and sim.take() == []
    sim.step("arm_crash", 0)  # crash before the unblock's Commit: nothing recorded
    sim.step("unblock", 0)
    assert sim.crashes == 2 and sim.life.engine.is_blocked("k0")
    sim.step("arm_crash", 1)  # crash right after it: recorded
    sim.step("unblock", 0)
    assert sim.crashes == 3 and not sim.life.engine.is_blocked("k0")
    assert [d.message.sequence for d in sim.take()] == [3, 4]
    _finish(sim)


def test_v_an_unblocked_key_without_a_crash_goes_on_in_order() -> None:
    sim = Simulation(SimConfig(keys=1, per_key=3, on_dead_letter="block"))
    sim.ingest_all()
    sim.take()
    sim.nack("k0", 1, dead_letter=True)
    sim.dead_letter_all()
    sim.step("unblock", 0)
    assert [d.message.sequence for d in sim.take()] == [2]
    sim.ack("k0", 2)
    sim.settle()
    sim.step("crash", 0)
    assert [d.message.sequence for d in sim.take()] == [3]
    _finish(sim)


def test_i_held_payloads_and_idle_keys_stay_within_memory_bounds_across_a_restart() -> None:
    """One key held behind a gap past a tiny budget: payloads stay in the store (also after a restart)
    and arrive intact in order; an idle key is forgotten and rebuilt from its durable cursor."""
    sim = Simulation(
        SimConfig(keys=2, per_key=6, max_held_bytes=0, max_idle_keys=0, unpublished=frozenset({("k0", 1)}))
    )
    sim.ingest_all()
    for _ in range(6):  # k1 runs through and goes idle: forgotten at once (max_idle_keys 0)
        for delivery in sim.take("c1"):
            sim.ack(delivery.message.key, delivery.message.sequence)  # type: ignore[arg-type]
        sim.settle()
    assert {("k1", seq) for seq in range(1, 7)} <= sim.confirmed
    status = sim.life.engine.status(sim.now_ms)[0]
    assert status.keys == 1 and status.counts["keys_evicted"] >= 1  # only k0 (held) is in memory
    held = sim.life.engine.export().pending
    assert len(held) == 5 and all(m.payload is not None and m.payload.stripped for m in held)
    sim.step("crash", 0)
    reloaded = sim.life.engine.export().pending
    assert len(reloaded) == 5 and all(m.payload is not None and m.payload.stripped for m in reloaded)
    sim.publish(Published("k0", 1))
    sim.publish(Published("k1", 7))  # the forgotten key, rebuilt from its cursor: 7 follows 6
    sim.ingest_all()
    deliveries = sim.take("c0", 20)
    assert sorted((d.message.key, d.message.sequence) for d in deliveries) == [("k0", 1), ("k1", 7)]
    _finish(sim)


# ---- several owners: handovers and fencing ---------------------------------------------------------


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


# ---- skipped ranges only from the engine, drops only over pending records -----------------------


def test_27a_a_fast_path_ack_committed_beside_a_later_stored_one_is_no_skip_after_a_restart() -> None:
    """No gap timeout: 1 takes the fast path, 2 (stored first, out of order) is delivered after it;
    both acks go in one ``commit_acks``, whose stored ack 2 (cursor 3) is folded and checkpointed
    before the fast-path ack of 1. Killed before 1's checkpoint: 1 comes back from Pub/Sub below the
    cursor, a duplicate (dropped), never a ``late`` dead letter (nothing was ever skipped)."""
    sim = Simulation(SimConfig(keys=1, per_key=2, fast_path=True))
    sim.step("ingest", 3)  # the copy of 2: out of order, stored
    sim.step("pubsub_ack", 0)
    sim.step("ingest", 0)  # the copy of 1: the fast path (no document)
    assert sim.pending_documents() == {("k0", 2)} and len(sim.life.fast) == 1
    for seq in (1, 2):
        assert [d.message.sequence for d in sim.take()] == [seq]
        sim.ack("k0", seq)
    sim.step("commit_acks", 0)  # ack 2's Commit writes the checkpoint; ack 1 waits for the next one
    sim.step("crash", 0)
    cursor = sim.life.store.cursor(SUB, "k0")
    assert cursor is not None and (cursor.next_sequence, cursor.skipped) == (3, ()), "1 recorded as skipped"
    sim.ingest_all()  # Pub/Sub delivers 1 again: its ack was never confirmed
    sim.dead_letter_all()
    assert sim.dead_letter_topic == [], "a duplicate of a delivered message was dead-lettered"
    assert sim.life.engine.status(sim.now_ms)[0].counts["duplicates"] == 1
    _finish(sim)


def test_27a_a_range_a_gap_timeout_skipped_stays_skipped_when_a_later_ack_is_durable_first() -> None:
    """Gap skip: 1 missing, 2 delivered past it. Its ack's Commit applies but its answer is lost,
    3's ack (cursor 4) is durable first and checkpointed: that ack carried the skipped range too
    (no ack can be sure to be the first the store folds). Killed: 1 arrives at last, late."""
    sim = Simulation(
        SimConfig(keys=1, per_key=3, gap_timeout_ms=1_000, on_gap_timeout="skip", unpublished=frozenset({("k0", 1)}))
    )
    sim.ingest_all()
    sim.step("tick", 2)  # past the gap timeout: 1 is skipped
    (second,) = sim.take()
    assert second.message.sequence == 2 and [(s.first, s.last) for s in second.skipped] == [(1, 1)]
    sim.ack("k0", 2)
    sim.step("lose_answer", 0)
    sim.step("commit_acks", 0)  # applied, the answer lost: the runtime retries it later
    assert sim.life.acks and ("k0", 2) not in sim.confirmed
    retried, sim.life.acks = sim.life.acks, []
    assert [d.message.sequence for d in sim.take()] == [3]  # the app's ack freed the key's slot
    sim.ack("k0", 3)
    sim.step("commit_acks", 0)
    sim.life.acks = retried
    sim.step("crash", 0)  # before the retry of 2's ack
    cursor = sim.life.store.cursor(SUB, "k0")
    assert cursor is not None and (cursor.next_sequence, cursor.skipped) == (4, ((1, 1),))
    sim.publish(Published("k0", 1))
    sim.ingest_all()
    sim.dead_letter_all()
    assert [(m.sequence, reason) for m, reason in sim.dead_letter_topic if isinstance(m, Message)] == [(1, "late")]
    _finish(sim)


def test_27_3_a_stale_copy_of_an_acked_message_never_replaces_its_tombstone() -> None:
    """2's ack is durable on its tombstone only (the checkpoint was written a moment before, with
    1's ack). A stale copy of 2 (a read-back that raced the ack, a Listen snapshot older than it)
    reaches the engine, which drops it; the drop must not replace the acked tombstone, which
    carries the key's cursor: killed before the next checkpoint, 3 must still be delivered."""
    sim = Simulation(SimConfig(keys=1, per_key=3))
    sim.step("ingest", 0)  # 1 only
    sim.step("pubsub_ack", 0)
    sim.take()
    sim.ack("k0", 1)
    sim.step("commit_acks", 0)  # tombstone 1 and the shard's checkpoint (next 2)
    sim.ingest_all()
    (second,) = sim.take()
    sim.ack("k0", 2)
    sim.step("tick", 0)  # 10 ms: the checkpoint is not due again
    sim.step("commit_acks", 0)  # tombstone 2 (cursor 3) only
    sim.life.seen = [second.message]
    sim.step("stale_copy", 0)
    assert sim.life.drops == [second.message], "the engine finishes the stale copy's record"
    sim.step("drops", 0)
    assert sim.documents.docs[f"pubsub-sidecar/{SUB}/messages/{second.message.payload.ref}"]["state"] == "acked"  # type: ignore[union-attr]
    sim.step("crash", 0)
    assert [d.message.sequence for d in sim.take()] == [3], "the key waits for 2, which is finished"
    _finish(sim)


def _ack_retried_across_a_re_take(sim: Simulation) -> None:
    """k0/1 delivered and acked; its Commit fails in a brownout and is retried after the lease
    moved to this very pod at epoch + 1 and the pod reloaded the shard (k0/1 pending there)."""
    sim.ingest_all()
    (delivery,) = sim.take()
    assert delivery.message.sequence == 1
    sim.ack("k0", 1)
    sim.step("brownout", 0)  # the next write fails before it applies
    sim.step("commit_acks", 0)  # refused by Firestore: the runtime retries it
    assert sim.unavailable == 1 and not sim.confirmed
    sim.step("lose_lease", 0)  # one pod: the lease goes to p0 itself, epoch 2 (its margin ran out)
    sim.step("take_over", 0)  # p0 takes the shard back and reloads it: k0/1 is still pending
    assert sim.handovers == 1
    sim.step("commit_acks", 0)  # the retry, now that Firestore answers


def test_27_1_an_ack_retried_across_a_re_take_is_refused_not_confirmed() -> None:
    """Case 1: the retried ack is refused (its engine is gone, and the store holds the shard at
    epoch 2), so it is never confirmed; the epoch-2 engine delivers k0/1 again, which G3 allows."""
    sim = Simulation(SimConfig(keys=1, per_key=2))
    _ack_retried_across_a_re_take(sim)
    assert ("k0", 1) not in sim.confirmed and sim.stale_acks == 1
    (again,) = sim.take()
    assert again.message.sequence == 1
    _finish(sim)


def test_27_1_without_the_epoch_rule_the_simulation_finds_a_confirmed_ack_delivered_again() -> None:
    """The same run with the code before the rule (writes fenced with the epoch the pod holds when
    they are sent): the retry passes the epoch-2 fence, the ack is confirmed, and the epoch-2
    engine delivers k0/1 again: the check on every delivery catches it."""
    sim = Simulation(SimConfig(keys=1, per_key=2, epoch_rule=False))
    _ack_retried_across_a_re_take(sim)
    assert ("k0", 1) in sim.confirmed
    with pytest.raises(AssertionError, match="G3"):
        sim.take()
    sim.close()


# Fast-path acks beside stored ones, lost answers, stale copies of finished records, drops and
# crashes, on one pod with no skip policy (the fast path on or off): where a ``late`` dead letter
# can only be a mistake (the check in ``Simulation._apply``) and a drop over a finished record
# stalls a key after a restart.
_FOCUSED_OPS = (
    *("ingest", "ingest", "pubsub_ack", "take", "take", "app_ack", "app_ack", "commit_acks", "commit_acks"),
    *("flush", "tick", "crash", "arm_crash", "lose_answer", "redeliver", "stale_copy", "drops", "page"),
)


@st.composite
def _focused_configs(draw: st.DrawFn) -> SimConfig:
    return SimConfig(
        keys=draw(st.integers(1, 2)),
        per_key=draw(st.integers(2, 5)),
        max_in_flight=draw(st.integers(1, 2)),
        fast_path=draw(st.booleans()),
        paged=draw(st.booleans()),
        page_size=draw(st.integers(1, 3)),
    )


@settings(
    max_examples=_PAGED_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    config=_focused_configs(),
    steps=st.lists(st.tuples(st.sampled_from(_FOCUSED_OPS), st.integers(0, 1_000)), min_size=20, max_size=80),
)
def test_27_fast_path_acks_stale_copies_and_crashes_keep_every_guarantee(
    config: SimConfig, steps: list[tuple[str, int]]
) -> None:
    Simulation(config).run(steps)
