"""Example tests of watermark and none modes, and of the input each mode refuses (bad config, a
sequence-mode message without a sequence, jitter outside the unit interval).
"""

from __future__ import annotations

import pytest
from examples_support import ack_all, sequence_engine
from harness import seq_message, wm_message

from sidecar.engine import DeadLetter, DropDuplicate, Engine, EngineConfig, Hold, Message

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
