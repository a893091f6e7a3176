"""Per-message and per-key bookkeeping shared by the ordering policies and the engine's books.

Plain mutable records with ``__slots__`` (the hot path creates one ``Entry`` per stored message and
touches a ``KeyLedger`` on every event, so attribute access must be cheap and memory small).

Entry life cycle (``Entry.state``)::

    HELD --take--> OUT --ack--> ACKING --ack_durable--> DONE (retired once every earlier one is)
      ^             |  \\--nack/expiry/close--> HELD (again, after backoff)
      |             \\--nack dead_letter / attempts exhausted--> DEAD --dead_letter_done--> DONE | BLOCKED

Key invariants (checked by the property tests):

- ``KeyLedger.out`` holds the in-order entries handed out and not yet retired, sorted by position;
  the key's cursor only moves over a prefix of it whose entries are all DONE, so a cursor never
  passes a message that is still in flight, acking or dead-lettering.
- ``n_out`` counts entries in OUT or DEAD of the key (late ones too): the in-flight slots. An ACKING
  entry (the app acked, not yet durable) holds no slot: G2 waits for the app's ack only.
- ``consumer`` is set exactly while ``n_out > 0``: the key's affinity to one stream.
- A dead letter outside any key's order (a conflict, a late message, a refused replay) is held in
  ``AsideDeadLetters`` until ``dead_letter_done``: pending in an export, and a copy of its record
  stored meanwhile is a duplicate (the record must stay pending until the dead letter is recorded).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from sidecar.engine.dedup import identity
from sidecar.engine.types import Message, SkippedRange

HELD = 0
"""Stored, not handed out (held behind a gap or the watermark, or ready)."""
OUT = 1
"""Delivered to a consumer, no answer yet."""
ACKING = 2
"""Acked by the app; the ack is being made durable. Never redelivered, keeps its slot."""
DEAD = 3
"""Being published to the dead-letter topic; the key waits for ``dead_letter_done``."""
DONE = 4
"""Finished (durably acked, or dead-lettered with ``skip``); waits in ``out`` until it is a prefix."""
BLOCKED = 5
"""Dead-lettered with ``on_dead_letter: block``: stays at the head of ``out`` so the cursor stops there."""
BACKOFF = 6
"""none mode only: nacked, waits for its own backoff (ordered modes back off the whole key)."""


class Entry:
    """One stored message while the engine is responsible for it."""

    __slots__ = (
        "consumer",
        "deliveries",
        "delivery_id",
        "key",
        "late",
        "message",
        "n",
        "pos",
        "replayed",
        "resumed",
        "skipped",
        "state",
        "twin",
        "unrecorded_through",
    )

    def __init__(self, message: Message, key: KeyLedger | None, pos: object, n: int) -> None:
        self.message = message
        self.key = key
        self.pos = pos
        """Sequence number (sequence mode), ``(timestamp_ms, dedup_id)`` (watermark mode), None (none)."""
        self.n = n
        """Arrival number: export keeps arrival order, status finds the oldest undelivered."""
        self.deliveries = 0
        self.state = HELD
        self.delivery_id = ""
        self.consumer: str | None = None
        self.skipped: list[SkippedRange] | None = None
        self.late = False
        """Handed out outside the key's order, ahead of its backlog; never moves the cursor."""
        self.replayed = False
        """A replay whose position the key had passed: ``late`` too, and delivered flagged ``replayed``."""
        self.resumed = False
        """sequence: a replay that took the place of the dead letter its key was blocked at. In order
        (in ``out``, moves the cursor), but waits in the late queue: the run may have moved past it."""
        self.twin: Message | None = None
        self.unrecorded_through: int | None = None
        """sequence mode, while ACKING: the cursor its ack carried; the gap-skipped ranges below it
        rode on that ack, so they are recorded once it is durable (``KeyLedger.unrecorded_skips``)."""
        """A fast-path message (``volatile``) that a stored copy of itself reached meanwhile: that
        copy's record stays pending until this one's ack is durable, then is finished as dropped."""


class KeyLedger:
    """Everything the engine knows about one ordering key."""

    __slots__ = (
        "adopted",
        "backoff_since",
        "backoff_until",
        "blocked",
        "blocked_pos",
        "blocked_since",
        "consumer",
        "counted_ready",
        "cursor",
        "dead_lettering",
        "finishing_through",
        "gap_missing",
        "gap_since",
        "heap",
        "index",
        "known_from",
        "late",
        "n_held",
        "n_out",
        "n_ready",
        "name",
        "next_out",
        "out",
        "queued",
        "released",
        "run_end",
        "skipped",
        "unrecorded_skips",
        "wait_since",
        "waiting",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.heap: list[Any] = []  # policy-specific heap of held in-order entries (by position)
        self.index: dict[Any, Entry] = {}  # sequence mode: seq -> Entry for every entry the key still holds
        self.late: deque[Entry] = deque()  # late messages to deliver (on_late: deliver)
        self.out: list[Entry] = []
        self.finishing_through: Any = None
        """sequence mode: a position P such that, when last looked, every entry of ``out`` up to P was
        ACKING or DONE (a memo for the cursor an ack gives; see ``SequencePolicy.cursor_if_acked``)."""
        self.n_held = 0
        """Entries in HELD (heap and late queue)."""
        self.n_out = 0
        self.n_ready = 0
        """HELD entries releasable in order now (ignoring slots, backoff and blocks)."""
        self.counted_ready = 0
        """The part of ``n_ready`` included in the engine's global ready count (0 while blocked)."""
        self.consumer: str | None = None
        self.cursor: object = None
        """sequence: next expected sequence (None until ``first_sequence: any`` adopts one);
        watermark: last position acked (or skipped by a dead letter), None before any."""
        self.next_out: int = 0
        """sequence: the next sequence to hand out (>= cursor)."""
        self.run_end: int = 0
        """sequence: one past the run from ``next_out``, where the key's order has reached: every
        position below it is held, in flight, acking, finished or passed over (skipped, or late and
        finished). A rewind moves ``next_out`` back, never this."""
        self.released: object = None
        """watermark: highest position ever handed out (or the restored cursor): behind it is late."""
        self.known_from: int = 0
        """sequence: the cursor when this engine learned of the key (start, adopted or restored).
        Below it the engine does not know what happened; a message there got past the store's
        dedup, so it was never stored before: skipped before a restart, or older than adoption."""
        self.adopted = False
        """sequence: ``known_from`` is a first sequence this engine adopted (``first_sequence: any``),
        so nothing below it was ever delivered; False when it is a restored cursor."""
        self.skipped: list[list[int]] = []
        """sequence: ranges ``[first, last]`` passed over by a gap skip; a later arrival there is late."""
        self.unrecorded_skips: list[SkippedRange] = []
        """sequence: ranges a gap skip passed over that no durable ack has carried to the store yet.
        Every ack carries those below its cursor (``AckIntent.skipped``), until one that carried
        them is durable: acks may become durable in any order, and a dead-lettered message carries
        nothing, so no single ack can be trusted to be the one the store folds first. Unlike
        ``skipped``, an arrival never takes a sequence out: until its message is finished, the
        store must still count it as skipped."""
        self.blocked = False
        self.blocked_pos: object = None
        """While ``blocked``: the position of the dead letter the key stopped at (None if unknown)."""
        self.blocked_since: int | None = None
        self.dead_lettering = 0
        self.backoff_until: int | None = None
        self.backoff_since: int | None = None
        self.queued: str | None = None
        """Which ready queue holds the key: "" the shared one, else the owning consumer's; None if none.
        A queue may still hold the key after it moved: an entry counts only if it matches this."""
        self.gap_missing: int | None = None
        """sequence: the missing sequence whose gap timeout is armed (None when no gap)."""
        self.gap_since: int | None = None
        self.waiting = False
        """Holds messages back (gap, watermark, backoff, dead letter): counted in ``keys_blocked``."""
        self.wait_since: int | None = None


class AsideDeadLetters:
    """Dead letters outside any key's order, from the ``DeadLetter`` decision to ``dead_letter_done``.

    One message may be dead-lettered aside more than once (two stored copies of one conflict): it is
    counted, and forgotten when every one of its dead letters is done."""

    __slots__ = ("identities", "messages")

    def __init__(self) -> None:
        self.messages: dict[Message, tuple[int, int]] = {}
        """Each message: how many of its dead letters are not done yet, and its arrival number."""
        self.identities: dict[object, int] = {}
        """Their records' identities (``dedup.identity``), counted: a copy of one is a duplicate."""

    def add(self, message: Message, n: int) -> None:
        held = self.messages.get(message)
        self.messages[message] = (1, n) if held is None else (held[0] + 1, held[1])
        ident = identity(message)
        self.identities[ident] = self.identities.get(ident, 0) + 1

    def done(self, message: Message) -> bool:
        """One dead letter of ``message`` is recorded; False when none of it is held here."""
        held = self.messages.get(message)
        if held is None:
            return False
        count, n = held
        if count > 1:
            self.messages[message] = (count - 1, n)
        else:
            del self.messages[message]
        ident = identity(message)
        if self.identities.get(ident, 0) > 1:
            self.identities[ident] -= 1
        else:
            self.identities.pop(ident, None)
        return True
