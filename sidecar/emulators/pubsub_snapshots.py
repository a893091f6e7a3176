"""The Pub/Sub emulator's snapshot and Seek RPCs (``google.pubsub.v1.Subscriber``).

Request checks and production's error codes live here; what a snapshot keeps and what a seek does
to a subscription is ``pubsub_replay.py``.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
from google.protobuf import empty_pb2
from google.pubsub_v1 import types

from sidecar.emulators.pubsub_names import parse_project, parse_snapshot, parse_subscription
from sidecar.emulators.pubsub_replay import Replay
from sidecar.emulators.pubsub_rpc import apply_mask, invalid, page, unary
from sidecar.emulators.pubsub_state import Broker

_Snapshot = types.Snapshot.pb()


class SnapshotService:
    """CreateSnapshot, GetSnapshot, ListSnapshots, UpdateSnapshot, DeleteSnapshot and Seek."""

    def __init__(self, broker: Broker, replay: Replay) -> None:
        self._broker = broker
        self._replay = replay

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "CreateSnapshot": unary(self.create_snapshot, types.CreateSnapshotRequest.pb(), _Snapshot),
            "GetSnapshot": unary(self.get_snapshot, types.GetSnapshotRequest.pb(), _Snapshot),
            "ListSnapshots": unary(
                self.list_snapshots, types.ListSnapshotsRequest.pb(), types.ListSnapshotsResponse.pb()
            ),
            "UpdateSnapshot": unary(self.update_snapshot, types.UpdateSnapshotRequest.pb(), _Snapshot),
            "DeleteSnapshot": unary(self.delete_snapshot, types.DeleteSnapshotRequest.pb(), empty_pb2.Empty),
            "Seek": unary(self.seek, types.SeekRequest.pb(), types.SeekResponse.pb()),
        }

    async def create_snapshot(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not request.subscription:
            raise invalid("CreateSnapshot: subscription is required")
        project, _ = parse_subscription(request.subscription)
        # An empty name gets a generated one in the subscription's project, as production does.
        name = request.name or f"projects/{project}/snapshots/snapshot-{uuid.uuid4().hex}"
        parse_snapshot(name)
        sub = self._broker.subscription(request.subscription)
        return self._replay.create_snapshot(name, sub, request.labels)

    async def get_snapshot(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_snapshot(request.snapshot)
        return self._replay.snapshot(request.snapshot).config

    async def list_snapshots(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        project = parse_project(request.project)
        self._replay.expunge()
        prefix = f"projects/{project}/snapshots/"
        names = sorted(n for n in self._broker.snapshots if n.startswith(prefix))
        chosen, token = page(names, request.page_size, request.page_token)
        configs = [self._broker.snapshots[n].config for n in chosen]
        return types.ListSnapshotsResponse.pb()(snapshots=configs, next_page_token=token)

    async def update_snapshot(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_snapshot(request.snapshot.name)
        snapshot = self._replay.snapshot(request.snapshot.name)
        updated = _Snapshot()
        updated.CopyFrom(snapshot.config)
        # Only labels can change: the topic and the retained messages are fixed at creation, and so
        # is the expiry, which follows from the backlog.
        apply_mask(updated, request.snapshot, request.update_mask, {"name", "topic", "expire_time"})
        snapshot.config = updated
        return updated

    async def delete_snapshot(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_snapshot(request.snapshot)
        self._replay.delete_snapshot(request.snapshot)
        return empty_pb2.Empty()

    async def seek(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parse_subscription(request.subscription)
        target = request.WhichOneof("target")
        if target is None:
            raise invalid("Seek: one of time or snapshot must be set")
        sub = self._broker.subscription(request.subscription)
        if target == "time":
            if request.time.seconds < 0 or not 0 <= request.time.nanos < 1_000_000_000:
                raise invalid("Seek: time is not a valid timestamp")
            self._replay.seek_to_time(sub, request.time.ToNanoseconds())
        else:
            if not request.snapshot:
                raise invalid("Seek: snapshot must not be empty")
            parse_snapshot(request.snapshot)
            self._replay.seek_to_snapshot(sub, request.snapshot)
        return types.SeekResponse.pb()()
