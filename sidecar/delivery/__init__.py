"""The app-facing gRPC server: ``pubsub_sidecar.v1.OrderedDelivery``, health and reflection.

- ``server``: the grpc.aio server and its listeners.
- ``servicer``: Subscribe streams, GetStatus and UnblockKey over the subscriptions' runtimes.
- ``streams``: the open Subscribe streams, each one's budget, and the deal of ready messages among them.
- ``subscribe``: one stream at work: its sender and its reader (acks, nacks, confirmations, its end).
- ``responses``: engine types to protobuf (messages packed into responses, GetStatus, UnblockKey).
- ``errors``: the delivery layer's errors, mapped to gRPC status codes in one place.
- ``handlers``: the method table, with request decoding that never fails inside gRPC.

The only layer of the running sidecar that imports the generated protobuf code (``pubsub_sidecar.v1``;
the ``status`` and ``unblock`` commands use it as clients). May import
``sidecar.pipeline`` (the runtimes it serves), ``sidecar.store`` (its errors), ``sidecar.engine``,
``sidecar.config`` and ``sidecar.ops``.
"""
