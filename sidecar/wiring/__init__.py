"""Joins the layers into one running sidecar: start in dependency order, stop in reverse.

- ``app``: the ``run`` command's process: config, clients, components, signals and shutdown.
- ``ownership``: one subscription's shard leases (``sidecar.cluster``) carried out on its store
  and runtime (``sidecar.pipeline``): a glue module lives above both layers it joins.

May import any layer but ``sidecar.commands``.
"""
