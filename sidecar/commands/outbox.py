"""`pubsub-sidecar outbox list|retry|discard`: the outbox relay's waiting room, for operators and scripts.

Rules this module keeps (``sidecar.publishing.waiting_room`` does the work, against Firestore):

- Every action reads the relays from the sidecar's config file (``--config``: project, Firestore
  root, each relay's outbox and attributes), as the running relays do; ``--relay`` picks one (by
  default, every relay of the file for ``list``; required for ``retry`` and ``discard``).
- ``list`` prints a table (relay, entry, key, entries waiting behind it, whether a retry can help,
  the reason), or one JSON object per entry with ``--json``; it changes nothing.
- ``retry ENTRY`` frees an entry the relay gave up on (a publish that failed for good); the relay
  publishes it at once with its key's next number. An entry unpublishable as written is refused.
- ``discard ENTRY --note TEXT`` deletes the entry from the outbox and records the decision with the
  note; its key flows on. One JSON line on stderr records who discarded what, and why.
- Exit codes: 0 done (an empty list included); 2 a bad argument, config file, relay name, or no way
  to reach Firestore (one line); 1 a refusal (not in the waiting room, a retry that cannot help) or
  a Firestore failure (one line).
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import sys
from collections.abc import Sequence

from sidecar.commands.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from sidecar.config import credentials
from sidecar.config.credentials import require_google_access
from sidecar.config.model import ConfigError, SidecarConfig, config_error_exit, load_config
from sidecar.config.relays import RelayConfig
from sidecar.publishing.waiting_room import (
    Waiting,
    WaitingRoomRefusal,
    discard,
    list_waiting,
    open_documents,
    retry,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    for name, help_text in (
        ("list", "show the entries that wait, why, and what waits behind them"),
        ("retry", "publish again an entry the relay gave up on"),
        ("discard", "delete an entry from the outbox, with a note (its key flows on)"),
    ):
        action = actions.add_parser(name, help=help_text)
        action.add_argument("--config", required=True, help="the sidecar's config file (its relays: section)")
        action.add_argument("--relay", help="the relay's name (default for list: every relay)")
        if name == "list":
            action.add_argument("--json", action="store_true", help="one JSON object per entry")
        else:
            action.add_argument("entry", help="the outbox entry's document id (as `list` shows it)")
        if name == "discard":
            action.add_argument("--note", required=True, help="why the entry is dropped (kept with the decision)")


def run_command(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        return config_error_exit(exc)
    relays = _relays(config, args.relay, args.action)
    if isinstance(relays, str):
        print(f"pubsub-sidecar outbox: {relays}", file=sys.stderr)
        return EXIT_USAGE
    require_google_access([credentials.FIRESTORE])
    try:
        return asyncio.run(_act(args, config, relays))
    except WaitingRoomRefusal as exc:
        print(f"pubsub-sidecar outbox: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # a Firestore failure: one line, not a traceback
        print(f"pubsub-sidecar outbox: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_FAILED


def _relays(config: SidecarConfig, name: str | None, action: str) -> list[RelayConfig] | str:
    if not config.relays:
        return "the config file has no relays"
    if name is None:
        return list(config.relays) if action == "list" else "--relay is required (the relay's name)"
    chosen = [r for r in config.relays if r.name == name]
    if not chosen:
        return f"no relay named {name!r} (the file has {', '.join(r.name for r in config.relays)})"
    return chosen


async def _act(args: argparse.Namespace, config: SidecarConfig, relays: Sequence[RelayConfig]) -> int:
    opened = {}
    try:
        for relay in relays:
            database = relay.outbox.database
            if database not in opened:
                opened[database] = open_documents(config.project, database)
        root = config.firestore.root
        if args.action == "list":
            found: list[Waiting] = []
            for relay in relays:
                found += await list_waiting(opened[relay.outbox.database], relay, config.project, root)
            _print(found, args.json)
            return EXIT_OK
        relay = relays[0]
        documents = opened[relay.outbox.database]
        if args.action == "retry":
            waiting = await retry(documents, relay, config.project, root, args.entry)
            print(f"relay {relay.name}: entry {args.entry} (key {waiting.key!r}) will be published again")
            return EXIT_OK
        waiting = await discard(documents, relay, config.project, root, args.entry, args.note)
        record = {"decision": "discard", "by": _who(), **waiting.to_json(), "note": args.note.strip()}
        print(json.dumps(record), file=sys.stderr)
        print(f"relay {relay.name}: entry {args.entry} discarded; key {waiting.key!r} flows on")
        return EXIT_OK
    finally:
        for documents in opened.values():
            await documents.close()


def _who() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "unknown"


def _print(found: list[Waiting], as_json: bool) -> None:
    if as_json:
        for waiting in found:
            print(json.dumps(waiting.to_json()))
        return
    if not found:
        print("nothing waits")
        return
    rows = [("RELAY", "ENTRY", "KEY", "BEHIND", "RETRY", "REASON")]
    for w in found:
        rows.append(
            (
                w.relay,
                w.entry_id,
                "-" if w.key is None else w.key,
                str(w.behind),
                "yes" if w.given_up else "no",
                w.reason,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:5], widths, strict=True)) + "  " + row[5])
    print(f"{len(found)} waiting; {len({w.key for w in found if w.key is not None})} keys blocked")
