"""The app-facing gRPC server: ``pubsub_sidecar.v1.OrderedDelivery``, health and reflection.

- ``server``: the grpc.aio server and its listeners.
- ``servicer``: Subscribe streams, GetStatus and UnblockKey over the subscriptions' runtimes.
- ``handlers``: the method table, with request decoding that never fails inside gRPC.

The only layer that imports the generated protobuf code (``pubsub_sidecar.v1``). May import
``sidecar.pipeline`` (the runtimes it serves), ``sidecar.store`` (its errors), ``sidecar.engine``,
``sidecar.config`` and ``sidecar.ops``.
"""
