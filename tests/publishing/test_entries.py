"""Outbox entries read into what is published (sidecar/publishing/entries.py): the contract's fields,
and every entry that can never be published, with its reason and the key it blocks (if any)."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.publishing.entries import MAX_MESSAGE_BYTES, Entry, Rules, Unpublishable, message, read_entry

RULES = Rules("demo", "projects/demo/topics/orders", "order_id", "seq", ordering_key=True)


def test_the_contract_fields_become_the_message() -> None:
    fields = {
        "key": "456",
        "data": "OrderCreated",
        "attributes": {"type": "OrderCreated"},
        "topic": "audit",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "app_field": 7,
    }
    entry = read_entry("e1", fields, 10, RULES)
    assert isinstance(entry, Entry)
    published = message(entry, 3, RULES)
    assert published.data == b"OrderCreated"
    assert published.topic == "projects/demo/topics/audit"
    assert published.ordering_key == "456"
    assert published.attributes == {
        "type": "OrderCreated",
        "traceparent": fields["traceparent"],
        "order_id": "456",
        "seq": "3",
    }
    assert message(entry, 3, RULES) == published  # a republish is the same message


def test_bytes_data_and_the_default_topic() -> None:
    entry = read_entry("e1", {"key": "k", "data": b"\x00\x01"}, 1, RULES)
    assert isinstance(entry, Entry)
    assert (entry.data, entry.topic, dict(entry.attributes)) == (b"\x00\x01", RULES.topic, {})


_BAD: list[tuple[str, dict[str, Any], str | None, str]] = [
    ("no key", {"data": b"x"}, None, "no key"),
    ("int key", {"key": 456, "data": b"x"}, None, "int, not a string"),
    ("empty key", {"key": "", "data": b"x"}, None, "empty"),
    ("no data", {"key": "k"}, "k", "no data"),
    ("data a number", {"key": "k", "data": 5}, "k", "not bytes or a string"),
    ("too large", {"key": "k", "data": b"x" * MAX_MESSAGE_BYTES}, "k", "over Pub/Sub's"),
    ("sequence attribute", {"key": "k", "data": b"", "attributes": {"seq": "9"}}, "k", "set by the relay"),
    ("key attribute", {"key": "k", "data": b"", "attributes": {"order_id": "k"}}, "k", "set by the relay"),
    ("goog attribute", {"key": "k", "data": b"", "attributes": {"googfoo": "1"}}, "k", "reserved"),
    ("attribute not a string", {"key": "k", "data": b"", "attributes": {"n": 1}}, "k", "not a string"),
    ("attributes not a map", {"key": "k", "data": b"", "attributes": ["a"]}, "k", "not a map"),
    ("long attribute value", {"key": "k", "data": b"", "attributes": {"a": "v" * 1025}}, "k", "1024"),
    ("bad topic", {"key": "k", "data": b"", "topic": "projects/p/subscriptions/s"}, "k", "topic"),
    ("long ordering key", {"key": "k" * 1025, "data": b""}, "k" * 1025, "ordering key"),
]


@pytest.mark.parametrize(("fields", "blocks", "reason"), [c[1:] for c in _BAD], ids=[c[0] for c in _BAD])
def test_an_entry_that_can_never_be_published(fields: dict[str, Any], blocks: str | None, reason: str) -> None:
    entry = read_entry("e1", fields, 1, RULES)
    assert isinstance(entry, Unpublishable)
    assert entry.key == blocks
    assert reason in entry.reason
    assert read_entry("e1", fields, 1, RULES) == entry  # every pod, every restart: the same verdict
