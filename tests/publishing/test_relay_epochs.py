"""A relay's shard worker settles only under the lease epoch it was made for: when the pod loses the
shard and takes it back (a new epoch) while a batch is being published, that batch's settle is
refused (``ShardLost``), not passed under the new epoch, whose worker read the counters afresh."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from sidecar.config.relays import RelayConfig
from sidecar.publishing.entries import Message
from sidecar.publishing.publisher import PublishFailure
from sidecar.publishing.relay import Relay
from sidecar.store import documents as docs
from sidecar.store import outbox
from sidecar.store.api import ShardLost
from sidecar.store.memory_documents import MemoryDocuments

ROOT = "sidecar"
RELAY = outbox.relay_root(ROOT, "orders-out")
LEASE = f"{RELAY}/leases/0000"


class Leases:
    """The public API the relay uses of ``ShardLeases``, with an epoch the test moves."""

    def __init__(self, documents: docs.Documents, *args: Any, **kwargs: Any) -> None:
        self.documents = documents
        self.epoch = 7
        self.lost: list[tuple[int, int]] = []

    def fence(self, shard: int) -> docs.Fence:
        return docs.Fence(LEASE, {"owner": "pod-a", "epoch": self.epoch})

    def holds(self, shard: int) -> int | None:
        return self.epoch

    def shard_lost(self, shard: int, epoch: int) -> None:
        self.lost.append((shard, epoch))


class RegainedWhilePublishing:
    """Pub/Sub takes the batch; meanwhile the pod lost the shard and took it back at a new epoch."""

    def __init__(self, documents: MemoryDocuments) -> None:
        self.documents = documents
        self.leases: Leases | None = None

    async def publish(self, messages: Sequence[Message]) -> list[PublishFailure | None]:
        assert self.leases is not None
        self.leases.epoch = 8
        self.documents.docs[LEASE] = {"owner": "pod-a", "epoch": 8}
        return [None] * len(messages)

    async def can_publish(self, topic: str) -> str | None:
        return None

    async def aclose(self) -> None:
        return None


async def test_a_batch_published_under_an_old_epoch_is_not_settled_under_the_new_one() -> None:
    documents = MemoryDocuments()
    documents.docs[LEASE] = {"owner": "pod-a", "epoch": 7}
    documents.docs["outbox/e1"] = {"key": "456", "data": b"x"}
    publisher = RegainedWhilePublishing(documents)
    config = RelayConfig.model_validate(
        {
            "name": "orders-out",
            "outbox": {"collection": "outbox"},
            "topic": "projects/p/topics/orders",
            "key_attribute": "order_id",
            "sequence": {"attribute": "seq"},
            "shards": 1,
        }
    )
    relay = Relay(
        config,
        project="p",
        root=ROOT,
        documents=documents,
        publisher=publisher,
        pod_id="pod-a",
        leases=Leases,  # type: ignore[arg-type]
    )
    leases = relay.leases
    assert isinstance(leases, Leases)
    publisher.leases = leases
    relay._on_change(docs.Change([("e1", {"key": "456", "data": b"x"}, 10)], [], 11, True))
    await relay._on_gained(0, 7)
    (task, worker) = relay._workers[0]
    with pytest.raises(ShardLost):
        await worker.step([relay._view[0]["e1"]])
    assert "outbox/e1" in documents.docs  # not settled: the epoch-8 worker numbers it from the counters
    assert outbox.counters_path(RELAY, 0) not in documents.docs
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
