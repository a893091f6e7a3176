"""One subscription's running parts, made and joined: runtime, shard leases and ownership, ingest, watermark.

Rules:

- Making the parts starts nothing: ``assemble_subscription`` only constructs and joins them; the
  sidecar (``sidecar.wiring.app``) starts them in dependency order and ``sidecar.wiring.shutdown``
  stops them in reverse.
- The runtime learns about its leases through plain callables set here (``lease_check``,
  ``status_counts``, ``on_shard_lost``); the leases act on the runtime only through
  ``sidecar.wiring.ownership`` (gained, lost, before release): neither layer imports the other.
- Ingest persists through the timing store it is given (the persist-latency histogram); the runtime
  reports each batch it hands out through ``on_delivered`` (the publish-to-delivery histogram).
- The Listen on the lease documents starts a full lease round at once on a take, hand-over,
  release, request or a change by hand, never on a renewal; when it fails, a full round still runs
  every 60 leases (``sidecar.cluster.leases.manager``).
- ``pod_identity`` is the pod's name, the same for every process of the pod (static membership):
  a restarted container takes its own shards back at once, at new epochs, as a new incarnation of
  the name (``sidecar.cluster.leases.members``), and a second process under a living name is refused.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sidecar.cluster.leases.manager import ShardLeases
from sidecar.config.model import SubscriptionConfig
from sidecar.dead_letters.publisher import DeadLetterPublisher
from sidecar.engine.types import Deliver
from sidecar.pipeline.ingest import Ingestor
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.pipeline.watermark_source import WatermarkSource
from sidecar.store import documents as docs
from sidecar.store.api import StoreError
from sidecar.store.firestore import FirestoreStore
from sidecar.store.timed import TimedStore
from sidecar.wiring.ownership import ShardOwnership

_LOGGER = logging.getLogger(__name__)


@dataclass
class SubscriptionParts:
    """One subscription's components, as the sidecar starts, watches and stops them."""

    config: SubscriptionConfig
    runtime: SubscriptionRuntime
    ingestor: Ingestor
    watermark: WatermarkSource | None = None
    leases: ShardLeases | None = None
    ownership: ShardOwnership | None = None
    lease_listen: docs.Listening | None = None
    listen_leases: Callable[[], docs.Listening] | None = None
    """Starts the Listen on the subscription's lease documents (``Sidecar._run``)."""


def assemble_subscription(
    sub: SubscriptionConfig,
    *,
    root: str,
    pod: str,
    store: FirestoreStore,
    timed_store: TimedStore,
    dead_letters: DeadLetterPublisher,
    on_delivered: Callable[[str, Sequence[Deliver], int], None],
    peer_address: str = "",
) -> SubscriptionParts:
    """Make ``sub``'s runtime, ownership, leases, ingest and watermark source, joined (nothing runs)."""
    runtime = SubscriptionRuntime(
        sub.name,
        sub.engine_config(),
        store,
        dead_letters,
        on_delivered=functools.partial(on_delivered, sub.name),
        max_held_bytes=sub.flow_control.max_held_bytes,
        shard_count=sub.sharding.shards,
    )
    ownership = ShardOwnership(runtime, store, drain_timeout_seconds=sub.sharding.drain_timeout_ms / 1000)
    leases = ShardLeases(
        store.documents,
        f"{root}/{sub.name}",
        sub.sharding.shards,
        pod,
        lease_ms=sub.sharding.lease_duration_ms,
        on_gained=ownership.on_gained,
        on_lost=ownership.on_lost,
        before_release=ownership.before_release,
        address=peer_address,  # in this pod's member document: the forwarders' target, the restart's probe
        attempts=runtime,  # delivery attempts recorded in a hand-over's lease write, kept by the next owner
    )
    runtime.pod = pod
    runtime.lease_check = leases.holds
    runtime.status_counts = functools.partial(_lease_counts, leases, ownership)
    runtime.on_shard_lost = leases.shard_lost
    ingestor = Ingestor(sub, timed_store, runtime, dead_letters)
    return SubscriptionParts(
        sub,
        runtime,
        ingestor,
        _watermark_source(sub, runtime),
        leases=leases,
        ownership=ownership,
        listen_leases=functools.partial(_listen_leases, store.documents, leases, f"{root}/{sub.name}", sub.name),
    )


def pod_identity() -> str:
    """This pod among the pods of a subscription: its name (``POD_NAME`` from the downward API, else
    the host name), the same for every process the pod runs. Each process is a new incarnation of
    the name (its member document): a zombie of an earlier one is never taken for the live one, and
    its writes are fenced by epochs that moved on."""
    return os.environ.get("POD_NAME") or socket.gethostname() or "sidecar"


def _lease_counts(leases: ShardLeases, ownership: ShardOwnership) -> dict[str, int]:
    counts = leases.stats.counts()
    counts["inbox_messages"] = ownership.inbox_messages
    counts["inbox_listen_failures"] = ownership.listen_failures
    return counts


def _listen_leases(documents: docs.Documents, leases: ShardLeases, sub_path: str, name: str) -> docs.Listening:
    """A Listen on the subscription's lease documents: any change (a release, a request, a take)
    runs a lease round at once instead of at the next renewal."""

    seen: dict[str, object] = {}

    def on_change(change: docs.Change) -> None:
        # Every change but a renewal (``beat``, which only sidecars from before member documents
        # write) is one to act on: a take, hand-over, release, request, or a document changed by hand.
        if change.initial:
            seen.clear()
        relevant = bool(change.removals)
        for doc_id, fields, _ in change.upserts:
            state = sorted((name, repr(value)) for name, value in fields.items() if name != "beat")
            relevant |= seen.get(doc_id) != state
            seen[doc_id] = state
        for doc_id in change.removals:
            seen.pop(doc_id, None)
        if relevant and not change.initial:
            leases.poke()

    def on_error(error: StoreError) -> None:
        # The rounds still run every third of a lease: hand-overs are seen later, nothing is lost.
        _LOGGER.warning("subscription %s: the Listen on lease documents failed (%s); rounds continue", name, error)

    return documents.listen(sub_path, "leases", [], on_change, on_error)


def _watermark_source(sub: SubscriptionConfig, runtime: SubscriptionRuntime) -> WatermarkSource | None:
    ordering = sub.ordering
    if ordering.mode != "watermark":
        return None
    # The subscription name is resolved to projects/P/subscriptions/S when the config is loaded.
    _, project, _, subscription_id = sub.subscription.split("/")
    return WatermarkSource(
        project=project,
        subscription_id=subscription_id,
        poll_interval_s=ordering.watermark.poll_interval_ms / 1000,
        safety_margin_ms=ordering.watermark.safety_margin_ms,
        allowed_skew_ms=ordering.timestamp.allowed_skew_ms or 0,
        max_metric_delay_ms=ordering.watermark.max_metric_delay_ms,
        on_watermark=runtime.advance_watermark,
    )
