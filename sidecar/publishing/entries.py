"""An outbox entry as the app wrote it (DESIGN §12), read into what the relay publishes, or the reason
it never can be. Pure.

Rules:

- An entry is a document with a random id: ``key`` (string, required, non-empty), ``data`` (bytes, or
  a string sent as its UTF-8), ``attributes`` (map of string to string, optional), ``topic`` (string,
  optional: a full ``projects/P/topics/T`` or a bare id under the relay's project),
  ``traceparent`` / ``tracestate`` (strings, optional, W3C: published as the attributes of the same
  names). Fields beyond these are left alone (the app's own).
- Unpublishable for good (``Unpublishable``, with its reason; the same fields always give the same
  verdict, so every pod and every restart agrees): no key, a key that is not a string or is empty,
  no data or data of another type, attributes that are not a map of strings, an attribute the relay
  sets itself (the key and sequence attributes) or that starts with ``goog`` (Pub/Sub's), an
  attribute name or value past Pub/Sub's limits, more than 100 attributes, a topic that is no topic
  name, and a message over Pub/Sub's 10 MB.
- The published message of an entry is a function of its fields and its sequence number only
  (``message``): a republish after a crash is the same message, which the subscriber side drops.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sidecar.config.fields import check_pubsub_name

MAX_MESSAGE_BYTES = 10 * 1024 * 1024
"""Pub/Sub's limit on one message (data, attributes and ordering key)."""
MAX_ATTRIBUTES = 100
MAX_ATTRIBUTE_NAME_BYTES = 256
MAX_ATTRIBUTE_VALUE_BYTES = 1024
MAX_ORDERING_KEY_BYTES = 1024
TRACE_FIELDS = ("traceparent", "tracestate")
"""W3C trace context fields of an entry, published as attributes of the same names."""

_check_topic = check_pubsub_name("topics")


@dataclass(frozen=True, slots=True)
class Rules:
    """What a relay's config says about its entries."""

    project: str
    topic: str
    """The default topic, full name."""
    key_attribute: str
    sequence_attribute: str
    ordering_key: bool


@dataclass(frozen=True, slots=True)
class Entry:
    """A publishable entry."""

    id: str
    key: str
    data: bytes
    attributes: Mapping[str, str]
    """The app's attributes and the trace context; the relay adds the key and the sequence."""
    topic: str
    """Full topic name."""
    update_time_us: int

    def size(self) -> int:
        """Bytes of data and attributes (what counts against a Publish request's limit)."""
        return len(self.data) + sum(_size(n) + _size(v) for n, v in self.attributes.items()) + 2 * _size(self.key)


@dataclass(frozen=True, slots=True)
class Unpublishable:
    """An entry that can never be published as written: it waits for an operator."""

    id: str
    key: str | None
    """Its key when it has a usable one (that key is blocked behind it), else None (it blocks nothing)."""
    reason: str
    update_time_us: int


@dataclass(frozen=True, slots=True)
class Message:
    """What is published for an entry at a sequence number."""

    entry_id: str
    key: str
    sequence: int
    update_time_us: int
    topic: str
    data: bytes
    attributes: dict[str, str]
    ordering_key: str


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def read_entry(entry_id: str, fields: Mapping[str, Any], update_time_us: int, rules: Rules) -> Entry | Unpublishable:
    """The entry ``fields`` (an outbox document's) as published, or why it cannot be."""
    key = fields.get("key")
    if key is None:
        return Unpublishable(entry_id, None, "no key: an entry needs a string `key`", update_time_us)
    if not isinstance(key, str):
        return Unpublishable(entry_id, None, f"the key is {type(key).__name__}, not a string", update_time_us)
    if not key:
        return Unpublishable(entry_id, None, "the key is empty", update_time_us)

    def bad(reason: str) -> Unpublishable:
        return Unpublishable(entry_id, key, reason, update_time_us)

    if rules.ordering_key and _size(key) > MAX_ORDERING_KEY_BYTES:
        return bad(f"the key is over {MAX_ORDERING_KEY_BYTES} bytes, Pub/Sub's limit on an ordering key")
    if _size(key) > MAX_ATTRIBUTE_VALUE_BYTES:
        return bad(f"the key is over {MAX_ATTRIBUTE_VALUE_BYTES} bytes, Pub/Sub's limit on an attribute value")
    data = fields.get("data")
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if not isinstance(data, bytes):
        what = "no data" if data is None else f"data is {type(data).__name__}, not bytes or a string"
        return bad(what)
    attributes = fields.get("attributes")
    if attributes is None:
        attributes = {}
    if not isinstance(attributes, dict):
        return bad(f"attributes is {type(attributes).__name__}, not a map of strings")
    published: dict[str, str] = {}
    for name, value in attributes.items():
        problem = _attribute_problem(name, value, rules)
        if problem:
            return bad(problem)
        published[name] = value
    for name in TRACE_FIELDS:
        value = fields.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or _size(value) > MAX_ATTRIBUTE_VALUE_BYTES:
            return bad(f"{name} is not a string of at most {MAX_ATTRIBUTE_VALUE_BYTES} bytes")
        published[name] = value
    if len(published) + 2 > MAX_ATTRIBUTES:
        return bad(f"more than {MAX_ATTRIBUTES} attributes with the key and sequence attributes")
    topic = _topic(fields.get("topic"), rules)
    if topic is None:
        return bad(f"topic {fields.get('topic')!r} is neither projects/P/topics/T nor a topic id")
    size = len(data) + sum(_size(n) + _size(v) for n, v in published.items())
    size += _size(rules.key_attribute) + _size(key) + _size(rules.sequence_attribute) + 20
    size += _size(key) if rules.ordering_key else 0
    if size > MAX_MESSAGE_BYTES:
        return bad(f"the message is {size} bytes, over Pub/Sub's {MAX_MESSAGE_BYTES} bytes")
    return Entry(entry_id, key, data, published, topic, update_time_us)


def _attribute_problem(name: Any, value: Any, rules: Rules) -> str | None:
    if not isinstance(name, str) or not isinstance(value, str):
        return f"attribute {str(name)[:64]!r} is not a string to a string"
    if name in (rules.key_attribute, rules.sequence_attribute):
        return f"attribute {name!r} is set by the relay (the key and sequence attributes)"
    if name.lower().startswith("goog"):
        return f"attribute {name[:64]!r}: names starting with 'goog' are reserved by Pub/Sub"
    if name in TRACE_FIELDS:
        return f"attribute {name!r}: set the entry's {name} field instead"
    if not name or _size(name) > MAX_ATTRIBUTE_NAME_BYTES:
        return f"attribute name {name[:64]!r} is empty or over {MAX_ATTRIBUTE_NAME_BYTES} bytes"
    if _size(value) > MAX_ATTRIBUTE_VALUE_BYTES:
        return f"attribute {name[:64]!r}: the value is over {MAX_ATTRIBUTE_VALUE_BYTES} bytes"
    return None


def _topic(value: Any, rules: Rules) -> str | None:
    if value is None:
        return rules.topic
    if not isinstance(value, str):
        return None
    try:
        _check_topic(value)
    except ValueError:
        return None
    return value if "/" in value else f"projects/{rules.project}/topics/{value}"


def message(entry: Entry, sequence: int, rules: Rules) -> Message:
    """What ``entry`` is published as at ``sequence``: always the same for the same two."""
    attributes = dict(entry.attributes)
    attributes[rules.key_attribute] = entry.key
    attributes[rules.sequence_attribute] = str(sequence)
    return Message(
        entry.id,
        entry.key,
        sequence,
        entry.update_time_us,
        entry.topic,
        entry.data,
        attributes,
        entry.key if rules.ordering_key else "",
    )
