"""Recovery: the documents a subscription left in Firestore in, the engine's snapshot out. Pure.

``DocumentStore.load`` reads four things and hands them here: the subscription document (mode) and
the checkpoint document of each shard loaded (``clean_ms``), every cursor document of those shards,
every pending message of those shards (chunks already reassembled), and every tombstone finished at
or after ``since_ms(checkpoints)`` (of any shard: ``recover`` keeps those of the shards loaded). Nothing here
reads, writes or waits, so the rules below are exercised directly by the crash simulation
(tests/store/test_crash_*.py) against any state a crash can leave.

Rules, and why each keeps the guarantees of DESIGN §1:

1. **A key's cursor is the fold of its cursor document and its recent tombstones**, with the same
   ``fold_ack``/``fold_dead_letter`` the writer used (``sidecar.store.cursors``). The cursor document
   holds every change up to the checkpoint; every change after it is on a tombstone written in the
   same Commit as the change itself. So the fold sees every durable finish (G3: a confirmed ack is
   never delivered again) and nothing that was not durable (a cursor is never ahead of a finish
   whose tombstone a crash prevented: that message is pending and comes back in order, G1/G2).
   An ack's tombstone carries the ranges a gap timeout skipped below its cursor (``cursor_skips``):
   the fold records those as skipped and nothing else the cursor passes (``fold_ack``).
2. **Finished sequences above the cursor** (``done_above``: out-of-order acks with
   ``max_in_flight_per_key`` > 1, dead letters under ``skip``) are restored as finished
   placeholders, so the cursor passes them as soon as the message below them is acked: no key waits
   for a position that is already finished (liveness).
3. **Only dead letters in the key's order block.** An in-order dead letter blocks the key under
   ``block`` (as the engine did before the crash) and is passed like an ack under ``skip``. A late
   message is dead-lettered aside: it never blocks; in sequence mode its position counts as
   finished (it will never be delivered), so the key does not wait for it again.
4. **Pending messages are handed back as they are**; the engine's restore replays them through its
   own rules (duplicates of held messages, late messages below the cursor). ``restorable`` checks
   and orders them: all of a load's in ``recover``, or one page at a time when the load read the
   state only (``DocumentStore.pending_pages``).
5. **Bounded work.** One pass over what was read: recovery ends in time linear in the documents
   loaded, whatever the store holds (no read loops driven by what a document says).
6. **Loud on foreign data.** A document of ours that is malformed or from a newer layout stops
   recovery with ``CorruptDocument`` naming it; nothing is skipped silently. So does one of layout
   v1 (no ``shard``): a sharded load could not see it.
7. **One checkpoint per shard.** Each shard's ``clean_ms`` is written only by its owner, in the
   fenced Commit that also writes that shard's cursors: a checkpoint shared by several pods would
   let one pod's clean time cover another pod's unwritten cursor changes. A shard without a
   checkpoint document is read from the beginning (``since`` 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sidecar.engine.types import EngineSnapshot, Message, Mode
from sidecar.store.api import DEAD_LETTERED, DEAD_LETTERED_ASIDE
from sidecar.store.cursor_documents import cursor_fields
from sidecar.store.cursor_documents import state_from_cursor_doc as _decode_cursor
from sidecar.store.cursors import CursorRules, CursorState, fold_ack, fold_dead_letter, key_cursor
from sidecar.store.layout import (
    ACKED,
    CURSOR_SKIPS,
    DONE_STATES,
    LAYOUT_VERSION,
    OVERLAY,
    CorruptDocument,
    check_version,
    require_v2,
)

CHECKPOINT_MARGIN_MS = 5_000
"""Tombstones finished this long before the checkpoint are read too: absorbs wall-clock steps
between the pod that wrote the checkpoint and the one that recovers."""


class ModeMismatch(ValueError):
    """The subscription's documents were written in another ordering mode."""


@dataclass(frozen=True, slots=True)
class Recovered:
    snapshot: EngineSnapshot
    states: dict[str, CursorState]
    """The durable per-key states, for the cursor book (``dirty_since_ms`` set where the cursor
    document lags behind the tombstones)."""
    since_ms: int


def check_subscription(name: str, mode: Mode, path: str, fields: dict[str, Any]) -> None:
    """The subscription document is ours, of this layout and mode; raises ModeMismatch or CorruptDocument."""
    what = f"subscription document {path}"
    check_version(what, fields)
    if fields.get("v", 1) < LAYOUT_VERSION:
        raise CorruptDocument(
            f"{what} is of layout v{fields.get('v', 1)} (written before shards): drain the subscription "
            "with the previous sidecar version first (docs/store.md, upgrading to layout 2)"
        )
    if fields.get("mode") != mode:
        raise ModeMismatch(
            f"subscription {name!r} is stored in mode {fields.get('mode')!r} at {path!r} but configured as "
            f"{mode!r}: use a new subscription name, or delete that document tree"
        )


def checkpoint_of(path: str, fields: dict[str, Any] | None) -> int | None:
    """A shard's checkpoint document's ``clean_ms`` (None: no document); raises CorruptDocument."""
    if fields is None:
        return None
    require_v2(f"checkpoint document {path}", fields)
    clean = fields.get("clean_ms")
    if type(clean) is not int:
        raise CorruptDocument(f"checkpoint document {path}: clean_ms={clean!r} is not an integer")
    return clean


def overlay_of(path: str, fields: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """The cursors a shard's checkpoint holds (``layout.OVERLAY``): (key document id, fields) each."""
    if fields is None:
        return []
    overlay = fields.get(OVERLAY)
    if overlay is None:
        return []
    if not isinstance(overlay, dict):
        raise CorruptDocument(f"checkpoint document {path}: {OVERLAY} is {type(overlay).__name__}, not a map")
    out = []
    for doc_id, entry in overlay.items():
        if not isinstance(entry, dict):
            raise CorruptDocument(f"checkpoint document {path}: {OVERLAY}.{doc_id} is not a map")
        out.append((f"checkpoint document {path}, {OVERLAY}.{doc_id}", entry))
    return out


def since_ms(checkpoints: Iterable[int | None]) -> int:
    """Tombstones finished at or after this time must be folded in (0: a shard has no checkpoint)."""
    known = list(checkpoints)
    if not known or any(clean is None for clean in known):
        return 0
    return min(clean for clean in known if clean is not None) - CHECKPOINT_MARGIN_MS


def recover(
    rules: CursorRules,
    cursor_docs: Iterable[tuple[str, dict[str, Any]]],
    recent_tombstones: Iterable[tuple[str, dict[str, Any]]],
    pending: list[Message],
    since: int,
    shards: frozenset[int] | None = None,
    overlays: Iterable[tuple[str, dict[str, Any]]] = (),
) -> Recovered:
    """Fold cursor documents, the checkpoints' overlays and recent tombstones into per-key states;
    the snapshot to restore. ``shards``: the shards loaded (tombstones of other shards are left
    out); None: all. ``overlays``: (where, fields) of each cursor a checkpoint holds; a key's
    overlay entry replaces its cursor document (it is never older: a key leaves the overlay only in
    the Commit that writes its document)."""
    mode = rules.mode
    states: dict[str, CursorState] = {}
    stored: dict[str, dict[str, Any]] = {}

    def keep(state: CursorState) -> None:
        if mode == "sequence" and state.next_sequence is None and state.blocked_at is None:
            state.next_sequence = rules.sequence_start
        states[state.key] = state
        stored[state.key] = cursor_fields(state)

    for doc_id, fields in cursor_docs:
        require_v2(f"cursor document keys/{doc_id}", fields)
        state = _decode_cursor(doc_id, fields)
        if state.key in states:
            raise CorruptDocument(f"cursor document keys/{doc_id}: a second cursor for key {state.key[:100]!r}")
        keep(state)
    for where, fields in overlays:
        state = _decode_cursor(where, fields, where)
        state.in_overlay = True
        keep(state)
    # In Commit order: done_ms, then the cursor each ack carried, makes the fold deterministic.
    mine = [
        (doc_id, fields)
        for doc_id, fields in recent_tombstones
        if shards is None or require_v2(f"message document {doc_id}", fields) in shards
    ]
    tombstones = sorted((_tombstone(doc_id, fields, mode) for doc_id, fields in mine), key=lambda t: (t[1], t[0]))
    for _doc_id, _done_ms, key, state_name, position, cursor, aside, skipped in tombstones:
        if key is None or aside:
            continue  # aside: a replay finished outside its key's order (``layout``): never folded
        key_state = states.get(key)
        if key_state is None:
            key_state = states[key] = rules.new_state(key)
        if state_name == ACKED:
            fold_ack(key_state, mode, position, cursor, skipped)
        elif state_name in (DEAD_LETTERED, DEAD_LETTERED_ASIDE) and position is not None:
            in_order = state_name == DEAD_LETTERED
            fold_dead_letter(key_state, mode, position, rules.on_dead_letter, in_order=in_order)
    for state in states.values():
        state.written_ms = None
        state.dirty_since_ms = 0 if cursor_fields(state) != stored.get(state.key) else None
    cursors = [key_cursor(state, mode) for state in states.values()]
    snapshot = EngineSnapshot(cursors=tuple(c for c in cursors if c is not None), pending=restorable(pending, mode))
    return Recovered(snapshot=snapshot, states=states, since_ms=since)


def restore_order(message: Message) -> tuple[int, str, int, int, str]:
    """Stored order, then position: the engine gets each key's messages in a stable order."""
    return (message.stored_at_ms, message.key, message.sequence or 0, message.timestamp_ms or 0, message.dedup_id)


def restorable(pending: Iterable[Message], mode: Mode) -> tuple[Message, ...]:
    """Pending messages in ``restore_order``, each checked to carry its mode's position (sequence
    mode ``seq``, watermark ``ts``): all of a load's at once, or one page of them; raises
    CorruptDocument naming the first document that does not."""
    checked = list(pending)
    for message in checked:
        if mode == "sequence" and message.sequence is None:
            raise CorruptDocument(f"message document {message.payload.ref if message.payload else '?'}: no seq")
        if mode == "watermark" and message.timestamp_ms is None:
            raise CorruptDocument(f"message document {message.payload.ref if message.payload else '?'}: no ts")
    return tuple(sorted(checked, key=restore_order))


def _tombstone(
    doc_id: str, fields: dict[str, Any], mode: Mode
) -> tuple[str, int, str | None, str, Any, Any, bool, list[tuple[int, int]] | None]:
    """(doc id, done_ms, key, state, position, cursor, aside, skipped) of a finished message document;
    ``skipped`` None for a sequence cursor of an earlier release (``layout.CURSOR_SKIPS``)."""
    what = f"message document {doc_id}"
    require_v2(what, fields)
    state = fields.get("state")
    done_ms = fields.get("done_ms")
    key = fields.get("key")
    if state not in DONE_STATES or type(done_ms) is not int or not isinstance(key, str):
        raise CorruptDocument(f"{what}: not a tombstone of ours (state={state!r}, done_ms={done_ms!r})")
    position: Any = None
    cursor: Any = None
    skipped: list[tuple[int, int]] | None = []
    try:
        if mode == "sequence":
            position = None if fields.get("seq") is None else int(fields["seq"])
            cursor = None if fields.get("cursor_seq") is None else int(fields["cursor_seq"])
            flat = fields.get(CURSOR_SKIPS)
            if cursor is not None and flat is None:
                skipped = None  # an earlier release's tombstone: inferred, as it was then
            elif flat:
                if not isinstance(flat, list) or len(flat) % 2 or any(type(bound) is not int for bound in flat):
                    raise ValueError(f"{CURSOR_SKIPS}={flat!r} is not a list of pairs of integers")
                skipped = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
        elif mode == "watermark":
            if fields.get("ts") is not None:
                position = (int(fields["ts"]), str(fields["dedup_id"]))
            if fields.get("cursor_ts") is not None:
                cursor = (int(fields["cursor_ts"]), str(fields["cursor_id"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptDocument(f"{what}: {exc!r}") from exc
    return doc_id, done_ms, key, state, position, cursor, fields.get("aside") is True, skipped
