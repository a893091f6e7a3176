"""The `pubsub-sidecar` command: parses arguments and hands off to the module that does the job.

Each subcommand lives in its own module and is imported only when chosen, so `pubsub-sidecar
emulators` never loads the sidecar and `pubsub-sidecar run` never loads the emulators.

A command that cannot reach Google (no emulator variable, no credentials) raises
``GoogleAccessMissing`` (``sidecar.config.credentials``): printed here as one line naming what to set, exit
code 2, like a config error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from sidecar.commands.exit_codes import EXIT_USAGE
from sidecar.config.credentials import GoogleAccessMissing

# subcommand -> "module:function"; the function takes the parsed namespace and returns an exit code.
_COMMANDS: dict[str, str] = {
    "run": "sidecar.commands.run:run_command",
    "emulators": "sidecar.emulators.main:run_command",
    "demo": "sidecar.commands.demo:run_command",
    "status": "sidecar.commands.status:run_command",
    "dead-letters": "sidecar.commands.dead_letters:run_command",
    "unblock": "sidecar.commands.unblock:run_command",
    "skip-gap": "sidecar.commands.skip_gap:run_command",
    "outbox": "sidecar.commands.outbox:run_command",
    "bench": "bench.__main__:run_command",
}


def _non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pubsub-sidecar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the sidecar")
    run.add_argument("--config", required=True, help="YAML config file")
    run.add_argument("--log-format", choices=["json", "text"], default="json")
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    run.add_argument(
        "--grace-period",
        type=float,
        default=25.0,
        help="seconds SIGTERM waits for in-flight acks before giving messages back (default 25)",
    )

    emu = sub.add_parser("emulators", help="run the Pub/Sub, Firestore and Monitoring emulators")
    emu.add_argument("--host", default="127.0.0.1")
    emu.add_argument("--pubsub-port", type=int, default=8085)
    emu.add_argument("--firestore-port", type=int, default=8080)
    emu.add_argument("--monitoring-port", type=int, default=8086)
    emu.add_argument("--admin-port", type=int, default=8087, help="HTTP admin: fault injection, counters")
    emu.add_argument("--metric-period", type=float, default=60.0, help="metric sampling period, seconds")
    emu.add_argument("--metric-delay", type=float, default=120.0, help="metric visibility delay, seconds")
    indexes = emu.add_mutually_exclusive_group()
    indexes.add_argument(
        "--firestore-indexes",
        metavar="PATH",
        help="firestore.indexes.json (Firebase CLI format): exemptions, composites, TTL fields (default: "
        "./firestore.indexes.json, else the repository's, so that local runs match production)",
    )
    indexes.add_argument(
        "--no-firestore-indexes",
        action="store_true",
        help="load no index configuration: every field indexed, no TTL policy (production's defaults)",
    )
    emu.add_argument(
        "--firestore-ttl-sweep",
        type=_non_negative_seconds,
        default=60.0,
        metavar="SECONDS",
        help="Firestore TTL sweep interval (default 60; 0 = after every commit)",
    )

    demo = sub.add_parser("demo", help="emulators + sidecar + publisher + app, with a summary")
    demo.add_argument("--orders", type=int, default=20)
    demo.add_argument("--log-format", choices=["json", "text"], default="text")

    status = sub.add_parser("status", help="show what GetStatus says")
    status.add_argument("--target", required=True, help="sidecar address, host:port or unix:///path")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--max-keys", type=int, default=50, help="waiting keys to show per subscription")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the sidecar")

    dead_letters = sub.add_parser("dead-letters", help="see, replay and discard dead letters waiting on a subscription")
    # The options live with the command; importing its pure module loads no Google library.
    importlib.import_module("sidecar.commands.dead_letters").add_arguments(dead_letters)

    unblock = sub.add_parser("unblock", help="skip the dead letter that blocks a key (recorded durably)")
    unblock.add_argument("--target", required=True, help="sidecar address, host:port or unix:///path")
    unblock.add_argument("--subscription", required=True, help="the subscription `name` from the sidecar's config")
    unblock.add_argument("--key", required=True, help="the blocked ordering key")
    unblock.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the sidecar (default 30)")

    skip_gap = sub.add_parser("skip-gap", help="skip the missing sequences a key waits on (recorded durably)")
    skip_gap.add_argument("--target", required=True, help="sidecar address, host:port or unix:///path")
    skip_gap.add_argument("--subscription", required=True, help="the subscription `name` from the sidecar's config")
    skip_gap.add_argument("--key", required=True, help="the ordering key that waits on a gap")
    skip_gap.add_argument(
        "--through",
        required=True,
        type=int,
        help="the last missing sequence to skip (`status` prints the whole gap's)",
    )
    skip_gap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the sidecar (default 30)")

    outbox = sub.add_parser("outbox", help="list, retry and discard outbox entries a relay cannot publish")
    importlib.import_module("sidecar.commands.outbox").add_arguments(outbox)

    bench = sub.add_parser("bench", help="benchmark the sidecar against the raw subscriber")
    bench.add_argument("--quick", action="store_true")
    bench.add_argument("--scenario", action="append", help="run only these scenarios")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, _, func_name = _COMMANDS[args.command].partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(args) or 0)
    except GoogleAccessMissing as exc:
        print(f"pubsub-sidecar {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
