"""A key's cursor as document fields, and back: cursor documents and checkpoint overlay entries. Pure.

Rules:

- ``cursor_fields`` is the one encoding of a ``CursorState`` (``sidecar.store.cursors``); the book
  compares it to tell a change, the writer stores it, ``state_from_cursor_doc`` reads it back.
  An overlay entry (a key in a checkpoint's ``cursors`` map) is the same fields without ``v``.
- A document that is not one of ours (a wrong type, a missing key, an odd number of skip bounds)
  raises ``CorruptDocument`` naming it: recovery stops rather than guess a cursor.
- **Cursor documents never expire.** A key's cursor must outlive every message that can still
  come for it: a cursor that expired would restart the key at ``start`` (its next message waits
  forever for sequence 1, and a replay of old messages is delivered again).
"""

from __future__ import annotations

from typing import Any

from sidecar.store.cursors import CursorState
from sidecar.store.layout import LAYOUT_VERSION, CorruptDocument, check_version, value_size


def overlay_fields(state: CursorState) -> dict[str, Any]:
    """A key's entry in its shard checkpoint's ``cursors`` map: its cursor fields without ``v``."""
    fields = cursor_fields(state)
    del fields["v"]
    return fields


def overlay_entry_size(state: CursorState) -> int:
    """Storage size of the key's entry in the ``cursors`` map (name + value, Firestore's formula)."""
    return 41 + value_size(overlay_fields(state))


def cursor_fields(state: CursorState) -> dict[str, Any]:
    """A cursor document's fields (without ``written_ms``, which the writer adds)."""
    fields: dict[str, Any] = {"key": state.key, "v": LAYOUT_VERSION}
    if state.next_sequence is not None:
        fields["next_seq"] = state.next_sequence
    if state.known_from is not None and state.next_sequence is not None and state.known_from < state.next_sequence:
        fields["known"] = state.known_from
        if state.skips:
            fields["skips"] = [seq for bounds in state.skips for seq in bounds]
    if state.done_above:
        fields["above_seq"] = sorted(state.done_above)
    if state.last_position is not None:
        fields["pos_ts"], fields["pos_id"] = state.last_position
    if isinstance(state.blocked_at, int):
        fields["blk_seq"] = state.blocked_at
    elif state.blocked_at is not None:
        fields["blk_ts"], fields["blk_id"] = state.blocked_at
    if state.unblocked:
        ordered = sorted(state.unblocked)
        if isinstance(ordered[0], int):
            fields["unb_seq"] = ordered
        else:  # Firestore has no arrays of arrays: timestamps and ids side by side
            fields["unb_ts"] = [pos[0] for pos in ordered]
            fields["unb_id"] = [pos[1] for pos in ordered]
    return fields


def state_from_cursor_doc(doc_id: str, fields: dict[str, Any], what: str = "") -> CursorState:
    """Decode a cursor document (or, ``what`` naming it, a checkpoint's overlay entry); raises
    CorruptDocument naming it when it is not one of ours."""
    what = what or f"cursor document keys/{doc_id}"
    check_version(what, fields)
    try:
        key = fields["key"]
        if not isinstance(key, str):
            raise TypeError(f"key is {type(key).__name__}, not a string")
        state = CursorState(key)
        if fields.get("next_seq") is not None:
            state.next_sequence = _int(fields["next_seq"])
        state.done_above = {_int(seq) for seq in fields.get("above_seq") or []}
        if fields.get("known") is not None:
            state.known_from = _int(fields["known"])
        flat = [_int(seq) for seq in fields.get("skips") or []]
        if len(flat) % 2:
            raise ValueError(f"skips has an odd number of bounds ({len(flat)})")
        state.skips = [[flat[i], flat[i + 1]] for i in range(0, len(flat), 2)]
        if fields.get("pos_ts") is not None:
            state.last_position = (_int(fields["pos_ts"]), str(fields["pos_id"]))
        if fields.get("blk_seq") is not None:
            state.blocked_at = _int(fields["blk_seq"])
        elif fields.get("blk_ts") is not None:
            state.blocked_at = (_int(fields["blk_ts"]), str(fields["blk_id"]))
        state.unblocked = {_int(seq) for seq in fields.get("unb_seq") or []}
        timestamps, ids = fields.get("unb_ts") or [], fields.get("unb_id") or []
        if len(timestamps) != len(ids):
            raise ValueError(f"unb_ts has {len(timestamps)} entries, unb_id {len(ids)}")
        state.unblocked |= {(_int(ts), str(id_)) for ts, id_ in zip(timestamps, ids, strict=True)}
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptDocument(f"{what}: {exc!r}") from exc
    return state


def _int(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {value!r}")
    return value
