"""Firestore's Listen protocol as deltas: raw ``ListenResponse``s in, consistent snapshots out. Google-free.

``sidecar.store.firestore`` keeps a Listen stream open (``_Listening``: the RPC, reconnects with
backoff, errors) and hands every raw response to a ``ListenSnapshots``, which keeps the
protocol's state across the streams of one listen and says when a snapshot is complete. It
imports nothing of Google's: it reads the raw protobuf messages it is given.

The official client's ``Watch`` (sync client) rebuilds and re-sorts its whole result set on every
snapshot, on a thread of its own; an inbox holding a backlog of N pending documents then costs
O(N log N) Python work per change, with the GIL taken from the event loop. Here a change costs
O(1): the protocol is the one ``watch.py`` follows (and our emulator serves), processed as deltas.

Rules:

- Changes (DocumentChange, DocumentDelete, DocumentRemove) accumulate until a TargetChange
  NO_CHANGE with no target ids and a read time marks a consistent snapshot, once the target is
  CURRENT; then one ``Change`` goes out (none when nothing changed, except the initial one).
  RESET forgets what was sent: the server resends the set.
- The resume token of the last CURRENT/NO_CHANGE is kept once the snapshot it precedes is handed
  over (the official watch keeps it at ``push`` alike); a stream that fails with a transient
  status is reopened with it, so only changes since are resent. A token taken earlier would let a
  stream that fails between a CURRENT and its snapshot resume past changes never handed over (a
  first snapshot's whole result set among them).
- ``initial`` is True for the first snapshot of a stream opened without a resume token (the full
  result set), False for every later one, resumed streams included.
- A REMOVE of the target ends the listen: ``ListenRemoved`` carries its cause.
"""

from __future__ import annotations

from typing import Any

from sidecar.store import documents as docs
from sidecar.store.api import StoreError
from sidecar.store.firestore_codec import fields_of, micros_of

TARGET_ID = 1
"""One target per Listen stream: each listen is its own stream."""


class ListenRemoved(Exception):
    """The server removed the target (a TargetChange REMOVE): the cause becomes ``on_error``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.error: StoreError = docs.Misconfigured(f"listen: target removed by the server ({code}): {message}")


class ListenSnapshots:
    """The protocol state of one listen, across its streams (module docstring)."""

    def __init__(self) -> None:
        self.resume_token = b""
        """The token of the last snapshot handed over: a stream reopened with it resumes there."""
        self._in_result: set[str] = set()
        """Document ids in the result set as handed over so far."""
        self.delivered = False
        """The current stream completed at least one snapshot."""
        self._initial = True
        self._current = False
        self._upserts: dict[str, tuple[docs.Fields, int]] = {}
        self._removals: set[str] = set()
        self._token = b""
        """The latest resume token, kept once the changes it covers are handed over."""

    def new_stream(self) -> bytes:
        """A stream opens: the resume token to open it with (b"": afresh, its first snapshot is the
        initial one)."""
        self.delivered = False
        self._initial = not self.resume_token
        self._current = False
        self._upserts, self._removals = {}, set()
        self._token = b""
        return self.resume_token

    def receive(self, raw: Any) -> docs.Change | None:
        """One raw ``ListenResponse`` of the stream: the snapshot it completes, to hand over now
        (None: none yet, or nothing changed). Raises ``ListenRemoved`` on a REMOVE."""
        kind = raw.WhichOneof("response_type")
        if kind == "document_change":
            change = raw.document_change
            doc_id = change.document.name.rpartition("/")[2]
            if TARGET_ID in change.target_ids:
                self._upserts[doc_id] = (fields_of(change.document), micros_of(change.document.update_time))
                self._removals.discard(doc_id)
            elif TARGET_ID in change.removed_target_ids:
                self._upserts.pop(doc_id, None)
                self._removals.add(doc_id)
        elif kind in ("document_delete", "document_remove"):
            doc_id = getattr(raw, kind).document.rpartition("/")[2]
            self._upserts.pop(doc_id, None)
            self._removals.add(doc_id)
        elif kind == "target_change":
            return self._target_change(raw.target_change)
        return None

    def _target_change(self, change: Any) -> docs.Change | None:
        change_type = change.target_change_type
        if change_type == change.TargetChangeType.REMOVE:
            raise ListenRemoved(change.cause.code, change.cause.message)
        if change_type == change.TargetChangeType.RESET:
            self._upserts.clear()
            self._removals = set(self._in_result)
            self._token = b""
            return None
        if change_type == change.TargetChangeType.CURRENT:
            self._current = True
        if change.resume_token and (change_type != change.TargetChangeType.NO_CHANGE or self._current):
            self._token = bytes(change.resume_token)
        global_snapshot = change_type == change.TargetChangeType.NO_CHANGE and not change.target_ids
        if not (global_snapshot and self._current and change.HasField("read_time")):
            return None
        upserts, removals = self._upserts, self._removals - set(self._upserts)
        gone = [doc_id for doc_id in removals if doc_id in self._in_result]
        batch = None
        if upserts or gone or self._initial:
            self._in_result.difference_update(gone)
            self._in_result.update(upserts)
            batch = docs.Change(
                [(doc_id, f, t) for doc_id, (f, t) in upserts.items()], gone, micros_of(change.read_time), self._initial
            )
        self.delivered = True
        self._initial = False
        self._upserts, self._removals = {}, set()
        if self._token:
            self.resume_token, self._token = self._token, b""
        return batch
