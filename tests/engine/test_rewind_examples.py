"""Example tests of a nack's rewind over skipped and late sequences (``on_late: deliver``, gap skip):
each message is handed out once, skipped ranges stay skipped, a failed take changes nothing.
"""

from __future__ import annotations

import pytest
from examples_support import sequence_engine
from harness import seq_message, wm_message

from sidecar.engine import Deliver, DropDuplicate, Engine, EngineConfig, EngineSnapshot, KeyCursor, SkippedRange


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
