"""Joins the layers into one running sidecar: start in dependency order, stop in reverse.

- ``app``: the ``run`` command's process: config, clients, components, signals, start and stop.
- ``subscription``: one subscription's parts (runtime, leases and ownership, ingest, watermark
  source), made and joined.
- ``reporting``: what the subscriptions report to ``sidecar.ops``: metric snapshots, latency
  histograms, readiness checks, liveness.
- ``shutdown``: the stop sequence within the grace period, then the clients' close.
- ``ownership``: one subscription's shard leases (``sidecar.cluster``) carried out on its store
  and runtime (``sidecar.pipeline``): a glue module lives above both layers it joins.

May import any layer but ``sidecar.commands``.
"""
