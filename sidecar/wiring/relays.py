"""The configured outbox relays (``relays:``, DESIGN §12) of one running sidecar: made, checked,
run, stopped and reported.

- Made in ``Relays.__init__``: one ``FirestoreDocuments`` per outbox database (the relay's counters
  and leases live beside its outbox, so one fenced Commit covers both), one Pub/Sub publisher for all.
- ``check`` (before anything runs): each relay's topic must take publishes from this process, or the
  start ends with one line and exit 2 (``RelayRefused``).
- ``start`` adds each relay's run (its Listen and lease rounds) to the sidecar's watched tasks: one
  that ends stops the sidecar, as a subscription's would.
- ``stop`` (SIGTERM) hands every relay's shards over after their workers end the step they are in.
- ``collector``: the relays' figures as Prometheus families (``pubsub_sidecar_relay_*``).
- ``write_entry``: what the ``Publish`` RPC writes (the servicer's ``entries``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.config.model import SidecarConfig
from sidecar.publishing.publisher import PubsubPublisher
from sidecar.publishing.relay import Relay
from sidecar.store.firestore import FirestoreDocuments

_LOGGER = logging.getLogger(__name__)

_COUNTERS = {
    "relay_published": "Messages the relay published (republishes after a failure included).",
    "relay_republished": "Messages published again with the same number (a failed publish or settle).",
    "relay_settled_batches": "Batches settled: entries deleted and counters moved in one fenced Commit.",
    "relay_publish_failures": "Messages Pub/Sub did not take (retried with backoff, in order).",
    "relay_listen_failures": "Times the Listen on the outbox failed for good and was opened again.",
}
_GAUGES = {
    "relay_pending_entries": "Outbox entries this pod sees (all shards).",
    "relay_waiting_entries": "Entries in the waiting room (unpublishable, or failed for good): their keys wait.",
    "relay_blocked_keys": "Keys that wait behind an entry in the waiting room.",
    "relay_shards_held": "Relay shards this pod holds.",
}


class Relays:
    def __init__(self, config: SidecarConfig, pod: str) -> None:
        self.relays: dict[str, Relay] = {}
        self._documents: dict[str, FirestoreDocuments] = {}
        self._publisher: PubsubPublisher | None = None
        if not config.relays:
            return
        self._publisher = PubsubPublisher()
        for relay in config.relays:
            database = relay.outbox.database
            if database not in self._documents:
                self._documents[database] = FirestoreDocuments(config.project, database)
            self.relays[relay.name] = Relay(
                relay,
                project=config.project,
                root=config.firestore.root,
                documents=self._documents[database],
                publisher=self._publisher,
                pod_id=pod,
            )

    async def check(self) -> None:
        """``RelayRefused`` (one line) for the first relay whose topic takes no publishes from here."""
        for relay in self.relays.values():
            await relay.check()

    def start(self, watchers: dict[asyncio.Future[Any], str]) -> None:
        for name, relay in self.relays.items():
            watchers[asyncio.ensure_future(relay.run())] = f"relay {name}"

    async def stop(self) -> None:
        for name, relay in self.relays.items():
            try:
                await relay.stop()
            except Exception as exc:
                _LOGGER.error("relay %s: stopping failed: %r", name, exc)
            await relay.close_workers()

    async def close(self) -> None:
        if self._publisher is not None:
            await self._publisher.aclose()
        for documents in self._documents.values():
            await documents.close()

    def relay_names(self) -> list[str]:
        return list(self.relays)

    def reports(self) -> list[Relay]:
        """What GetStatus shows of each relay (``Relay.counts``, ``Relay.waiting``)."""
        return list(self.relays.values())

    async def write_entry(self, relay: str, entry_id: str, fields: dict[str, Any]) -> str:
        """The ``Publish`` RPC's write (``sidecar.delivery.servicer.EntryWriter``)."""
        found = self.relays.get(relay)
        if found is None:
            raise LookupError(f"unknown relay {relay!r}")
        return await found.write_entry(entry_id, fields)

    def collector(self) -> Collector:
        return RelayCollector(lambda: {name: relay.counts() for name, relay in self.relays.items()})


class RelayCollector(Collector):
    """The relays' figures (relay name -> ``Relay.counts()``) as Prometheus families."""

    def __init__(self, source: Callable[[], dict[str, dict[str, int]]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        counts = self._source()
        for figures, kind in ((_COUNTERS, CounterMetricFamily), (_GAUGES, GaugeMetricFamily)):
            for name, doc in figures.items():
                family = kind(f"pubsub_sidecar_{name}", doc, labels=["relay"])
                for relay, values in counts.items():
                    family.add_metric([relay], values.get(name, 0))
                yield family
