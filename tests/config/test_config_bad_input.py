"""Config file, bad input: every bad value or file is refused with one line naming the file, the field
path and the reason (and the field's YAML line); the config error exit prints that line and returns 2;
arbitrary data gives a config or that error.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from config_support import DESIGN_EXAMPLE, error_of, minimal
from hypothesis import given
from hypothesis import strategies as st

from sidecar.config.model import EXIT_CONFIG, ConfigError, config_error_exit, load_config, parse_config

# ---- bad input: one line, field path, reason ------------------------------------------------

BAD_INPUTS: list[tuple[str, Any, str, str]] = [
    # (id, data, expected path, expected fragment of the reason)
    ("unknown top field", {**minimal(), "extra": 1}, "extra", "unknown field"),
    ("unknown subscription field", minimal(ordering_mode="x"), "subscriptions[0].ordering_mode", "unknown field"),
    (
        "unknown deep field",
        minimal(delivery={"backoff": {"initial": "1s", "maxi": "2s"}}),
        "subscriptions[0].delivery.backoff.maxi",
        "allowed: initial, maximum",
    ),
    ("unknown firestore field", {**minimal(), "firestore": {"db": "x"}}, "firestore.db", "unknown field"),
    (
        "wrong type int",
        minimal(delivery={"max_delivery_attempts": "5"}),
        "subscriptions[0].delivery.max_delivery_attempts",
        "expected an integer",
    ),
    (
        "bool for int",
        minimal(delivery={"max_in_flight_per_key": True}),
        "subscriptions[0].delivery.max_in_flight_per_key",
        "expected an integer",
    ),
    ("wrong type str", minimal(name=12), "subscriptions[0].name", "expected a string"),
    ("wrong type section", minimal(delivery=[1]), "subscriptions[0].delivery", "expected a mapping"),
    ("subscriptions not a list", {"project": "p1", "subscriptions": {"a": 1}}, "subscriptions", "expected a list"),
    (
        "zero attempts",
        minimal(delivery={"max_delivery_attempts": 0}),
        "subscriptions[0].delivery.max_delivery_attempts",
        "at least 1",
    ),
    (
        "negative in flight",
        minimal(delivery={"max_in_flight_per_key": -1}),
        "subscriptions[0].delivery.max_in_flight_per_key",
        "at least 1",
    ),
    (
        "zero ack deadline",
        minimal(delivery={"ack_deadline": "0s"}),
        "subscriptions[0].delivery.ack_deadline",
        "longer than 0s",
    ),
    ("zero ttl", minimal(dedup={"ttl": "0ms"}), "subscriptions[0].dedup.ttl", "longer than 0s"),
    (
        "zero outstanding",
        minimal(flow_control={"max_outstanding_messages": 0}),
        "subscriptions[0].flow_control.max_outstanding_messages",
        "at least 1",
    ),
    (
        "bare number duration",
        minimal(delivery={"ack_deadline": 60}),
        "subscriptions[0].delivery.ack_deadline",
        "needs a unit",
    ),
    ("bad duration", minimal(dedup={"ttl": "7 days"}), "subscriptions[0].dedup.ttl", "expected a duration"),
    (
        "backoff inverted",
        minimal(delivery={"backoff": {"initial": "1m", "maximum": "1s"}}),
        "subscriptions[0].delivery.backoff",
        "maximum must be at least initial",
    ),
    ("no mode", minimal(ordering={"key": {"ordering_key": True}}), "subscriptions[0].ordering.mode", "required"),
    ("unknown mode", minimal(ordering={"mode": "fifo"}), "subscriptions[0].ordering.mode", "got 'fifo'"),
    ("ordering not a mapping", minimal(ordering="sequence"), "subscriptions[0].ordering", "expected a mapping"),
    (
        "sequence without key",
        minimal(ordering={"mode": "sequence", "sequence": {"attribute": "seq"}}),
        "subscriptions[0].ordering.key",
        "required in sequence mode",
    ),
    (
        "sequence without sequence",
        minimal(ordering={"mode": "sequence", "key": {"attribute": "k"}}),
        "subscriptions[0].ordering.sequence",
        "required in sequence mode",
    ),
    (
        "sequence without attribute",
        minimal(ordering={"mode": "sequence", "key": {"attribute": "k"}, "sequence": {"start": 1}}),
        "subscriptions[0].ordering.sequence.attribute",
        "required",
    ),
    (
        "watermark without timestamp",
        minimal(ordering={"mode": "watermark", "key": {"ordering_key": True}}),
        "subscriptions[0].ordering.timestamp",
        "required in watermark mode",
    ),
    (
        "watermark without key",
        minimal(ordering={"mode": "watermark", "timestamp": {"source": "publish_time"}}),
        "subscriptions[0].ordering.key",
        "required in watermark mode",
    ),
    (
        "timestamp in sequence mode",
        minimal(
            ordering={
                "mode": "sequence",
                "key": {"attribute": "k"},
                "sequence": {"attribute": "seq"},
                "timestamp": {"source": "publish_time"},
            }
        ),
        "subscriptions[0].ordering.timestamp",
        "not allowed in sequence mode (it belongs to watermark mode)",
    ),
    (
        "sequence in watermark mode",
        minimal(
            ordering={
                "mode": "watermark",
                "key": {"attribute": "k"},
                "timestamp": {"source": "publish_time"},
                "sequence": {"attribute": "seq"},
            }
        ),
        "subscriptions[0].ordering.sequence",
        "not allowed in watermark mode (it belongs to sequence mode)",
    ),
    (
        "gap timeout in none mode",
        minimal(ordering={"mode": "none", "gap_timeout": "5m"}),
        "subscriptions[0].ordering.gap_timeout",
        "not allowed in none mode",
    ),
    (
        "key with both sources",
        minimal(ordering={"mode": "none", "key": {"attribute": "k", "ordering_key": True}}),
        "subscriptions[0].ordering.key",
        "exactly one",
    ),
    (
        "key with no source",
        minimal(ordering={"mode": "none", "key": {}}),
        "subscriptions[0].ordering.key",
        "exactly one",
    ),
    (
        "ordering_key false",
        minimal(ordering={"mode": "none", "key": {"ordering_key": False}}),
        "subscriptions[0].ordering.key",
        "ordering_key: false",
    ),
    (
        "empty attribute name",
        minimal(ordering={"mode": "none", "key": {"attribute": ""}}),
        "subscriptions[0].ordering.key.attribute",
        "must not be empty",
    ),
    (
        "skew with publish_time",
        minimal(ordering={"mode": "watermark", "key": {"attribute": "k"}, "timestamp": {"allowed_skew": "2s"}}),
        "subscriptions[0].ordering.timestamp",
        "allowed_skew applies only",
    ),
    (
        "timestamp source attribute without name",
        minimal(ordering={"mode": "watermark", "key": {"attribute": "k"}, "timestamp": {"source": "attribute"}}),
        "subscriptions[0].ordering.timestamp",
        "needs attribute",
    ),
    (
        "dedup by attribute without name",
        minimal(dedup={"by": "attribute"}),
        "subscriptions[0].dedup",
        "needs attribute",
    ),
    (
        "dedup by message_id with name",
        minimal(dedup={"by": "message_id", "attribute": "e"}),
        "subscriptions[0].dedup",
        "exclusive",
    ),
    (
        "bad literal",
        minimal(delivery={"on_dead_letter": "drop"}),
        "subscriptions[0].delivery.on_dead_letter",
        "'block' or 'skip'",
    ),
    (
        "zero gap timeout",
        minimal(
            ordering={
                "mode": "sequence",
                "key": {"attribute": "k"},
                "sequence": {"attribute": "s"},
                "gap_timeout": "0s",
            }
        ),
        "subscriptions[0].ordering.gap_timeout",
        "longer than 0s",
    ),
    (
        "negative start",
        minimal(ordering={"mode": "sequence", "key": {"attribute": "k"}, "sequence": {"attribute": "s", "start": -1}}),
        "subscriptions[0].ordering.sequence.start",
        "at least 0",
    ),
    (
        "duplicate names",
        {"project": "p1", "subscriptions": [minimal()["subscriptions"][0]] * 2},
        "subscriptions[1].name",
        "duplicate name 'orders'",
    ),
    ("bad name", minimal(name="a/b"), "subscriptions[0].name", "not a valid name"),
    (
        "bad subscription path",
        minimal(subscription="projects/p/topics/orders"),
        "subscriptions[0].subscription",
        "neither",
    ),
    ("short id too short", minimal(subscription="ab"), "subscriptions[0].subscription", "3-255"),
    ("goog prefix", minimal(subscription="googorders"), "subscriptions[0].subscription", "goog"),
    (
        "bad topic",
        minimal(dead_letter_topic="projects/p/subscriptions/x"),
        "subscriptions[0].dead_letter_topic",
        "topics",
    ),
    ("no subscriptions", {"project": "p1"}, "subscriptions", "required"),
    ("empty subscriptions", {"project": "p1", "subscriptions": []}, "subscriptions", "must not be empty"),
    ("bad listen", {**minimal(), "listen": "localhost"}, "listen", "HOST:PORT"),
    ("relative unix socket", {**minimal(), "listen": "unix:sidecar.sock"}, "listen", "unix:///absolute/path"),
    ("unbracketed ipv6", {**minimal(), "listen": "::1:50051"}, "listen", "brackets"),
    ("port out of range", {**minimal(), "http": "127.0.0.1:70000"}, "http", "0..65535"),
    ("bad firestore root", {**minimal(), "firestore": {"root": "a/b"}}, "firestore.root", "collection id"),
    (
        "bad size",
        minimal(flow_control={"max_outstanding_bytes": "100 MiB"}),
        "subscriptions[0].flow_control.max_outstanding_bytes",
        "expected a size",
    ),
    (
        "lease extension too short",
        minimal(flow_control={"max_lease_extension": "5s"}),
        "subscriptions[0].flow_control.max_lease_extension",
        "between 10s and 600s",
    ),
    (
        "lease extension too long",
        minimal(flow_control={"max_lease_extension": "11m"}),
        "subscriptions[0].flow_control.max_lease_extension",
        "between 10s and 600s",
    ),
    (
        "lease extension fraction",
        minimal(flow_control={"max_lease_extension": "10500ms"}),
        "subscriptions[0].flow_control.max_lease_extension",
        "whole seconds",
    ),
    (
        "lease extension bare number",
        minimal(flow_control={"max_lease_extension": 10}),
        "subscriptions[0].flow_control.max_lease_extension",
        "unit",
    ),
]


@pytest.mark.parametrize(("data", "path", "reason"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_names_the_field_path_and_reason(tmp_path: Path, data: Any, path: str, reason: str) -> None:
    err = error_of(tmp_path, data)
    assert err.path == path
    assert reason in err.reason
    assert str(err).startswith(f"{err.file}: {path}: ")


def test_missing_project_without_environment_says_how_to_set_it(tmp_path: Path) -> None:
    data = minimal()
    del data["project"]
    err = error_of(tmp_path, data)
    assert err.path == "project"
    assert "GOOGLE_CLOUD_PROJECT" in err.reason


def test_error_shows_the_yaml_line_of_the_field(tmp_path: Path) -> None:
    err = error_of(tmp_path, DESIGN_EXAMPLE.replace("max_delivery_attempts: 5", "max_delivery_attempts: five"))
    assert err.path == "subscriptions[0].delivery.max_delivery_attempts"
    assert err.reason.endswith("(line 15)")


def test_more_problems_are_counted_on_the_same_line(tmp_path: Path) -> None:
    err = error_of(tmp_path, minimal(delivery={"max_delivery_attempts": 0, "max_in_flight_per_key": 0}))
    assert "[+1 more]" in err.reason


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "the file is empty"),
        ("# only a comment\n", "the file is empty"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("just text\n", "the top level must be a mapping"),
    ],
)
def test_empty_or_non_mapping_file(tmp_path: Path, text: str, fragment: str) -> None:
    assert fragment in str(error_of(tmp_path, text))


def test_invalid_yaml_reports_line_and_column(tmp_path: Path) -> None:
    err = error_of(tmp_path, "project: p\nsubscriptions: [\n  {name: a\n")
    assert err.path.startswith("line ")
    assert ", column " in err.path
    assert "invalid YAML" in err.reason


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    err = error_of(tmp_path, "project: a\nsubscriptions: []\nproject: b\n")
    assert err.path == "project"
    assert "duplicate key (line 3; first on line 1)" in err.reason


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(tmp_path)  # a directory
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"project: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary)


def test_config_error_exit_prints_one_line_and_returns_2(tmp_path: Path) -> None:
    err = error_of(tmp_path, minimal(delivery={"max_delivery_attempts": 0}))
    stream = io.StringIO()
    assert config_error_exit(err, stream) == EXIT_CONFIG == 2
    output = stream.getvalue()
    assert output.count("\n") == 1
    assert output == f"pubsub-sidecar: {err}\n"


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(
                st.sampled_from(["project", "subscriptions", "name", "ordering", "mode", "key", "x"]), inner, max_size=4
            )
        ),
        max_leaves=12,
    )
)
def test_arbitrary_data_gives_config_error_or_config(data: Any) -> None:
    try:
        parse_config(data)
    except ConfigError as err:
        assert "\n" not in str(err)
