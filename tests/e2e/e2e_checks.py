"""The guarantees, checked from what the apps saw: G1-G3 in sequence mode for one app or across apps,
per delivery (a confirmed ack is final, every position confirmed), and how long confirmations took.

Rules: a check fails with an ``AssertionError`` that describes each violation (key, sequence, which
app), not only how many; a wait for every position confirmed fails with that description at its
deadline.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence

from e2e_app import App, Seen
from e2e_waits import WAIT_SECONDS, async_wait_until


def check_sequence_guarantees(app: App, expected: Mapping[str, int]) -> None:
    """G1, G2 and G3 for sequence mode, from what the app saw.

    ``expected`` maps each key to its last sequence (1..N published). Nothing lost: every sequence
    seen. Order: sequence s reaches the app only after s - 1 did. Dedup: a delivery never comes
    after the sidecar confirmed an ack of that same message.
    """
    per_key = app.by_key()
    assert set(per_key) == set(expected), f"keys differ: missing {set(expected) - set(per_key)}"
    for key, deliveries in per_key.items():
        delivered: set[int] = set()
        for seen in deliveries:
            assert seen.sequence == 1 or seen.sequence - 1 in delivered, (
                f"key {key!r}: sequence {seen.sequence} delivered before {seen.sequence - 1}: "
                f"{[d.sequence for d in deliveries]}"
            )
            confirmed_at = app.confirmed_at.get((key, seen.sequence, seen.dedup_id))
            assert confirmed_at is None or seen.at < confirmed_at, (
                f"key {key!r}: sequence {seen.sequence} delivered again after its ack was confirmed"
            )
            delivered.add(seen.sequence)
        assert delivered == set(range(1, expected[key] + 1)), f"key {key!r}: saw {sorted(delivered)}"


def check_sequence_guarantees_across(apps: Sequence[App], expected: Mapping[str, int]) -> None:
    """G1, G2 and G3 for sequence mode over several apps, each behind its own sidecar pod.

    Nothing lost: every sequence seen by some app. Order: a delivery of sequence s (s > 1), to any
    app, comes after some app sent its ack of s - 1 (one clock: every app runs in this process).
    Dedup: no delivery, to any app, after the sidecar confirmed an ack of that message to any app.
    """
    acked: dict[tuple[str, int], float] = {}
    confirmed: dict[tuple[str, int, str], float] = {}
    for app in apps:
        for ident, at in app.acked_at.items():
            acked[ident] = min(at, acked.get(ident, at))
        for ident3, at in app.confirmed_at.items():
            confirmed[ident3] = min(at, confirmed.get(ident3, at))
    deliveries = sorted((seen for app in apps for seen in app.seen), key=lambda seen: seen.at)
    per_key: dict[str, set[int]] = defaultdict(set)
    for seen in deliveries:
        if seen.sequence > 1:
            before = acked.get((seen.key, seen.sequence - 1))
            assert before is not None and before <= seen.at, (
                f"key {seen.key!r}: sequence {seen.sequence} delivered (epoch {seen.epoch}) before any app "
                f"acked {seen.sequence - 1}"
            )
        confirmed_at = confirmed.get((seen.key, seen.sequence, seen.dedup_id))
        assert confirmed_at is None or seen.at < confirmed_at, (
            f"key {seen.key!r}: sequence {seen.sequence} delivered again after its ack was confirmed"
        )
        per_key[seen.key].add(seen.sequence)
    assert set(per_key) == set(expected), f"keys differ: missing {sorted(set(expected) - set(per_key))}"
    for key, sequences in per_key.items():
        assert sequences == set(range(1, expected[key] + 1)), f"key {key!r}: saw {sorted(sequences)}"


# ---- checks over several apps, per delivery (issue 27's runs) ---------------------------------------


def check_confirmed_deliveries_are_final(apps: Sequence[App]) -> None:
    """G3 per delivery, across apps (sequence mode): a delivery whose ack the sidecar confirmed is
    the last delivery of its key and sequence anywhere, whichever copy or pod delivers it.

    Stricter than ``check_sequence_guarantees_across`` (no delivery after the confirmation): this
    also refuses a confirmation that arrives for an old delivery after the message was delivered
    again (an ack accepted under an old epoch made durable after a new owner loaded the shard), and
    two confirmed deliveries of one position (a duplicate publish, other message id).
    """
    latest: dict[tuple[str, int], Seen] = {}
    for seen in sorted((seen for app in apps for seen in app.seen), key=lambda seen: seen.at):
        latest[(seen.key, seen.sequence)] = seen
    for app in apps:
        for record in app.acks:
            if record.confirmed_at is None:
                continue
            first = record.seen
            last = latest[(first.key, first.sequence)]
            assert last is first, (
                f"key {first.key!r}: sequence {first.sequence} delivered again (delivery {last.delivery_id}, epoch "
                f"{last.epoch}, {last.at - first.at:+.1f}s) after delivery {first.delivery_id} (epoch {first.epoch}), "
                f"whose ack was confirmed {record.confirmed_at - first.at:+.1f}s after it was delivered"
            )


def check_every_position_confirmed(apps: Sequence[App], expected: Mapping[str, int]) -> None:
    """Every key's 1..N has an ack the sidecar confirmed, at some app; a position missing one is
    described by what became of its acks (confirmation pending, stream ended, or never acked)."""
    confirmed = {(r.seen.key, r.seen.sequence) for app in apps for r in app.acks if r.confirmed_at is not None}
    missing = [
        (key, seq) for key, last in expected.items() for seq in range(1, last + 1) if (key, seq) not in confirmed
    ]
    if not missing:
        return
    now = time.monotonic()
    lines = []
    for key, seq in missing[:20]:
        records = [r for app in apps for r in app.acks if (r.seen.key, r.seen.sequence) == (key, seq)]
        fates = [
            f"delivery {r.seen.delivery_id} (epoch {r.seen.epoch}) acked {now - r.acked_at:.1f}s ago, "
            + (f"stream ended {r.ended_at - r.acked_at:.1f}s after the ack" if r.ended_at else "still unconfirmed")
            for r in records
        ]
        lines.append(f"  {key}#{seq}: " + ("; ".join(fates) or "never acked"))
    raise AssertionError(f"{len(missing)} positions never confirmed:\n" + "\n".join(lines))


def check_acks_confirmed_within(apps: Sequence[App], bound_seconds: float) -> list[float]:
    """Every ack sent on a live stream is confirmed within ``bound_seconds``, unless its stream ended
    within that time (the app then gets the message again, or it was durable: G3 allows either).
    Returns the ack-to-confirmation delays, for the report."""
    now = time.monotonic()
    delays: list[float] = []
    late: list[str] = []
    for app in apps:
        for r in app.acks:
            what = f"{r.seen.key}#{r.seen.sequence} (delivery {r.seen.delivery_id})"
            if r.confirmed_at is not None:
                delays.append(r.confirmed_at - r.acked_at)
                if r.confirmed_at - r.acked_at > bound_seconds:
                    late.append(f"{what}: confirmed {r.confirmed_at - r.acked_at:.1f}s after the ack")
            elif r.ended_at is not None:
                if r.ended_at - r.acked_at > bound_seconds:
                    late.append(f"{what}: unconfirmed while its stream lived {r.ended_at - r.acked_at:.1f}s more")
            elif now - r.acked_at > bound_seconds:
                late.append(f"{what}: unconfirmed {now - r.acked_at:.1f}s after the ack, stream alive")
    assert not late, (
        f"{len(late)} of {sum(len(app.acks) for app in apps)} acks not confirmed within {bound_seconds:.0f}s "
        "while their stream lived:\n  " + "\n  ".join(late[:20])
    )
    return delays


def positions_unconfirmed(apps: Sequence[App], expected: Mapping[str, int]) -> int:
    """How many of every key's 1..N have no ack the sidecar confirmed yet, at any app."""
    confirmed = {(r.seen.key, r.seen.sequence) for app in apps for r in app.acks if r.confirmed_at is not None}
    return sum(1 for key, last in expected.items() for seq in range(1, last + 1) if (key, seq) not in confirmed)


async def async_wait_every_position_confirmed(
    apps: Sequence[App], expected: Mapping[str, int], within_seconds: float = WAIT_SECONDS
) -> None:
    """Wait until every key's 1..N has a confirmed ack; at the deadline, fail describing each
    position still without one (``check_every_position_confirmed``)."""
    try:
        await async_wait_until(
            lambda: not positions_unconfirmed(apps, expected), "every position confirmed", within_seconds
        )
    except AssertionError:
        check_every_position_confirmed(apps, expected)
        raise
