"""The app side of end-to-end tests: an app on the project's client (``OrderedSubscriber``) that
records every delivery it saw and every ack it sent, with when the sidecar confirmed it.

Rules: the app talks to the sidecar only over gRPC, as a user's app does, and settles each message
as its ``decide`` says; what it records (``Seen``, ``AckRecord``) is what the checks judge
(``e2e_checks``).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from pubsub_sidecar_client import Message, OrderedSubscriber


@dataclass(frozen=True, slots=True)
class Seen:
    """One delivery as the app saw it."""

    key: str
    sequence: int
    data: bytes
    message_id: str
    dedup_id: str
    delivery_attempt: int
    skipped: tuple[tuple[int, int], ...]
    attributes: dict[str, str]
    at: float
    epoch: int = 0
    delivery_id: str = ""


@dataclass(slots=True)
class AckRecord:
    """One delivery the app acked on a live stream (``ack()`` returned True), and what became of it.

    ``confirmed_at``: when the sidecar confirmed it as durable; ``ended_at``: when the client said it
    never will be (the stream ended first). Both None: still waiting. Monotonic clock.
    """

    seen: Seen
    acked_at: float
    confirmed_at: float | None = None
    ended_at: float | None = None


Decision = str
"""What the app does with a message: "ack", "nack", "hold" (keep it unacked) or "dead_letter"."""


class App:
    """The app: reads one subscription through ``OrderedSubscriber``, records and settles each message.

    ``decide(message)`` picks "ack" (the default), "nack", "hold" or "dead_letter". Acked messages
    whose ack the sidecar confirmed are in ``confirmed`` (by dedup id): G3 says they never come again.
    """

    def __init__(
        self,
        target: str,
        subscription: str,
        decide: Callable[[Message], Decision] | None = None,
        *,
        max_outstanding_messages: int = 0,
    ) -> None:
        self.target = target
        self.subscription = subscription
        self.decide = decide or (lambda _m: "ack")
        self.max_outstanding_messages = max_outstanding_messages
        self.seen: list[Seen] = []
        self.held: list[Message] = []
        self.confirmed_at: dict[tuple[str, int, str], float] = {}
        """(key, sequence, dedup id) -> when the sidecar confirmed the ack (monotonic clock)."""
        self.acked_at: dict[tuple[str, int], float] = {}
        """(key, sequence) -> when the app first sent an ack for it (monotonic clock)."""
        self.acks: list[AckRecord] = []
        """Every ack sent on a live stream, one per delivery, with its confirmation (or its end)."""
        self.changed = asyncio.Event()
        self._subscriber: OrderedSubscriber | None = None
        self._task: asyncio.Task[None] | None = None
        self._confirm_tasks: set[asyncio.Task[None]] = set()
        self._held_seen: dict[int, Seen] = {}
        """id(message) -> its Seen, for the messages in ``held`` (which keeps them alive)."""

    def start(self) -> App:
        self._subscriber = OrderedSubscriber(
            self.target,
            self.subscription,
            max_outstanding_messages=self.max_outstanding_messages,
            reconnect_backoff_initial_seconds=0.05,
            reconnect_backoff_max_seconds=0.5,
        )
        self._subscriber.start()
        self._task = asyncio.create_task(self._read(self._subscriber))
        return self

    async def _read(self, subscriber: OrderedSubscriber) -> None:
        async for message in subscriber:
            seen = Seen(
                message.key,
                message.sequence,
                message.data,
                message.message_id,
                message.dedup_id,
                message.delivery_attempt,
                message.skipped,
                dict(message.attributes),
                time.monotonic(),
                message.epoch,
                message.delivery_id,
            )
            self.seen.append(seen)
            decision = self.decide(message)
            if decision == "ack":
                self.acked_at.setdefault((message.key, message.sequence), time.monotonic())
                if await message.ack():
                    self._track_confirmation(message, seen)
            elif decision == "nack":
                await message.nack()
            elif decision == "dead_letter":
                await message.nack(dead_letter=True)
            else:
                self.held.append(message)
                self._held_seen[id(message)] = seen
            self.changed.set()

    def _track_confirmation(self, message: Message, seen: Seen) -> None:
        record = AckRecord(seen, time.monotonic())
        self.acks.append(record)
        task = asyncio.create_task(self._await_confirmation(message, record))
        self._confirm_tasks.add(task)
        task.add_done_callback(self._confirm_tasks.discard)

    async def _await_confirmation(self, message: Message, record: AckRecord) -> None:
        try:
            await message.confirmed()
        except Exception:
            record.ended_at = time.monotonic()
            return  # not confirmed: the sidecar may deliver it again, which G3 allows
        record.confirmed_at = time.monotonic()
        self.confirmed_at.setdefault((message.key, message.sequence, message.dedup_id), record.confirmed_at)

    async def stop(self) -> None:
        if self._subscriber is not None:
            await self._subscriber.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in list(self._confirm_tasks):
            task.cancel()
        await asyncio.gather(*self._confirm_tasks, return_exceptions=True)

    async def ack_held(self) -> int:
        """Ack every held message still valid (those of a broken stream are redelivered instead)."""
        held, self.held = self.held, []
        held_seen, self._held_seen = self._held_seen, {}
        acked = 0
        for message in held:
            self.acked_at.setdefault((message.key, message.sequence), time.monotonic())
            if await message.ack():
                acked += 1
                self._track_confirmation(message, held_seen[id(message)])
        return acked

    # ---- what tests read ---------------------------------------------------------------------

    def by_key(self) -> dict[str, list[Seen]]:
        keys: dict[str, list[Seen]] = defaultdict(list)
        for seen in self.seen:
            keys[seen.key].append(seen)
        return keys

    def distinct(self) -> set[tuple[str, int, str]]:
        return {(seen.key, seen.sequence, seen.dedup_id) for seen in self.seen}
