"""What the engine reports about itself: counters, and what each key waits for (the status RPC).

Rules:

- The counters are O(1): kept up to date by the books on every event, never recounted here.
- The per-key list costs one pass over the keys, for the status RPC only (``max_keys=0`` skips it):
  keys holding, delivering, blocked or dead-lettering, waiting ones first, longest waiting first.
- A key reports one state, the first that applies: stopped at a dead letter (waiting for an
  operator, or for the dead letter's publish), backing off, waiting for a sequence or the
  watermark, in flight, ready, idle. Its ``waiting_for`` says what would move it on, in words.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sidecar.engine.books import Books
from sidecar.engine.state import BLOCKED, DONE, KeyLedger
from sidecar.engine.types import EngineStatus, KeyState, KeyStatus


def undelivered(books: Books) -> int:
    """``Engine.undelivered``: messages releasable or in flight."""
    ready = len(books.none.ready) if books.none is not None else books.n_ready
    return ready + books.n_out


def status(books: Books, now_ms: int, max_keys: int) -> tuple[EngineStatus, list[KeyStatus]]:
    """``Engine.status``."""
    arrivals = books.arrivals
    while arrivals and (arrivals[0].deliveries or arrivals[0].state in (DONE, BLOCKED)):
        arrivals.popleft()
    ready = len(books.none.ready) if books.none is not None else books.n_ready
    engine_status = EngineStatus(
        mode=books.mode,
        buffered=books.n_pending + len(books.parked),
        ready=ready,
        in_flight=books.n_out,
        keys=len(books.keys),
        keys_blocked=books.n_waiting_keys,
        oldest_undelivered_ms=arrivals[0].message.stored_at_ms if arrivals else None,
        watermark_ms=books.wm.watermark_ms if books.wm is not None else None,
        counts=books.all_counts(),
        keys_blocked_dead_letter=books.n_dead_letter_blocked,
    )
    if max_keys <= 0 or books.none is not None:
        return engine_status, []
    never = float("inf")
    candidates = [key for key in books.keys.values() if key.n_held or key.n_out or key.blocked or key.dead_lettering]
    candidates.sort(key=lambda k: (not k.waiting, k.wait_since if k.wait_since is not None else never, k.name))
    return engine_status, [key_status(books, key) for key in candidates[:max_keys]]


def key_status(books: Books, key: KeyLedger) -> KeyStatus:
    """One key's state, what it waits for and since when."""
    state: KeyState
    waiting_for = ""
    since = key.wait_since
    missing = last_missing = None
    blocked_id, blocked_seq = "", None
    if key.blocked:
        state, waiting_for = "blocked_dead_letter", "an operator: the key stopped at a dead letter"
        since = key.blocked_since
        blocking = next((e for e in key.out if e.state == BLOCKED), None)
        if blocking is not None:
            blocked_id, blocked_seq = blocking.message.message_id, blocking.message.sequence
        elif books.seq is not None:
            blocked_seq = key.blocked_pos  # type: ignore[assignment]  # restored blocked: the store knows where
        which = ", ".join(
            part
            for part in (f"sequence {blocked_seq}" if blocked_seq is not None else "",
                         f"message {blocked_id}" if blocked_id else "")
            if part
        )  # fmt: skip
        if which:
            waiting_for = f"an operator: the key stopped at a dead letter ({which})"
    elif key.dead_lettering:
        state, waiting_for = "blocked_dead_letter", "the dead-letter publish to finish"
    elif key.backoff_until is not None:
        state, waiting_for, since = "backoff", f"retry at {iso(key.backoff_until)}", key.backoff_since
    elif key.n_held and not key.n_ready:
        if books.seq is not None:
            state, waiting_for, missing = "waiting_sequence", books.seq.waiting_for(key), key.next_out
            span = books.seq.missing(key)
            last_missing = span[1] if span is not None else None
        else:
            head = books.wm.head_timestamp_ms(key)  # type: ignore[union-attr]
            state = "waiting_watermark"
            waiting_for = f"watermark to pass {iso(head)}" if head is not None else "the watermark"
    elif key.n_out and (not key.n_ready or key.n_out >= books.max_in_flight):
        state, since = "in_flight", None
    elif key.n_ready:
        state, since = "ready", None
    else:
        state, since = "idle", None
    return KeyStatus(
        key=key.name,
        state=state,
        waiting_for=waiting_for,
        since_ms=since,
        buffered=key.n_held + key.n_out,
        in_flight=key.n_out,
        next_sequence=key.cursor if books.seq is not None else None,  # type: ignore[arg-type]
        missing_sequence=missing,
        last_missing_sequence=last_missing,
        blocked_message_id=blocked_id,
        blocked_sequence=blocked_seq,
    )


def iso(ms: int) -> str:
    """``ms`` since the epoch as an ISO 8601 UTC time, to the millisecond."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
