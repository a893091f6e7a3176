"""The dead-letter view (pure): reading the sidecar's attributes, selection rules, rendering."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sidecar.dead_letters.view import Filters, WaitingLetter, format_age, format_table, select, to_json, visible

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def letter(dead_letter_id: str, age_seconds: float, **attributes: str) -> WaitingLetter:
    return WaitingLetter.from_pubsub(
        f"ack-{dead_letter_id}", dead_letter_id, NOW - timedelta(seconds=age_seconds), b"data", attributes
    )


def ours(dead_letter_id: str, key: str, age_seconds: float = 10, **extra: str) -> WaitingLetter:
    attributes = {
        "sidecar_reason": "late", "sidecar_subscription": "orders", "sidecar_key": key,
        "sidecar_message_id": f"orig-{dead_letter_id}", "sidecar_delivery_attempts": "3", "order_id": key,
    }  # fmt: skip
    return letter(dead_letter_id, age_seconds, **(attributes | extra))


def test_watermark_position_is_the_event_time_and_garbage_numbers_read_as_unknown() -> None:
    wm = ours("1", "p", sidecar_timestamp_ms="1777636800000", sidecar_delivery_attempts="x")
    assert wm.position == "2026-05-01T12:00:00.000Z"
    assert wm.attempts is None
    assert ours("2", "k", sidecar_sequence="7").position == 7
    assert ours("3", "k").position is None


def test_original_attributes_drop_only_the_sidecars_own() -> None:
    assert ours("1", "k", sidecar_sequence="7").original_attributes() == {"order_id": "k"}


def test_a_foreign_message_is_shown_but_selected_only_by_id() -> None:
    foreign = letter("f1", 100, origin="elsewhere")
    mine = ours("1", "k")
    assert foreign.foreign and foreign.reason == "foreign" and foreign.message_id == "f1"
    assert select([foreign, mine], Filters(), NOW) == [mine]
    assert select([foreign, mine], Filters(reasons=frozenset({"foreign"})), NOW) == []
    assert select([foreign, mine], Filters(message_ids=frozenset({"f1"})), NOW) == [foreign]
    assert visible([foreign, mine], Filters(), NOW) == [foreign, mine]  # oldest first
    assert visible([foreign, mine], Filters(keys=frozenset({"k"})), NOW) == [mine]
    assert visible([foreign, mine], Filters(older_than_seconds=60), NOW) == [foreign]


def test_message_id_filter_matches_the_original_or_the_dead_letter_id() -> None:
    mine = ours("1", "k")
    assert select([mine], Filters(message_ids=frozenset({"orig-1"})), NOW) == [mine]
    assert select([mine], Filters(message_ids=frozenset({"1"})), NOW) == [mine]
    assert select([mine], Filters(message_ids=frozenset({"2"})), NOW) == []


def test_json_has_the_contract_fields() -> None:
    row = to_json(ours("1", "k", sidecar_sequence="4"), NOW)
    assert {"key", "position", "reason", "attempts", "subscription", "message_id"} <= set(row)
    assert (row["key"], row["position"], row["attempts"], row["age_seconds"]) == ("k", 4, 3, 10.0)


def test_table_shortens_long_keys_and_counts_per_reason() -> None:
    table = format_table([ours("1", "x" * 100), letter("f", 5)], NOW)
    assert "x" * 39 + "…" in table and "x" * 41 not in table
    assert table.splitlines()[-1] == "2 dead letter(s): foreign 1, late 1"


def test_ages_read_at_a_glance() -> None:
    assert [format_age(s) for s in (5, 65, 3_700, 90_000)] == ["5s", "1m05s", "1h01m", "1d01h"]


def test_reason_matches_a_family_or_a_prefix() -> None:
    malformed = ours("1", "k", sidecar_reason="malformed: sequence attribute 'seq' is missing")
    rejected = ours("2", "k", sidecar_reason="store_rejected: too big")
    late = ours("3", "k")

    def chosen(*reasons: str) -> list[str]:
        return [x.dead_letter_id for x in select([malformed, rejected, late], Filters(reasons=frozenset(reasons)), NOW)]

    assert chosen("malformed") == ["1"]
    assert chosen("malformed: sequence") == ["1"]
    assert chosen("malformed: sequence attribute 'seq' is missing") == ["1"]
    assert chosen("malformed: timestamp") == []
    assert chosen("late", "store_rejected") == ["2", "3"]
    assert chosen("lat") == ["3"]  # a prefix
    assert chosen("sequence") == []  # the detail is matched from its family on only
