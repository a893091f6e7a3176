"""Durable storage: what the sidecar keeps in Firestore, and how it rebuilds itself from it.

One job per module (read them in this order):

- ``api``: the ``Store`` protocol and its types and errors (what the rest of the sidecar sees).
- ``layout``: document ids, fields, sizes and chunks. Pure.
- ``cursors``: per-key durable cursor state and the fold that builds it. Pure.
- ``cursor_book``: a subscription's durable cursors, and which still need writing (coalescing). Pure.
- ``cursor_documents``: a key's cursor as document fields, and back. Pure.
- ``recovery``: documents in, the engine's snapshot out. Pure.
- ``documents``: the seam to a document database: plain writes, reads and queries.
- ``persist``, ``document_store``, ``reader``: the ``Store`` over that seam (what to write, in which
  Commit; what to read back at recovery and delivery).
- ``flusher``: the background flush of the cursors and checkpoints left lagging.
- ``shard_reads``: what a load reads of its shards, handed to ``recovery``.
- ``outbox``: an outbox relay's documents (the app's entries, the per-shard counters, the waiting
  room) and its one fenced settle Commit (``sidecar.publishing``).
- ``firestore``: the seam on Firestore; the only module that imports google-cloud-firestore.
- ``firestore_codec``, ``firestore_errors``, ``listen_protocol``: what the seam on Firestore hands
  out (raw protobufs and back, Google's errors as ours, the Listen protocol as deltas); none
  imports google-cloud-firestore.
- ``memory_documents``: the seam in memory, with Firestore's semantics (crash simulation, tests).
- ``memory``: a simpler in-memory ``Store`` for delivery tests and benchmarks. Not durable.
- ``timed``: a ``Store`` wrapper that times ``persist`` for the metrics.

Importing this package imports no Google library: ``sidecar.store.firestore`` (and through it
``firestore_errors``, the only other module that imports a Google library: api_core, auth, grpc)
is imported by name where Firestore is wanted.
"""

from sidecar.store.api import (
    IncomingMessage,
    PersistOutcome,
    PersistResult,
    Store,
    StoreError,
    StoreRejected,
    StoreUnavailable,
    SubscriptionStoreConfig,
)

__all__ = [
    "IncomingMessage",
    "PersistOutcome",
    "PersistResult",
    "Store",
    "StoreError",
    "StoreRejected",
    "StoreUnavailable",
    "SubscriptionStoreConfig",
]
