"""Classification of a received Pub/Sub message: key, position and dedup id, or Malformed.

Pure: no I/O, no clock, no Google imports; ingest hands in the message's parts. ``classify`` never
raises on message content: anything the publisher got wrong comes back as ``Malformed(reason, key)``,
and ingest dead-letters it with the reason ``malformed: <reason>`` (the family ``malformed``, which
metrics count by, then the detail) and the key. Reasons name the attribute and show (a shortened
copy of) the offending value. ``Malformed.key`` is the message's key whenever it could be read
(a readable key with a bad sequence, timestamp, dedup attribute or replay marker), so that
``dead-letters list --key`` finds the dead letter; empty when the key itself is what is wrong.

Rules (docs/config.md repeats them for users):

- **Key.** ``key: {ordering_key: true}`` takes the Pub/Sub ordering key, ``key: {attribute: A}``
  the attribute's value. Any text is a valid key (``/``, unicode, kilobytes: the store hashes it).
  In sequence and watermark modes an empty or missing key is malformed. In none mode the key is
  informational: missing or empty gives ``""``.
- **Sequence** (sequence mode). The attribute must be ASCII decimal digits only (``^[0-9]+$``: no
  sign, spaces, exponent, fraction or underscores) with a value from the configured
  ``sequence.start`` (default 1) to 2**63-1 (protobuf int64). Leading zeros are accepted
  (``"007"`` is 7): zero-padded counters are a common publisher format. A value below ``start``
  is malformed rather than silently dropped as "already delivered".
- **Timestamp** (watermark mode). ``publish_time``, or the attribute as either epoch
  milliseconds (ASCII digits only) or RFC 3339 with a zone (``Z`` or ``+hh:mm``/``-hh:mm``,
  optional fraction of up to 9 digits, truncated to the millisecond, ``T`` or ``t`` between date
  and time). Either form must lie in 1970-01-01T00:00:00Z .. 9999-12-31T23:59:59.999Z. No zone,
  a leap second (``:60``), epoch seconds with a fraction, or anything else is malformed.
  Epoch seconds written as digits are read as milliseconds (a date in January 1970): the
  publisher must send milliseconds.
- **Dedup id.** ``message_id``, or the configured attribute; a missing or empty attribute is
  malformed (falling back to ``message_id`` would let the publisher's retries through as
  separate messages, breaking the guarantee the attribute was configured for).
- **Fingerprint.** SHA-256 over data, ordering key and all attributes (sorted), length-prefixed
  so that no two different messages encode alike, truncated to 16 bytes. It covers everything
  the publisher controls and nothing Pub/Sub assigns (message id, publish time), so a
  publisher's retry has the same fingerprint and a different payload under the same key and
  sequence does not. A replay's marker attributes are left out: a replay has its original's.
- **Replays** (``sidecar.dead_letters.replay_marker``: an operator's ``dead-letters replay``). Key and position
  are read as for any message (the original attributes travel unchanged); the replay id becomes
  ``IncomingMessage.replay_id``; with ``dedup: {by: message_id}`` the dedup id is the original's
  message id (``sidecar_replay_of``), and a publish-time timestamp is the original's
  (``sidecar_replay_timestamp_ms``) when the marker has it. A half marker is malformed.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from dataclasses import dataclass

from sidecar.config.model import (
    MAX_SEQUENCE,
    KeyConfig,
    SequenceOrdering,
    SubscriptionConfig,
    WatermarkOrdering,
)
from sidecar.dead_letters.replay_marker import REPLAY_TIMESTAMP_MS, BadMarker, read_marker, without_marker
from sidecar.engine.fingerprint import fingerprint
from sidecar.store.api import IncomingMessage

MAX_TIMESTAMP_MS = 253_402_300_799_999
"""9999-12-31T23:59:59.999Z: the largest instant a protobuf Timestamp (and Firestore) can hold."""

_DIGITS_RE = re.compile(r"[0-9]+")
_RFC3339_RE = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?"
    r"(?:([Zz])|([+-])([0-9]{2}):([0-9]{2}))"
)
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_SHOWN_VALUE_CHARS = 40
"""Reasons travel as a dead-letter attribute (1,024 bytes at most): show only a value's start."""


@dataclass(frozen=True, slots=True)
class Malformed:
    """The publisher sent something the configuration cannot place; ``reason`` says what."""

    reason: str
    key: str = ""
    """The message's key when it could be read (empty when the key is what is wrong, or there is none)."""


def classify(
    config: SubscriptionConfig,
    data: bytes,
    attributes: dict[str, str],
    ordering_key: str,
    message_id: str,
    publish_time_ms: int,
) -> IncomingMessage | Malformed:
    """Key, position and dedup id of one message under ``config``, or why there are none.

    ``attributes`` (the caller's own copy of the Pub/Sub map<string, string>: the types hold by
    construction) is kept by the result, not copied: records share it, and none changes it."""
    attrs = attributes
    ordering = config.ordering
    is_ordered = isinstance(ordering, SequenceOrdering | WatermarkOrdering)
    key = _key(ordering.key, attrs, ordering_key, required=is_ordered)
    if isinstance(key, Malformed):
        return key
    result = _classify_keyed(config, key, data, attrs, ordering_key, message_id, publish_time_ms)
    if isinstance(result, Malformed):
        return Malformed(result.reason, key)
    return result


def _classify_keyed(
    config: SubscriptionConfig,
    key: str,
    data: bytes,
    attrs: dict[str, str],
    ordering_key: str,
    message_id: str,
    publish_time_ms: int,
) -> IncomingMessage | Malformed:
    """``classify`` once the key is read: the position, the dedup id, the replay marker."""
    try:
        replay = read_marker(attrs)
    except BadMarker as exc:
        return Malformed(str(exc))
    ordering = config.ordering

    sequence: int | None = None
    timestamp_ms: int | None = None
    if isinstance(ordering, SequenceOrdering):
        parsed = parse_sequence(ordering.sequence.attribute, attrs.get(ordering.sequence.attribute))
        if isinstance(parsed, Malformed):
            return parsed
        if parsed < ordering.sequence.start:
            return Malformed(
                f"sequence attribute {ordering.sequence.attribute!r} is {parsed}, "
                f"below the configured start {ordering.sequence.start}"
            )
        sequence = parsed
    elif isinstance(ordering, WatermarkOrdering):
        if ordering.timestamp.attribute is None and replay is not None and replay.timestamp_ms is not None:
            parsed = parse_timestamp_ms(REPLAY_TIMESTAMP_MS, replay.timestamp_ms)
            if isinstance(parsed, Malformed):
                return parsed
            timestamp_ms = parsed
        elif ordering.timestamp.attribute is None:
            timestamp_ms = publish_time_ms
        else:
            parsed = parse_timestamp_ms(ordering.timestamp.attribute, attrs.get(ordering.timestamp.attribute))
            if isinstance(parsed, Malformed):
                return parsed
            timestamp_ms = parsed

    dedup_attribute = config.dedup.attribute
    if dedup_attribute is None:
        dedup_id = message_id if replay is None else replay.replay_of
    else:
        dedup_id = attrs.get(dedup_attribute, "")
        if not dedup_id:
            return Malformed(f"dedup attribute {dedup_attribute!r} is {_missing_or_empty(attrs, dedup_attribute)}")

    return IncomingMessage(
        key=key,
        dedup_id=dedup_id,
        message_id=message_id,
        data=data,
        attributes=attrs,
        ordering_key=ordering_key,
        publish_time_ms=publish_time_ms,
        # A replay's marker is not content: its fingerprint is its original's, computed now.
        # Anything else computes it from its own parts when first asked for.
        known_fingerprint=None if replay is None else fingerprint(data, without_marker(attrs), ordering_key),
        sequence=sequence,
        timestamp_ms=timestamp_ms,
        replay_id="" if replay is None else replay.replay_id,
    )


def _key(key: KeyConfig | None, attrs: Mapping[str, str], ordering_key: str, *, required: bool) -> str | Malformed:
    if key is None:
        return ""
    if key.ordering_key:
        if not ordering_key and required:
            return Malformed("the ordering key is empty (the key is configured as ordering_key: true)")
        return ordering_key
    assert key.attribute is not None  # KeyConfig validates: exactly one source
    value = attrs.get(key.attribute, "")
    if not value and required:
        return Malformed(f"key attribute {key.attribute!r} is {_missing_or_empty(attrs, key.attribute)}")
    return value


def parse_sequence(attribute: str, value: str | None) -> int | Malformed:
    """The sequence in ``value`` (ASCII digits, at most 2**63-1), or why it is not one."""
    if value is None:
        return Malformed(f"sequence attribute {attribute!r} is missing")
    if not _DIGITS_RE.fullmatch(value):
        return Malformed(f"sequence attribute {attribute!r} is not a base-10 integer: {_show(value)}")
    # Checked on the digits before int(): Python refuses int() on very long strings.
    if len(value.lstrip("0")) > len(str(MAX_SEQUENCE)) or int(value) > MAX_SEQUENCE:
        return Malformed(f"sequence attribute {attribute!r} is out of range (at most 2**63-1): {_show(value)}")
    return int(value)


def parse_timestamp_ms(attribute: str, value: str | None) -> int | Malformed:
    """Epoch milliseconds of ``value`` (epoch ms digits or RFC 3339 with a zone), or why not."""
    if value is None:
        return Malformed(f"timestamp attribute {attribute!r} is missing")
    if _DIGITS_RE.fullmatch(value):
        if len(value.lstrip("0")) > len(str(MAX_TIMESTAMP_MS)) or int(value) > MAX_TIMESTAMP_MS:
            return Malformed(f"timestamp attribute {attribute!r} is after year 9999 in epoch ms: {_show(value)}")
        return int(value)
    match = _RFC3339_RE.fullmatch(value)
    if match is None:
        return Malformed(
            f"timestamp attribute {attribute!r} is neither RFC 3339 with a zone nor epoch milliseconds: {_show(value)}"
        )
    year, month, day, hour, minute, second, fraction, zulu, sign, off_hours, off_minutes = match.groups()
    try:
        if zulu:
            zone = datetime.UTC
        else:
            offset = datetime.timedelta(hours=int(off_hours), minutes=int(off_minutes))
            if int(off_minutes) > 59:
                raise ValueError("offset minutes out of range")
            zone = datetime.timezone(-offset if sign == "-" else offset)
        moment = datetime.datetime(int(year), int(month), int(day), int(hour), int(minute), int(second), tzinfo=zone)
    except (ValueError, OverflowError):
        return Malformed(f"timestamp attribute {attribute!r} is not a valid date and time: {_show(value)}")
    whole_seconds = (moment - _EPOCH) // datetime.timedelta(seconds=1)
    millis = int((fraction or "0").ljust(3, "0")[:3])
    result = whole_seconds * 1000 + millis
    if not 0 <= result <= MAX_TIMESTAMP_MS:
        return Malformed(f"timestamp attribute {attribute!r} is outside 1970..9999 (UTC): {_show(value)}")
    return result


def _missing_or_empty(attrs: Mapping[str, str], name: str) -> str:
    return "empty" if name in attrs else "missing"


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_VALUE_CHARS else text[: _SHOWN_VALUE_CHARS - 3] + "..."
