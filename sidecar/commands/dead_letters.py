"""`pubsub-sidecar dead-letters list|replay|discard`: the dead-letter waiting room, for operators and scripts.

Rules this module keeps:

- ``list`` never acks: it leases what waits, shows it, and gives it back (``sidecar.dead_letters.subscription``).
  A table for people, ending with the count per reason; ``--json`` prints one JSON object per
  message on stdout (``sidecar.dead_letters.view.to_json``) and the counts on stderr.
- ``discard`` acks the selected messages only after the operator's ``--note`` says why, and writes
  one structured (JSON) log line per discarded message on stderr, with who ran it and the note, so
  that a discard is a decision on record. ``--dry-run`` shows what it would discard and acks nothing.
  The note is required: a discard without a reason is exactly the silent loss this tool exists
  to prevent.
- ``replay`` sends the selected messages back to their topic and acks each only once Pub/Sub
  has its replay (``sidecar.dead_letters.replay``); ``--dry-run`` shows what would go where.
- Exit codes: 0 when the command did what was asked, including when nothing matches (it says so);
  2 for a bad argument, a dead-letter subscription that does not exist, or no way to reach Pub/Sub
  (neither ``PUBSUB_EMULATOR_HOST`` nor credentials: ``sidecar.config.credentials``) (one line on stderr);
  1 when Pub/Sub failed the command half-way (one line; what was not acked is given back).
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import os
import re
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, TextIO

from sidecar.commands.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from sidecar.config.durations import parse_duration_ms
from sidecar.dead_letters.replay import ReplayUsageError, plan, replay_letters
from sidecar.dead_letters.view import (
    Filters,
    WaitingLetter,
    count_by_reason,
    format_table,
    select,
    to_json,
    visible,
)
from sidecar.ops.logs import setup_logging

if TYPE_CHECKING:
    from sidecar.dead_letters.subscription import DeadLetterSubscription

DEFAULT_MAX_MESSAGES = 10_000
"""Messages one scan leases at most: every message is held in memory while the command runs."""

_DECISIONS = logging.getLogger("sidecar.dead_letters.subscription.decisions")
"""The record of discards: one INFO line per discarded message."""

_SUBSCRIPTION_RE = re.compile(r"projects/[^/]+/subscriptions/[^/]+")
_TOPIC_RE = re.compile(r"projects/[^/]+/topics/[^/]+")

DEFAULT_LEASE_SECONDS = 120
"""Lease on scanned dead letters: long enough for an operator's replay or discard of thousands,
short enough that a killed command's messages come back within minutes."""


class UsageError(Exception):
    """A bad argument: one line, exit 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``dead-letters`` subcommands and their options (``sidecar.commands.main`` builds the parser)."""
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    list_parser = actions.add_parser("list", help="show what waits on a dead-letter subscription (acks nothing)")
    replay = actions.add_parser("replay", help="send the selected dead letters back to their topic, then ack them")
    discard = actions.add_parser("discard", help="ack the selected dead letters, with a log record of each")
    for sub in (list_parser, replay, discard):
        sub.add_argument(
            "--dead-letter-subscription",
            required=True,
            metavar="PATH",
            help="projects/P/subscriptions/S, or S with GOOGLE_CLOUD_PROJECT set",
        )
        sub.add_argument("--key", action="append", default=[], help="only this key (repeatable)")
        sub.add_argument(
            "--reason",
            action="append",
            default=[],
            help="only this reason: a family (malformed, late) or the start of a reason (repeatable)",
        )
        sub.add_argument("--older-than", metavar="DURATION", help="only dead letters older than this, e.g. 1h")
        sub.add_argument(
            "--message-id",
            action="append",
            default=[],
            help="only this message (original or dead-letter id; repeatable); the only way to select a foreign one",
        )
        sub.add_argument("--json", action="store_true", help="one JSON object per message")
        sub.add_argument("--dry-run", action="store_true", help="change nothing (list never changes anything)")
        sub.add_argument("--max-messages", type=int, default=DEFAULT_MAX_MESSAGES, help="scan at most this many")
    discard.add_argument("--note", required=True, help="why these are discarded: kept in the log record")
    replay.add_argument(
        "--topic",
        metavar="PATH",
        help="replay to this topic (projects/P/topics/T) instead of the topic of each dead letter's subscription",
    )
    for sub in (replay, discard):
        sub.add_argument(
            "--lease-seconds",
            type=int,
            default=DEFAULT_LEASE_SECONDS,
            help="how long the scanned dead letters stay leased (10-600; a killed run's come back after it)",
        )


def run_command(args: argparse.Namespace) -> int:
    from sidecar.config.credentials import PUBSUB, require_google_access
    from sidecar.dead_letters.subscription import (
        BadSubscriptionName,
        DeadLetterSubscription,
        DeadLetterToolError,
        ReplayTargetNotFound,
        SubscriptionNotFound,
    )

    try:
        path = subscription_path(args.dead_letter_subscription, os.environ.get("GOOGLE_CLOUD_PROJECT"))
        filters = filters_from(args)
        if args.max_messages <= 0:
            raise UsageError(f"--max-messages must be positive (got {args.max_messages})")
        if args.action == "discard" and not args.note.strip():
            raise UsageError("--note must say why the messages are discarded")
        lease_seconds = getattr(args, "lease_seconds", DEFAULT_LEASE_SECONDS)
        if not 10 <= lease_seconds <= 600:
            raise UsageError(f"--lease-seconds must be 10..600 (Pub/Sub's ack deadline range), got {lease_seconds}")
        topic = getattr(args, "topic", None)
        if topic is not None and not _TOPIC_RE.fullmatch(topic):
            raise UsageError(f"--topic {topic!r} is not projects/P/topics/T")
    except UsageError as exc:
        print(f"pubsub-sidecar dead-letters: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # GoogleAccessMissing: one line and exit 2 (sidecar.commands.main), before the Pub/Sub client is made.
    require_google_access([PUBSUB])
    setup_logging("json", "WARNING", stream=sys.stderr)
    _DECISIONS.setLevel(logging.INFO)
    queue = DeadLetterSubscription(path, lease_seconds=lease_seconds)
    try:
        queue.check()
        letters, cut = queue.scan(args.max_messages)
        if cut:
            print(f"note: scanned the first {args.max_messages} messages only (--max-messages)", file=sys.stderr)
        now = datetime.now(UTC)
        if args.action == "list":
            return list_letters(visible(letters, filters, now), filters, now, args.json, sys.stdout)
        if args.action == "replay":
            return replay_selected(queue, select(letters, filters, now), filters, now, args, sys.stdout)
        return discard_letters(queue, select(letters, filters, now), filters, now, args, sys.stdout)
    except ReplayUsageError as exc:
        print(f"pubsub-sidecar dead-letters: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (SubscriptionNotFound, BadSubscriptionName, ReplayTargetNotFound) as exc:
        print(f"pubsub-sidecar dead-letters: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DeadLetterToolError as exc:
        print(f"pubsub-sidecar dead-letters: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        queue.close()


def subscription_path(text: str, project: str | None) -> str:
    """The full subscription path; a bare name needs GOOGLE_CLOUD_PROJECT. Raises UsageError."""
    if _SUBSCRIPTION_RE.fullmatch(text):
        return text
    if "/" not in text and text and project:
        return f"projects/{project}/subscriptions/{text}"
    raise UsageError(
        f"--dead-letter-subscription {text!r} is not projects/P/subscriptions/S"
        + ("" if project or "/" in text else " (a bare name needs GOOGLE_CLOUD_PROJECT)")
    )


def filters_from(args: argparse.Namespace) -> Filters:
    older_than_seconds = None
    if args.older_than is not None:
        try:
            older_than_seconds = parse_duration_ms(args.older_than) / 1000
        except ValueError as exc:
            raise UsageError(f"--older-than: {exc}") from exc
    for option, values in (("--key", args.key), ("--reason", args.reason), ("--message-id", args.message_id)):
        if any(not value for value in values):
            raise UsageError(f"{option} must not be empty")
    return Filters(
        keys=frozenset(args.key),
        reasons=frozenset(args.reason),
        older_than_seconds=older_than_seconds,
        message_ids=frozenset(args.message_id),
    )


def list_letters(letters: list[WaitingLetter], filters: Filters, now: datetime, as_json: bool, out: TextIO) -> int:
    if not letters:
        print(f"no dead letters match ({filters.describe()})", file=sys.stderr if as_json else out)
        return EXIT_OK
    if as_json:
        for letter in letters:
            out.write(json.dumps(to_json(letter, now), ensure_ascii=False) + "\n")
        counts = ", ".join(f"{reason} {n}" for reason, n in count_by_reason(letters).items())
        print(f"{len(letters)} dead letter(s): {counts}", file=sys.stderr)
    else:
        out.write(format_table(letters, now) + "\n")
    return EXIT_OK


def discard_letters(
    queue: DeadLetterSubscription,
    letters: list[WaitingLetter],
    filters: Filters,
    now: datetime,
    args: argparse.Namespace,
    out: TextIO,
) -> int:
    if not letters:
        print(f"no dead letters match ({filters.describe()}); nothing discarded", file=out)
        return EXIT_OK
    if args.dry_run:
        out.write(format_table(letters, now) + "\n")
        print(f"dry run: would discard {len(letters)} dead letter(s); nothing acked", file=out)
        return EXIT_OK
    queue.ack(letters)
    operator = _operator()
    for letter in letters:
        record = to_json(letter, now)
        _DECISIONS.info(
            "dead letter discarded",
            extra={
                "event": "dead_letter_discarded",
                "dead_letter_subscription": queue.path,
                "note": args.note,
                "operator": operator,
                **{name: value for name, value in record.items() if name != "age_seconds"},
            },
        )
    print(f"discarded {len(letters)} dead letter(s) from {queue.path}", file=out)
    return EXIT_OK


def replay_selected(
    queue: DeadLetterSubscription,
    letters: list[WaitingLetter],
    filters: Filters,
    now: datetime,
    args: argparse.Namespace,
    out: TextIO,
) -> int:
    from sidecar.dead_letters.subscription import ReplayPublisher

    if not letters:
        print(f"no dead letters match ({filters.describe()}); nothing replayed", file=out)
        return EXIT_OK
    replays = plan(letters, args.topic, queue.topic_of)
    publisher = ReplayPublisher()
    try:
        replay_letters(queue, publisher, replays, now, args, _operator(), out)
    finally:
        publisher.close()
    return EXIT_OK


def _operator() -> str:
    """Who ran the command, as the OS knows them; a container without a user name says so."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"
