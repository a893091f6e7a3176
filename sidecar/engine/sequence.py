"""sequence mode: per key, deliver N only after everything below N was acked, skipped or dead-lettered.

Rules (DESIGN §4):

- A key's cursor starts at ``sequence_start``. With ``first_sequence_any`` a key the engine has no
  cursor for adopts the sequence of the first message that arrives for it. Sequences below the
  adopted one that arrive later are treated as *late* (``on_late``), never dropped silently: with
  shuffled input the first arrival is not necessarily the lowest, and the late rule makes that
  visible. A store cursor, once written, wins over adoption.
- ``seq`` the key has passed (below ``run_end``, holding nothing there): a duplicate
  (DropDuplicate) if this engine saw it finish (its record expired and was created again: it is
  never delivered again, G3); late if a gap skip passed over it, or if it lies below the adopted
  first sequence; dead-lettered as ``below_cursor`` if it lies below the cursor the engine was
  restored with (acked or skipped before the restart: the engine cannot tell, so it neither
  delivers it, G3, nor drops it, G1).
- ``seq`` equal to a sequence the key still holds: the same fingerprint is a duplicate, another fingerprint a conflict
  (DeadLetter "conflict"; the original stays).
- Stored sequences form a *run* from ``next_out``: the run is releasable in order; anything beyond
  it is held with the reason "missing sequence N" where N is the first missing one.
- A gap timeout with ``skip`` moves ``next_out`` to the lowest held sequence; that message carries
  the skipped range. The cursor written to the store moves only when it is acked. An operator's
  skip (``gap_skip``) passes the same way over the missing sequences up to the one it names; the
  store recorded it before (``recorded``), so no ack carries it.
- A nack's (or an expiry's, or a close's) rewind moves ``next_out`` back to the lowest message
  given back, never ``run_end``: what the key passed stays passed. Every position from the rewind
  up to ``run_end`` is held, in flight, acking, finished, or passed over (skipped, or late: such a
  message is handed out from the late queue, and once finished it leaves nothing behind). The
  rewound run walks over all of them, so a skipped range is neither waited for nor skipped again,
  a sequence skipped before the rewind that arrives after it is late (never in order after the
  message that reported it skipped, G2), and a copy of a finished late one is a duplicate (G3).
- A replay (``Message.replay_id``) keeps its original's sequence. At the sequence its key is
  blocked at, it takes the dead letter's place (``resume_at``); at a
  sequence the key has not reached and holds nothing at, it is an ordinary arrival; at a sequence
  the key passed or finished it is *behind*, and ``arrival`` applies ``on_replay_behind`` (a
  flagged replay waits in ``replays``, never in ``index``, whose slot may hold a finished
  placeholder); at a sequence the key holds another message for, it is behind too: that message
  has the place (a replay is never dropped for another message: the operator asked for it).

Complexity: arrival O(log b) (heap push, b = the key's backlog), hand-out O(log b) (the next in
order is the heap's head, or the run's end), a rewind O(log b) per message given back; extending
the run after a gap fills walks each message once.
"""

from __future__ import annotations

import bisect
import heapq

from sidecar.engine.state import DONE, HELD, Entry, KeyLedger
from sidecar.engine.types import (
    Action,
    DeadLetter,
    DropDuplicate,
    EngineConfig,
    Hold,
    KeyCursor,
    Message,
    SkippedRange,
)

_MAX_SKIPPED_RANGES_PER_KEY = 64
"""Skipped ranges remembered per key to recognise late arrivals; the oldest are forgotten first
(a message from a forgotten range is then dead-lettered as ``below_cursor``, never dropped)."""


class SequencePolicy:
    __slots__ = ("_deliver_late", "_first_any", "_start", "replays")

    def __init__(self, config: EngineConfig) -> None:
        self._start = config.sequence_start
        self._first_any = config.first_sequence_any
        self._deliver_late = config.on_late == "deliver"
        self.replays: dict[str, Entry] = {}
        """Replays delivered outside their key's order, by replay id."""

    def new_key(self, key: KeyLedger) -> None:
        if self._first_any:
            key.cursor = None
        else:
            key.cursor = key.next_out = key.run_end = key.known_from = self._start

    def restore_cursor(self, key: KeyLedger, cursor: KeyCursor) -> None:
        if cursor.last_position is not None:
            raise ValueError(f"key {cursor.key!r}: a watermark cursor (last_position) in a sequence-mode snapshot")
        if cursor.next_sequence is not None:
            key.cursor = key.next_out = key.run_end = key.known_from = int(cursor.next_sequence)
            if cursor.known_from is not None and cursor.known_from < key.cursor:
                # The store knows what became of every sequence from there: finished, or skipped.
                key.known_from = int(cursor.known_from)
                key.skipped = [[first, last] for first, last in cursor.skipped if last >= key.known_from]
        key.blocked = cursor.blocked
        if cursor.blocked:
            # Stopped at its cursor unless the store knows the exact sequence (an earlier message
            # may still have been in flight when the key blocked).
            key.blocked_pos = cursor.blocked_position if cursor.blocked_position is not None else key.cursor
        for seq in sorted(cursor.acked_above):
            if key.cursor is None or seq < key.cursor:  # type: ignore[operator]
                continue
            # A finished placeholder: the run walks over it and the cursor passes it in turn.
            placeholder = Entry(Message(key.name, "", "", 0, sequence=seq, known_fingerprint=b""), key, seq, 0)
            placeholder.state = DONE
            key.index[seq] = placeholder
            key.out.append(placeholder)

    def export_cursor(self, key: KeyLedger) -> KeyCursor | None:
        if key.cursor is None and not key.blocked:
            return None
        acked_above = tuple(entry.pos for entry in key.out if entry.state == DONE and not entry.late)
        return KeyCursor(
            key=key.name,
            next_sequence=key.cursor,  # type: ignore[arg-type]
            blocked=key.blocked,
            acked_above=acked_above,  # type: ignore[arg-type]
            blocked_position=key.blocked_pos if key.blocked else None,  # type: ignore[arg-type]
        )

    @staticmethod
    def position(message: Message) -> int:
        seq = message.sequence
        if type(seq) is not int:
            raise ValueError(
                f"sequence mode: message {message.dedup_id!r} of key {message.key!r} has no integer sequence ({seq!r})"
            )
        return seq

    def replay_place(self, key: KeyLedger, message: Message) -> str:
        """Where a replay that is not at its key's block falls (module docstring): "ahead" (an
        ordinary arrival) or "behind" (the key passed its sequence, or holds a message there)."""
        seq = self.position(message)
        if seq in key.index or (key.cursor is not None and seq < key.run_end):
            return "behind"
        return "ahead"

    def resume_at(
        self, key: KeyLedger, blocking: Entry | None, message: Message, n: int
    ) -> tuple[Action | None, Entry | None]:
        """A replay of the dead letter the key was blocked at takes its place (the block is lifted).

        Restored blocked (``blocking`` None), nothing at or after the blocked sequence was handed out:
        an ordinary arrival. Otherwise the dead letter was handed out and ``next_out`` is past it
        (maybe past a skipped range too): the replay takes its index slot and waits at the head of the
        late queue, *resumed*: handed out before anything else of the key, and in ``out`` like an
        in-order message, so its durable ack moves the cursor past the blocked sequence."""
        if blocking is None:
            return self.arrive(key, message, n)
        entry = Entry(message, key, blocking.pos, n)
        entry.resumed = True
        key.index[blocking.pos] = entry
        key.late.appendleft(entry)
        key.n_held += 1
        key.n_ready += 1
        return None, entry

    def add_flagged(self, key: KeyLedger, entry: Entry) -> None:
        """A replay delivered outside the key's order, ahead of its backlog (like a late message)."""
        self.replays[entry.message.replay_id] = entry
        key.late.append(entry)
        key.n_held += 1
        key.n_ready += 1

    def find_replay(self, message: Message) -> Entry | None:
        return self.replays.get(message.replay_id) if message.replay_id else None

    def arrive(self, key: KeyLedger, message: Message, n: int) -> tuple[Action | None, Entry | None]:
        seq = self.position(message)
        index = key.index
        held = index.get(seq)
        if held is not None:
            if held.n == 0:  # a restored placeholder: acked before the restart
                return DropDuplicate(message, "duplicate of an acked message", finish_record=True), None
            if held.message.fingerprint == message.fingerprint:
                if held.message.volatile and not message.volatile and held.twin is None:
                    # A stored copy of a fast-path message: its record is the only durable one until
                    # the held message's ack is durable, so it stays pending until then (``twin``).
                    held.twin = message
                return DropDuplicate(message, "duplicate of a message the engine holds"), None
            return DeadLetter(message, "conflict", 0), None
        if key.cursor is None:
            key.cursor = key.next_out = key.run_end = key.known_from = seq
            key.adopted = True
        if seq < key.run_end:
            # Passed already (this position holds nothing, and a run is never short of one).
            if seq >= key.known_from and not _take_from_skipped(key.skipped, seq):
                reason = "below the key's cursor (already acked or dead-lettered)"
                return DropDuplicate(message, reason, finish_record=True), None
            if seq < key.known_from and not key.adopted:
                # Below the cursor the engine was restored with: acked or skipped before, unknown which.
                return DeadLetter(message, "below_cursor", 0), None
            if not self._deliver_late:
                return DeadLetter(message, "late", 0), None
            entry = Entry(message, key, seq, n)
            entry.late = True
            index[seq] = entry
            key.late.append(entry)
            key.n_held += 1
            key.n_ready += 1
            return None, entry
        entry = Entry(message, key, seq, n)
        index[seq] = entry
        heapq.heappush(key.heap, seq)
        key.n_held += 1
        run_end = key.run_end
        if seq == run_end:
            # Usual case: the run grows by one; walk on only if later sequences were waiting.
            if (seq + 1) in index:
                _extend_run(key)
            else:
                key.run_end = seq + 1
                key.n_ready += 1
        elif seq > run_end:
            return Hold(message, f"missing sequence {run_end}"), entry
        if key.blocked:
            return Hold(message, f"key blocked by a dead letter at sequence {key.cursor}"), entry
        return None, entry

    def pop_head(self, key: KeyLedger) -> Entry:
        """The next releasable entry (precondition: ``key.n_ready > 0``). Looks it up before it
        changes anything: if the books were wrong it raises with the key as it was."""
        late = key.late
        if late:
            entry = late.popleft()
        else:
            heap = key.heap
            entry = key.index[heap[0]]
            heapq.heappop(heap)
            # Next in order: the next held in-order entry inside the run, else the run's end. What
            # lies between holds nothing to hand out in order: acking or finished entries, late ones
            # and resumed replays (handed out from the late queue), positions passed over.
            run_end = key.run_end
            key.next_out = heap[0] if heap and heap[0] < run_end else run_end
        key.n_held -= 1
        key.n_ready -= 1
        return entry

    def give_back(self, key: KeyLedger, entries: list[Entry]) -> None:
        """Entries (already HELD again, in position order) return to the key's backlog.

        In-order ones rewind ``next_out`` to the lowest of them; ``run_end`` stays: every position
        from there up to it is held, in flight, acking, finished or passed over (skipped, or late),
        and a position passed over stays passed over (rule of the module docstring)."""
        rewind = None
        for entry in entries:
            key.n_held += 1
            key.n_ready += 1
            if entry.late or entry.resumed:
                key.late.appendleft(entry)
            else:
                heapq.heappush(key.heap, entry.pos)
                if rewind is None or entry.pos < rewind:  # type: ignore[operator]
                    rewind = entry.pos
        if rewind is not None and rewind < key.next_out:  # type: ignore[operator]
            key.next_out = rewind  # type: ignore[assignment]

    def retire(self, key: KeyLedger, entry: Entry) -> None:
        """An in-order entry left the head of ``out`` finished: the cursor passes it."""
        key.cursor = entry.pos + 1  # type: ignore[operator]
        del key.index[entry.pos]

    def forget(self, key: KeyLedger, entry: Entry) -> None:
        """A late entry is finished (acked or dead-lettered); it never moved the cursor."""
        if entry.replayed:
            del self.replays[entry.message.replay_id]
        else:
            del key.index[entry.pos]

    def on_blocked(self, key: KeyLedger, entry: Entry) -> None:
        """Kept in the index: a redelivery of the blocking message stays a duplicate."""

    def pass_restored_block(self, key: KeyLedger, position: object) -> Entry | None:
        """Unblock a key restored blocked (no entry here): ``position`` counts as finished.

        Restored blocked, nothing of the key was handed out since, so ``out`` holds only finished
        placeholders. The blocked sequence becomes one more; the cursor walks over those at its head
        and the run of stored sequences is recomputed from there. A held copy of the skipped message
        (stored again after its tombstone expired) is taken out and returned, to be dropped."""
        if type(position) is not int or key.cursor is None or position < key.cursor:  # type: ignore[operator]
            return None
        copy = key.index.get(position)
        if copy is not None:
            if copy.state != HELD or copy.late:
                return None  # a finished placeholder: nothing to pass
            del key.index[position]
            key.heap.remove(position)
            heapq.heapify(key.heap)
            key.n_held -= 1
            copy.state = DONE
        placeholder = Entry(Message(key.name, "", "", 0, sequence=position, known_fingerprint=b""), key, position, 0)
        placeholder.state = DONE
        key.index[position] = placeholder
        out = key.out
        i = len(out)
        while i and out[i - 1].pos > position:  # type: ignore[operator]
            i -= 1
        out.insert(i, placeholder)
        while out and out[0].state == DONE and out[0].pos == key.cursor:
            self.retire(key, out.pop(0))
        key.next_out = key.run_end = max(key.next_out, key.cursor)  # type: ignore[call-overload]
        key.n_ready = len(key.late)
        _extend_run(key)
        return copy

    def held_below(self, key: KeyLedger, pos: object) -> bool:
        """A message given back by a nack waits before ``pos``: the cursor must not pass it."""
        heap = key.heap
        return bool(heap) and bool(heap[0] < pos)

    def cursor_if_acked(self, key: KeyLedger, entry: Entry) -> int | None:
        """The key's cursor once ``entry``'s ack is durable: past the longest prefix of ``out`` that
        is acking or done, never past a message given back by a nack that waits before it.

        The walk resumes where the last one stopped (``key.finishing_through``), so that a hot key
        with a long window of acks waiting to be durable costs O(1) amortised per ack, not O(window).
        The memo stays true because an ACKING or DONE entry never goes back, entries leave ``out``
        only from its head (retired) or when still in flight, and an entry handed out again after a
        nack was held below every position the walk passed (``held_below`` stopped it there)."""
        cursor = key.cursor
        if entry.late:
            return cursor  # type: ignore[return-value]
        out = key.out
        start = 0
        through = key.finishing_through
        if through is not None and out and out[0].pos <= through and not self.held_below(key, through):
            # Every entry up to ``through`` was acking or done when last looked, and still is.
            start = bisect.bisect_right(out, through, key=_pos)
            cursor = through + 1
        for i in range(start, len(out)):
            handed = out[i]
            if self.held_below(key, handed.pos):
                break
            if handed is entry or handed.state in _FINISHING:
                cursor = handed.pos + 1  # type: ignore[operator]
                key.finishing_through = handed.pos
            else:
                break
        return cursor  # type: ignore[return-value]

    def gap(self, key: KeyLedger) -> int | None:
        """The missing sequence the key waits on, or None when its backlog has no gap at its head."""
        heap = key.heap
        if heap and heap[0] != key.next_out:
            return key.next_out
        return None

    def missing(self, key: KeyLedger) -> tuple[int, int] | None:
        """The missing sequences ``(first, last)`` the key waits on at the head of its backlog, None
        when it waits on no gap. ``last`` is one below the lowest sequence the key holds at all past
        the gap (held, or finished before a restart: a restored placeholder)."""
        first = self.gap(key)
        if first is None:
            return None
        held = key.heap[0]
        lowest = min((seq for seq in key.index if first <= seq < held), default=held)
        return first, lowest - 1

    def skip_gap(self, key: KeyLedger, through: int | None = None, *, recorded: bool = False) -> int:
        """Pass over the missing sequences (all of them, or those up to ``through``); returns how many
        were skipped.

        Only what is missing is skipped: up to the lowest sequence the key holds at all, which may be
        one finished before a restart (a restored placeholder) rather than the lowest held one. A
        finished sequence inside a skipped range would later look like a late arrival and could be
        delivered again (G3). ``through`` (an operator's skip, ``gap_skip``) must lie in the range
        ``missing`` gives. ``recorded``: the store already holds the skipped range and its cursor passed
        it (an operator's skip is written before it applies, with nothing unfinished before the gap),
        so no ack needs to carry it (``unrecorded_skips``) and the key's cursor passes it at once."""
        held = key.heap[0]
        first, last = self.missing(key)  # type: ignore[misc]
        if through is not None:
            if not first <= through <= last:
                raise ValueError(f"key {key.name!r}: cannot skip through {through}, missing {first}..{last}")
            last = through
        skipped = key.skipped
        skipped.append([first, last])
        if len(skipped) > _MAX_SKIPPED_RANGES_PER_KEY:
            # Forget the oldest range, and with it what the engine knows below its end: an arrival
            # from there is then dead-lettered as below the cursor, never dropped silently.
            _, forgotten_last = skipped.pop(0)
            key.known_from = max(key.known_from, forgotten_last + 1)
            key.adopted = False
        entry = key.index[held]
        if entry.skipped is None:
            entry.skipped = []
        entry.skipped.append(SkippedRange(first, last))
        if not recorded:
            unrecorded = key.unrecorded_skips
            unrecorded.append(SkippedRange(first, last))
            if len(unrecorded) > _MAX_SKIPPED_RANGES_PER_KEY:
                # Bounded by merging the two oldest: the store then counts the sequences between them
                # as skipped too (a copy of one is late, never dropped: G1), never the reverse.
                unrecorded[0:2] = [SkippedRange(unrecorded[0].first, unrecorded[1].last)]
        # Step over sequences finished before a restart: the next to hand out is missing or held.
        following = last + 1
        index = key.index
        while following < held and following in index and not _in_order_held(index[following]):
            following += 1
        key.next_out = key.run_end = following
        if recorded:
            # The store's cursor passed the range (nothing before it was unfinished): so does the key's,
            # and over the sequences finished before a restart that follow it.
            key.cursor = last + 1
            out = key.out
            while out and out[0].state == DONE and out[0].pos == key.cursor:
                self.retire(key, out.pop(0))
        key.n_ready = len(key.late)
        _extend_run(key)
        skipped_count: int = last - first + 1
        return skipped_count

    def waiting_for(self, key: KeyLedger) -> str:
        return f"sequence {key.next_out}"


def _pos(entry: Entry) -> object:
    return entry.pos


_FINISHING = frozenset({2, 4})  # ACKING, DONE: the cursor may count them as passed once durable


def _extend_run(key: KeyLedger) -> None:
    index = key.index
    end = key.run_end
    ready = 0
    while True:
        entry = index.get(end)
        if entry is None:
            break
        if _in_order_held(entry):
            ready += 1  # late entries and resumed replays are walked over: the late queue counts them
        end += 1
    key.run_end = end
    key.n_ready += ready


def _in_order_held(entry: Entry) -> bool:
    """Held and waiting for its turn in the key's order. A late entry sits in the index at a sequence
    a gap skip passed over; a nack's rewind can bring ``next_out`` back below it, and the run then
    walks over it like a finished one: it is counted and handed out from the late queue only. A
    resumed replay waits in the late queue likewise."""
    return entry.state == HELD and not entry.late and not entry.resumed


def _take_from_skipped(ranges: list[list[int]], seq: int) -> bool:
    """Remove ``seq`` from the skipped ranges; True if it was in one (so it is late, once)."""
    for i, bounds in enumerate(ranges):
        first, last = bounds
        if first <= seq <= last:
            if first == last:
                del ranges[i]
            elif seq == first:
                bounds[0] = seq + 1
            elif seq == last:
                bounds[1] = seq - 1
            else:
                bounds[1] = seq - 1
                ranges.insert(i + 1, [seq + 1, last])
            return True
    return False
