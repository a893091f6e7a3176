"""Example tests of an operator's actions on a key's dead letter: ``unblock`` skips the message the key
is blocked at, ``dead-letters replay`` makes it the key's next message (or refuses or flags it).
"""

from __future__ import annotations

import pytest
from examples_support import ack_all, sequence_engine, taken
from harness import replay_of, seq_message, wm_message

from sidecar.engine import DeadLetter, DropDuplicate, Engine, EngineConfig, EngineSnapshot, KeyCursor, Message
from sidecar.engine.dead_letters import KeyNotBlocked

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
