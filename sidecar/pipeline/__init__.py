"""The data path of one subscription: Pub/Sub in, classified, stored or taken in order, handed to
the runtime that releases each key's messages in order.

- ``ingest`` (with ``ingest_scheduler``, ``ingest_watch`` and ``pull_health``): the StreamingPull,
  the callbacks on the event loop, persist batches, and Pub/Sub acks only once durable.
- ``classify``: a received message's key, position and dedup id, or why it is malformed.
- ``runtime`` (with ``shard_engines``): one subscription's live state; executes the pure engine's
  decisions with a store and a clock.
- ``watermark_source`` and ``watermark_rule``: watermark mode's watermark from Cloud Monitoring.

May import ``sidecar.engine``, ``sidecar.store``, ``sidecar.dead_letters``, ``sidecar.config``,
``sidecar.ops``, ``sidecar.shards`` and ``sidecar.backoff``; not ``delivery`` (which serves it),
``cluster`` (which ``wiring.ownership`` joins to it) or ``wiring``.
"""
