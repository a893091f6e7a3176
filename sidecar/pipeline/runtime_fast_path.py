"""Sequence mode's in-order fast path at the runtime: messages taken unstored, and their settlement.

A message received at the first position its key is missing, at the pod that delivers the key, goes
to the engine without a document (docs/store.md, "fast path"), flagged ``volatile``. Pub/Sub keeps
it until it is settled. Rules:

- Only the key's owner takes it: the shard owned here, not being handed over, its lease held within
  its margin now (``RuntimeContext.delivering``); never a replayed message, one sent on to its owner,
  or any while the runtime stops. Anything else is stored as usual.
- A copy of an unsettled fast-path message (same position and content) is taken too and kept beside
  its original, unstored: stored, it would cost a document and its tombstone, only to be dropped as
  a duplicate. It is settled with its original.
- ``settle(..., True)`` once the message is safe: its ack durable (``runtime_acks``), or its dead
  letter published and recorded (``runtime_actions``): ``on_settled`` acks it (and its copies) in
  Pub/Sub. ``settle(..., False)`` when this pod gave it up (its shard lost or dropped): Pub/Sub
  delivers it again. A message is settled once; later settles do nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sidecar.engine.types import Message
from sidecar.pipeline.runtime_context import RuntimeContext
from sidecar.pipeline.shard_engines import ShardEngine
from sidecar.store.api import IncomingMessage


class FastPath:
    """Takes in-order messages unstored and settles them with Pub/Sub (``on_settled``)."""

    def __init__(self, ctx: RuntimeContext) -> None:
        self._ctx = ctx
        self.on_settled: Callable[[Message, bool], None] | None = None
        """Told when a fast-path message is settled: True once it is safe, False when given up."""

    def take(self, batch: Sequence[IncomingMessage]) -> list[Message | None]:
        """Per message of ``batch`` in order: the volatile message the engine took, or None (store it)."""
        ctx = self._ctx
        ctx.require_recovered()
        now_ms = ctx.clock()
        taken: list[Message | None] = [self._take_one(incoming, now_ms) for incoming in batch]
        if any(message is not None for message in taken):
            ctx.after_change()
        return taken

    def awaits_predecessor(self, incoming: IncomingMessage) -> bool:
        """Whether ``incoming``, which did not take the fast path, lies beyond the first position its
        key is missing at this pod, the key's owner (``Engine.awaits_predecessor``)."""
        entry = self._entry(incoming)
        if entry is None:
            return False
        return entry.engine.awaits_predecessor(incoming.to_message(self._ctx.clock(), "", volatile=True))

    def _entry(self, incoming: IncomingMessage) -> ShardEngine | None:
        """The engine that could take ``incoming`` by the fast path: this pod delivers its key now."""
        if incoming.sequence is None or incoming.replay_id or incoming.to_owner or self._ctx.stopping:
            return None
        return self._ctx.delivering(incoming.key)

    def _take_one(self, incoming: IncomingMessage, now_ms: int) -> Message | None:
        entry = self._entry(incoming)
        if entry is None:
            return None
        message = incoming.to_message(now_ms, "", volatile=True)
        if not entry.engine.fast_path(message):
            original = entry.engine.volatile_original(message)
            if original is None or id(original) not in entry.volatile:
                return None
            # Stored, it would cost a document and its tombstone, only to be dropped as a duplicate.
            entry.copies.setdefault(id(original), []).append(message)
            self._ctx.counters.fast_path_copies += 1
            return message
        # Taken: only now may it carry (and use up) the attempts an earlier engine made of it.
        message = self._ctx.engines.with_prior(message)
        entry.volatile[id(message)] = message
        self._ctx.counters.fast_path += 1
        self._ctx.apply(entry, entry.engine.on_stored(message, now_ms))
        return message

    def settle(self, entry: ShardEngine, message: Message, safe: bool) -> None:
        """Settle ``message`` (and its copies) with Pub/Sub, if it is an unsettled fast-path message."""
        if entry.volatile.pop(id(message), None) is None:
            return
        copies = entry.copies.pop(id(message), ())
        if safe:
            self._ctx.counters.fast_path_duplicates += len(copies)
        if self.on_settled is not None:
            self.on_settled(message, safe)
            for copy in copies:
                self.on_settled(copy, safe)

    def settle_all(self, entry: ShardEngine) -> None:
        """The shard's engine is gone: every fast-path message it held goes back to Pub/Sub."""
        for message in list(entry.volatile.values()):
            self.settle(entry, message, False)
