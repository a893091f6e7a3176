"""Example tests of delivery state, one behaviour each: nack backoff, ack deadlines, dead letters
(block or skip), consumers closing, round robin, foreign ids, restore from a snapshot.
"""

from __future__ import annotations

import pytest
from examples_support import ack_all, sequence_engine, taken
from harness import seq_message

from sidecar.engine import DeadLetter, Engine, EngineConfig, EngineSnapshot, KeyCursor, UnknownDelivery


def test_nack_backs_off_exponentially_with_injected_jitter() -> None:
    engine = Engine(
        EngineConfig(mode="sequence", backoff_initial_ms=1_000, backoff_maximum_ms=3_000, max_delivery_attempts=10),
        jitter=lambda: 0.25,
    )
    engine.on_stored(seq_message("k", 1), 0)
    now = 0
    delays = []
    for _ in range(4):
        (delivery,) = engine.take("c", 1, now)
        engine.nack("c", delivery.delivery_id, now)
        due = engine.next_timer_ms()
        assert due is not None
        delays.append(due - now)
        assert taken(engine, now_ms=due - 1) == []
        now = due
        engine.tick(now)
    # min(maximum, initial * 2**(n-1)) * (0.5 + jitter)
    assert delays == [750, 1_500, 2_250, 2_250]


def test_nack_with_several_in_flight_resends_it_and_everything_after_in_order() -> None:
    engine = sequence_engine(max_in_flight_per_key=3)
    for seq in (1, 2, 3):
        engine.on_stored(seq_message("k", seq), 0)
    first, second, third = engine.take("c", 10, 0)
    engine.ack("c", first.delivery_id, 0)
    engine.nack("c", second.delivery_id, 0, retry_after_ms=0)
    with pytest.raises(UnknownDelivery):
        engine.ack("c", third.delivery_id, 0)  # given back with the nacked one
    again = engine.take("c", 10, 0)
    assert [(d.message.sequence, d.attempt) for d in again] == [(2, 2), (3, 2)]


def test_ack_deadline_expiry_counts_as_an_attempt_then_dead_letters() -> None:
    engine = sequence_engine(ack_deadline_ms=1_000, max_delivery_attempts=2, backoff_initial_ms=0)
    engine.on_stored(seq_message("k", 1), 0)
    engine.take("c", 1, 0)
    assert engine.tick(1_000) == []
    (second,) = engine.take("c", 1, 1_000)
    assert second.attempt == 2
    assert engine.tick(2_000) == [DeadLetter(seq_message("k", 1), "max_delivery_attempts", 2, in_order=True)]
    assert engine.status(2_000)[0].counts["expired"] == 2


def test_dead_letter_with_block_stops_the_key() -> None:
    engine = sequence_engine(on_dead_letter="block")
    for seq in (1, 2):
        engine.on_stored(seq_message("k", seq), 0)
    (first,) = engine.take("c", 1, 0)
    (letter,) = engine.nack("c", first.delivery_id, 0, dead_letter=True)
    assert letter.reason == "app_dead_letter"
    engine.dead_letter_done(letter.message, 1)
    assert taken(engine) == []
    _, keys = engine.status(1)
    assert keys[0].state == "blocked_dead_letter"
    assert engine.export().cursors[0].blocked


def test_dead_letter_with_skip_goes_on_with_the_next_message() -> None:
    engine = sequence_engine(on_dead_letter="skip")
    for seq in (1, 2):
        engine.on_stored(seq_message("k", seq), 0)
    (first,) = engine.take("c", 1, 0)
    (letter,) = engine.nack("c", first.delivery_id, 0, dead_letter=True)
    assert taken(engine) == []  # not before the dead letter is durable
    engine.dead_letter_done(letter.message, 1)
    (second,) = engine.take("c", 1, 1)
    assert engine.ack("c", second.delivery_id, 1).cursor == 3


def test_consumer_close_gives_in_flight_back_at_once_but_not_acking_ones() -> None:
    engine = sequence_engine()
    engine.on_stored(seq_message("a", 1), 0)
    engine.on_stored(seq_message("b", 1), 0)
    deliveries = {d.message.key: d for d in engine.take("c", 10, 0)}
    engine.ack("c", deliveries["a"].delivery_id, 0)
    engine.consumer_closed("c", 0)
    assert taken(engine, "other") == [("b", 1)]
    engine.ack_durable([deliveries["a"].delivery_id], 0)
    assert engine.status(0)[0].counts["acked"] == 1


def test_a_key_with_messages_in_flight_stays_on_its_consumer() -> None:
    engine = sequence_engine(max_in_flight_per_key=2)
    for seq in (1, 2):
        engine.on_stored(seq_message("k", seq), 0)
    assert [d.message.sequence for d in engine.take("first", 1, 0)] == [1]
    assert engine.take("second", 10, 0) == []
    assert [d.message.sequence for d in engine.take("first", 10, 0)] == [2]


def test_ready_keys_are_served_round_robin() -> None:
    engine = sequence_engine(max_in_flight_per_key=5)
    for seq in (1, 2, 3):
        engine.on_stored(seq_message("a", seq), 0)
    engine.on_stored(seq_message("b", 1), 0)
    assert taken(engine)[:2] == [("a", 1), ("b", 1)]


def test_unknown_or_foreign_delivery_ids_are_refused() -> None:
    engine = sequence_engine()
    engine.on_stored(seq_message("k", 1), 0)
    (delivery,) = engine.take("c", 1, 0)
    with pytest.raises(UnknownDelivery):
        engine.ack("someone-else", delivery.delivery_id, 0)
    with pytest.raises(UnknownDelivery):
        engine.nack("c", "no-such-id", 0)


def test_restore_rebuilds_from_cursors_and_pending_and_redelivers_in_flight() -> None:
    engine = sequence_engine()
    for seq in (1, 2, 4):
        engine.on_stored(seq_message("k", seq), 0)
    ack_all(engine)
    engine.take("c", 1, 0)  # 2 in flight at the crash
    restored = Engine.restore(EngineConfig(mode="sequence"), engine.export(), 5, id_prefix="r-")
    (delivery,) = restored.take("c", 10, 5)
    assert (delivery.message.sequence, delivery.delivery_id, delivery.attempt) == (2, "r-1", 1)
    assert restored.status(5)[0].buffered == 2


def test_restore_reports_pending_messages_below_the_cursor_on_the_first_tick() -> None:
    snapshot = EngineSnapshot(cursors=(KeyCursor("k", next_sequence=3),), pending=(seq_message("k", 1),))
    restored = Engine.restore(EngineConfig(mode="sequence", on_late="deliver"), snapshot, 7)
    assert restored.next_timer_ms() == 7
    # Below a restored cursor the engine cannot tell skipped from acked: never delivered (G3), not dropped (G1).
    assert restored.tick(7) == [DeadLetter(seq_message("k", 1), "below_cursor", 0)]


def test_forgotten_skipped_ranges_are_dead_lettered_not_dropped() -> None:
    engine = Engine(EngineConfig(mode="sequence", gap_timeout_ms=10, on_gap_timeout="skip", on_late="deliver"))
    seq, now = 1, 0
    for _ in range(70):  # 70 gaps skipped: more ranges than the engine remembers
        engine.on_stored(seq_message("k", seq + 1), now)
        now += 10
        engine.tick(now)
        (delivery,) = engine.take("c", 1, now)
        engine.ack("c", delivery.delivery_id, now)
        engine.ack_durable([delivery.delivery_id], now)
        seq += 2
    # Sequence 1 was skipped first, and its range forgotten since: it must not vanish.
    (action,) = engine.on_stored(seq_message("k", 1), now)
    assert action == DeadLetter(seq_message("k", 1), "below_cursor", 0)
    # A recently skipped one is still known: delivered, flagged late.
    assert engine.on_stored(seq_message("k", seq - 2), now) == []
