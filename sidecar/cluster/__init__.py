"""Several pods on one subscription: which pod delivers which shard (``leases``).

May import ``sidecar.store`` (the lease documents live beside the messages), ``sidecar.engine``,
``sidecar.config``, ``sidecar.shards`` and ``sidecar.backoff``. What a lease decision does to a
subscription's runtime is ``sidecar.wiring.ownership``'s job: this layer knows no runtime.
"""
