"""The ranges a gap timeout skipped ride on acks (``AckIntent.skipped``) until one that carried them
is durable: the store records those as skipped, and nothing else a cursor passes."""

from __future__ import annotations

from harness import seq_message

from sidecar.engine import DeadLetter, Engine, EngineConfig, SkippedRange


def _engine(**overrides: object) -> Engine:
    config = {"gap_timeout_ms": 0, "on_gap_timeout": "skip", **overrides}
    return Engine(EngineConfig(mode="sequence", **config))  # type: ignore[arg-type]


def test_without_a_gap_skip_no_ack_carries_a_range() -> None:
    engine = Engine(EngineConfig(mode="sequence"))
    for seq in (2, 1):
        engine.on_stored(seq_message("k", seq), 0)
    for expected in (1, 2):
        (delivery,) = engine.take("c", 10, 0)
        intent = engine.ack("c", delivery.delivery_id, 0)
        assert (intent.cursor, intent.skipped) == (expected + 1, ())


def test_every_ack_past_a_skipped_range_carries_it_until_one_that_did_is_durable() -> None:
    engine = _engine()
    for seq in (3, 4, 5):
        engine.on_stored(seq_message("k", seq), 0)
    engine.tick(0)  # 1..2 skipped
    (third,) = engine.take("c", 10, 0)
    assert third.skipped == (SkippedRange(1, 2),)
    intent_3 = engine.ack("c", third.delivery_id, 0)
    assert (intent_3.cursor, intent_3.skipped) == (4, (SkippedRange(1, 2),))
    # 3's ack is not durable yet (its answer lost, say): 4's ack may be the first the store folds.
    (fourth,) = engine.take("c", 10, 0)
    intent_4 = engine.ack("c", fourth.delivery_id, 0)
    assert (intent_4.cursor, intent_4.skipped) == (5, (SkippedRange(1, 2),))
    engine.ack_durable([intent_4.delivery_id], 0)
    (fifth,) = engine.take("c", 10, 0)
    intent_5 = engine.ack("c", fifth.delivery_id, 0)
    assert intent_5.skipped == (), "4's durable ack carried the range"


def test_a_dead_lettered_message_past_a_skipped_range_leaves_it_to_the_next_ack() -> None:
    engine = _engine(on_dead_letter="skip", max_delivery_attempts=1)
    for seq in (2, 3):
        engine.on_stored(seq_message("k", seq), 0)
    engine.tick(0)  # 1 skipped
    (second,) = engine.take("c", 10, 0)
    (dead,) = engine.nack("c", second.delivery_id, 0, dead_letter=True)
    assert isinstance(dead, DeadLetter)
    engine.dead_letter_done(dead.message, 0)  # its record moves no cursor past 1
    (third,) = engine.take("c", 10, 0)
    intent = engine.ack("c", third.delivery_id, 0)
    assert (intent.cursor, intent.skipped) == (4, (SkippedRange(1, 1),))


def test_a_late_arrival_in_a_skipped_range_still_rides_on_acks_until_recorded() -> None:
    # The late message is not finished when it arrives: until then the store must count it skipped.
    engine = _engine(on_late="dead_letter")
    engine.on_stored(seq_message("k", 2), 0)
    engine.tick(0)  # 1 skipped
    (second,) = engine.take("c", 10, 0)
    (late,) = engine.on_stored(seq_message("k", 1), 0)
    assert isinstance(late, DeadLetter) and late.reason == "late"
    assert engine.ack("c", second.delivery_id, 0).skipped == (SkippedRange(1, 1),)
