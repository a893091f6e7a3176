"""Classification: key, position, dedup id and fingerprint, or Malformed naming the attribute."""

from __future__ import annotations

import datetime
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sidecar.config.model import SubscriptionConfig
from sidecar.pipeline.classify import MAX_TIMESTAMP_MS, Malformed, classify, fingerprint
from sidecar.store.api import IncomingMessage

MAX_SEQUENCE = 2**63 - 1


def sub(ordering: dict[str, Any], **extra: Any) -> SubscriptionConfig:
    return SubscriptionConfig.model_validate(
        {"name": "s", "subscription": "projects/p/subscriptions/sub", "ordering": ordering, **extra}
    )


SEQUENCE = sub({"mode": "sequence", "key": {"attribute": "order_id"}, "sequence": {"attribute": "seq"}})
SEQUENCE_ORDERING_KEY = sub({"mode": "sequence", "key": {"ordering_key": True}, "sequence": {"attribute": "seq"}})
SEQUENCE_FROM_0 = sub({"mode": "sequence", "key": {"attribute": "k"}, "sequence": {"attribute": "seq", "start": 0}})
WATERMARK_PUBLISH = sub({"mode": "watermark", "key": {"ordering_key": True}, "timestamp": {"source": "publish_time"}})
WATERMARK_ATTR = sub({"mode": "watermark", "key": {"attribute": "k"}, "timestamp": {"attribute": "ts"}})
NONE = sub({"mode": "none"})
NONE_WITH_KEY = sub({"mode": "none", "key": {"attribute": "k"}})
DEDUP_ATTR = sub({"mode": "none"}, dedup={"attribute": "event_id"})
ALL_CONFIGS = [
    SEQUENCE,
    SEQUENCE_ORDERING_KEY,
    SEQUENCE_FROM_0,
    WATERMARK_PUBLISH,
    WATERMARK_ATTR,
    NONE,
    NONE_WITH_KEY,
    DEDUP_ATTR,
]


def run(
    config: SubscriptionConfig,
    attributes: dict[str, str],
    *,
    data: bytes = b"payload",
    ordering_key: str = "",
    message_id: str = "m-1",
    publish_time_ms: int = 1_700_000_000_123,
) -> IncomingMessage | Malformed:
    return classify(config, data, attributes, ordering_key, message_id, publish_time_ms)


def ok(result: IncomingMessage | Malformed) -> IncomingMessage:
    assert isinstance(result, IncomingMessage), result
    return result


def bad(result: IncomingMessage | Malformed) -> str:
    assert isinstance(result, Malformed), result
    return result.reason


# ---- sequence mode ---------------------------------------------------------------------------


def test_sequence_message_is_classified_with_key_sequence_and_ids() -> None:
    message = ok(run(SEQUENCE, {"order_id": "o-1", "seq": "3", "other": "x"}, ordering_key="ok"))
    assert (message.key, message.sequence, message.timestamp_ms) == ("o-1", 3, None)
    assert (message.dedup_id, message.message_id) == ("m-1", "m-1")
    assert message.attributes == {"order_id": "o-1", "seq": "3", "other": "x"}
    assert (message.data, message.ordering_key, message.publish_time_ms) == (b"payload", "ok", 1_700_000_000_123)
    assert len(message.fingerprint) == 16


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("-5", "not a base-10 integer: '-5'"),
        ("1e3", "not a base-10 integer: '1e3'"),
        ("99999999999999999999", "out of range"),
        ("9223372036854775808", "out of range"),
        ("", "not a base-10 integer: ''"),
        (" 3", "not a base-10 integer"),
        ("3 ", "not a base-10 integer"),
        ("3.0", "not a base-10 integer"),
        ("+3", "not a base-10 integer"),
        ("1_000", "not a base-10 integer"),
        ("\u0663", "not a base-10 integer"),  # ARABIC-INDIC DIGIT THREE: int() would accept it
        ("0x10", "not a base-10 integer"),
        ("0", "below the configured start 1"),
        ("9" * 5000, "out of range"),  # longer than int() accepts
    ],
)
def test_bad_sequences_are_malformed_naming_the_attribute(value: str, fragment: str) -> None:
    reason = bad(run(SEQUENCE, {"order_id": "o", "seq": value}))
    assert "'seq'" in reason
    assert fragment in reason
    assert len(reason) < 200


def test_missing_sequence_is_malformed() -> None:
    assert bad(run(SEQUENCE, {"order_id": "o"})) == "sequence attribute 'seq' is missing"


def test_sequence_bounds_and_leading_zeros() -> None:
    assert ok(run(SEQUENCE, {"order_id": "o", "seq": str(MAX_SEQUENCE)})).sequence == MAX_SEQUENCE
    assert ok(run(SEQUENCE, {"order_id": "o", "seq": "007"})).sequence == 7
    assert ok(run(SEQUENCE_FROM_0, {"k": "o", "seq": "0"})).sequence == 0


@pytest.mark.parametrize("key", ["a/b/c", "ключ-🔑", "x" * 2048, "..", "__name__", " "])
def test_any_text_is_a_key(key: str) -> None:
    assert ok(run(SEQUENCE, {"order_id": key, "seq": "1"})).key == key
    assert ok(run(SEQUENCE_ORDERING_KEY, {"seq": "1"}, ordering_key=key)).key == key


def test_missing_or_empty_key_is_malformed_in_ordered_modes() -> None:
    assert bad(run(SEQUENCE, {"seq": "1"})) == "key attribute 'order_id' is missing"
    assert bad(run(SEQUENCE, {"order_id": "", "seq": "1"})) == "key attribute 'order_id' is empty"
    assert "ordering key is empty" in bad(run(SEQUENCE_ORDERING_KEY, {"seq": "1"}, ordering_key=""))
    assert "ordering key is empty" in bad(run(WATERMARK_PUBLISH, {}, ordering_key=""))
    assert "'k'" in bad(run(WATERMARK_ATTR, {"ts": "0"}))


# ---- watermark mode --------------------------------------------------------------------------


def test_watermark_with_publish_time_uses_it_as_timestamp() -> None:
    message = ok(run(WATERMARK_PUBLISH, {}, ordering_key="k", publish_time_ms=1234))
    assert (message.key, message.timestamp_ms, message.sequence) == ("k", 1234, None)


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        ("1970-01-01T00:00:00Z", 0),
        ("2026-03-01T12:00:00Z", 1_772_366_400_000),
        ("2026-03-01T12:00:00.5Z", 1_772_366_400_500),
        ("2026-03-01T12:00:00.123456789Z", 1_772_366_400_123),
        ("2026-03-01t12:00:00z", 1_772_366_400_000),
        ("2026-03-01T14:30:00+02:30", 1_772_366_400_000),
        ("2026-03-01T07:00:00-05:00", 1_772_366_400_000),
        ("2024-02-29T00:00:00Z", 1_709_164_800_000),
        ("9999-12-31T23:59:59.999Z", MAX_TIMESTAMP_MS),
        ("1772366400000", 1_772_366_400_000),
        ("0", 0),
        ("253402300799999", MAX_TIMESTAMP_MS),
    ],
)
def test_timestamp_attribute_forms(value: str, ms: int) -> None:
    assert ok(run(WATERMARK_ATTR, {"k": "a", "ts": value})).timestamp_ms == ms


@pytest.mark.parametrize(
    "value",
    [
        "2026-03-01T12:00:00",  # no zone
        "2026-03-01 12:00:00Z",  # space separator
        "2026-03-01",
        "2026-02-30T00:00:00Z",
        "2026-03-01T24:00:00Z",
        "2026-12-31T23:59:60Z",  # leap second
        "2026-03-01T12:00:00+24:00",
        "2026-03-01T12:00:00+01:60",
        "2026-03-01T12:00:00.Z",
        "2026-03-01T12:00:00.1234567890Z",
        "1969-12-31T23:59:59Z",
        "0001-01-01T00:00:00+01:00",
        "1772366400.5",
        "-1",
        "253402300800000",
        "9" * 5000,
        "",
        "yesterday",
    ],
)
def test_bad_timestamps_are_malformed_naming_the_attribute(value: str) -> None:
    assert "timestamp attribute 'ts'" in bad(run(WATERMARK_ATTR, {"k": "a", "ts": value}))


def test_missing_timestamp_is_malformed() -> None:
    assert bad(run(WATERMARK_ATTR, {"k": "a"})) == "timestamp attribute 'ts' is missing"


# ---- none mode and dedup ---------------------------------------------------------------------


def test_none_mode_key_is_optional() -> None:
    assert ok(run(NONE, {}, ordering_key="ignored")).key == ""
    assert ok(run(NONE_WITH_KEY, {})).key == ""
    assert ok(run(NONE_WITH_KEY, {"k": "v"})).key == "v"
    message = ok(run(NONE, {}))
    assert (message.sequence, message.timestamp_ms) == (None, None)


def test_dedup_id_from_attribute_or_message_id() -> None:
    assert ok(run(DEDUP_ATTR, {"event_id": "e-9"}, message_id="m-7")).dedup_id == "e-9"
    assert ok(run(NONE, {"event_id": "e-9"}, message_id="m-7")).dedup_id == "m-7"
    assert bad(run(DEDUP_ATTR, {})) == "dedup attribute 'event_id' is missing"
    assert bad(run(DEDUP_ATTR, {"event_id": ""})) == "dedup attribute 'event_id' is empty"


# ---- fingerprint -----------------------------------------------------------------------------


def test_fingerprint_ignores_what_pubsub_assigns() -> None:
    first = ok(run(SEQUENCE, {"order_id": "o", "seq": "1"}, message_id="a", publish_time_ms=1))
    retry = ok(run(SEQUENCE, {"seq": "1", "order_id": "o"}, message_id="b", publish_time_ms=2))
    assert first.fingerprint == retry.fingerprint


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((b"x", {}, ""), (b"y", {}, "")),
        ((b"x", {}, ""), (b"x", {}, "k")),
        ((b"x", {"a": "1"}, ""), (b"x", {"a": "2"}, "")),
        ((b"x", {"a": "1"}, ""), (b"x", {"b": "1"}, "")),
        ((b"x", {}, ""), (b"x", {"": ""}, "")),
        ((b"ab", {}, ""), (b"a", {}, "b")),  # length prefixes keep boundaries apart
        ((b"", {"ab": "c"}, ""), (b"", {"a": "bc"}, "")),
    ],
)
def test_fingerprint_covers_data_ordering_key_and_attributes(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert fingerprint(*a) != fingerprint(*b)


def test_the_fingerprint_is_computed_when_first_asked_for_and_kept() -> None:
    # The in-order fast path never asks: a message it takes never pays for the hash.
    incoming = ok(run(SEQUENCE, {"order_id": "o", "seq": "1"}, ordering_key="ok"))
    assert incoming.known_fingerprint is None
    message = incoming.to_message(0, "", volatile=True)
    assert message.known_fingerprint is None
    expected = fingerprint(b"payload", {"order_id": "o", "seq": "1"}, "ok")
    assert (message.fingerprint, message.known_fingerprint) == (expected, expected)
    assert (incoming.fingerprint, incoming.known_fingerprint) == (expected, expected)
    assert message == incoming.to_message(0, "", volatile=True), "equality ignores the kept value"


def test_fingerprint_is_stable_across_versions() -> None:
    # Stored documents keep fingerprints: a new version must compute the very same bytes, or every
    # redelivered copy of a stored message would look like a conflict.
    assert fingerprint(b"hello", {"a": "1", "seq": "7"}, "ok").hex() == "44be30f101204c50997ddb8c114ed37a"


# ---- properties ------------------------------------------------------------------------------

texts = st.text(max_size=30)


@given(
    config=st.sampled_from(ALL_CONFIGS),
    data=st.binary(max_size=64),
    attributes=st.dictionaries(
        st.sampled_from(["order_id", "seq", "k", "ts", "event_id"]) | texts,
        st.sampled_from(["1", "007", "-5", "1e3", "", "2026-03-01T12:00:00Z"]) | texts,
        max_size=6,
    ),
    ordering_key=texts,
    message_id=texts,
    publish_time_ms=st.integers(min_value=0, max_value=MAX_TIMESTAMP_MS),
)
def test_classification_never_raises(
    config: SubscriptionConfig,
    data: bytes,
    attributes: dict[str, str],
    ordering_key: str,
    message_id: str,
    publish_time_ms: int,
) -> None:
    result = classify(config, data, attributes, ordering_key, message_id, publish_time_ms)
    if isinstance(result, Malformed):
        assert result.reason
    else:
        assert result.attributes == attributes
        assert result.data == data


@given(sequence=st.integers(min_value=1, max_value=MAX_SEQUENCE), key=st.text(min_size=1), zeros=st.integers(0, 3))
def test_valid_sequences_round_trip(sequence: int, key: str, zeros: int) -> None:
    message = ok(run(SEQUENCE, {"order_id": key, "seq": "0" * zeros + str(sequence)}))
    assert (message.key, message.sequence) == (key, sequence)


@given(
    moment=st.datetimes(
        min_value=datetime.datetime(1970, 1, 2), max_value=datetime.datetime(9999, 12, 30), timezones=st.just(None)
    ),
    offset_minutes=st.integers(min_value=-23 * 60 - 59, max_value=23 * 60 + 59),
)
@example(moment=datetime.datetime(6326, 1, 1, 0, 0, 0, 999985), offset_minutes=0)
def test_valid_rfc3339_timestamps_round_trip(moment: datetime.datetime, offset_minutes: int) -> None:
    utc = moment.replace(tzinfo=datetime.UTC)
    # Exact integer arithmetic: a float timestamp rounds .999985 s up to the next second far in the future.
    expected_ms = (utc - datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)) // datetime.timedelta(milliseconds=1)
    zone = datetime.timezone(datetime.timedelta(minutes=offset_minutes))
    text = utc.astimezone(zone).isoformat(timespec="microseconds")
    assert ok(run(WATERMARK_ATTR, {"k": "a", "ts": text})).timestamp_ms == expected_ms
    zulu = utc.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert ok(run(WATERMARK_ATTR, {"k": "a", "ts": zulu})).timestamp_ms == expected_ms


@given(ms=st.integers(min_value=0, max_value=MAX_TIMESTAMP_MS))
def test_valid_epoch_millis_round_trip(ms: int) -> None:
    assert ok(run(WATERMARK_ATTR, {"k": "a", "ts": str(ms)})).timestamp_ms == ms


def test_classify_imports_no_google_library() -> None:
    """Classification is pure: a fresh interpreter importing it loads neither Google nor gRPC."""
    code = (
        "import sys, sidecar.pipeline.classify; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('google', 'grpc')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# ---- replays (``pubsub-sidecar dead-letters replay``) -------------------------------------------

REPLAY = {"sidecar_replay_of": "m-original", "sidecar_replay_id": "dl-7"}


def test_a_replay_keeps_its_key_position_dedup_id_and_fingerprint_and_gets_its_replay_id() -> None:
    original = ok(run(SEQUENCE, {"order_id": "o-1", "seq": "4"}, message_id="m-original"))
    replayed = ok(run(SEQUENCE, {"order_id": "o-1", "seq": "4", **REPLAY}, message_id="m-replay"))
    assert (replayed.key, replayed.sequence, replayed.dedup_id) == ("o-1", 4, "m-original")
    assert replayed.fingerprint == original.fingerprint, "the marker is not content"
    assert (replayed.replay_id, replayed.message_id) == ("dl-7", "m-replay")
    assert original.replay_id == ""
    assert replayed.attributes["sidecar_replay_id"] == "dl-7", "the app sees the marker"


def test_a_replay_with_a_dedup_attribute_keeps_that_attribute_as_its_dedup_id() -> None:
    replayed = ok(run(DEDUP_ATTR, {"event_id": "e-9", **REPLAY}, message_id="m-replay"))
    assert (replayed.dedup_id, replayed.replay_id) == ("e-9", "dl-7")


def test_a_replay_ordered_by_publish_time_keeps_its_originals_event_time() -> None:
    marker = {**REPLAY, "sidecar_replay_timestamp_ms": "1700000000000"}
    replayed = ok(run(WATERMARK_PUBLISH, marker, ordering_key="p-1", publish_time_ms=1_800_000_000_000))
    assert (replayed.timestamp_ms, replayed.dedup_id) == (1_700_000_000_000, "m-original")
    by_attribute = ok(run(WATERMARK_ATTR, {"k": "p", "ts": "5000", **marker}))
    assert by_attribute.timestamp_ms == 5000, "an event-time attribute travels with the replay itself"


@pytest.mark.parametrize(
    ("marker", "missing"),
    [
        ({"sidecar_replay_of": "m-original"}, "sidecar_replay_id"),
        ({"sidecar_replay_id": "dl-7"}, "sidecar_replay_of"),
        ({"sidecar_replay_of": "", "sidecar_replay_id": "dl-7"}, "sidecar_replay_of"),
    ],
)
def test_a_half_replay_marker_is_malformed(marker: dict[str, str], missing: str) -> None:
    result = run(SEQUENCE, {"order_id": "o-1", "seq": "4", **marker})
    assert isinstance(result, Malformed) and repr(missing) in result.reason


def test_a_replay_timestamp_that_is_not_one_is_malformed() -> None:
    result = run(WATERMARK_PUBLISH, {**REPLAY, "sidecar_replay_timestamp_ms": "soon"}, ordering_key="p")
    assert isinstance(result, Malformed) and "sidecar_replay_timestamp_ms" in result.reason


# ---- the key of a malformed message (issue 31: `dead-letters list --key` finds it) -------------


@pytest.mark.parametrize(
    ("config", "attributes", "ordering_key", "key"),
    [
        (SEQUENCE, {"order_id": "o-7"}, "", "o-7"),  # no sequence
        (SEQUENCE, {"order_id": "o-7", "seq": "seven"}, "", "o-7"),
        (SEQUENCE_FROM_0, {"k": "o-7", "seq": "1" * 30}, "", "o-7"),
        (SEQUENCE_ORDERING_KEY, {"seq": "-1"}, "ok-7", "ok-7"),
        (WATERMARK_ATTR, {"k": "o-7", "ts": "yesterday"}, "", "o-7"),
        (sub({"mode": "none", "key": {"attribute": "k"}}, dedup={"attribute": "e"}), {"k": "o-7"}, "", "o-7"),
        (SEQUENCE, {"order_id": "o-7", "seq": "4", "sidecar_replay_id": "dl-7"}, "", "o-7"),  # half a marker
    ],
)
def test_a_malformed_message_keeps_its_key_when_the_key_could_be_read(
    config: SubscriptionConfig, attributes: dict[str, str], ordering_key: str, key: str
) -> None:
    result = run(config, attributes, ordering_key=ordering_key)
    assert isinstance(result, Malformed) and result.key == key, result


def test_a_malformed_key_leaves_the_key_empty() -> None:
    for result in (run(SEQUENCE, {"seq": "1"}), run(SEQUENCE_ORDERING_KEY, {"seq": "x"}, ordering_key="")):
        assert isinstance(result, Malformed) and result.key == "", result
