"""The ``relays:`` section (DESIGN §12): the contract's example, a relay-only file, and bad input as
one line naming the field path and the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config.model import ConfigError, load_config

CONTRACT = """\
project: demo-project
relays:
  - name: orders-out
    outbox: {database: "(default)", collection: outbox}
    topic: projects/demo-project/topics/orders
    key_attribute: order_id          # the published attribute carrying `key`
    sequence: {attribute: seq, start: 1}
    ordering_key: false              # also set Pub/Sub's ordering key to `key`
"""


def relay(**overrides: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": "orders-out",
        "outbox": {"collection": "outbox"},
        "topic": "orders",
        "key_attribute": "order_id",
        "sequence": {"attribute": "seq"},
    }
    entry.update(overrides)
    return entry


def load(tmp_path: Path, data: Any) -> Any:
    path = tmp_path / "sidecar.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return load_config(path, env={})


def test_the_contract_example_is_a_whole_config_file(tmp_path: Path) -> None:
    config = load(tmp_path, CONTRACT)
    assert config.subscriptions == []
    [out] = config.relays
    assert out.name == "orders-out"
    assert (out.outbox.database, out.outbox.collection) == ("(default)", "outbox")
    assert out.topic == "projects/demo-project/topics/orders"
    assert (out.key_attribute, out.sequence.attribute, out.sequence.start) == ("order_id", "seq", 1)
    assert out.ordering_key is False
    assert (out.shards, out.lease_duration_ms, out.max_batch) == (16, 10_000, 499)


def test_a_short_topic_resolves_under_the_project(tmp_path: Path) -> None:
    config = load(
        tmp_path, {"project": "p1", "relays": [relay(topic="orders", sequence={"attribute": "n", "start": 0})]}
    )
    assert config.relays[0].topic == "projects/p1/topics/orders"
    assert config.relays[0].topic_id == "orders"
    assert config.relays[0].sequence.start == 0


def test_relays_beside_subscriptions(tmp_path: Path) -> None:
    sub = {"name": "orders", "subscription": "orders", "ordering": {"mode": "none"}}
    config = load(tmp_path, {"project": "p1", "subscriptions": [sub], "relays": [relay(lease_duration="3s")]})
    assert len(config.subscriptions) == 1
    assert config.relays[0].lease_duration_ms == 3_000


_BAD = [
    ("no outbox", relay(outbox=None), "relays[0].outbox", "expected"),
    ("outbox without collection", relay(outbox={}), "relays[0].outbox.collection", "required"),
    ("nested collection", relay(outbox={"collection": "a/b"}), "relays[0].outbox.collection", "collection id"),
    ("unknown field", relay(ordering_keys=True), "relays[0].ordering_keys", ""),
    ("topic not a topic", relay(topic="projects/p/subscriptions/x"), "relays[0].topic", "topics"),
    ("goog topic", relay(topic="googorders"), "relays[0].topic", "goog"),
    ("no key attribute", relay(key_attribute=None), "relays[0].key_attribute", "expected"),
    ("empty key attribute", relay(key_attribute=""), "relays[0].key_attribute", "empty"),
    ("same attributes", relay(key_attribute="seq"), "relays[0]", "must differ"),
    ("goog attribute", relay(key_attribute="googkey"), "relays[0]", "reserves"),
    ("negative start", relay(sequence={"attribute": "seq", "start": -1}), "relays[0].sequence.start", ""),
    ("string start", relay(sequence={"attribute": "seq", "start": "1"}), "relays[0].sequence.start", "integer"),
    ("ordering key not a bool", relay(ordering_key="yes"), "relays[0].ordering_key", "true or false"),
    ("too many shards", relay(shards=5000), "relays[0].shards", "1024"),
    ("short lease", relay(lease_duration="100ms"), "relays[0].lease_duration", "300ms"),
    ("lease without unit", relay(lease_duration=10), "relays[0].lease_duration", ""),
    ("batch too large", relay(max_batch=500), "relays[0].max_batch", "499"),
    ("bad name", relay(name="orders out"), "relays[0].name", "not a valid name"),
]


@pytest.mark.parametrize(("data", "path", "reason"), [c[1:] for c in _BAD], ids=[c[0] for c in _BAD])
def test_bad_relay_is_one_line_naming_the_field(tmp_path: Path, data: Any, path: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, {"project": "p1", "relays": [data]})
    message = str(info.value)
    assert "\n" not in message
    assert info.value.path == path
    assert reason in info.value.reason


def test_duplicate_relay_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, {"project": "p1", "relays": [relay(), relay(topic="other")]})
    assert info.value.path == "relays[1].name"
    assert "relays[0] has it already" in info.value.reason


@pytest.mark.parametrize(("data", "reason"), [({}, "required (or relays:)"), ({"relays": []}, "required")])
def test_nothing_to_run(tmp_path: Path, data: dict[str, Any], reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, {"project": "p1", **data})
    assert info.value.path == "subscriptions"
    assert reason in info.value.reason
