"""The data path of one subscription: Pub/Sub in, classified, stored or taken in order, handed to
the runtime that releases each key's messages in order.

- ``ingest``: ``Ingestor``, one subscription's ingest, joining its parts and running the batch loop:
  ``ingest_pull`` (the StreamingPull and its client, with ``ingest_scheduler``, the callbacks on the
  event loop, ``ingest_watch`` and ``pull_health``, what the StreamingPull attempts say),
  ``ingest_sort`` (the callback, classify, the fast path, deferred, held and to-store queues),
  ``ingest_persist`` (persist batches and their outcomes), ``ingest_settlement`` (acks and nacks
  with Pub/Sub, only once durable; dead letter, then ack), ``ingest_backpressure`` (no new batch
  while the app is behind) and ``ingest_counters``. Of this package only ``ingest_pull``,
  ``ingest_scheduler`` and ``ingest_watch`` import google-cloud-pubsub (the other ingest modules
  see its messages as ``ingest_settlement.PulledMessage``).
- ``classify``: a received message's key, position and dedup id, or why it is malformed.
- ``runtime``: ``SubscriptionRuntime``, one subscription's live state; executes the pure engine's
  decisions with a store and a clock, through its parts: ``runtime_loading`` (recovery, a shard's
  load, messages as stored), ``runtime_delivery`` (take, acks and nacks from the app's streams),
  ``runtime_acks`` (acks confirmed only once durable), ``runtime_fast_path`` (the in-order fast path
  and its settlement with Pub/Sub), ``runtime_actions`` (dead letters, dropped duplicates, unblock),
  ``runtime_shards`` (shard adoption, drain and loss; one engine per shard, ``shard_engines``),
  ``runtime_wakeups`` (streams and the timer) and ``runtime_context`` (what the parts share);
  ``message_traces``: each message's span and the trace context its deliveries carry.
- ``watermark_source`` and ``watermark_rule``: watermark mode's watermark from Cloud Monitoring.

May import ``sidecar.engine``, ``sidecar.store``, ``sidecar.dead_letters``, ``sidecar.config``,
``sidecar.ops``, ``sidecar.shards`` and ``sidecar.backoff``; not ``delivery`` (which serves it),
``cluster`` (which ``wiring.ownership`` joins to it) or ``wiring``.
"""
