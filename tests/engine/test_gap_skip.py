"""An operator's skip of a gap (``Engine.skip_gap``, ``sidecar.engine.gap_skip``): what it skips,
what it refuses, and that afterwards the key behaves as after a gap timeout's skip."""

from __future__ import annotations

import pytest
from examples_support import ack_all, sequence_engine, taken
from harness import seq_message
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.engine import DeadLetter, Engine, EngineConfig, EngineSnapshot, KeyCursor, SkippedRange
from sidecar.engine.gap_skip import KeyNotWaitingOnGap, SkipOutOfRange


def _stuck(*seqs: int) -> Engine:
    engine = sequence_engine()
    for seq in seqs:
        engine.on_stored(seq_message("k", seq), 0)
    return engine


def test_skip_through_the_last_missing_sequence_releases_what_follows_in_order() -> None:
    engine = _stuck(1, 2, 4, 5)
    assert ack_all(engine) == [("k", 1)]
    assert ack_all(engine) == [("k", 2)]
    assert taken(engine) == []
    assert engine.missing_range("k", 3) == SkippedRange(3, 3)
    assert engine.skip_gap("k", 3, 10) == SkippedRange(3, 3)
    (fourth,) = engine.take("c", 10, 10)
    assert fourth.message.sequence == 4 and fourth.skipped == (SkippedRange(3, 3),)
    engine.ack_durable([engine.ack("c", fourth.delivery_id, 10).delivery_id], 10)
    assert ack_all(engine) == [("k", 5)]
    assert engine.status(10)[0].counts["skipped"] == 1


def test_a_skipped_sequence_arriving_later_is_dead_lettered_late() -> None:
    engine = _stuck(1, 4)
    ack_all(engine)
    engine.skip_gap("k", 3, 0)
    late = seq_message("k", 2)
    assert engine.on_stored(late, 0) == [DeadLetter(late, "late", 0)]
    also_late = seq_message("k", 3)
    assert engine.on_stored(also_late, 0) == [DeadLetter(also_late, "late", 0)]


def test_a_partial_skip_leaves_the_key_waiting_on_the_rest() -> None:
    engine = _stuck(1, 5)
    ack_all(engine)
    assert engine.skip_gap("k", 3, 0) == SkippedRange(2, 3)
    assert taken(engine) == []
    (key,) = engine.status(0)[1]
    assert (key.state, key.missing_sequence) == ("waiting_sequence", 4)
    engine.on_stored(seq_message("k", 4), 0)
    assert ack_all(engine) == [("k", 4)]
    assert ack_all(engine) == [("k", 5)]


@pytest.mark.parametrize("through", [1, 5, 6, 9])
def test_a_through_outside_the_missing_range_is_refused_naming_the_range(through: int) -> None:
    engine = _stuck(1, 5, 6)
    ack_all(engine)
    with pytest.raises(SkipOutOfRange, match="misses sequences 2 to 4"):
        engine.skip_gap("k", through, 0)
    assert taken(engine) == []  # nothing changed
    assert engine.skip_gap("k", 4, 0) == SkippedRange(2, 4)


def test_refused_when_the_key_does_not_wait_on_a_gap_naming_what_it_waits_on() -> None:
    engine = _stuck(1, 2)
    with pytest.raises(KeyNotWaitingOnGap, match="delivering its messages in order"):
        engine.skip_gap("k", 1, 0)
    with pytest.raises(KeyNotWaitingOnGap, match="holds no messages"):
        engine.skip_gap("other", 1, 0)
    blocked = sequence_engine()
    blocked.on_stored(seq_message("k", 1), 0)
    (delivery,) = blocked.take("c", 10, 0)
    (dead_letter,) = blocked.nack("c", delivery.delivery_id, 0, dead_letter=True)
    assert isinstance(dead_letter, DeadLetter)
    blocked.dead_letter_done(dead_letter.message, 0)
    with pytest.raises(KeyNotWaitingOnGap, match=r"blocked by a dead letter at sequence 1 \(use unblock\)"):
        blocked.skip_gap("k", 1, 0)
    watermark = Engine(EngineConfig(mode="watermark"))
    with pytest.raises(KeyNotWaitingOnGap, match="watermark mode"):
        watermark.skip_gap("k", 1, 0)


def test_refused_while_messages_before_the_gap_are_not_acked_durably() -> None:
    engine = _stuck(1, 3)
    (first,) = engine.take("c", 10, 0)
    with pytest.raises(KeyNotWaitingOnGap, match="sequences 1 to 1 before the gap are not acked yet"):
        engine.skip_gap("k", 2, 0)
    engine.ack_durable([engine.ack("c", first.delivery_id, 0).delivery_id], 0)
    assert engine.skip_gap("k", 2, 0) == SkippedRange(2, 2)


def test_a_sequence_finished_before_a_restart_bounds_the_range() -> None:
    # Restored at cursor 2 with 4 finished above it (acked before the restart), 6 held: 2-3 are
    # missing and 4 is not, so the skip stops at 3 and the key then waits on 5.
    cursor = KeyCursor(key="k", next_sequence=2, acked_above=(4,), known_from=1)
    engine = Engine.restore(
        EngineConfig(mode="sequence"), EngineSnapshot(cursors=(cursor,), pending=(seq_message("k", 6),)), 0
    )
    engine.tick(0)
    with pytest.raises(SkipOutOfRange, match="misses sequences 2 to 3"):
        engine.skip_gap("k", 4, 0)
    engine.skip_gap("k", 3, 0)
    (key,) = engine.status(0)[1]
    assert key.missing_sequence == 5


@settings(max_examples=200, deadline=None)
@given(
    held=st.sets(st.integers(min_value=2, max_value=30), min_size=1, max_size=12),
    pick=st.integers(min_value=0, max_value=1000),
    late=st.sets(st.integers(min_value=1, max_value=30), max_size=6),
)
def test_skip_passes_exactly_the_chosen_missing_sequences(held: set[int], pick: int, late: set[int]) -> None:
    """Whatever is held past a gap at 1: the valid range is exactly the missing run at the head, the
    skip delivers nothing skipped, a skipped sequence arriving later is dead-lettered late, and
    skipping each gap the status names delivers everything held once, in increasing order."""
    engine = sequence_engine()
    for seq in sorted(held, reverse=True):
        engine.on_stored(seq_message("k", seq), 0)
    lowest = min(held)
    (status,) = engine.status(0)[1]
    assert (status.missing_sequence, status.last_missing_sequence) == (1, lowest - 1)
    for out_of_range in (0, lowest):
        with pytest.raises(SkipOutOfRange):
            engine.missing_range("k", out_of_range)
    through = 1 + pick % (lowest - 1)
    assert engine.skip_gap("k", through, 0) == SkippedRange(1, through)
    for seq in sorted(late):
        if seq <= through:
            message = seq_message("k", seq, variant=1)
            assert engine.on_stored(message, 0) == [DeadLetter(message, "late", 0)]
    delivered: list[int] = []
    for _ in range(len(held) + 32):
        got = ack_all(engine)
        delivered.extend(seq for _, seq in got if seq is not None)
        if got:
            continue
        keys = engine.status(0)[1]
        if not keys:
            break
        (status,) = keys
        assert status.state == "waiting_sequence" and status.last_missing_sequence is not None
        engine.skip_gap("k", status.last_missing_sequence, 0)
    assert delivered == sorted(held)
