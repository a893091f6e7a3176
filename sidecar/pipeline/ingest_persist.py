"""Persisting: one batch of sorted messages written with ``store.persist``, and each outcome acted on.

``Persister.persist_batch`` is one persist call (the ingest's batch loop runs up to
``max_concurrent_persists`` at once). What each result makes of its message:

| outcome                                  | what happens                                          |
|------------------------------------------|-------------------------------------------------------|
| STORED                                   | ``runtime.on_stored``, **then** ack                   |
| STORED for another pod's shard           | ack (the owner's Listen picks it up)                  |
| DUPLICATE                                | ack (a pending original goes to ``runtime.on_stored``) |
| CONFLICT                                 | dead-lettered, then acked                             |
| refused for good (``StoreRejected``)     | dead-lettered, then acked                             |
| FAILED, ``StoreError``                   | nacked after a backoff                                |
| written while this pod's lease moved on  | nacked: the redelivered copy marks it for the owner   |

Rules (G1 in DESIGN §1 depends on each of them):

- **Ack only what is durable.** A message is acked only after the store said it is durable
  (STORED, after ``runtime.on_stored``: an ack first could lose it if ``on_stored`` failed; or
  DUPLICATE: an earlier copy is durable), or after the dead-letter topic took it.
- **Store failure: nack after a backoff.** FAILED results and ``StoreError`` keep the message leased
  for a capped exponential backoff (with jitter, growing with consecutive failed batches), then nack
  it so that Pub/Sub redelivers it at once. Chosen over letting the lease lapse because the lease
  is the client's business (its leaser extends it for up to ``max_lease_duration``, one hour by
  default) and a lapse would take an ack deadline or that hour; an immediate nack would make a
  hot redelivery loop during a store outage. While messages wait out their backoff they still
  count against the client's flow control, so pulling slows down by itself during an outage.
- **One bad message poisons nothing.** A batch the store refuses for good is tried again one
  message at a time: only the message refused is dead-lettered.
- **Several pods.** A message whose key this pod does not deliver is stored for its owner
  (``to_owner``). One whose key it delivers goes to the runtime after the write only if the lease is
  still held at the same epoch; otherwise the new owner's load may have missed it, so it is nacked.
- Once a batch is written (or failed), its keys are released (``Sorter.release_keys``) and, with the
  fast path, their waiting messages are offered to it again: a message stored may be the
  predecessor they lacked.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from sidecar.engine.types import Message
from sidecar.pipeline.ingest_counters import IngestCounters
from sidecar.pipeline.ingest_settlement import Settlement
from sidecar.pipeline.ingest_sort import Received, Sorter
from sidecar.pipeline.runtime import SubscriptionRuntime
from sidecar.store.api import IncomingMessage, PersistOutcome, Store, StoreError, StoreRejected

_LOGGER = logging.getLogger(__name__)


class Persister:
    """Writes the batches of one subscription to the store and settles each message by its outcome."""

    def __init__(
        self,
        name: str,
        store: Store,
        runtime: SubscriptionRuntime,
        counters: IngestCounters,
        sorter: Sorter,
        settlement: Settlement,
        *,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        is_stopping: Callable[[], bool],
        clock: Callable[[], int],
        backoff_seconds: Callable[[int], float],
    ) -> None:
        self.name = name
        self._store = store
        self._runtime = runtime
        self._counters = counters
        self._sorter = sorter
        self._settlement = settlement
        self._spawn = spawn
        self._is_stopping = is_stopping
        self._clock = clock
        self._backoff_seconds = backoff_seconds
        self.persisting_messages = 0
        """Messages in a persist under way (``persist_batch``)."""
        self._consecutive_failures = 0

    async def persist_batch(self, batch: list[Received]) -> None:
        self._counters.persist_batches += 1
        self.persisting_messages += len(batch)
        try:
            await self._store_batch(batch)
        finally:
            self.persisting_messages -= len(batch)
            self._sorter.release_keys(batch)
            if self._sorter.fast_path and self._runtime.is_ready and not self._is_stopping():
                # A message stored may be the predecessor its key's waiting messages lacked.
                self._sorter.reoffer({item.incoming.key for item in batch})

    async def _store_batch(self, batch: list[Received]) -> None:
        # Several pods: a message whose key this pod does not deliver is stored for its owner
        # (``to_owner``: the owner's Listen picks it up). One whose key it delivers is handed to the
        # runtime after the write only if the lease is still held at the same epoch; otherwise the
        # new owner's load may have missed it, so it is nacked and its redelivery marks it.
        epochs = [self._runtime.owner_epoch(item.incoming.key) for item in batch]
        incoming = [
            item.incoming if epoch is not None or not self._runtime.sharded else _to_owner(item.incoming)
            for item, epoch in zip(batch, epochs, strict=True)
        ]
        try:
            results = await self._store.persist(self.name, incoming, self._clock())
        except StoreRejected as exc:
            if len(batch) == 1:
                self._dead_letter_rejected(batch[0], exc)
                return
            # Which message the store refused is unknown: try each alone, so one bad message
            # neither poisons its batch mates nor returns forever.
            for item in batch:
                await self._store_batch([item])
            return
        except StoreError as exc:
            self._on_persist_failed(batch, exc)
            return
        if len(results) != len(batch):
            _LOGGER.error(
                "ingest of %s: store returned %d results for %d messages", self.name, len(results), len(batch)
            )
            self._on_persist_failed(batch, StoreError("result count mismatch"))
            return

        settlement = self._settlement
        stored: list[Message] = []
        stored_items: list[Received] = []
        failed: list[Received] = []
        first_error: StoreError | None = None
        sharded = self._runtime.sharded
        for item, result, epoch in zip(batch, results, epochs, strict=True):
            outcome = result.outcome
            if (
                sharded
                and epoch is not None
                and outcome is not PersistOutcome.FAILED
                and epoch != self._runtime.owner_epoch(item.incoming.key)
            ):
                # Written unmarked while this pod's lease moved on: the next owner's load may have
                # missed it. Pub/Sub redelivers it, and that copy marks the document for the owner.
                self._counters.owner_changed += 1
                settlement.nack(item.message)
            elif outcome is PersistOutcome.STORED and sharded and epoch is None:
                self._counters.persisted += 1
                self._counters.stored_for_owner += 1
                settlement.ack(item.message)
            elif outcome is PersistOutcome.STORED:
                stored.append(result.message)
                stored_items.append(item)
            elif outcome is PersistOutcome.DUPLICATE:
                self._counters.duplicates += 1
                if result.pending is not None:
                    # A pending original the engine may never have seen: it drops it if it holds it.
                    self._runtime.on_stored([result.pending])
                settlement.ack(item.message)
            elif outcome is PersistOutcome.CONFLICT:
                self._counters.conflicts += 1
                if result.pending is not None:
                    self._runtime.on_stored([result.pending])
                self._spawn(settlement.dead_letter_then_ack(item.message, "conflict", key=item.incoming.key))
            elif isinstance(result.error, StoreRejected):
                self._dead_letter_rejected(item, result.error)
            else:
                failed.append(item)
                first_error = first_error or result.error
        if stored:
            # The engine learns of them before Pub/Sub forgets them: an ack first could lose them
            # if on_stored failed (they are durable, but only a restart would load them).
            self._runtime.on_stored(stored)
            self._counters.persisted += len(stored)
            for item in stored_items:
                settlement.ack(item.message)
        if failed:
            self._on_persist_failed(failed, first_error or StoreError("persist failed"))
        else:
            self._consecutive_failures = 0

    def _on_persist_failed(self, items: Sequence[Received], error: BaseException) -> None:
        delay = self._backoff_seconds(self._consecutive_failures)
        self._consecutive_failures += 1
        self._counters.persist_failures += len(items)
        _LOGGER.warning(
            "ingest of %s: persist of %d messages failed (%s); nacking them in %.2fs",
            self.name,
            len(items),
            error,
            delay,
        )
        for item in items:
            self._settlement.nack_later(item.message, delay)

    def _dead_letter_rejected(self, item: Received, error: StoreError) -> None:
        self._counters.rejected += 1
        self._spawn(
            self._settlement.dead_letter_then_ack(item.message, f"store_rejected: {error}", key=item.incoming.key)
        )


def _to_owner(incoming: IncomingMessage) -> IncomingMessage:
    return dataclasses.replace(incoming, to_owner=True)
