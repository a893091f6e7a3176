"""Example tests of recovery by pages: what a loading engine delivers, holds and refuses until the
load ends, and how the first stored copy of a message still wins.
"""

from __future__ import annotations

import dataclasses

import pytest
from examples_support import ack_all, sequence_engine, taken
from harness import seq_message, wm_message

from sidecar.engine import DeadLetter, Engine, EngineConfig, EngineSnapshot, Hold, KeyCursor, SkippedRange


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
