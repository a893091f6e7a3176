"""What waits on a dead-letter subscription, as operators and scripts see it. Pure.

``WaitingLetter.from_pubsub`` reads the ``sidecar_*`` attributes ``sidecar.dead_letters.publisher`` writes
(reason, key, attempts, the subscription it came from, the original message id, its position) into
one record; ``select`` applies the command line's filters; ``to_json`` and ``format_table`` render.
Nothing here reads a clock, a socket or the environment: ``now`` is an argument.

Rules:

- A message without ``sidecar_reason`` and ``sidecar_subscription`` was not written by the sidecar:
  it is *foreign*. It is always listed (flagged), but a filter by key or reason never selects it,
  and neither does an empty filter: only ``--message-id`` does, so that ``discard`` or ``replay``
  never act on something the sidecar knows nothing about unless an operator names it.
- ``--message-id`` matches the original message id (``sidecar_message_id``) or the dead letter's own
  Pub/Sub id, so a foreign message can be named by the only id it has.
- Ages are measured from the dead letter's publish time: when the sidecar gave up on the message.
- A reason is a family, then for some a detail after ``": "`` (``malformed: sequence attribute
  'seq' is missing``); metrics count by family (``reason_family``). ``--reason`` matches a letter
  whose family is the given text, or whose whole reason starts with it (``malformed``,
  ``malformed: sequence``, ``late``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

FOREIGN = "foreign"
"""The reason shown for a message the sidecar did not write."""

SIDECAR_PREFIX = "sidecar_"
"""The sidecar's own attributes on a dead letter (``sidecar.dead_letters.publisher``)."""


@dataclass(frozen=True, slots=True)
class WaitingLetter:
    """One message on a dead-letter subscription, leased (not acked) while the command runs."""

    ack_id: str
    dead_letter_id: str
    """The dead letter's own Pub/Sub message id (a new one: the publish made a new message)."""
    published_at: datetime
    data: bytes
    attributes: Mapping[str, str]

    @classmethod
    def from_pubsub(
        cls, ack_id: str, message_id: str, publish_time: datetime, data: bytes, attributes: Mapping[str, str]
    ) -> WaitingLetter:
        published_at = publish_time if publish_time.tzinfo else publish_time.replace(tzinfo=UTC)
        return cls(ack_id, message_id, published_at, bytes(data), dict(attributes))

    @property
    def foreign(self) -> bool:
        return "sidecar_reason" not in self.attributes or "sidecar_subscription" not in self.attributes

    @property
    def reason(self) -> str:
        return FOREIGN if self.foreign else self.attributes["sidecar_reason"]

    @property
    def key(self) -> str | None:
        return None if self.foreign else self.attributes.get("sidecar_key")

    @property
    def subscription(self) -> str | None:
        return None if self.foreign else self.attributes["sidecar_subscription"]

    @property
    def message_id(self) -> str:
        """The original message's id, or the dead letter's own for a foreign message."""
        return self.attributes.get("sidecar_message_id") or self.dead_letter_id

    @property
    def attempts(self) -> int | None:
        return _int_or_none(self.attributes.get("sidecar_delivery_attempts"))

    @property
    def position(self) -> int | str | None:
        """The sequence (sequence mode), the event time as RFC 3339 (watermark mode), or None."""
        sequence = _int_or_none(self.attributes.get("sidecar_sequence"))
        if sequence is not None:
            return sequence
        timestamp_ms = _int_or_none(self.attributes.get("sidecar_timestamp_ms"))
        if timestamp_ms is not None:
            return _rfc3339(datetime.fromtimestamp(timestamp_ms / 1000, UTC))
        return None

    def original_attributes(self) -> dict[str, str]:
        """The attributes the message was published with: the sidecar's own removed."""
        return {name: value for name, value in self.attributes.items() if not name.startswith(SIDECAR_PREFIX)}

    def age_seconds(self, now: datetime) -> float:
        return max(0.0, (now - self.published_at).total_seconds())


@dataclass(frozen=True, slots=True)
class Filters:
    """The command line's selection; every given filter must match (and)."""

    keys: frozenset[str] = frozenset()
    reasons: frozenset[str] = frozenset()
    older_than_seconds: float | None = None
    message_ids: frozenset[str] = frozenset()

    def describe(self) -> str:
        parts = [f"key {k!r}" for k in sorted(self.keys)] + [f"reason {r!r}" for r in sorted(self.reasons)]
        if self.older_than_seconds is not None:
            parts.append(f"older than {self.older_than_seconds:g}s")
        parts += [f"message id {m!r}" for m in sorted(self.message_ids)]
        return ", ".join(parts) if parts else "no filter"

    def matches(self, letter: WaitingLetter, now: datetime) -> bool:
        if self.message_ids and not {letter.message_id, letter.dead_letter_id} & self.message_ids:
            return False
        if letter.foreign and not self.message_ids:
            return False  # module docstring: foreign messages are selected by id only
        if self.keys and letter.key not in self.keys:
            return False
        if self.reasons and not any(reason_matches(letter.reason, wanted) for wanted in self.reasons):
            return False
        return self.older_than_seconds is None or letter.age_seconds(now) > self.older_than_seconds


def reason_family(reason: str) -> str:
    """The family of a dead-letter reason: the text before its first ``": "`` (all of it without one)."""
    return reason.split(": ", 1)[0]


def reason_matches(reason: str, wanted: str) -> bool:
    """``--reason wanted`` selects ``reason``: its family is ``wanted``, or it starts with ``wanted``."""
    return reason_family(reason) == wanted or reason.startswith(wanted)


def select(letters: Iterable[WaitingLetter], filters: Filters, now: datetime) -> list[WaitingLetter]:
    """The letters the filters select, oldest first (a key's letters in their original order)."""
    chosen = [letter for letter in letters if filters.matches(letter, now)]
    return sorted(chosen, key=_order)


def visible(letters: Iterable[WaitingLetter], filters: Filters, now: datetime) -> list[WaitingLetter]:
    """What ``list`` shows: the selection plus the foreign messages the filters do not exclude."""
    shown = [letter for letter in letters if filters.matches(letter, now) or _foreign_shown(letter, filters, now)]
    return sorted(shown, key=_order)


def _foreign_shown(letter: WaitingLetter, filters: Filters, now: datetime) -> bool:
    """A foreign message is listed unless a key, id or (other) reason filter, or its age, excludes it."""
    if not letter.foreign or filters.keys or filters.message_ids:
        return False
    if filters.reasons and FOREIGN not in filters.reasons:
        return False
    return filters.older_than_seconds is None or letter.age_seconds(now) > filters.older_than_seconds


def _order(letter: WaitingLetter) -> tuple[Any, ...]:
    position = letter.position
    return (letter.published_at, letter.subscription or "", letter.key or "", str(position), letter.dead_letter_id)


def to_json(letter: WaitingLetter, now: datetime) -> dict[str, Any]:
    """The stable JSON object of one letter (``list --json`` prints one per line)."""
    return {
        "message_id": letter.message_id,
        "dead_letter_id": letter.dead_letter_id,
        "subscription": letter.subscription,
        "key": letter.key,
        "position": letter.position,
        "reason": letter.reason,
        "attempts": letter.attempts,
        "foreign": letter.foreign,
        "dead_lettered_at": _rfc3339(letter.published_at),
        "age_seconds": round(letter.age_seconds(now), 3),
        "size_bytes": len(letter.data),
    }


def count_by_reason(letters: Iterable[WaitingLetter]) -> dict[str, int]:
    counts = Counter(letter.reason for letter in letters)
    return dict(sorted(counts.items()))


_COLUMNS = ("SUBSCRIPTION", "KEY", "POSITION", "REASON", "ATTEMPTS", "AGE", "MESSAGE ID")


def format_table(letters: Sequence[WaitingLetter], now: datetime) -> str:
    """A table for people, one row per letter, then the count per reason."""
    rows = [
        (
            letter.subscription or "-",
            _shorten(letter.key if letter.key is not None else "-"),
            "-" if letter.position is None else str(letter.position),
            letter.reason,
            "-" if letter.attempts is None else str(letter.attempts),
            format_age(letter.age_seconds(now)),
            letter.message_id,
        )
        for letter in letters
    ]
    widths = [max(len(column), *(len(row[i]) for row in rows)) for i, column in enumerate(_COLUMNS)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in [_COLUMNS, *rows]]  # fmt: skip
    counts = count_by_reason(letters)
    lines.append("")
    lines.append(f"{len(letters)} dead letter(s): " + ", ".join(f"{reason} {n}" for reason, n in counts.items()))
    return "\n".join(lines)


def format_age(seconds: float) -> str:
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


_MAX_KEY_CHARS = 40
"""Keys may be kilobytes long; the table shows the start, ``--json`` the whole (cut at 1 KB) key."""


def _shorten(text: str) -> str:
    return text if len(text) <= _MAX_KEY_CHARS else text[: _MAX_KEY_CHARS - 1] + "…"


def _int_or_none(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _rfc3339(instant: datetime) -> str:
    return instant.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
