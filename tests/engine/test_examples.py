"""Example tests, one behaviour each: the engine's policies as readable documentation."""

from __future__ import annotations

import dataclasses

import pytest
from harness import replay_of, seq_message, wm_message

from sidecar.engine import (
    DeadLetter,
    Deliver,
    DropDuplicate,
    Engine,
    EngineConfig,
    EngineSnapshot,
    Hold,
    KeyCursor,
    Message,
    SkippedRange,
    UnknownDelivery,
)
from sidecar.engine.dead_letters import KeyNotBlocked


def sequence_engine(**overrides: object) -> Engine:
    return Engine(EngineConfig(mode="sequence", **overrides))  # type: ignore[arg-type]


def taken(engine: Engine, consumer: str = "c", now_ms: int = 0) -> list[tuple[str, int | None]]:
    return [(d.message.key, d.message.sequence) for d in engine.take(consumer, 100, now_ms)]


def ack_all(engine: Engine, consumer: str = "c", now_ms: int = 0) -> list[tuple[str, int | None]]:
    deliveries = engine.take(consumer, 100, now_ms)
    engine.ack_durable([engine.ack(consumer, d.delivery_id, now_ms).delivery_id for d in deliveries], now_ms)
    return [(d.message.key, d.message.sequence) for d in deliveries]


# ---- sequence mode ----------------------------------------------------------------------------


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


# ---- delivery state ---------------------------------------------------------------------------


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


# ---- a nack's rewind over skipped and late sequences (on_late: deliver, gap skip) --------------------


def _skipping(max_in_flight: int, gap_timeout_ms: int = 0) -> Engine:
    return sequence_engine(
        max_in_flight_per_key=max_in_flight, gap_timeout_ms=gap_timeout_ms, on_gap_timeout="skip", on_late="deliver"
    )


def _ack_durably(engine: Engine, delivery: Deliver, now_ms: int = 0) -> None:
    engine.ack_durable([engine.ack(delivery.consumer, delivery.delivery_id, now_ms).delivery_id], now_ms)


def test_a_late_message_finished_inside_a_rewound_run_is_never_delivered_again() -> None:
    # Window 2: 4 goes out carrying the skipped 3, which then arrives and is delivered late and
    # acked durably; a nack of 2 rewinds the key below 3. 3 stays passed: the cursor reaches 5 and a
    # copy of 3 is a duplicate (it was delivered again, in order and unflagged, after 4: G2 and G3).
    engine = _skipping(2)
    for seq in (1, 2, 4):
        engine.on_stored(seq_message("k", seq), 0)
    (first,) = engine.take("c", 1, 0)
    engine.ack("c", first.delivery_id, 0)
    (second,) = engine.take("c", 1, 0)
    engine.tick(0)  # the gap at 3 times out
    (fourth,) = engine.take("c", 1, 0)
    assert fourth.skipped == (SkippedRange(3, 3),)
    assert engine.on_stored(seq_message("k", 3), 0) == []  # late
    engine.ack("c", fourth.delivery_id, 0)
    (late,) = engine.take("c", 1, 0)
    assert (late.message.sequence, late.late) == (3, True)
    _ack_durably(engine, late)
    engine.nack("c", second.delivery_id, 0, retry_after_ms=0)
    (again,) = engine.take("c", 10, 0)
    assert (again.message.sequence, again.attempt) == (2, 2)
    engine.ack("c", again.delivery_id, 0)
    engine.ack_durable([first.delivery_id, again.delivery_id, fourth.delivery_id], 0)
    assert engine.export() == EngineSnapshot(cursors=(KeyCursor("k", next_sequence=5),), pending=())
    (copy,) = engine.on_stored(seq_message("k", 3), 0)
    assert isinstance(copy, DropDuplicate) and copy.finish_record
    assert engine.take("c", 10, 0) == []


def test_a_late_ack_made_durable_before_the_next_take_leaves_the_rewound_key_whole() -> None:
    # Window 1 (the default): 2 is skipped while 1 is out, then arrives late; a nack of 1 rewinds the
    # key below it, the late 2 goes out first and its ack is durable before the next take. That
    # take raised KeyError in pop_head and left the key out of the ready queues for good.
    engine = _skipping(1)
    engine.on_stored(seq_message("k", 1), 0)
    engine.on_stored(seq_message("k", 3), 0)
    (first,) = engine.take("c", 1, 0)
    engine.tick(0)  # the gap at 2 times out
    assert engine.on_stored(seq_message("k", 2), 0) == []  # late
    engine.nack("c", first.delivery_id, 0, retry_after_ms=0)
    (late,) = engine.take("c", 1, 0)
    assert (late.message.sequence, late.late) == (2, True)
    _ack_durably(engine, late)
    handed = []
    for _ in range(3):
        for delivery in engine.take("c", 10, 0):
            handed.append((delivery.message.sequence, delivery.late, delivery.skipped))
            _ack_durably(engine, delivery)
    assert handed == [(1, False, ()), (3, False, (SkippedRange(2, 2),))]
    assert engine.export() == EngineSnapshot(cursors=(KeyCursor("k", next_sequence=4),), pending=())


def test_a_rewind_over_a_skipped_gap_neither_waits_for_it_again_nor_skips_it_twice() -> None:
    # Window 3: 4 goes out carrying the skipped 3, and a nack of 1 gives 1, 2 and 4 back. The key
    # goes on at once (it waited a second gap timeout, skipped 3 twice, and so let two copies of 3
    # be delivered late, the second after the first was acked: G3).
    engine = _skipping(3, gap_timeout_ms=30)
    for seq in (1, 2, 4):
        engine.on_stored(seq_message("k", seq), 0)
    first, _second = engine.take("c", 2, 0)
    engine.tick(30)
    assert [d.skipped for d in engine.take("c", 10, 30)] == [(SkippedRange(3, 3),)]
    engine.nack("c", first.delivery_id, 30, retry_after_ms=0)
    again = engine.take("c", 10, 30)
    assert [(d.message.sequence, d.skipped) for d in again] == [(1, ()), (2, ()), (4, (SkippedRange(3, 3),))]
    deadline_ms = EngineConfig("sequence").ack_deadline_ms
    assert engine.next_timer_ms() == 30 + deadline_ms, "the ack deadlines only: no gap timer"
    for delivery in again:
        _ack_durably(engine, delivery, 30)
    assert engine.on_stored(seq_message("k", 3), 40) == []  # late, once
    (late,) = engine.take("c", 10, 40)
    assert late.late
    _ack_durably(engine, late, 40)
    (copy,) = engine.on_stored(seq_message("k", 3), 50)
    assert isinstance(copy, DropDuplicate)
    assert engine.take("c", 10, 50) == []


def test_a_skipped_sequence_arriving_after_a_rewind_is_late() -> None:
    # 4 went out (and was acked) carrying the skipped 3; a nack of 1 then rewinds the key below 3.
    # 3 arriving now is late: delivered flagged, never in order after the 4 that reported it skipped.
    engine = _skipping(3)
    for seq in (1, 2, 4):
        engine.on_stored(seq_message("k", seq), 0)
    first, _second = engine.take("c", 2, 0)
    engine.tick(0)
    (fourth,) = engine.take("c", 10, 0)
    engine.ack("c", fourth.delivery_id, 0)
    engine.nack("c", first.delivery_id, 0, retry_after_ms=0)
    assert engine.on_stored(seq_message("k", 3), 0) == []
    handed = [(d.message.sequence, d.late) for d in engine.take("c", 10, 0)]
    assert handed == [(3, True), (1, False), (2, False)]


@pytest.mark.parametrize("mode", ["sequence", "watermark"])
def test_a_take_that_fails_leaves_the_key_queued_as_it_was(mode: str) -> None:
    # White-box: a key whose books do not add up (the head of its backlog gone missing, as a bug
    # would leave it) makes ``take`` raise. The key must stay as it was and queued, not be stranded
    # with its ready count spent (the stream then aborts; nothing may stay stuck after it).
    engine = Engine(EngineConfig(mode=mode))  # type: ignore[arg-type]
    for seq in (1, 2):
        message = seq_message("k", seq) if mode == "sequence" else wm_message("k", seq, f"k{seq}")
        engine.on_stored(message, 0)
    engine.advance_watermark(10, 0)
    key = engine._keys["k"]
    if mode == "sequence":
        head = key.index.pop(1)
        with pytest.raises(KeyError):
            engine.take("c", 10, 0)
        key.index[1] = head
    else:
        heap, key.heap = key.heap, []
        with pytest.raises(IndexError):
            engine.take("c", 10, 0)
        key.heap = heap
    assert engine.status(0)[0].ready == 2 and engine.has_ready()
    assert [d.message.dedup_id for d in engine.take("c", 10, 0)] == [("k/1" if mode == "sequence" else "k1")]


# ---- watermark mode ---------------------------------------------------------------------------


def test_watermark_releases_only_what_it_passed_in_position_order() -> None:
    engine = Engine(EngineConfig(mode="watermark"))
    engine.on_stored(wm_message("k", 20, "b"), 0)
    held = engine.on_stored(wm_message("k", 10, "a"), 0)
    assert isinstance(held[0], Hold) and "watermark" in held[0].reason
    engine.advance_watermark(15, 0)
    assert [d.message.dedup_id for d in engine.take("c", 10, 0)] == ["a"]
    engine.advance_watermark(5, 0)  # never moves back
    assert engine.status(0)[0].watermark_ms == 15


def test_equal_timestamps_are_ordered_by_dedup_id() -> None:
    engine = Engine(EngineConfig(mode="watermark", max_in_flight_per_key=2))
    engine.on_stored(wm_message("k", 10, "z"), 0)
    engine.on_stored(wm_message("k", 10, "m"), 0)
    engine.advance_watermark(10, 0)
    assert [d.message.dedup_id for d in engine.take("c", 10, 0)] == ["m", "z"]


@pytest.mark.parametrize("on_late", ["dead_letter", "deliver"])
def test_message_behind_the_released_cursor_is_late(on_late: str) -> None:
    engine = Engine(EngineConfig(mode="watermark", on_late=on_late))  # type: ignore[arg-type]
    engine.advance_watermark(100, 0)
    engine.on_stored(wm_message("k", 50, "b"), 0)
    ack_all(engine)
    late = wm_message("k", 40, "a")
    actions = engine.on_stored(late, 0)
    if on_late == "dead_letter":
        assert actions == [DeadLetter(late, "late", 0)]
    else:
        (delivery,) = engine.take("c", 1, 0)
        assert delivery.late and delivery.message == late
        assert engine.ack("c", delivery.delivery_id, 0).cursor == (50, "b")  # the cursor never moves back


# ---- none mode --------------------------------------------------------------------------------


def test_none_mode_delivers_on_arrival_and_drops_duplicates_within_the_ttl() -> None:
    engine = Engine(EngineConfig(mode="none", dedup_ttl_ms=1_000))
    message = Message("k", "id-1", "m-1", 0, known_fingerprint=b"f")
    assert engine.on_stored(message, 0) == []
    assert ack_all(engine) == [("k", None)]
    assert isinstance(engine.on_stored(message, 999)[0], DropDuplicate)
    assert engine.on_stored(message, 1_000) == []  # the TTL passed: Firestore is the authority now


def test_none_mode_has_no_per_key_limit_or_order() -> None:
    engine = Engine(EngineConfig(mode="none"))
    for i in range(3):
        engine.on_stored(Message("k", f"id-{i}", f"m-{i}", 0, known_fingerprint=b"f"), 0)
    assert len(engine.take("c", 10, 0)) == 3


# ---- input errors -----------------------------------------------------------------------------


def test_invalid_config_is_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="max_in_flight_per_key must be >= 1"):
        Engine(EngineConfig(mode="sequence", max_in_flight_per_key=0))


def test_sequence_mode_message_without_sequence_is_refused_clearly() -> None:
    engine = sequence_engine()
    with pytest.raises(ValueError, match="has no integer sequence"):
        engine.on_stored(Message("k", "d", "m", 0, known_fingerprint=b"f"), 0)


def test_jitter_outside_the_unit_interval_is_refused() -> None:
    engine = Engine(EngineConfig(mode="sequence"), jitter=lambda: 1.5)
    engine.on_stored(seq_message("k", 1), 0)
    (delivery,) = engine.take("c", 1, 0)
    with pytest.raises(ValueError, match="jitter"):
        engine.nack("c", delivery.delivery_id, 0)


# ---- unblock (an operator skips the dead letter a key is blocked at) ----------------------------


def _blocked_at_one(**overrides: object) -> Engine:
    engine = sequence_engine(on_dead_letter="block", **overrides)
    for seq in (1, 2, 3):
        engine.on_stored(seq_message("k", seq), 0)
    (first,) = engine.take("c", 1, 0)
    (letter,) = engine.nack("c", first.delivery_id, 0, dead_letter=True)
    engine.dead_letter_done(letter.message, 1)
    assert engine.is_blocked("k") and taken(engine) == []
    assert engine.status(1)[0].keys_blocked_dead_letter == 1
    return engine


def test_unblock_skips_the_blocking_message_and_delivers_the_rest_in_order() -> None:
    engine = _blocked_at_one()
    assert engine.unblock("k", 1, 2) == (seq_message("k", 1), [])
    assert not engine.is_blocked("k")
    assert ack_all(engine) == [("k", 2)]
    assert ack_all(engine) == [("k", 3)]
    assert engine.export().cursors == (KeyCursor(key="k", next_sequence=4),)
    assert engine.status(3)[0].counts["unblocked"] == 1
    assert engine.status(3)[0].keys_blocked_dead_letter == 0


def test_the_first_ack_after_an_unblock_carries_a_cursor_past_the_skipped_message() -> None:
    engine = _blocked_at_one()
    engine.unblock("k", 1, 2)
    (second,) = engine.take("c", 1, 2)
    assert engine.ack("c", second.delivery_id, 2).cursor == 3


def test_unblock_of_a_key_that_is_not_blocked_raises_and_changes_nothing() -> None:
    engine = sequence_engine(on_dead_letter="block")
    engine.on_stored(seq_message("k", 1), 0)
    with pytest.raises(KeyNotBlocked):
        engine.unblock("k", 1, 0)
    with pytest.raises(KeyNotBlocked):
        engine.unblock("unknown", 1, 0)
    assert taken(engine) == [("k", 1)]


def test_unblock_of_a_key_restored_blocked_passes_the_position_the_store_gives() -> None:
    config = EngineConfig(mode="sequence", on_dead_letter="block")
    snapshot = EngineSnapshot(
        cursors=(KeyCursor(key="k", next_sequence=4, blocked=True),),
        pending=(seq_message("k", 5), seq_message("k", 6)),
    )
    engine = Engine.restore(config, snapshot, 0)
    assert taken(engine) == []
    assert engine.status(0)[0].keys_blocked_dead_letter == 1
    assert engine.unblock("k", 4, 1) == (None, [])
    assert engine.status(1)[0].keys_blocked_dead_letter == 0
    assert ack_all(engine, now_ms=1) == [("k", 5)]
    assert ack_all(engine, now_ms=1) == [("k", 6)]
    assert engine.export().cursors == (KeyCursor(key="k", next_sequence=7),)


def test_restored_unblock_above_an_unfinished_message_waits_for_it() -> None:
    # Acked 4 was not durable when 5 was dead-lettered in order (two in flight): the cursor is 4.
    config = EngineConfig(mode="sequence", on_dead_letter="block", max_in_flight_per_key=2)
    snapshot = EngineSnapshot(
        cursors=(KeyCursor(key="k", next_sequence=4, blocked=True),),
        pending=(seq_message("k", 4), seq_message("k", 6)),
    )
    engine = Engine.restore(config, snapshot, 0)
    engine.unblock("k", 5, 1)
    assert ack_all(engine, now_ms=1) == [("k", 4), ("k", 6)]
    assert engine.export().cursors == (KeyCursor(key="k", next_sequence=7),)


def test_watermark_unblock_releases_the_key() -> None:
    engine = Engine(EngineConfig(mode="watermark", on_dead_letter="block"))
    for ts in (100, 200):
        engine.on_stored(wm_message("p", ts, f"id{ts}"), 0)
    engine.advance_watermark(1_000, 0)
    (first,) = engine.take("c", 1, 0)
    (letter,) = engine.nack("c", first.delivery_id, 0, dead_letter=True)
    engine.dead_letter_done(letter.message, 1)
    assert engine.take("c", 1, 1) == []
    assert engine.unblock("p", None, 2) == (first.message, [])
    (second,) = engine.take("c", 1, 2)
    assert second.message.timestamp_ms == 200
    assert engine.ack("c", second.delivery_id, 2).cursor == (200, second.message.dedup_id)


def test_restored_unblock_drops_a_pending_copy_of_the_skipped_message() -> None:
    # 4's tombstone expired and Pub/Sub redelivered it: stored again, pending behind the block at 4.
    config = EngineConfig(mode="sequence", on_dead_letter="block")
    snapshot = EngineSnapshot(
        cursors=(KeyCursor(key="k", next_sequence=4, blocked=True),),
        pending=(seq_message("k", 4), seq_message("k", 5)),
    )
    engine = Engine.restore(config, snapshot, 0)
    _message, actions = engine.unblock("k", 4, 1)
    assert actions == [DropDuplicate(seq_message("k", 4), "the message an operator skipped", finish_record=True)]
    assert ack_all(engine, now_ms=1) == [("k", 5)]
    assert engine.status(1)[0].buffered == 0


def test_a_gap_skip_after_a_restart_skips_only_what_is_missing() -> None:
    # Restored: cursor 1, 2 and 3 acked above it, 4 finished too, 6 pending: only 1 and 5 are missing.
    snapshot = EngineSnapshot(
        cursors=(KeyCursor("k", next_sequence=1, acked_above=(2, 3, 4)),), pending=(seq_message("k", 6),)
    )
    config = EngineConfig(mode="sequence", gap_timeout_ms=10, on_gap_timeout="skip", on_late="deliver")
    engine = Engine.restore(config, snapshot, 0)
    engine.tick(0)
    engine.tick(10)  # the gap at 1 times out
    engine.tick(20)  # then the gap at 5
    (delivery,) = engine.take("c", 5, 20)
    assert delivery.message.sequence == 6
    assert [(r.first, r.last) for r in delivery.skipped] == [(1, 1), (5, 5)]
    # An acked message is never taken for a late one: a copy of 3 is a duplicate, not delivered.
    (action,) = engine.on_stored(seq_message("k", 3), 20)
    assert isinstance(action, DropDuplicate)


# ---- replays (an operator's ``dead-letters replay``) ---------------------------------------------


def test_a_replay_of_the_blocking_message_is_the_keys_next_message_and_its_ack_moves_the_key_on() -> None:
    engine = _blocked_at_one()
    replay = replay_of(seq_message("k", 1), "dl-1")
    assert engine.on_stored(replay, 2) == []
    assert not engine.is_blocked("k") and engine.status(2)[0].keys_blocked_dead_letter == 0
    (delivered,) = engine.take("c", 10, 2)
    assert (delivered.message, delivered.replayed, delivered.late) == (replay, False, False)
    assert engine.ack("c", delivered.delivery_id, 2).cursor == 2
    engine.ack_durable([delivered.delivery_id], 2)
    assert ack_all(engine, now_ms=2) == [("k", 2)]
    assert ack_all(engine, now_ms=2) == [("k", 3)]
    assert engine.export().cursors == (KeyCursor(key="k", next_sequence=4),)


def test_a_second_copy_of_a_replay_is_a_duplicate_and_another_replay_behind_is_refused_by_default() -> None:
    engine = _blocked_at_one()
    replay = replay_of(seq_message("k", 1), "dl-1")
    engine.on_stored(replay, 2)
    (copy,) = engine.on_stored(replay, 2)
    assert isinstance(copy, DropDuplicate) and not copy.finish_record, "its record is the held replay's"
    (refused,) = engine.on_stored(replay_of(seq_message("k", 1), "dl-2"), 2)
    assert isinstance(refused, DeadLetter) and (refused.reason, refused.in_order) == ("replay_behind", False)


def test_a_replay_of_a_restored_blocked_key_unblocks_it_after_what_came_before() -> None:
    config = EngineConfig(mode="sequence", on_dead_letter="block", max_in_flight_per_key=2)
    snapshot = EngineSnapshot(
        cursors=(KeyCursor(key="k", next_sequence=4, blocked=True, blocked_position=5),),
        pending=(seq_message("k", 4), seq_message("k", 6)),
    )
    engine = Engine.restore(config, snapshot, 0)
    assert taken(engine) == []
    engine.on_stored(replay_of(seq_message("k", 5), "dl-5"), 1)
    assert [(d.message.sequence, d.message.replay_id) for d in engine.take("c", 10, 1)] == [(4, ""), (5, "dl-5")]


@pytest.mark.parametrize("policy", ["deliver_flagged", "refuse"])
def test_a_replay_the_key_went_past_is_flagged_or_refused(policy: str) -> None:
    engine = sequence_engine(on_dead_letter="skip", on_replay_behind=policy)
    for seq in (1, 2):
        engine.on_stored(seq_message("k", seq), 0)
    (first,) = engine.take("c", 1, 0)
    (letter,) = engine.nack("c", first.delivery_id, 0, dead_letter=True)
    engine.dead_letter_done(letter.message, 0)
    (second,) = engine.take("c", 1, 0)  # k#2 in flight: the key went on
    actions = engine.on_stored(replay_of(seq_message("k", 1), "dl-1"), 1)
    if policy == "refuse":
        assert [(a.reason, a.in_order) for a in actions] == [("replay_behind", False)]  # type: ignore[union-attr]
        return
    assert actions == []
    assert engine.take("c", 10, 1) == [], "one in flight per key: the replay waits for k#2's ack"
    engine.ack_durable([engine.ack("c", second.delivery_id, 1).delivery_id], 1)
    (flagged,) = engine.take("c", 10, 1)
    assert (flagged.message.replay_id, flagged.replayed, flagged.late) == ("dl-1", True, False)
    intent = engine.ack("c", flagged.delivery_id, 1)
    assert intent.aside and intent.cursor == 3, "an out-of-order replay moves no cursor"
    engine.ack_durable([flagged.delivery_id], 1)
    assert engine.export().cursors == (KeyCursor(key="k", next_sequence=3),)


def test_a_watermark_replay_at_the_block_resumes_the_key_in_order() -> None:
    engine = Engine(EngineConfig(mode="watermark", on_dead_letter="block"))
    first, second = wm_message("p", 10, "a"), wm_message("p", 20, "b")
    for message in (first, second):
        engine.on_stored(message, 0)
    engine.advance_watermark(100, 0)
    (delivery,) = engine.take("c", 1, 0)
    (letter,) = engine.nack("c", delivery.delivery_id, 0, dead_letter=True)
    engine.dead_letter_done(letter.message, 0)
    replay = replay_of(first, "dl-a")
    assert engine.on_stored(replay, 1) == []
    assert [d.message for d in engine.take("c", 10, 1)] == [replay]


def test_in_none_mode_a_replay_is_an_ordinary_message_with_its_own_identity() -> None:
    engine = Engine(EngineConfig(mode="none"))
    original = Message("k", "id-1", "m-1", 0, known_fingerprint=b"f")
    engine.on_stored(original, 0)
    ack_all(engine)
    assert engine.on_stored(original, 0)[0].reason.startswith("duplicate")  # type: ignore[union-attr]
    replay = replay_of(original, "dl-1")
    assert engine.on_stored(replay, 0) == []
    assert [(d.message, d.replayed) for d in engine.take("c", 10, 0)] == [(replay, False)]


# ---- recovery by pages --------------------------------------------------------------------------


def _loading(config: EngineConfig, cursors: tuple[KeyCursor, ...] = (), watermark_ms: int | None = None) -> Engine:
    return Engine.restore(config, EngineSnapshot(cursors, (), watermark_ms), 0, loading=True)


def test_a_loading_engine_delivers_the_cursors_successor_and_holds_a_gap_without_a_timer() -> None:
    engine = _loading(EngineConfig(mode="sequence", gap_timeout_ms=10, on_gap_timeout="skip"))
    engine.restore_pending([seq_message("k", 3, stored_at_ms=3), seq_message("k", 1, stored_at_ms=1)], 0)
    assert ack_all(engine) == [("k", 1)]
    engine.tick(1_000)
    assert taken(engine, now_ms=1_000) == []  # 2 may be on a later page: no skip
    assert engine.next_timer_ms() is None
    engine.restore_pending([seq_message("k", 2, stored_at_ms=2)], 1_000)
    assert engine.finish_loading(1_000) == []
    assert ack_all(engine, now_ms=1_000) + ack_all(engine, now_ms=1_000) == [("k", 2), ("k", 3)]


def test_a_loading_engine_starts_the_gap_timer_when_the_load_ends() -> None:
    engine = _loading(EngineConfig(mode="sequence", gap_timeout_ms=10, on_gap_timeout="skip"))
    engine.restore_pending([seq_message("k", 3)], 0)
    engine.finish_loading(500)
    assert engine.next_timer_ms() == 510
    engine.tick(510)
    deliveries = engine.take("c", 10, 510)
    assert [(d.message.sequence, d.skipped) for d in deliveries] == [(3, (SkippedRange(1, 2),))]


def test_messages_stored_while_loading_wait_so_the_first_stored_copy_still_wins() -> None:
    engine = _loading(EngineConfig(mode="sequence"))
    fresh = seq_message("k", 1, variant=1, stored_at_ms=50)
    assert isinstance(engine.on_stored(fresh, 50)[0], Hold)
    assert not engine.fast_path(seq_message("k", 1))
    assert engine.status(50)[0].buffered == 1
    engine.restore_pending([seq_message("k", 1, stored_at_ms=10)], 50)
    actions = engine.finish_loading(60)
    assert [(type(a), a.message) for a in actions] == [(DeadLetter, fresh)]  # the conflict is the later copy
    assert [d.message.fingerprint for d in engine.take("c", 10, 60)] == [b"k/1/0"]


def test_first_sequence_any_adopts_the_first_stored_message_whatever_page_it_is_on() -> None:
    config = EngineConfig(mode="sequence", sequence_start=None)
    engine = _loading(config)
    engine.restore_pending([seq_message("k", 7, stored_at_ms=20)], 0)
    assert taken(engine) == []
    engine.restore_pending([seq_message("k", 5, stored_at_ms=10)], 0)
    engine.finish_loading(0)
    whole = Engine.restore(
        config, EngineSnapshot((), (seq_message("k", 7, stored_at_ms=20), seq_message("k", 5, stored_at_ms=10))), 0
    )
    assert taken(engine) == taken(whole) == [("k", 5)]


def test_a_loading_engine_in_watermark_mode_releases_nothing_until_the_load_ends() -> None:
    engine = _loading(EngineConfig(mode="watermark", max_in_flight_per_key=2), watermark_ms=100)
    engine.restore_pending([wm_message("k", 50, "b")], 0)
    engine.advance_watermark(200, 0)
    assert engine.take("c", 10, 0) == []  # "a" at 40 may be on a later page
    engine.restore_pending([wm_message("k", 40, "a")], 0)
    engine.finish_loading(0)
    assert [d.message.dedup_id for d in engine.take("c", 10, 0)] == ["a", "b"]
    assert engine.status(0)[0].watermark_ms == 200


def test_restore_pending_is_refused_once_the_engine_is_not_loading() -> None:
    engine = _loading(EngineConfig(mode="sequence"))
    engine.finish_loading(0)
    with pytest.raises(RuntimeError, match="not loading"):
        engine.restore_pending([seq_message("k", 1)], 0)


def test_a_message_beyond_the_first_missing_position_awaits_its_predecessor() -> None:
    engine = sequence_engine()
    assert engine.awaits_predecessor(seq_message("k", 3))
    assert not engine.awaits_predecessor(seq_message("k", 1)), "1 is next: the fast path takes it"
    engine.on_stored(seq_message("k", 3), 0)
    assert not engine.awaits_predecessor(seq_message("k", 3)), "held already: a copy of it"
    assert engine.awaits_predecessor(seq_message("k", 4))
    engine.on_stored(seq_message("k", 1), 0)
    engine.on_stored(seq_message("k", 2), 0)
    assert not engine.awaits_predecessor(seq_message("k", 4)), "1-3 ready: 4 is next"
    assert not sequence_engine(sequence_start=None).awaits_predecessor(seq_message("new", 5)), "no cursor yet"
    assert not _loading(EngineConfig(mode="sequence")).awaits_predecessor(seq_message("k", 3)), "loading"
    assert not Engine(EngineConfig(mode="watermark")).awaits_predecessor(wm_message("k", 5, "k5"))


def test_a_copy_of_a_held_fast_path_message_finds_its_original_until_it_is_finished() -> None:
    engine = sequence_engine()
    original = dataclasses.replace(seq_message("k", 1), volatile=True)
    assert engine.volatile_original(seq_message("k", 1)) is None, "nothing held yet"
    engine.on_stored(original, 0)
    copy = dataclasses.replace(seq_message("k", 1), message_id="m-retry", volatile=True)
    assert engine.volatile_original(copy) is original
    assert engine.volatile_original(seq_message("k", 1, variant=1)) is None, "other content: a conflict"
    assert engine.volatile_original(seq_message("k", 2)) is None, "another position"
    engine.on_stored(seq_message("k", 2), 0)
    assert engine.volatile_original(seq_message("k", 2)) is None, "a stored original: its record dedups"
    [delivery] = engine.take("c", 1, 0)
    assert engine.volatile_original(copy) is original, "in flight"
    engine.ack("c", delivery.delivery_id, 0)
    assert engine.volatile_original(copy) is original, "acking: not durable yet"
    engine.ack_durable([delivery.delivery_id], 0)
    assert engine.volatile_original(copy) is None, "finished: below the cursor"
    assert Engine(EngineConfig(mode="watermark")).volatile_original(wm_message("k", 5, "k5")) is None
