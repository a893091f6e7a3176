"""`pubsub-sidecar dead-letters replay` against the Pub/Sub emulator, with real dead letters.

The dead letters are written by the sidecar's own ``DeadLetterPublisher`` (the attributes are what
production writes, ``sidecar_subscription_path`` included); the replays are read back from the source
subscription with the official client. The command runs in a thread, as an operator's shell would.
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
class Room:
    topic: str
    source: str
    dead_letters: str
    dead_letter_topic: str
    foreign_id: str


def engine_message(key: str, sequence: int, message_id: str, **attributes: str) -> Message:
    return Message(
        key=key,
        dedup_id=message_id,
        message_id=message_id,
        known_fingerprint=b"f",
        stored_at_ms=1,
        sequence=sequence,
        payload=Payload(
            data=f"{key}:{sequence}".encode(),
            attributes={"order_id": key, "seq": str(sequence), **attributes},
            publish_time_ms=1,
            ordering_key=f"ok-{key}",
        ),
    )


async def room(admin: PubSubAdmin, *, with_path: bool = True) -> Room:
    """order-1 seq 3 and order-2 seq 5 dead-lettered by the sidecar, and a foreign message."""
    topic = await admin.create_topic("orders")
    source = await admin.create_subscription("orders-sub", topic)
    dl_topic = await admin.create_topic("dl")
    dead_letters = await admin.create_subscription("dl-sub", dl_topic)
    publisher = DeadLetterPublisher({"orders": dl_topic}, subscription_paths={"orders": source} if with_path else {})
    try:
        await publisher.publish("orders", engine_message("order-1", 3, "m-13", note="x"), "max_delivery_attempts", 5)
        await publisher.publish("orders", engine_message("order-2", 5, "m-25"), "app_dead_letter", 1)
    finally:
        await publisher.aclose()
    foreign_id = await admin.publish(dl_topic, b"not ours", origin="someone-else")
    return Room(topic, source, dead_letters, dl_topic, foreign_id)


async def run(*argv: str) -> int:
    return await asyncio.to_thread(cli.main, list(argv))


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]


async def listed(dl: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> set[str]:
    assert await run("dead-letters", "list", *dl, "--json") == 0
    return {str(row["message_id"]) for row in json_lines(capsys.readouterr().out)}


async def test_replay_sends_each_dead_letter_back_to_its_topic_with_the_marker_then_acks_it(
    admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]
) -> None:
    r = await room(admin)
    dl = ("--dead-letter-subscription", r.dead_letters)
    assert await run("dead-letters", "list", *dl, "--json", "--key", "order-1") == 0
    (row,) = json_lines(capsys.readouterr().out)
    assert await run("dead-letters", "replay", *dl, "--key", "order-1") == 0
    out, err = capsys.readouterr()
    assert f"replayed 1 dead letter(s) from {r.dead_letters} to {r.topic}" in out
    (record,) = [rec for rec in json_lines(err) if rec.get("event") == "dead_letter_replayed"]
    assert (record["message_id"], record["topic"], record["key"]) == ("m-13", r.topic, "order-1")

    (replayed,) = await admin.pull_available(r.source)
    assert replayed.data == b"order-1:3"
    assert replayed.attributes == {
        "order_id": "order-1",
        "seq": "3",
        "note": "x",
        "sidecar_replay_of": "m-13",
        "sidecar_replay_id": row["dead_letter_id"],
    }, "original attributes, the sidecar's own removed, the marker added"
    assert replayed.ordering_key == "ok-order-1"
    assert record["replay_message_id"] == replayed.message_id
    assert await listed(dl, capsys) == {"m-25", r.foreign_id}, "acked once replayed; the rest waits"


async def test_dry_run_shows_the_target_and_publishes_nothing(
    admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]
) -> None:
    r = await room(admin)
    dl = ("--dead-letter-subscription", r.dead_letters)
    assert await run("dead-letters", "replay", *dl, "--dry-run") == 0
    out = capsys.readouterr().out
    assert f"dry run: would replay 2 dead letter(s) to {r.topic}; nothing published or acked" in out
    assert await admin.pull_available(r.source) == []
    assert await listed(dl, capsys) == {"m-13", "m-25", r.foreign_id}


async def test_a_foreign_message_is_replayed_only_when_named_and_given_a_topic(
    admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]
) -> None:
    r = await room(admin)
    dl = ("--dead-letter-subscription", r.dead_letters)
    assert await run("dead-letters", "replay", *dl, "--reason", "foreign") == 0
    assert "no dead letters match (reason 'foreign'); nothing replayed" in capsys.readouterr().out
    assert await run("dead-letters", "replay", *dl, "--message-id", r.foreign_id) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is foreign" in err and "--topic" in err
    assert await run("dead-letters", "replay", *dl, "--message-id", r.foreign_id, "--topic", r.topic) == 0
    (replayed,) = await admin.pull_available(r.source)
    assert replayed.data == b"not ours"
    assert replayed.attributes == {
        "origin": "someone-else",
        "sidecar_replay_of": r.foreign_id,
        "sidecar_replay_id": r.foreign_id,
    }
    assert await listed(dl, capsys) == {"m-13", "m-25"}


async def test_a_dead_letter_that_does_not_name_its_subscription_needs_a_topic(
    admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]
) -> None:
    r = await room(admin, with_path=False)
    dl = ("--dead-letter-subscription", r.dead_letters)
    assert await run("dead-letters", "replay", *dl) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not name it" in err
    assert await listed(dl, capsys) == {"m-13", "m-25", r.foreign_id}, "nothing acked"


async def test_a_source_subscription_or_topic_that_is_gone_is_one_line_and_exit_2(
    admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]
) -> None:
    r = await room(admin)
    dl = ("--dead-letter-subscription", r.dead_letters)
    assert await run("dead-letters", "replay", *dl, "--topic", admin.topic_path("gone")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err
    await asyncio.to_thread(admin.subscriber.delete_subscription, request={"subscription": r.source})
    assert await run("dead-letters", "replay", *dl) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"subscription {r.source}" in err and "--topic" in err
    assert await listed(dl, capsys) == {"m-13", "m-25", r.foreign_id}, "nothing acked"


async def test_bad_replay_arguments_exit_2(admin: PubSubAdmin, capsys: pytest.CaptureFixture[str]) -> None:
    dl = ("--dead-letter-subscription", admin.subscription_path("x"))
    assert await run("dead-letters", "replay", *dl, "--topic", "orders") == 2
    assert "is not projects/P/topics/T" in capsys.readouterr().err
    assert await run("dead-letters", "replay", *dl, "--lease-seconds", "5") == 2
    assert "--lease-seconds must be 10..600" in capsys.readouterr().err
    assert await run("dead-letters", "replay", "--dead-letter-subscription", admin.subscription_path("none")) == 2
    assert "does not exist" in capsys.readouterr().err
