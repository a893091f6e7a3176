"""An operator's skip of the missing sequences a key waits on (``skip-gap``). Pure.

Rules:

- Only a key that waits on a gap can be skipped: sequence mode, the key holds messages past its
  next sequence and that sequence is missing, and every message of the key before the gap is
  finished durably (``key.cursor`` is the first missing sequence: the store's cursor stands where
  the skip starts, so the store can record it). Anything else is refused with ``KeyNotWaitingOnGap``
  naming what the key waits on instead (a dead letter: ``unblock``; the acks of messages before
  the gap; nothing).
- ``through`` is the last sequence to skip: from the first missing one up to the last missing one,
  one below the lowest sequence the key holds (or finished before a restart) past the gap. Less
  than all of them may be skipped (the key then waits on ``through + 1``); a held or finished
  sequence is never skipped, since it is not missing. Out of range: ``SkipOutOfRange``, naming the
  range.
- The skip is the one a gap timeout makes (``SequencePolicy.skip_gap``): the range is remembered
  as skipped, so a late arrival from it is ``late`` (``on_late``), and the next held message
  carries the range to the app. The store recorded the range first (``Store.skip_gap``), so no ack
  carries it.
- ``missing_range`` decides, ``skip_gap`` applies after the store recorded it: it checks again, so
  a key that moved on meanwhile is refused, never skipped twice.
"""

from __future__ import annotations

from sidecar.engine.books import Books
from sidecar.engine.state import KeyLedger
from sidecar.engine.types import SkippedRange


class KeyNotWaitingOnGap(LookupError):
    """``skip_gap`` of a key that does not wait on a gap (the message names what it waits on)."""


class SkipOutOfRange(ValueError):
    """``skip_gap`` through a sequence outside the missing range (the message names the range)."""


def missing_range(books: Books, key_name: str, through: int) -> SkippedRange:
    """The sequences a skip of ``key_name`` through ``through`` would pass; raises KeyNotWaitingOnGap
    or SkipOutOfRange (module docstring)."""
    key = _waiting_key(books, key_name)
    first, last = books.seq.missing(key)  # type: ignore[union-attr, misc]
    if not first <= through <= last:
        span = f"sequence {first}" if first == last else f"sequences {first} to {last}"
        raise SkipOutOfRange(
            f"key {key_name!r} misses {span}: the last sequence to skip must be in that range, got {through}"
            + (f" ({last + 1} is held: it is not missing)" if through > last else "")
        )
    return SkippedRange(first, through)


def skip_gap(books: Books, key_name: str, through: int, now_ms: int) -> SkippedRange:
    """``Engine.skip_gap``: pass over the missing sequences up to ``through`` (recorded by the store)."""
    skipped = missing_range(books, key_name, through)
    key = books.keys[key_name]
    books.counts["skipped"] += books.seq.skip_gap(key, through, recorded=True)  # type: ignore[union-attr]
    key.gap_missing = key.gap_since = None
    books.refresh(key, now_ms)
    return skipped


def _waiting_key(books: Books, key_name: str) -> KeyLedger:
    seq = books.seq
    if seq is None:
        raise KeyNotWaitingOnGap(
            f"key {key_name!r} cannot wait on a gap: the subscription is in {books.config.mode} mode, "
            "gaps are a sequence-mode state"
        )
    key = books.keys.get(key_name)
    if key is None or not (key.n_held or key.n_out or key.blocked):
        raise KeyNotWaitingOnGap(f"key {key_name!r} is not waiting on a gap: it holds no messages")
    if key.blocked:
        where = f" at sequence {key.blocked_pos}" if key.blocked_pos is not None else ""
        raise KeyNotWaitingOnGap(
            f"key {key_name!r} is not waiting on a gap: it is blocked by a dead letter{where} (use unblock)"
        )
    first = seq.gap(key)
    if first is None:
        doing = "delivering its messages in order" if key.n_out or key.n_ready else "holding nothing past a gap"
        raise KeyNotWaitingOnGap(f"key {key_name!r} is not waiting on a gap: it is {doing}")
    if key.cursor != first:
        raise KeyNotWaitingOnGap(
            f"key {key_name!r} waits on sequence {first}, but sequences {key.cursor} to {first - 1} "
            "before the gap are not acked yet: retry once they are"
        )
    return key
