"""The cursor book: a subscription's durable per-key cursors, and which of them still need writing. Pure.

The book holds each key's ``CursorState`` as last made durable, and applies the fold of
``sidecar.store.cursors`` to a batch of finishes (``propose``: copies) once their Commit succeeded
(``accept``: kept). ``sidecar.store.fencing`` plans the Commits from it; recovery rebuilds it
(``restore``).

Rules:

- **Coalescing.** A key's cursor document is written at most once per ``interval_ms`` (Firestore
  sustains about one write per second per document); changes in between leave the key ``dirty``
  with the time of its oldest unwritten change, and a later Commit (an ack batch or the background
  flush) writes it. ``clean_through_ms`` is the time before which every durable change is in a
  cursor document: recovery folds in the tombstones finished after the checkpointed value.
- **Shards.** Every key belongs to one shard (``CursorRules.shard``). A pod that loses a shard
  forgets its keys' states and unwritten changes (``release``): the new owner advances them now,
  from what is durable; a later ``restore`` of the shard replaces whatever the book held for it.
- **The overlay.** A key's cursor is written into its shard's checkpoint (the ``cursors`` map)
  unless that map outgrows ``OVERLAY_MAX_BYTES``: then the keys changed longest ago move to their
  own cursor documents in the same Commit (``plan_checkpoint``); never more than
  ``OVERLAY_HARD_BYTES`` in one checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sidecar.engine.types import AckIntent, Message
from sidecar.store.cursor_documents import cursor_fields, overlay_entry_size
from sidecar.store.cursors import CursorRules, CursorState, fold_ack, fold_dead_letter, position_of, skips_of

OVERLAY_MAX_BYTES = 256 * 1024
"""Budget of a checkpoint's ``cursors`` map; past it, the keys changed longest ago move to their own
cursor documents (one write each), so the checkpoint stays far under Firestore's 1 MiB."""

OVERLAY_HARD_BYTES = 800 * 1024
"""Never more in one checkpoint: keys with a change that would not fit wait for the next one."""


class CursorBook:
    """The durable per-key cursors of one subscription, and which of them still need writing.

    A key's cursor is written into its shard's checkpoint document (``cursors``, a map by key
    document id: the *overlay*), rewritten whole at most once per ``interval_ms``: one write carries
    every key of the shard that changed, however many keys there are. Only when the overlay outgrows
    ``OVERLAY_MAX_BYTES`` do the keys changed longest ago move to their own cursor documents
    (``plan_checkpoint``), in the same Commit that drops them from the overlay.
    """

    def __init__(self, rules: CursorRules, interval_ms: int) -> None:
        self.rules = rules
        self.mode = rules.mode
        self.policy = rules.on_dead_letter
        self.interval_ms = interval_ms
        self.states: dict[str, CursorState] = {}
        self._dirty: dict[int, set[str]] = {}
        """Per shard: keys with a change not yet in a cursor record."""
        self._overlay: dict[int, set[str]] = {}
        """Per shard: keys whose latest written state is in the shard's checkpoint."""
        self._shards: dict[str, int] = {}

    def shard(self, key: str) -> int:
        shard = self._shards.get(key)
        if shard is None:
            shard = self._shards[key] = self.rules.shard(key)
        return shard

    def _copy(self, key: str, proposed: dict[str, CursorState]) -> CursorState:
        state = proposed.get(key)
        if state is None:
            current = self.states.get(key)
            state = current.copy() if current is not None else self.rules.new_state(key)
            proposed[key] = state
        return state

    def propose(
        self,
        acks: Sequence[AckIntent],
        dead_letters: Sequence[Message],
        now_ms: int,
        aside: Sequence[Message] = (),
    ) -> dict[str, CursorState]:
        """Copies of the affected keys' states with ``acks``, in-order ``dead_letters`` and dead
        letters ``aside`` (late) folded in."""
        proposed: dict[str, CursorState] = {}
        if self.mode == "none":
            return proposed  # none mode keeps no cursor
        for ack in acks:
            state = self._copy(ack.message.key, proposed)
            before = cursor_fields(state)
            fold_ack(state, self.mode, position_of(ack.message), ack.cursor, skips_of(ack))
            self._touch(state, before, now_ms)
        for message, in_order in [*((m, True) for m in dead_letters), *((m, False) for m in aside)]:
            position = position_of(message)
            if position is None:
                continue
            state = self._copy(message.key, proposed)
            before = cursor_fields(state)
            fold_dead_letter(state, self.mode, position, self.policy, in_order=in_order)
            self._touch(state, before, now_ms)
        return proposed

    @staticmethod
    def _touch(state: CursorState, before: dict[str, Any], now_ms: int) -> None:
        if cursor_fields(state) != before:
            state.changed_ms = now_ms
            if state.dirty_since_ms is None:
                state.dirty_since_ms = now_ms

    def dirty_shards(self, proposed: dict[str, CursorState] | None = None) -> set[int]:
        """Shards with a change not yet in a cursor record (``proposed`` included)."""
        shards = {shard for shard, keys in self._dirty.items() if keys}
        for key, state in (proposed or {}).items():
            if state.dirty_since_ms is not None:
                shards.add(self.shard(key))
        return shards

    def plan_checkpoint(
        self, shard: int, proposed: dict[str, CursorState], room: int, now_ms: int
    ) -> tuple[list[CursorState], list[CursorState], int | None]:
        """What a checkpoint of ``shard`` written now holds: (overlay states, states to write to
        their own cursor documents in the same Commit (at most ``room``), the oldest change left
        for a later checkpoint (None: every change of the shard is in this one)).

        Every key already in the overlay stays in it unless it moves to its own document: dropping
        it would let recovery fall back to an older document."""
        keys = set(self._overlay.get(shard, ())) | self._dirty.get(shard, set())
        keys |= {k for k, st in proposed.items() if st.dirty_since_ms is not None and self.shard(k) == shard}
        states = [proposed.get(key) or self.states[key] for key in keys]
        sizes = {state.key: overlay_entry_size(state) for state in states}
        total = sum(sizes.values())
        spill: list[CursorState] = []
        if total > OVERLAY_MAX_BYTES and room > 0:
            oldest_first = sorted(states, key=lambda st: (st.changed_ms, st.key))
            for state in oldest_first:
                if total <= OVERLAY_MAX_BYTES or len(spill) >= room:
                    break
                if state.written_ms is not None and now_ms - state.written_ms < self.interval_ms:
                    continue  # its document was written less than an interval ago (about 1 write/s per document)
                spill.append(state)
                total -= sizes[state.key]
        moved = {state.key for state in spill}
        kept = [state for state in states if state.key not in moved]
        left: int | None = None
        if total > OVERLAY_HARD_BYTES:
            # Only changes not yet in the overlay may wait; the newest wait first.
            for state in sorted(kept, key=lambda st: st.changed_ms, reverse=True):
                if total <= OVERLAY_HARD_BYTES:
                    break
                if not state.in_overlay and state.dirty_since_ms is not None:
                    kept.remove(state)
                    total -= sizes[state.key]
                    left = state.dirty_since_ms if left is None else min(left, state.dirty_since_ms)
        return sorted(kept, key=lambda st: st.key), spill, left

    def accept(
        self,
        proposed: dict[str, CursorState],
        now_ms: int,
        *,
        documents: Iterable[CursorState] = (),
        overlays: Mapping[int, Iterable[CursorState]] | None = None,
    ) -> None:
        """After a successful Commit: keep ``proposed``; ``documents`` were written to their own
        cursor documents, ``overlays`` (per shard) into the checkpoint written in that Commit."""
        self.states.update(proposed)
        for key, state in proposed.items():
            if state.dirty_since_ms is not None:
                self._dirty.setdefault(self.shard(key), set()).add(key)
        for state in documents:
            kept = self.states.setdefault(state.key, state)
            kept.written_ms = now_ms
            kept.dirty_since_ms = None
            kept.in_overlay = False
            shard = self.shard(state.key)
            self._dirty.get(shard, set()).discard(state.key)
            self._overlay.get(shard, set()).discard(state.key)
        for shard, states in (overlays or {}).items():
            dirty = self._dirty.get(shard, set())
            overlay = self._overlay.setdefault(shard, set())
            for state in states:
                kept = self.states.setdefault(state.key, state)
                kept.dirty_since_ms = None
                kept.in_overlay = True
                dirty.discard(state.key)
                overlay.add(state.key)

    def restore(self, states: dict[str, CursorState], dirty_since_ms: int, shards: Iterable[int] | None = None) -> None:
        """Replace the book (or, with ``shards``, those shards' part of it) with recovered states;
        keys whose record lagged are dirty."""
        if shards is None:
            self.states, self._dirty, self._overlay = {}, {}, {}
        else:
            self.release(shards)
        self.states.update(states)
        for key, state in states.items():
            shard = self.shard(key)
            if state.in_overlay:
                self._overlay.setdefault(shard, set()).add(key)
            if state.dirty_since_ms is not None:
                state.dirty_since_ms = dirty_since_ms
                self._dirty.setdefault(shard, set()).add(key)

    def release(self, shards: Iterable[int]) -> None:
        """Forget the states and unwritten changes of ``shards``' keys (another owner has them)."""
        lost = set(shards)
        for key in [key for key in self.states if self.shard(key) in lost]:
            del self.states[key]
            self._shards.pop(key, None)
        for shard in lost:
            self._dirty.pop(shard, None)
            self._overlay.pop(shard, None)

    def dirty_states(self, proposed: dict[str, CursorState]) -> list[CursorState]:
        """Every state with an unwritten change, ``proposed`` taking precedence over the book."""
        merged = {key: self.states[key] for keys in self._dirty.values() for key in keys}
        merged.update(proposed)
        return [state for state in merged.values() if state.dirty_since_ms is not None]

    def has_dirty(self) -> bool:
        return any(self._dirty.values())
