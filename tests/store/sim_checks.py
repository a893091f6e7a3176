"""The checks of the crash simulation: G1-G3 and liveness, on every write, every delivery and at the end.

Each check reads the simulation (``sim_pods.SimulatedPods`` and what the scenario recorded) and
the documents (``DocumentRecords``), and fails with the guarantee's name (``G1``, ``G2``, ``G3``,
``fencing``, ``liveness``) and the identity that broke it:

- ``check_fenced_write``: after every applied write, no write that advances a key (tombstone,
  cursor, checkpoint) applied unless its writer holds the shard's lease at the epoch it believes.
- ``check_delivery``: G3, nothing delivered after its ack was confirmed; the data is what was
  published; G2, nothing delivered before every earlier message of its key was acked,
  dead-lettered or skipped by policy (or is in flight within the key's window).
- ``check_end`` (after ``drain``): G1, every valid message is confirmed or dead-lettered with a
  reason (or held durably behind a key blocked by its own in-order dead letter); liveness, no key
  waits for a position already finished, and none is blocked but by such a dead letter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sim_world import Identity, Published, identity_of

from sidecar.engine import Deliver
from sidecar.store import documents as docs
from sidecar.store import layout
from sidecar.store.api import DEAD_LETTERED

if TYPE_CHECKING:
    from sim_pods import SimulatedPods


def check_fenced_write(sim: SimulatedPods, writes: Sequence[docs.Write]) -> None:
    """No write that advances a key applies unless its writer holds the shard's lease as it believes."""
    for write in writes:
        fields = write.fields
        if fields is None or not (
            "/keys/" in write.path
            or "/checkpoints/" in write.path
            or ("/messages/" in write.path and fields.get("state") in layout.DONE_STATES)
        ):
            continue
        shard = fields["shard"]
        lease = sim._leases()[shard]
        assert lease == {"owner": f"p{sim.active}", "epoch": sim.life.believed.get(shard)}, (
            f"fencing: p{sim.active} advanced shard {shard} ({write.path}) after its lease changed to {lease}"
        )


def check_delivery(sim: SimulatedPods, delivery: Deliver) -> None:
    message = delivery.message
    ident = identity_of(message)
    assert ident not in sim.confirmed, f"G3: {ident} delivered again after its ack was confirmed"
    assert message.payload is not None and not message.payload.stripped, f"{ident} delivered without its data"
    expected = Published(message.key, message.sequence or 0, int(message.payload.attributes["v"])).incoming()
    assert (message.payload.data, message.fingerprint) == (expected.data, expected.fingerprint), (
        f"{ident} delivered with other data than was published"
    )
    for skipped in delivery.skipped:
        sim.skipped.update((message.key, seq) for seq in range(skipped.first, skipped.last + 1))
    if delivery.late:
        return  # flagged: the app is told it is out of order
    engine = sim._engine_of(message.key)
    assert engine is not None
    in_flight = {
        identity_of(d.message)
        for d in sim.life.outstanding.values()
        if d.message.key == message.key and engine.is_in_flight(d.delivery_id)
    }
    # An app-acked message holds no slot (G2 waits for the app's ack, not for its durability).
    assert len(in_flight) < sim.config.max_in_flight, (
        f"G2: {ident} delivered with {sorted(in_flight)} still in flight (window {sim.config.max_in_flight})"
    )
    assert message.sequence is not None
    finished = sim.records.finished_documents() | sim.expired_tombstones | sim.records.cursor_passed(message.key)
    for seq in range(1, message.sequence):
        before = (message.key, seq)
        resolved = (
            before in finished  # acked durably (confirmed or not), or dead-lettered
            or before in sim.confirmed
            or before in sim.life.accepted
            or before in in_flight
            or before in sim.dead_lettered
            or before in sim.skipped
        )
        assert resolved, f"G2: {ident} delivered before {before} was acked, dead-lettered or skipped"


def check_end(sim: SimulatedPods) -> None:
    """G1 and liveness after ``drain``."""
    blocked = blocked_keys(sim)
    pending = sim.records.pending_documents()
    # Acked by the app durably (an ack made durable just before a crash may never be confirmed;
    # G3 allows that, and it is never delivered again) or dead-lettered durably.
    finished = sim.records.finished_contents() | sim.expired_contents
    for message in sim.published:
        if message.malformed:
            assert any(m is message or m == message for m, _ in sim.dead_letter_topic), "G1: malformed lost"
            continue
        ident = message.identity
        incoming = message.incoming()
        if (message.key, message.seq, incoming.fingerprint) in sim.resolved_contents:
            continue
        if (message.key, message.seq, incoming.fingerprint) in finished:
            continue
        if any(isinstance(m, Published) and m == message for m, reason in sim.dead_letter_topic):
            continue  # a conflicting copy, dead-lettered at ingest
        if ident in sim.expired_tombstones:
            # Another content of this identity finished and its tombstone expired: past the dedup
            # TTL a conflicting copy can no longer be told from a duplicate (documented).
            continue
        if ident in sim.dead_lettered and ident in sim.confirmed:
            continue  # a copy of a finished message whose tombstone expired, dead-lettered below the cursor
        if ident in sim.app_acked and ident in sim.records.cursor_passed(message.key) and ident not in sim.skipped:
            # A fast-path message's ack made durable by a checkpoint (written by another Commit of
            # its shard: a dead letter's, a drop's) just before a crash: never confirmed, never
            # delivered again (G3 allows it); the cursor is its only record.
            continue
        if sim.config.fast_path and ident in sim.confirmed and ident in sim.config.conflicts:
            # Another content of this identity went through the fast path and was acked: no record
            # of its content is left to tell this copy from a duplicate (docs/store.md, documented).
            continue
        assert message.key in blocked and ident in pending, (
            f"G1: {ident} neither confirmed nor dead-lettered (key blocked: {message.key in blocked}, "
            f"pending: {ident in pending})"
        )
    keys = [
        key_status
        for life in sim.lives
        for engine in life.engines.values()
        for key_status in engine.status(sim.now_ms, max_keys=1_000)[1]
    ]
    for key_status in keys:
        if key_status.state == "blocked_dead_letter":
            assert key_status.key in blocked, f"liveness: {key_status.key} blocked without a dead letter"
        assert key_status.state != "waiting_sequence" or (
            (key_status.key, key_status.missing_sequence) in sim.config.unpublished
            and sim.config.on_gap_timeout == "hold"
        ), f"liveness: {key_status.key} waits for {key_status.waiting_for}, already finished or skipped"
    assert not blocked or sim.config.on_dead_letter == "block"


def blocked_keys(sim: SimulatedPods) -> set[str]:
    """Keys stopped by an in-order dead letter of their own under ``block`` (made durable, even
    if a crash came before the process learned that it was)."""
    if sim.config.on_dead_letter != "block":
        return set()
    durable = sim.records.documents_in((DEAD_LETTERED,)) | sim.expired_in_order_dead_letters
    return {key for key, seq in sim.in_order_dead_letters | durable if (key, seq) not in unblocked(sim)}


def unblocked(sim: SimulatedPods) -> set[Identity]:
    """Dead letters an operator passed: those this run saw confirmed, and those the cursor
    documents record (an unblock that applied just before a crash)."""
    recorded = {(fields["key"], seq) for fields in sim.records.cursor_records() for seq in fields.get("unb_seq") or []}
    return sim.confirmed_unblocks | recorded
