"""Crash simulation, the recovery defects each as an explicit run on one pod: idle keys past the dedup
TTL, acks above the cursor, late dead letters, unseen creates, forgotten skipped ranges, tombstones,
unblocks and memory bounds across a restart.
"""

from __future__ import annotations

from crash_sim import Simulation
from crash_sim_support import _finish
from sim_world import SUB, Crash, Published, SimConfig

from sidecar.engine.types import Message


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
