"""The peer channel between the pods of one subscription (docs/forwarding.md): a pod that receives a
message whose key another pod owns forwards it to that owner, over authenticated gRPC.

- ``proto``: the generated code of ``proto/sidecar/peering/proto/peer.proto`` (``scripts/gen_proto.py``;
  never edited by hand).
- ``auth``: the shared secret, read from a file, sent as call metadata and checked in constant time.
- ``server``: the owner's side: the ``PeerIntake`` server on the peer port, which checks the sender's
  view of the shard's lease and hands each forwarded message to the subscription's ingest as its own
  intake (``sidecar.pipeline.ingest_forwarded``), answering once its outcome is durable.
- ``client``: the sender's side: one channel per owner address, a bounded window of messages in
  flight per owner, batches per send; it implements ``sidecar.pipeline.ingest_forwarded.Forwarder``.
- ``routes``: ``PeerRoute`` and the ``PeerDirectory`` Protocol the client reads (who owns a shard, at
  which epoch, at which address); ``sidecar.wiring.peering`` feeds it.

May import ``sidecar.pipeline``, ``sidecar.config``, ``sidecar.ops``, ``sidecar.engine`` and the leaves;
``sidecar.wiring`` joins it to the rest.
"""
