"""`pubsub-sidecar run --config FILE`: check what the user gave, then run the sidecar until it stops.

Rules:

- Everything the user must fix is refused before any client is made or any log line written, with
  one line on stderr and exit code 2: an invalid config file (``sidecar.config.model``), a peer
  secret file that cannot be read or is empty (``sidecar.config.peering``), a
  ``--grace-period`` that is not positive, with tracing on an ``OTEL_*`` environment naming an
  exporter the sidecar does not ship (``sidecar.ops.tracing``), no way to reach Pub/Sub, Firestore
  or (in watermark mode) Monitoring (``GoogleAccessMissing``, printed by ``sidecar.commands.main``),
  a bad log setting.
- The sidecar itself (``sidecar.wiring.app``) runs until SIGTERM/SIGINT or a component failure; its
  ``failure`` is the exit code: none 0; an address in use (``ListenError``, one line already
  printed, nothing else ran) or a relay whose topic takes no publishes from this process
  (``RelayRefused``, one line, checked before anything runs) 2; any other 1, so that Kubernetes
  restarts the container.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from sidecar.commands.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from sidecar.config import credentials
from sidecar.config.credentials import require_google_access
from sidecar.config.model import ConfigError, config_error_exit, load_config
from sidecar.config.peering import PeerSecretError, read_peer_secret
from sidecar.ops.listening import ListenError
from sidecar.ops.logs import setup_logging
from sidecar.ops.tracing import TracingConfigError, exporter_name
from sidecar.publishing.relay import RelayRefused
from sidecar.wiring.app import serve_until_stopped


def run_command(args: argparse.Namespace) -> int:
    """``pubsub-sidecar run --config FILE``."""
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        return config_error_exit(exc)
    peering = config.peering
    if peering is not None and peering.enabled and peering.secret_file:
        try:
            read_peer_secret(peering.secret_file)  # unreadable or empty: one line, exit 2, like a config error
        except PeerSecretError as exc:
            print(f"pubsub-sidecar: {exc}", file=sys.stderr)
            return EXIT_USAGE
    if not args.grace_period > 0:
        print(f"pubsub-sidecar: --grace-period must be positive, got {args.grace_period}", file=sys.stderr)
        return EXIT_USAGE
    if config.tracing.enabled:
        try:
            exporter_name(os.environ)
        except TracingConfigError as exc:
            print(f"pubsub-sidecar run: tracing: {exc}", file=sys.stderr)
            return EXIT_USAGE
    watermark = any(sub.ordering.mode == "watermark" for sub in config.subscriptions)
    # GoogleAccessMissing: one line and exit 2 (sidecar.commands.main), before any client or log line.
    require_google_access([credentials.PUBSUB, credentials.FIRESTORE, *([credentials.MONITORING] * watermark)])
    try:
        setup_logging(args.log_format, args.log_level)
    except ValueError as exc:
        print(f"pubsub-sidecar: {exc}", file=sys.stderr)
        return EXIT_USAGE
    sidecar = asyncio.run(serve_until_stopped(config, args.grace_period))
    if isinstance(sidecar.failure, ListenError | RelayRefused):  # one line already printed
        return EXIT_USAGE
    return EXIT_FAILED if sidecar.failure is not None else EXIT_OK
