"""Publishing in order (DESIGN §12): the outbox relay, the publisher half of sequence mode.

The app writes its business change and an outbox entry in one Firestore transaction; a relay
publishes each entry with its key's next sequence number, then deletes it and moves the key's
counter in one fenced Commit.

- ``entries``: an outbox entry read into what is published, or why it never can be. Pure.
- ``plan``: which entries of a shard go next, with which numbers (commit order per key). Pure.
- ``publisher``: Pub/Sub publishing (the official client; this layer's only Pub/Sub importer) and
  the start-up check that the topic takes this process's publishes.
- ``shard_relay``: one held shard's step: plan, publish, settle.
- ``relay``: ``Relay``, one configured relay on this pod: the outbox's Listen, the shard leases, a
  worker per held shard, its status.
- ``waiting_room``: what waits, retried or discarded by an operator (``pubsub-sidecar outbox``).

May import ``sidecar.store`` (the outbox, counters and fenced Commits, through ``sidecar.store.outbox``),
``sidecar.cluster`` (the shard leases: one writer per key across pods), ``sidecar.config``,
``sidecar.ops`` and the leaves (``backoff``, ``shards``). Not the pipeline, delivery or wiring.
"""
