"""Forwarding between pods, as ingest sees it (docs/forwarding.md): what the sorter hands a message
of another pod's shard to, and what an owner's ingest takes from another pod.

- ``Forwarder`` (the sender's side, declared in ``sidecar.pipeline.ingest_sort``, which uses it;
  implemented by ``sidecar.peering.client``): ``forward`` takes a
  message for the owner of its key's shard, or says at once that it cannot (no known owner, the owner
  is this pod, its window is full, its channel broken): the message then goes the old way (stored
  with ``inbox``). A message taken gets exactly one answer, ``on_answer(True)`` once the owner said
  its outcome is durable (the sorter then acks it with Pub/Sub), ``on_answer(False)`` for a refusal
  or a broken channel (the sorter then stores it for the owner: nothing is lost).
- ``ForwardedMessage`` (the owner's side): a message another pod forwarded, seen by ingest as a
  ``PulledMessage`` like one of its own: the fast path, the store, dedup and dead letters apply
  unchanged. Its ``ack`` and ``nack`` answer the sending pod instead of Pub/Sub: ``ack`` (its outcome
  is durable, by the same rules as a Pub/Sub ack) is ACCEPTED, ``nack`` (given back) is a refusal.
  Each is answered once; ``Settlement`` gives it back at stop with ``nack``, never with the
  ModifyAckDeadline calls it uses for Pub/Sub's messages.
- An owner never forwards a forwarded message again: if it no longer owns the key, it stores it for
  the owner (``inbox``), and that write is its answer.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Callable, Mapping

_IDS = itertools.count(1)
"""Local ack ids of forwarded messages: unique in the process, never taken for Pub/Sub's."""


class ForwardedMessage:
    """A message another pod forwarded to this one, the owner of its key, as ingest sees it."""

    __slots__ = (
        "_on_settled",
        "ack_id",
        "attributes",
        "data",
        "delivery_attempt",
        "message_id",
        "ordering_key",
        "publish_time",
    )

    def __init__(
        self,
        *,
        message_id: str,
        data: bytes,
        attributes: Mapping[str, str],
        ordering_key: str,
        publish_time: datetime.datetime,
        delivery_attempt: int,
        on_settled: Callable[[bool], None],
    ) -> None:
        self.ack_id = f"forwarded-{next(_IDS)}"
        self.message_id = message_id
        self.data = data
        self.attributes = attributes
        self.ordering_key = ordering_key
        self.publish_time = publish_time
        self.delivery_attempt = delivery_attempt
        self._on_settled: Callable[[bool], None] | None = on_settled

    def ack(self) -> None:
        """Its outcome is durable: the sending pod may ack it with Pub/Sub."""
        self._settle(True)

    def nack(self) -> None:
        """Given back: the sending pod takes another way."""
        self._settle(False)

    def _settle(self, accepted: bool) -> None:
        on_settled, self._on_settled = self._on_settled, None
        if on_settled is not None:
            on_settled(accepted)


def is_forwarded(message: object) -> bool:
    """True for a message another pod forwarded (answered through its own ``ack``/``nack``)."""
    return isinstance(message, ForwardedMessage)
