"""`pubsub-sidecar dead-letters list|discard` against the Pub/Sub emulator, with real dead letters.

The dead letters are written by the sidecar's own ``DeadLetterPublisher`` (so the attributes are
what production writes); one foreign message is published straight to the dead-letter topic.
The command runs in a thread (it is synchronous, like an operator's shell) with the official client.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest
from pubsub_admin import PubSubAdmin

from sidecar.commands import main as cli
from sidecar.dead_letters.publisher import DeadLetterPublisher
from sidecar.engine.types import Message, Payload

pytestmark = pytest.mark.timeout(120)


@dataclass
class Waiting:
    subscription: str
    foreign_id: str


def engine_message(key: str, sequence: int, message_id: str) -> Message:
    return Message(
        key=key,
        dedup_id=f"{key}/{sequence}",
        message_id=message_id,
        known_fingerprint=b"f",
        stored_at_ms=1,
        sequence=sequence,
        payload=Payload(data=f"{key}:{sequence}".encode(), attributes={"order_id": key}, publish_time_ms=1),
    )


async def waiting_room(admin: PubSubAdmin) -> Waiting:
    """order-1 seq 3 (max_delivery_attempts), order-2 seq 5 (app_requested), order-1 seq 4 (late), a foreign one."""
    topic = await admin.create_topic("dl")
    subscription = await admin.create_subscription("dl-sub", topic)
    publisher = DeadLetterPublisher({"orders": topic})
    try:
        await publisher.publish("orders", engine_message("order-1", 3, "m-13"), "max_delivery_attempts", 5)
        await publisher.publish("orders", engine_message("order-2", 5, "m-25"), "app_requested", 1)
        await publisher.publish("orders", engine_message("order-1", 4, "m-14"), "late", 0)
    finally:
        await publisher.aclose()
    foreign_id = await admin.publish(topic, b"not ours", origin="someone-else")
    return Waiting(subscription, foreign_id)


async def run(*argv: str) -> int:
    return await asyncio.to_thread(cli.main, list(argv))


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def test_list_json_shows_every_waiting_message_and_acks_nothing(
    admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]
) -> None:
    room = await waiting_room(admin)
    assert await run("dead-letters", "list", "--dead-letter-subscription", room.subscription, "--json") == 0
    first = json_lines(capsys.readouterr().out)
    by_id = {row["message_id"]: row for row in first}
    assert set(by_id) == {"m-13", "m-25", "m-14", room.foreign_id}
    assert by_id["m-13"] | {"dead_letter_id": None, "dead_lettered_at": None, "age_seconds": None} == {
        "message_id": "m-13",
        "dead_letter_id": None,
        "subscription": "orders",
        "key": "order-1",
        "position": 3,
        "reason": "max_delivery_attempts",
        "attempts": 5,
        "foreign": False,
        "dead_lettered_at": None,
        "age_seconds": None,
        "size_bytes": len(b"order-1:3"),
    }
    assert by_id[room.foreign_id]["foreign"] is True
    assert by_id[room.foreign_id]["reason"] == "foreign"
    assert by_id[room.foreign_id]["key"] is None
    # Listing acked nothing and gave every lease back: a second list sees the same messages at once.
    assert await run("dead-letters", "list", "--dead-letter-subscription", room.subscription, "--json") == 0
    assert {row["message_id"] for row in json_lines(capsys.readouterr().out)} == set(by_id)


async def test_list_filters_by_key_reason_and_age(admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]) -> None:
    room = await waiting_room(admin)
    base = ("dead-letters", "list", "--dead-letter-subscription", room.subscription, "--json")
    assert await run(*base, "--key", "order-1") == 0
    assert sorted(row["position"] for row in json_lines(capsys.readouterr().out)) == [3, 4]
    assert await run(*base, "--reason", "late", "--reason", "app_requested") == 0
    assert sorted(row["message_id"] for row in json_lines(capsys.readouterr().out)) == ["m-14", "m-25"]
    assert await run(*base, "--key", "order-1", "--reason", "late") == 0
    assert [row["message_id"] for row in json_lines(capsys.readouterr().out)] == ["m-14"]
    assert await run(*base, "--reason", "foreign") == 0
    assert [row["message_id"] for row in json_lines(capsys.readouterr().out)] == [room.foreign_id]
    # Nothing is an hour old: exit 0, nothing on stdout, and it says so.
    assert await run(*base, "--older-than", "1h") == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert "no dead letters match (older than 3600s)" in err
    assert await run(*base, "--older-than", "0s") == 0
    assert len(json_lines(capsys.readouterr().out)) == 4


async def test_list_table_ends_with_the_count_per_reason(
    admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]
) -> None:
    room = await waiting_room(admin)
    assert await run("dead-letters", "list", "--dead-letter-subscription", room.subscription) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["SUBSCRIPTION", "KEY", "POSITION", "REASON"]
    assert len([line for line in lines[1:] if line.strip()]) == 5  # four rows and the summary
    assert lines[-1] == "4 dead letter(s): app_requested 1, foreign 1, late 1, max_delivery_attempts 1"


async def test_a_subscription_that_does_not_exist_is_one_line_and_exit_2(
    admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = admin.subscription_path("never-created")
    for action in (("list",), ("discard", "--note", "x")):
        assert await run("dead-letters", *action, "--dead-letter-subscription", missing) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err == f"pubsub-sidecar dead-letters: dead-letter subscription {missing} does not exist\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--older-than", "90"), "--older-than: a duration needs a unit"),
        (("--older-than", "soon"), "--older-than: expected a duration"),
        (("--key", ""), "--key must not be empty"),
        (("--max-messages", "0"), "--max-messages must be positive"),
    ],
)
async def test_bad_arguments_exit_2_before_touching_pubsub(
    admin: PubSubAdmin, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str
) -> None:
    path = admin.subscription_path("never-created")
    assert await run("dead-letters", "list", "--dead-letter-subscription", path, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("pubsub-sidecar dead-letters: ") and message in err
    assert err.count("\n") == 1


async def test_a_malformed_subscription_name_exits_2(admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]) -> None:
    assert await run("dead-letters", "list", "--dead-letter-subscription", "projects/p/topics/t") == 2
    assert "is not projects/P/subscriptions/S" in capsys.readouterr().err


async def test_discard_needs_a_note(admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["dead-letters", "discard", "--dead-letter-subscription", admin.subscription_path("x")])
    assert exit_info.value.code == 2
    assert "--note" in capsys.readouterr().err


async def test_discard_acks_the_selection_with_one_log_record_each(
    admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]
) -> None:
    room = await waiting_room(admin)
    dl = ("--dead-letter-subscription", room.subscription)
    assert await run("dead-letters", "discard", *dl, "--key", "order-1", "--note", "orders replaced by hand") == 0
    out, err = capsys.readouterr()
    assert f"discarded 2 dead letter(s) from {room.subscription}" in out
    records = [r for r in json_lines(err) if r.get("event") == "dead_letter_discarded"]
    assert sorted(r["message_id"] for r in records) == ["m-13", "m-14"]
    for record in records:
        assert record["note"] == "orders replaced by hand"
        assert record["key"] == "order-1"
        assert record["dead_letter_subscription"] == room.subscription
        assert record["operator"]
        assert record["severity"] == "INFO"
    # What was discarded is gone; the rest still waits.
    assert await run("dead-letters", "list", *dl, "--json") == 0
    assert {row["message_id"] for row in json_lines(capsys.readouterr().out)} == {"m-25", room.foreign_id}


async def test_discard_dry_run_acks_nothing(admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]) -> None:
    room = await waiting_room(admin)
    dl = ("--dead-letter-subscription", room.subscription)
    assert await run("dead-letters", "discard", *dl, "--reason", "late", "--note", "n", "--dry-run") == 0
    out, err = capsys.readouterr()
    assert "dry run: would discard 1 dead letter(s); nothing acked" in out
    assert "dead_letter_discarded" not in err
    assert await run("dead-letters", "list", *dl, "--json") == 0
    assert len(json_lines(capsys.readouterr().out)) == 4


async def test_a_foreign_message_is_discarded_only_when_named_by_id(
    admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]
) -> None:
    room = await waiting_room(admin)
    dl = ("--dead-letter-subscription", room.subscription)
    # No filter selects every message of the sidecar's, never the foreign one.
    assert await run("dead-letters", "discard", *dl, "--reason", "foreign", "--note", "cleanup") == 0
    assert "no dead letters match (reason 'foreign'); nothing discarded" in capsys.readouterr().out
    assert await run("dead-letters", "discard", *dl, "--message-id", room.foreign_id, "--note", "not ours") == 0
    assert "discarded 1 dead letter(s)" in capsys.readouterr().out
    assert await run("dead-letters", "list", *dl, "--json") == 0
    assert {row["message_id"] for row in json_lines(capsys.readouterr().out)} == {"m-13", "m-14", "m-25"}


async def test_filters_that_match_nothing_discard_nothing_and_exit_0(
    admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]
) -> None:
    room = await waiting_room(admin)
    dl = ("--dead-letter-subscription", room.subscription)
    assert await run("dead-letters", "discard", *dl, "--key", "order-404", "--note", "n") == 0
    assert "no dead letters match (key 'order-404'); nothing discarded" in capsys.readouterr().out
    assert await run("dead-letters", "list", *dl, "--json") == 0
    assert len(json_lines(capsys.readouterr().out)) == 4
