"""Ingest's cumulative counters, one ``IngestCounters`` per ``Ingestor`` (``Ingestor.counters``).

Rules: plain attributes, written only on the event loop by the ingest modules (``ingest_sort``,
``ingest_persist``, ``ingest_settlement``, ``ingest_backpressure``), each counter by the module that
does what it counts; only ever incremented; read as they are by the metrics at scrape time
(``sidecar.ops.observability``) and by GetStatus. A leaf: it imports nothing of the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class IngestCounters:
    """Cumulative counts for metrics; plain attributes read by the observability layer."""

    received: int = 0
    """Pub/Sub deliveries handed to the callback (redeliveries included)."""
    fast_path: int = 0
    """Messages the runtime's fast path took, never stored: in order (delivered without a document),
    or copies of such a message still unsettled (acked with it: the runtime's ``fast_path_copies``)."""
    deferred: int = 0
    """Messages that waited for a persist of their key in progress before trying the fast path again."""
    held: int = 0
    """Messages kept back, unstored, for their key's missing position (``Sorter._hold``)."""
    malformed: int = 0
    duplicates: int = 0
    persisted: int = 0
    """Messages the store newly made durable (STORED)."""
    persist_failures: int = 0
    """Messages whose persist failed (each is nacked after a backoff and comes back)."""
    persist_batches: int = 0
    conflicts: int = 0
    rejected: int = 0
    """Messages the store refused for good (StoreRejected): dead-lettered."""
    dead_lettered: int = 0
    dead_letter_failures: int = 0
    acked: int = 0
    nacked: int = 0
    pauses: int = 0
    """Times pulling paused because ``undelivered`` was over ``max_undelivered_messages``."""
    stored_for_owner: int = 0
    """Messages stored for the pod that owns their key's shard (several pods on one subscription)."""
    owner_changed: int = 0
    """Messages stored while this pod's lease on their shard moved on: nacked, redelivered, marked."""
    forwarded: int = 0
    """Messages forwarded to their key's owner and acked once it answered that their outcome is durable."""
    forward_refused: int = 0
    """Messages forwarded and refused (or whose peer channel broke): stored for the owner instead."""
    forwarded_in: int = 0
    """Messages other pods forwarded to this one, the owner of their key (taken as its own intake)."""
