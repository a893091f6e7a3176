"""What the engine's property tests share: their settings, the op mixes, random streams per mode, and
``_run``, which plays a random lifecycle against ``Harness`` with the guarantees checked at every step.

Settings are deliberate: 300 examples per mode finds off-by-one errors at the edges (a sequence
equal to the cursor, a timestamp equal to the watermark, the last allowed attempt) in a few
seconds; ``derandomize=True`` makes CI runs reproducible (no example database needed), and
``deadline=None`` because the 2-core CI machine is shared with other suites.
"""

from __future__ import annotations

import random

from harness import Harness, seq_message, wm_message
from hypothesis import HealthCheck, settings

from sidecar.engine import EngineConfig, Message

PROPERTY_SETTINGS = settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

_OPS = [
    "store",
    "store",
    "store",
    "take",
    "take",
    "ack",
    "ack",
    "durable",
    "nack",
    "nack_dl",
    "expire",
    "close",
    "tick",
    "watermark",
    "dl_done",
    "crash",
]
_REPLAY_OPS = [*_OPS, "replay", "replay"]
_PAGED_OPS = [*_OPS, "crash", "page", "page", "page"]
"""Recovery by pages (``Harness.pages``): crashes more often, and pages restored between any two steps."""
"""With an operator replaying dead letters (a kept list of its own: the other tests' op sequences, and
so their derandomized examples, stay as they were)."""
_REWIND_OPS = [
    "late",
    "copy",
    "take",
    "take",
    "ack",
    "ack",
    "durable",
    "durable_some",
    "nack_now",
    "nack_now",
    "expire",
    "tick",
    "close",
    "dl_done",
]
"""Gap skips, late arrivals and rewinds together: messages held back until their gap may have been
skipped (``late``), copies of anything stored before (``copy``), nacks that rewind at once, acks made
durable a few at a time and in any order (``durable_some``)."""


def _sequence_stream(
    rng: random.Random, keys: int, per_key: int, dup_rate: float, conflict_rate: float
) -> list[Message]:
    stream = []
    for k in range(keys):
        for seq in range(1, per_key + 1):
            stream.append(seq_message(f"k{k}", seq))
            if rng.random() < dup_rate:
                stream.append(seq_message(f"k{k}", seq))
            if rng.random() < conflict_rate:
                stream.append(seq_message(f"k{k}", seq, variant=1))
    rng.shuffle(stream)
    return stream


def _watermark_stream(rng: random.Random, keys: int, per_key: int, dup_rate: float) -> list[Message]:
    stream = []
    for k in range(keys):
        for i in range(per_key):
            message = wm_message(f"k{k}", rng.randrange(0, 50), f"k{k}-{i}")
            stream.append(message)
            if rng.random() < dup_rate:
                stream.append(message)
    rng.shuffle(stream)
    return stream


def _config(mode: str, **policy: object) -> EngineConfig:
    """The engine config of the property tests: short deadlines and backoffs, ``policy`` drawn."""
    return EngineConfig(
        mode=mode,  # type: ignore[arg-type]
        ack_deadline_ms=100,
        backoff_initial_ms=3,
        backoff_maximum_ms=20,
        **policy,  # type: ignore[arg-type]
    )


def _none_stream(rng: random.Random, count: int) -> list[Message]:
    stream = []
    for i in range(count):
        message = wm_message(f"k{i % 3}", 0, f"id-{i}")
        fingerprint = message.fingerprint
        stream.append(Message(message.key, message.dedup_id, message.message_id, 0, known_fingerprint=fingerprint))
        if rng.random() < 0.3:
            stream.append(stream[-1])
    rng.shuffle(stream)
    return stream


def _run(
    harness: Harness,
    stream: list[Message],
    rng: random.Random,
    steps: int,
    ops: list[str] = _OPS,
    late: list[Message] | None = None,
) -> None:
    """``steps`` operations drawn from ``ops``, then the rest of ``stream`` (and of ``late``, the
    messages held back for the ``late`` operation), a drain and the nothing-lost check."""
    stream = list(stream)
    late = list(late or ())
    for _ in range(steps):
        op = rng.choice(ops)
        if op == "store" and stream:
            harness.store(stream.pop())
        elif op == "late" and late:
            harness.store(late.pop())
        elif op == "copy":
            harness.store_copy(rng.randrange(1000))
        elif op == "durable_some":
            harness.make_acks_durable(rng)
        elif op == "nack_now":
            harness.nack(rng.randrange(100), retry_after_ms=0, dead_letter=False)
        elif op == "take":
            harness.take(rng.choice(["a", "b"]), rng.randrange(1, 4))
        elif op == "ack":
            harness.ack(rng.randrange(100))
        elif op == "durable":
            harness.make_acks_durable()
        elif op == "nack":
            harness.nack(rng.randrange(100), retry_after_ms=rng.choice([None, 0, 5]), dead_letter=False)
        elif op == "nack_dl":
            harness.nack(rng.randrange(100), retry_after_ms=None, dead_letter=rng.random() < 0.3)
        elif op == "expire":
            harness.advance(harness.config.ack_deadline_ms)
        elif op == "close":
            harness.close(rng.choice(["a", "b"]))
        elif op == "tick":
            harness.advance(rng.randrange(1, 40))
        elif op == "watermark":
            harness.advance_watermark(rng.randrange(-5, 60))
        elif op == "dl_done":
            harness.finish_dead_letters()
        elif op == "crash":
            harness.crash_and_recover()
        elif op == "replay":
            harness.replay(rng.randrange(100), copies=rng.choice([1, 1, 2]))
        elif op == "page":
            harness.restore_page(rng.randrange(1, 4))
    while stream or late:
        harness.store((stream or late).pop())
    harness.drain()
    harness.check_nothing_lost()
