"""``pubsub-sidecar dead-letters replay``: send dead letters back to their topic, then ack them.

Rules this module keeps (the sidecar's side of a replay is in ``sidecar.engine``, rule 6):

- **What is sent.** The dead letter's data and attributes with the sidecar's own ``sidecar_*``
  attributes removed, its original ordering key (kept by the dead letter as
  ``sidecar_ordering_key``), and the replay marker (``sidecar.dead_letters.replay_marker``): the original message
  id, the dead letter's own id as the replay id, and the original event time when there is one.
- **Where.** To the topic of the subscription the dead letter came from: the dead letter names it
  (``sidecar_subscription_path``) and GetSubscription says its topic. ``--topic`` overrides that
  (and is the only way for a dead letter that does not name it: a foreign one, or one written by a
  sidecar before the attribute existed).
- **Nothing lost, nothing twice.** A dead letter is acked only after the Publish RPC that carried
  its replay returned (Pub/Sub stored it). If the command dies in between, the dead letter comes
  back when its lease lapses, and the next run publishes the very same replay id again: the
  sidecar stores a replay under its replay id, so the second publish is a duplicate and the app
  gets the message once.
- Foreign messages are replayed only when named by ``--message-id`` (``dead_letter_view.select``).
- One JSON log line per replayed dead letter (``event: dead_letter_replayed``), like a discard: the
  replay is a decision on record.
- ``--dry-run`` shows what would be sent where, and publishes and acks nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, TextIO

from sidecar.dead_letters.replay_marker import marker_attributes
from sidecar.dead_letters.view import WaitingLetter, format_table, to_json

if TYPE_CHECKING:
    from sidecar.dead_letters.subscription import DeadLetterSubscription, ReplayPublisher

_DECISIONS = logging.getLogger("sidecar.dead_letters.subscription.decisions")

SOURCE_PATH_ATTRIBUTE = "sidecar_subscription_path"
ORDERING_KEY_ATTRIBUTE = "sidecar_ordering_key"
TIMESTAMP_ATTRIBUTE = "sidecar_timestamp_ms"

MESSAGES_PER_PUBLISH = 100
"""Replays per Publish call (Pub/Sub takes up to 1,000 and 10 MB): each call's dead letters are acked
right after it returns, so a crash leaves at most this many published and not yet acked."""

HOLD_AFTER_PUBLISH_ENV = "PUBSUB_SIDECAR_REPLAY_HOLD_AFTER_PUBLISH"
"""Fault injection for the end-to-end test of a replay killed between its publish and its ack: when
set to a path, the command creates that file after its first Publish returned and then waits, before
acking anything, to be killed."""


class ReplayUsageError(Exception):
    """The selection cannot be replayed as asked (no topic known for a dead letter): exit 2."""


@dataclass(frozen=True, slots=True)
class Replay:
    """One dead letter and what its replay publishes."""

    letter: WaitingLetter
    topic: str
    data: bytes
    attributes: dict[str, str]
    ordering_key: str


def replay_of(letter: WaitingLetter, topic: str) -> Replay:
    """The message that replays ``letter`` (module docstring: what is sent)."""
    attributes = letter.original_attributes()
    attributes.update(
        marker_attributes(letter.message_id, letter.dead_letter_id, letter.attributes.get(TIMESTAMP_ATTRIBUTE))
    )
    return Replay(letter, topic, letter.data, attributes, letter.attributes.get(ORDERING_KEY_ATTRIBUTE, ""))


def plan(letters: Sequence[WaitingLetter], topic: str | None, topic_of: Callable[[str], str]) -> list[Replay]:
    """Each letter's replay, in the given order. Raises ReplayUsageError when a letter names no source
    subscription and no ``topic`` was given; ``topic_of`` (GetSubscription) is asked once per source."""
    topics: dict[str, str] = {}
    replays = []
    for letter in letters:
        target = topic
        if target is None:
            source = None if letter.foreign else letter.attributes.get(SOURCE_PATH_ATTRIBUTE)
            if not source:
                what = "is foreign" if letter.foreign else f"of subscription {letter.subscription!r} does not name it"
                raise ReplayUsageError(
                    f"dead letter {letter.dead_letter_id} {what}: which topic to replay it to is unknown; pass --topic"
                )
            if source not in topics:
                topics[source] = topic_of(source)
            target = topics[source]
        replays.append(replay_of(letter, target))
    return replays


def _batches(replays: list[Replay]) -> Iterator[list[Replay]]:
    """Consecutive replays to one topic, at most ``MESSAGES_PER_PUBLISH`` at a time (order kept)."""
    batch: list[Replay] = []
    for replay in replays:
        if batch and (replay.topic != batch[0].topic or len(batch) >= MESSAGES_PER_PUBLISH):
            yield batch
            batch = []
        batch.append(replay)
    if batch:
        yield batch


def replay_letters(
    queue: DeadLetterSubscription,
    publisher: ReplayPublisher,
    replays: list[Replay],
    now: datetime,
    args: argparse.Namespace,
    operator: str,
    out: TextIO,
) -> None:
    """Publish each replay, then ack its dead letter; or, with ``--dry-run``, show the plan."""
    if args.dry_run:
        out.write(format_table([r.letter for r in replays], now) + "\n")
        for topic, count in _per_topic(replays).items():
            print(f"dry run: would replay {count} dead letter(s) to {topic}; nothing published or acked", file=out)
        return
    hold_file = os.environ.get(HOLD_AFTER_PUBLISH_ENV)
    for batch in _batches(replays):
        queue.renew([r.letter for r in batch])
        ids = publisher.publish(batch[0].topic, [(r.data, r.attributes, r.ordering_key) for r in batch])
        if hold_file:
            _hold(hold_file)
        queue.ack([r.letter for r in batch])  # only now: Pub/Sub has the replays
        for replay, new_id in zip(batch, ids, strict=True):
            record = {name: value for name, value in to_json(replay.letter, now).items() if name != "age_seconds"}
            _DECISIONS.info(
                "dead letter replayed",
                extra={
                    "event": "dead_letter_replayed",
                    "dead_letter_subscription": queue.path,
                    "topic": replay.topic,
                    "replay_message_id": new_id,
                    "operator": operator,
                    **record,
                },
            )
            if args.json:
                out.write(json.dumps({**record, "topic": replay.topic, "replay_message_id": new_id}) + "\n")
    for topic, count in _per_topic(replays).items():
        print(f"replayed {count} dead letter(s) from {queue.path} to {topic}", file=sys.stderr if args.json else out)


def _per_topic(replays: Sequence[Replay]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for replay in replays:
        counts[replay.topic] = counts.get(replay.topic, 0) + 1
    return counts


def _hold(path: str) -> None:
    """The fault-injection hold (``HOLD_AFTER_PUBLISH_ENV``): say so, then wait to be killed."""
    with open(path, "w") as marker:
        marker.write(str(os.getpid()))
    while True:
        time.sleep(1)
