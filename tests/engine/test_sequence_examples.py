"""Example tests of sequence mode, one behaviour each: gaps held and skipped, one message per key in
flight, duplicates and conflicting copies, late messages, ``first_sequence: any``.
"""

from __future__ import annotations

import pytest
from examples_support import ack_all, sequence_engine, taken
from harness import seq_message

from sidecar.engine import DeadLetter, DropDuplicate, Engine, EngineConfig, Hold, SkippedRange


def test_gap_is_held_until_missing_sequence_arrives() -> None:
    engine = sequence_engine()
    assert engine.on_stored(seq_message("k", 2), 0) == [Hold(seq_message("k", 2), "missing sequence 1")]
    assert taken(engine) == []
    assert engine.on_stored(seq_message("k", 1), 0) == []
    assert ack_all(engine) == [("k", 1)]
    assert ack_all(engine) == [("k", 2)]


def test_one_message_per_key_in_flight_until_the_app_acked_it() -> None:
    engine = sequence_engine()
    for seq in (1, 2, 3):
        engine.on_stored(seq_message("k", seq), 0)
    (first,) = engine.take("c", 10, 0)
    assert taken(engine) == []  # in flight: the slot is taken
    intent = engine.ack("c", first.delivery_id, 0)
    assert intent.cursor == 2
    # The app's ack frees the slot (G2); the ack becoming durable is the store's business.
    (second,) = engine.take("c", 10, 0)
    assert second.message.sequence == 2 and taken(engine) == []
    assert engine.ack("c", second.delivery_id, 0).cursor == 3
    status = engine.status(0)[0]
    assert (status.in_flight, status.ready) == (0, 1)  # the acking two hold no slot: the third is ready
    engine.ack_durable([second.delivery_id], 1)  # durable out of order: the cursor waits for the first
    assert engine.export().cursors[0].next_sequence == 1
    engine.ack_durable([first.delivery_id], 1)
    assert engine.export().cursors[0].next_sequence == 3


def test_duplicate_below_cursor_or_pending_is_dropped() -> None:
    engine = sequence_engine()
    engine.on_stored(seq_message("k", 1), 0)
    assert isinstance(engine.on_stored(seq_message("k", 1), 0)[0], DropDuplicate)
    ack_all(engine)
    assert isinstance(engine.on_stored(seq_message("k", 1), 0)[0], DropDuplicate)
    assert engine.status(0)[0].counts["duplicates"] == 2


def test_conflicting_duplicate_is_dead_lettered_and_the_original_kept() -> None:
    engine = sequence_engine()
    engine.on_stored(seq_message("k", 1), 0)
    conflict = seq_message("k", 1, variant=1)
    assert engine.on_stored(conflict, 0) == [DeadLetter(conflict, "conflict", 0)]
    assert engine.dead_letter_done(conflict, 0) == []
    assert ack_all(engine) == [("k", 1)]


def test_gap_timeout_skip_delivers_next_with_the_skipped_range() -> None:
    engine = sequence_engine(gap_timeout_ms=5_000, on_gap_timeout="skip")
    engine.on_stored(seq_message("k", 1), 0)
    ack_all(engine)
    engine.on_stored(seq_message("k", 4), 10)
    assert engine.next_timer_ms() == 5_010
    assert engine.tick(5_009) == [] and taken(engine, now_ms=5_009) == []
    engine.tick(5_010)
    (delivery,) = engine.take("c", 10, 5_010)
    assert delivery.message.sequence == 4 and delivery.skipped == (SkippedRange(2, 3),)
    assert engine.ack("c", delivery.delivery_id, 5_010).cursor == 5


def test_gap_timeout_hold_keeps_waiting_visibly() -> None:
    engine = sequence_engine(gap_timeout_ms=100, on_gap_timeout="hold")
    engine.on_stored(seq_message("k", 2), 0)
    engine.tick(1_000)
    status, keys = engine.status(1_000)
    assert taken(engine, now_ms=1_000) == []
    assert status.keys_blocked == 1 and status.counts["gap_timeouts"] == 1
    assert (keys[0].state, keys[0].missing_sequence, keys[0].since_ms) == ("waiting_sequence", 1, 0)


@pytest.mark.parametrize("on_late", ["dead_letter", "deliver"])
def test_skipped_sequence_arriving_later_is_late(on_late: str) -> None:
    engine = sequence_engine(gap_timeout_ms=0, on_gap_timeout="skip", on_late=on_late)
    engine.on_stored(seq_message("k", 2), 0)
    engine.tick(0)
    assert ack_all(engine) == [("k", 2)]
    actions = engine.on_stored(seq_message("k", 1), 1)
    if on_late == "dead_letter":
        assert actions == [DeadLetter(seq_message("k", 1), "late", 0)]
    else:
        (delivery,) = engine.take("c", 10, 1)
        assert actions == [] and delivery.late and delivery.message.sequence == 1


def test_a_rewind_below_a_late_message_hands_out_each_message_once() -> None:
    # 1 and 2 in flight, 3 skipped, 4 ready; 3 then arrives (late) and a nack of 1 rewinds the key
    # below it. The in-order run walks over 3 (a skipped sequence): 3 is handed out once, from the
    # late queue, and the key's ready count matches what it holds (it was one too many: IndexError).
    engine = sequence_engine(max_in_flight_per_key=3, gap_timeout_ms=0, on_gap_timeout="skip", on_late="deliver")
    for seq in (1, 2, 4):
        engine.on_stored(seq_message("k", seq), 0)
    first, _second = engine.take("c", 2, 0)
    engine.tick(0)  # the gap at 3 times out
    assert engine.on_stored(seq_message("k", 3), 0) == []  # late: waits in the late queue
    engine.nack("c", first.delivery_id, 0, retry_after_ms=0)
    handed = []
    for _ in range(4):
        deliveries = engine.take("c", 10, 0)
        handed += [(d.message.sequence, d.late, d.skipped) for d in deliveries]
        engine.ack_durable([engine.ack("c", d.delivery_id, 0).delivery_id for d in deliveries], 0)
    assert handed == [(3, True, ()), (1, False, ()), (2, False, ()), (4, False, (SkippedRange(3, 3),))]
    status, _keys = engine.status(0)
    assert (status.buffered, status.ready, status.in_flight) == (0, 0, 0)


def test_a_late_message_pending_at_a_restart_is_dead_lettered_below_the_cursor() -> None:
    # Skipped ranges are not in a snapshot: after a restart a pending late message lies below the
    # restored cursor, where the engine cannot tell it from a copy of an acked one (docs/store.md,
    # recovery rule 4). It is dead-lettered, never delivered (G3) nor dropped (G1).
    config = EngineConfig(mode="sequence", gap_timeout_ms=0, on_gap_timeout="skip", on_late="deliver")
    engine = Engine(config)
    engine.on_stored(seq_message("k", 2), 0)
    engine.tick(0)
    assert ack_all(engine) == [("k", 2)]
    assert engine.on_stored(seq_message("k", 1), 1) == []  # late, held for delivery
    restored = Engine.restore(config, engine.export(), 2)
    assert restored.tick(2) == [DeadLetter(seq_message("k", 1), "below_cursor", 0)]
    assert taken(restored, now_ms=2) == []
    assert restored.dead_letter_done(seq_message("k", 1), 3) == []
    assert restored.status(3)[0].buffered == 0


def test_first_sequence_any_starts_a_new_key_at_its_first_seen_sequence() -> None:
    engine = sequence_engine(first_sequence_any=True, on_late="deliver")
    engine.on_stored(seq_message("old", 41), 0)
    assert ack_all(engine) == [("old", 41)]
    # An earlier sequence arriving after adoption is late, never dropped silently.
    engine.on_stored(seq_message("old", 40), 0)
    (delivery,) = engine.take("c", 10, 0)
    assert delivery.late and delivery.message.sequence == 40
