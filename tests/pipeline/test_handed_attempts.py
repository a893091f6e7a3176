"""The attempts a dropped engine made, encoded for the lease write that gives its shard up, and kept
by the process that takes the shard (``shard_engines``: ``handed_attempts``, ``inherit_attempts``)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from sidecar.engine import Engine
from sidecar.engine.types import EngineConfig, Message
from sidecar.pipeline.shard_engines import HANDED_ATTEMPTS_CHARS, ShardEngines, decode_attempts, encode_attempts

_IDENTITIES = st.one_of(
    st.text(max_size=20),
    st.tuples(st.text(max_size=20), st.integers(0, 2**62)),
    st.tuples(st.just("replay"), st.text(max_size=20)),
)


@given(st.dictionaries(_IDENTITIES, st.integers(1, 1_000), max_size=30))
def test_attempts_read_back_as_they_were_encoded(made: dict[object, int]) -> None:
    assert decode_attempts(encode_attempts(made)) == made


def test_the_most_attempted_are_kept_when_the_record_is_cut() -> None:
    made: dict[object, int] = {("k" * 100, n): 1 + n % 7 for n in range(5_000)}
    encoded = encode_attempts(made)
    assert len(encoded) <= HANDED_ATTEMPTS_CHARS
    kept = decode_attempts(encoded)
    assert 0 < len(kept) < len(made)
    assert min(kept.values()) >= max(count for ident, count in made.items() if ident not in kept)


def test_what_cannot_be_read_is_left_out() -> None:
    assert decode_attempts("not json") == {}
    assert decode_attempts('{"d": 1}') == {}
    rows = [["d", "x", 0], ["d", 5, 2], ["s", "k", "1", 2], ["q", "y", 2], [], "d", ["d", "ok", 3]]
    assert decode_attempts(json.dumps(rows)) == {"ok": 3}


def _engine() -> Engine:
    return Engine(EngineConfig(mode="sequence", ack_deadline_ms=1_000), id_prefix="x-")


def _message(seq: int) -> Message:
    return Message("k", f"d{seq}", f"m{seq}", 0, sequence=seq, known_fingerprint=b"f")


def test_a_shard_given_up_hands_its_attempts_to_the_engines_of_another_process() -> None:
    giving = ShardEngines("a-", lambda key: 0)
    engine = _engine()
    giving.add(0, 1, engine, 0)
    assert engine.on_stored(_message(1), 0) == []
    [first] = engine.take("c", 1, 0)
    assert first.attempt == 1
    assert giving.handed_attempts(0) == ""  # nothing until the engine is dropped
    giving.remove(0)
    encoded = giving.handed_attempts(0)
    assert encoded and giving.handed_attempts(0) == encoded  # the same for a retried write

    taking = ShardEngines("b-", lambda key: 0)
    taking.inherit_attempts(0, encoded)
    later = _engine()
    taking.add(0, 2, later, 0)
    assert later.on_stored(taking.with_prior(_message(1)), 0) == []
    [again] = later.take("c", 1, 0)
    assert again.attempt == 2
    # Taken again by the process that gave it up: nothing of the old record is written again.
    giving.add(0, 3, _engine(), 0)
    assert giving.handed_attempts(0) == ""
