"""What the parts of one subscription's runtime share: engines, store, clock, counters, lifecycle.

``SubscriptionRuntime`` (``sidecar.pipeline.runtime``) builds one ``RuntimeContext`` and hands it to
each of its parts (``runtime_loading``, ``runtime_fast_path``, ``runtime_acks``, ``runtime_actions``,
``runtime_shards``, ``runtime_delivery``). Rules every part keeps:

- Every engine call happens on the event loop thread, with ``now_ms`` read from ``clock``.
- A store call goes through ``retry_store``: a transient ``StoreUnavailable`` is retried with capped,
  jittered backoff, forever (Pub/Sub and the store keep the messages meanwhile); any other
  ``StoreError`` raises to the part that made the call, which decides (fail loudly, or log when the
  write is harmless to lose).
- A write the store fences carries ``fenced(epochs)``: the epoch each shard's decision was made under
  (None without leases: one engine, never dropped, nothing to tell apart).
- A part imports only the parts it drives (``runtime_shards`` drives the loading, the acks and the
  fast path; ``runtime_delivery`` the acks); what any part must tell the others goes through the
  context's four hooks, which the runtime routes: ``apply`` carries out an engine's actions,
  ``after_change`` wakes the streams and the timer, ``settle`` settles a fast-path message with
  Pub/Sub, ``shard_lost`` drops the shards the store said this pod no longer owns. A part that may
  have made messages ready calls ``after_change`` before it returns to the event loop (``take``,
  which only hands messages out, wakes the timer alone).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from sidecar.backoff import backoff_seconds
from sidecar.engine.types import Action, EngineConfig, Message
from sidecar.pipeline.shard_engines import ShardEngine, ShardEngines
from sidecar.store.api import ShardLost, Store, StoreUnavailable

_LOGGER = logging.getLogger(__name__)

_T = TypeVar("_T")

_RETRY_INITIAL_SECONDS = 0.05
"""First retry soon: most store blips (a Firestore UNAVAILABLE) clear within tens of milliseconds."""

_RETRY_MAXIMUM_SECONDS = 5.0
"""Cap so that a recovered store is used again within seconds, while an outage costs one call per 5 s."""


class SubscriptionUnavailable(Exception):
    """The subscription cannot serve now: still recovering, stopping, or failed."""


class NotOwner(LookupError):
    """The key's shard is owned by another pod (or by none yet): ask the pod that delivers it."""


@dataclass(slots=True)
class RuntimeCounters:
    """Cumulative counts of what the runtime itself did (the engine keeps the delivery counts)."""

    acks_submitted: int = 0
    fast_path: int = 0
    """Messages taken by the in-order fast path (``take_fast``): delivered without a document."""
    fast_path_copies: int = 0
    """Copies of unsettled fast-path messages that ``take_fast`` kept beside their original, unstored."""
    fast_path_duplicates: int = 0
    """Those copies acked as duplicates once their original's ack (or dead letter) was durable."""
    unknown_ids: int = 0
    ack_commits: int = 0
    store_retries: int = 0
    dead_letter_publish_failures: int = 0
    payloads_stripped: int = 0
    """Held messages whose payload was left in the store (over ``max_held_bytes``)."""
    payloads_read: int = 0
    """Stripped payloads read back from the store for delivery."""
    not_owned: int = 0
    """Stored messages of shards this pod does not own (their owner delivers them)."""
    shards_adopted: int = 0
    shards_dropped: int = 0
    acks_fenced: int = 0
    """Acks refused because the shard's lease had moved on (or the engine that accepted them was
    dropped, even if the shard was taken back since at a new epoch): not confirmed."""
    deliveries_withheld: int = 0
    """Deliveries taken but not sent: their shard was dropped while their payload was read back."""


class RuntimeContext:
    """One subscription's shared state and the hooks by which its runtime's parts tell each other."""

    def __init__(
        self,
        name: str,
        config: EngineConfig,
        store: Store,
        clock: Callable[[], int],
        engines: ShardEngines,
        shard_count: int | None,
        *,
        apply: Callable[[ShardEngine, Sequence[Action]], None],
        after_change: Callable[[], None],
        settle: Callable[[ShardEngine, Message, bool], None],
        shard_lost: Callable[[ShardLost], None],
    ) -> None:
        self.name = name
        self.config = config
        self.store = store
        self.clock = clock
        self.engines = engines
        self.shard_count = shard_count
        """None: one engine for every key (no leases). Otherwise keys route to ``shard_of(key, S)``."""
        self.counters = RuntimeCounters()
        self.apply = apply
        """Carry out an engine's actions (``runtime_actions``)."""
        self.after_change = after_change
        """Wake streams when messages are ready and the timer when an earlier timer appeared."""
        self.settle = settle
        """Settle a fast-path message: True once safe (ack it in Pub/Sub), False when given up."""
        self.shard_lost = shard_lost
        """The store refused a write: drop the shards this pod no longer owns."""
        self.lease_check: Callable[[int], int | None] | None = None
        """The lease manager's ``holds``: the epoch of a shard held within its safety margin now."""
        self.progress = asyncio.Event()
        """Set whenever acks became durable or a shard changed: ``drain_shard`` waits on it."""
        self.recovered = False
        self.stopping = False
        self.failure: BaseException | None = None

    @property
    def is_ready(self) -> bool:
        """Recovered, running and not stopping: streams may be served."""
        return self.recovered and not self.stopping and self.failure is None

    def unavailable_reason(self) -> str:
        """Why ``is_ready`` is False, in words for a client's status message."""
        if self.failure is not None:
            return f"subscription {self.name!r} failed ({self.failure!r}); the sidecar must restart"
        if not self.recovered:
            return f"subscription {self.name!r} is still recovering; retry shortly"
        if self.stopping:
            return f"subscription {self.name!r} is shutting down; reconnect"
        return f"subscription {self.name!r} is ready"

    def require_recovered(self) -> None:
        if not self.recovered:
            raise SubscriptionUnavailable(f"subscription {self.name!r} is still recovering")

    def fenced(self, epochs: dict[int, int]) -> dict[int, int] | None:
        """``epochs`` (shard -> the epoch a decision was made under) for the store, with leases;
        None without (one engine, never dropped: nothing to tell apart)."""
        return None if self.shard_count is None else epochs

    def current(self, entry: ShardEngine) -> bool:
        """Whether ``entry`` still delivers its shard (not dropped or replaced since)."""
        return self.engines.get(entry.shard) is entry

    def delivering(self, key: str) -> ShardEngine | None:
        """The engine that delivers ``key`` now: its shard is owned here, not being handed over, and
        (with leases) its lease held within its margin by ``lease_check``, so that a lease whose
        local deadline just passed counts as lost at once."""
        entry = self.engines.for_key(key)
        if entry is None or entry.draining:
            return None
        if self.lease_check is not None and self.lease_check(entry.shard) != entry.epoch:
            return None
        return entry

    async def retry_store(self, method: Callable[..., Awaitable[_T]], *args: object, **kwargs: object) -> _T:
        """``method(subscription, *args, now_ms, **kwargs)`` until it succeeds.

        StoreUnavailable is retried with backoff (``now_ms`` read afresh each time); other
        StoreErrors raise.
        """
        what = getattr(method, "__name__", "call")
        attempt = 0
        while True:
            try:
                return await method(self.name, *args, self.clock(), **kwargs)
            except StoreUnavailable as exc:
                self.counters.store_retries += 1
                _LOGGER.warning("subscription %s: store %s unavailable (%s); retrying", self.name, what, exc)
            await asyncio.sleep(retry_backoff_seconds(attempt))
            attempt += 1


def retry_backoff_seconds(attempt: int) -> float:
    """The runtime's backoff before retry ``attempt + 1`` of a store call or a dead-letter publish."""
    return backoff_seconds(attempt, _RETRY_INITIAL_SECONDS, _RETRY_MAXIMUM_SECONDS)


def first_cause(exc: BaseException) -> BaseException:
    """The worker's own error rather than the TaskGroup's wrapper, for ``failure`` and error messages."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
