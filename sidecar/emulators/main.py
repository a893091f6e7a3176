"""`pubsub-sidecar emulators`: run all emulators in one process until SIGTERM or SIGINT.

The ``export`` lines go to stdout, flushed, only once every server accepts connections, so a
parent process (a test fixture, ``eval $(...)``) may read them as the readiness signal. With port 0
they carry the real bound ports. SIGTERM/SIGINT stop the stack and exit 0; a failure to start
exits 1 with the reason on stderr.

The Firestore emulator loads an index configuration by default (``index_file``), so that local
runs match a production database deployed as docs/operations.md says (and the sidecar's start-up
check finds nothing to warn about): ``--firestore-indexes PATH`` names one, otherwise
``./firestore.indexes.json`` is used, otherwise the repository's own when running from a checkout;
``--no-firestore-indexes`` keeps production's defaults (every field indexed, no TTL policy).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from pathlib import Path

from sidecar.emulators.stack import EmulatorStack

_LOGGER = logging.getLogger(__name__)

_FREEZE_SECONDS = 5.0
"""How often what survived is moved out of the collector's generations (``_freeze_survivors``)."""


async def _freeze_survivors() -> None:
    """The emulators keep every message and document they serve: a full collection walks all of
    them, and at a few hundred thousand it stopped the event loop for 60-160 ms during a bench run,
    a stall the real services never show, and one that lands in the latency the sidecar reports.
    Freezing what survived (cheap: no walk) leaves full collections only the objects made since.
    The price: a reference cycle that becomes garbage after its freeze is never collected, which a
    test's or a bench run's emulator can afford (its data are acyclic protobufs and dicts)."""
    while True:
        await asyncio.sleep(_FREEZE_SECONDS)
        gc.freeze()


INDEXES_FILE = "firestore.indexes.json"
REPOSITORY_INDEXES = Path(__file__).resolve().parents[2] / INDEXES_FILE
"""The repository's index configuration (what production deploys), when running from a checkout."""


def index_file(requested: str | None, *, disabled: bool = False, cwd: Path | None = None) -> str | None:
    """The ``firestore.indexes.json`` the Firestore emulator loads (module docstring); None: none."""
    if disabled:
        return None
    if requested is not None:
        return requested
    for candidate in ((cwd if cwd is not None else Path.cwd()) / INDEXES_FILE, REPOSITORY_INDEXES):
        if candidate.is_file():
            return str(candidate)
    return None


def export_lines(stack: EmulatorStack) -> list[str]:
    lines = [f"export {name}={value}" for name, value in stack.env.items()]
    lines.append(f"export EMULATORS_ADMIN_URL={stack.admin_url}")
    return lines


async def _serve(args: argparse.Namespace) -> int:
    indexes = index_file(args.firestore_indexes, disabled=bool(getattr(args, "no_firestore_indexes", False)))
    if indexes is None:
        _LOGGER.info("Firestore emulator: no index configuration, every field indexed (production's defaults)")
    else:
        _LOGGER.info("Firestore emulator: index configuration from %s", indexes)
    stack = EmulatorStack(
        host=args.host,
        pubsub_port=args.pubsub_port,
        firestore_port=args.firestore_port,
        monitoring_port=args.monitoring_port,
        admin_port=args.admin_port,
        metric_period=args.metric_period,
        metric_delay=args.metric_delay,
        firestore_indexes=indexes,
        ttl_sweep_seconds=args.firestore_ttl_sweep,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # The one place that installs signal handlers for this process.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stack.start()
    except (OSError, ValueError) as exc:
        print(f"pubsub-sidecar emulators: cannot start: {exc}", file=sys.stderr, flush=True)
        return 1
    freezing = asyncio.create_task(_freeze_survivors())
    try:
        print("\n".join(export_lines(stack)), flush=True)
        await stop.wait()
        _LOGGER.info("signal received; stopping the emulators")
    finally:
        freezing.cancel()
        await stack.stop()
    return 0


def run_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return asyncio.run(_serve(args))
