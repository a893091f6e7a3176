"""ShardLeases over MemoryDocuments (Firestore's rules in memory): balancing, failover, the local
deadline, bad lease documents, store outages, a wall clock far off, and the constructor's checks.

Time is a ``FakeTime`` shared by the database and the pods (but in the wall-clock test): it moves
only when a test moves it, so a round delayed by a busy machine never runs a lease out behind the
test's back, and every assertion holds however slowly the rounds come."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Sequence

import pytest
from lease_harness import SUB_PATH, FakeTime, Member, OverlapChecker, balanced, pass_time, wait_until

from sidecar.cluster.leases import LeaseLayoutError, ShardLeases
from sidecar.cluster.leases.layout import lease_fields, lease_path
from sidecar.cluster.leases.members import member_path
from sidecar.store import documents as docs
from sidecar.store.api import ShardLost
from sidecar.store.memory_documents import MemoryDocuments

LEASE_MS = 600
SHARDS = 8


async def _noop_gained(shard: int, epoch: int) -> None:
    return None


async def _noop_release(shard: int) -> None:
    return None


def _frozen() -> tuple[FakeTime, MemoryDocuments]:
    clock = FakeTime()
    return clock, MemoryDocuments(clock_us=clock.clock_us)


def _member(documents: MemoryDocuments, clock: FakeTime, name: str, shards: int = SHARDS) -> Member:
    return Member(documents, name, shards, lease_ms=LEASE_MS, monotonic_ms=clock.monotonic_ms)


def _manager(documents: docs.Documents, **kwargs: object) -> ShardLeases:
    arguments: dict[str, object] = {
        "lease_ms": LEASE_MS,
        "on_gained": _noop_gained,
        "on_lost": lambda shard, epoch: None,
        "before_release": _noop_release,
    }
    arguments.update(kwargs)
    return ShardLeases(documents, SUB_PATH, SHARDS, "pod-a", **arguments)  # type: ignore[arg-type]


async def test_one_manager_takes_every_shard_at_the_read_time_and_keeps_renewing() -> None:
    clock, documents = _frozen()
    member = _member(documents, clock, "pod-a")
    before_us = documents.listen_tick()
    member.start()
    try:
        await wait_until(lambda: len(member.leases.owned()) == SHARDS, "all shards held")
        # One read planned every take: each new document's epoch is that read's time.
        (epoch,) = set(member.leases.owned().values())
        assert before_us <= epoch <= documents.update_time_us(lease_path(SUB_PATH, 0))
        renewals = member.leases.stats.renewals
        await wait_until(lambda: member.leases.stats.renewals >= renewals + 3 * SHARDS, "three more renewal rounds")
        assert member.leases.owned() == dict.fromkeys(range(SHARDS), epoch)
        stored = documents.snapshot()[lease_path(SUB_PATH, 3)]
        assert (stored["owner"], stored["epoch"], stored["wanted_by"], stored["shards"]) == (
            "pod-a",
            epoch,
            "",
            SHARDS,
        )
        assert member.leases.fence(3) == docs.Fence(lease_path(SUB_PATH, 3), {"owner": "pod-a", "epoch": epoch})
        assert [e for e in member.events if e[0] == "lost"] == []
    finally:
        await member.stop()


async def test_three_managers_balance_and_a_fourth_gets_its_share_without_overlap() -> None:
    clock, documents = _frozen()
    members = [_member(documents, clock, f"pod-{i}", 16) for i in range(3)]
    checker = OverlapChecker(members, 16)
    for member in members:
        member.start()
    try:
        await wait_until(lambda: balanced(members, 16), "3 pods balanced over 16 shards (5 or 6 each)")
        newcomer = _member(documents, clock, "pod-3", 16)
        members.append(newcomer)
        newcomer.start()
        await wait_until(lambda: balanced(members, 16), "4 pods balanced over 16 shards (4 each)")
        handed = sum(m.leases.stats.handovers for m in members)
        assert handed >= 4 and newcomer.leases.stats.asks >= 4
    finally:
        for member in members:
            await member.stop()
        await checker.close()


async def test_release_all_drains_then_hands_over_and_a_poked_manager_holds_them_within_a_round() -> None:
    clock, documents = _frozen()
    leaving, staying = (_member(documents, clock, name) for name in ("pod-a", "pod-b"))
    checker = OverlapChecker([leaving, staying], SHARDS)
    leaving.start()
    staying.start()
    try:
        await wait_until(lambda: balanced([leaving, staying], SHARDS), "2 pods balanced")
        held_epochs = leaving.leases.owned()
        held = set(held_epochs)
        drained: list[set[int]] = []

        async def drain(shards: set[int]) -> None:
            # Still held while the runtime drains (its acks need the fence).
            assert set(leaving.leases.owned()) == shards
            drained.append(shards)

        before = len(leaving.events)
        releases, handovers = leaving.leases.stats.releases, leaving.leases.stats.handovers
        await leaving.leases.release_all(drain)
        released = documents.snapshot()
        staying.leases.poke()  # as a Listen on the lease documents would
        await wait_until(lambda: len(staying.leases.owned()) == SHARDS, "the staying pod holds every shard")
        assert drained == [held]
        assert leaving.leases.owned() == {}
        assert sorted(s for what, s, _ in leaving.events[before:] if what == "lost") == sorted(held)
        assert leaving.leases.stats.handovers == handovers + len(held) and leaving.leases.stats.lost == 0
        assert leaving.leases.stats.releases == releases
        # Handed to the successor by name (the only other pod alive), not freed nor left to expire: at a
        # new epoch, then taken by it at a newer one.
        assert all(released[lease_path(SUB_PATH, s)]["owner"] == "pod-b" for s in held)
        assert released[member_path(SUB_PATH, "pod-a")]["left"] is True
        released_epochs = {s: released[lease_path(SUB_PATH, s)]["epoch"] for s in held}
        assert all(released_epochs[s] > e for s, e in held_epochs.items())
        epochs = staying.leases.owned()
        assert all(epochs[s] > e for s, e in released_epochs.items())
    finally:
        await leaving.stop()
        await staying.stop()
        await checker.close()


async def test_run_ends_when_cancelled_just_as_a_poke_wakes_it() -> None:
    """A cancellation that comes as a poke wakes ``run()`` (``release_all`` pokes as it ends, and
    shutdown cancels right after) must end it: on Python 3.11 ``asyncio.wait_for`` swallowed it, and
    ``run()`` went on for good. The poke lands a few loop iterations before the cancellation, for
    each count of iterations the window can take."""
    for iterations in range(4):
        clock, documents = _frozen()
        member = _member(documents, clock, "pod-a")
        member.start()
        try:
            leases = member.leases
            await wait_until(lambda: len(leases.owned()) == SHARDS, "all shards held")  # noqa: B023 (awaited here)
            rounds = member.leases.stats.rounds
            await asyncio.sleep(0.05)  # the round is over: run() waits for the next period or a poke
            assert member.leases.stats.rounds == rounds
            task = member.task
            assert task is not None
            member.leases.poke()
            for _ in range(iterations):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                async with asyncio.timeout(5):
                    await task
        finally:
            member.task = None


async def test_a_killed_manager_loses_its_shards_at_its_deadline_and_the_others_take_them_after_expiry() -> None:
    clock, documents = _frozen()
    members = [_member(documents, clock, f"pod-{i}") for i in range(3)]
    checker = OverlapChecker(members, SHARDS)
    for member in members:
        member.start()
    try:
        await wait_until(lambda: balanced(members, SHARDS), "3 pods balanced")
        victim, survivors = members[0], members[1:]
        held_epochs = victim.leases.owned()
        held = set(held_epochs)
        before = len(victim.events)
        await victim.stop()
        await pass_time(clock, survivors, LEASE_MS + LEASE_MS // 4, LEASE_MS)
        # The timer drops them locally (on_lost) when the safety margin passes, without a round.
        await wait_until(
            lambda: {s for what, s, _ in victim.events[before:] if what == "lost"} == held, "on_lost by timer"
        )
        assert victim.leases.owned() == {}
        await wait_until(lambda: balanced(survivors, SHARDS), "the survivors hold every shard")
        epochs = {s: e for m in survivors for s, e in m.leases.owned().items()}
        assert all(epochs[s] > e for s, e in held_epochs.items())
    finally:
        for member in members:
            await member.stop()
        await checker.close()


async def test_a_paused_manager_stops_holding_at_its_deadline_before_any_timer_or_round_runs() -> None:
    """A pod frozen past its margin (SIGSTOP, GC): on waking, ``holds`` compares with the clock at once."""
    clock, documents = _frozen()
    member = _member(documents, clock, "pod-a")
    member.start()
    try:
        await wait_until(lambda: len(member.leases.owned()) == SHARDS, "all shards held")
        await member.stop()
        clock.now_ms += LEASE_MS  # the process slept through its lease; no callback has run since
        assert member.leases.owned() == {} and member.leases.holds(0) is None
        with pytest.raises(ShardLost) as raised:
            member.leases.fence(0)
        assert raised.value.shards == frozenset({0})
    finally:
        await member.stop()


async def test_a_paused_manager_restarted_after_others_took_over_learns_it_lost_and_never_overlaps() -> None:
    clock, documents = _frozen()
    members = [_member(documents, clock, f"pod-{i}") for i in range(2)]
    checker = OverlapChecker(members, SHARDS)
    for member in members:
        member.start()
    try:
        await wait_until(lambda: balanced(members, SHARDS), "2 pods balanced")
        paused, other = members
        held = paused.leases.owned()
        before = len(paused.events)
        await paused.stop()
        await pass_time(clock, [other], LEASE_MS + LEASE_MS // 4, LEASE_MS)
        await wait_until(lambda: len(other.leases.owned()) == SHARDS, "the other pod took every shard")
        paused.start()
        await wait_until(lambda: balanced(members, SHARDS), "balanced again")
        lost = [(s, e) for what, s, e in paused.events[before:] if what == "lost"]
        assert sorted(lost) == sorted(held.items())
        assert all(e > held.get(s, 0) for s, e in paused.leases.owned().items() if s in held)
    finally:
        for member in members:
            await member.stop()
        await checker.close()


async def test_on_gained_is_awaited_before_the_shard_counts_as_held_and_renewals_go_on_meanwhile() -> None:
    clock, documents = _frozen()
    member = _member(documents, clock, "pod-a", 2)
    member.gain_gate = asyncio.Event()
    member.start()
    try:
        await wait_until(lambda: len([e for e in member.events if e[0] == "gained"]) == 2, "both shards gained")
        renewals = member.leases.stats.renewals
        await wait_until(lambda: member.leases.stats.renewals >= renewals + 4, "renewals while loading")
        assert member.leases.owned() == {} and member.leases.holds(0) is None
        member.gain_gate.set()
        await wait_until(lambda: set(member.leases.owned()) == {0, 1}, "held once loaded")
    finally:
        await member.stop()


async def test_a_fenced_write_refused_by_the_store_drops_the_shard_at_once() -> None:
    clock, documents = _frozen()
    member = _member(documents, clock, "pod-a", 2)
    member.start()
    try:
        await wait_until(lambda: len(member.leases.owned()) == 2, "both held")
        epoch = member.leases.owned()[0]
        member.leases.shard_lost(0, epoch)
        assert member.leases.holds(0) is None and ("lost", 0, epoch) in member.events
        await wait_until(lambda: (member.leases.holds(0) or 0) > epoch, "taken again at a new epoch")
    finally:
        await member.stop()


async def test_store_outage_loses_the_shards_at_the_deadline_then_they_are_taken_again() -> None:
    clock, documents = _frozen()
    member = _member(documents, clock, "pod-a", 2)
    member.start()
    try:
        await wait_until(lambda: len(member.leases.owned()) == 2, "both held")
        held = member.leases.owned()
        real_read = documents.get_versioned

        async def unavailable(paths: Sequence[str]) -> tuple[int, dict[str, docs.Versioned]]:
            raise docs.Unavailable("read: Firestore unavailable (test)")

        documents.get_versioned = unavailable  # type: ignore[method-assign]
        await wait_until(lambda: member.leases.stats.read_failures >= 2, "reads failing")
        assert len(member.leases.owned()) == 2  # still within the margin: time has not moved
        clock.now_ms += LEASE_MS
        assert member.leases.owned() == {}  # owned() answers from the deadline at once
        # The manager drops (and counts) them at its next round or timer.
        await wait_until(lambda: member.leases.stats.lost == 2, "both dropped by the manager")
        documents.get_versioned = real_read  # type: ignore[method-assign]
        await wait_until(
            lambda: all((member.leases.holds(s) or 0) > e for s, e in held.items()), "taken again at new epochs"
        )
    finally:
        await member.stop()


async def test_failed_writes_count_as_renewal_failures_and_the_shards_are_lost_at_the_deadline() -> None:
    clock, documents = _frozen()
    member = _member(documents, clock, "pod-a", 2)
    member.start()
    try:
        await wait_until(lambda: len(member.leases.owned()) == 2, "both held")

        def refuse(kind: str, writes: Sequence[docs.Write]) -> None:
            raise docs.Unavailable("batch write: Firestore unavailable (test)")

        documents.before_write = refuse
        await wait_until(lambda: member.leases.stats.renewal_failures >= 4, "renewals failing")
        assert len(member.leases.owned()) == 2  # still within the margin: time has not moved
        clock.now_ms += LEASE_MS
        assert member.leases.owned() == {}
    finally:
        await member.stop()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"v": 2}, "layout version 2 was written by a newer sidecar"),
        ({"epoch": "7"}, "field 'epoch' is str '7', not a non-negative integer (corrupt)"),
        ({"epoch": -3}, "field 'epoch' is int -3, not a non-negative integer (corrupt)"),
        ({"beat": 2**63 - 1}, "field 'beat' is int 9223372036854775807, not a non-negative integer (corrupt)"),
        ({"owner": None}, "field 'owner' is missing, not a string (corrupt)"),
        ({"shards": 4}, "written with shards=4, this pod is configured with shards=8"),
    ],
)
async def test_a_bad_lease_document_stops_its_shard_only_named_once_and_is_never_overwritten(
    change: dict[str, object], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock, documents = _frozen()
    path = lease_path(SUB_PATH, 5)
    await documents.commit(
        [docs.create(lease_path(SUB_PATH, s), lease_fields(SHARDS, "", 3, 9, LEASE_MS, "")) for s in range(SHARDS)]
    )
    await documents.commit([docs.replace(path, {**lease_fields(SHARDS, "pod-z", 3, 9, LEASE_MS, ""), **change})])
    bad = documents.snapshot()[path]
    caplog.set_level(logging.INFO, logger="sidecar.cluster.leases")
    member = _member(documents, clock, "pod-a")
    member.start()
    try:
        others = set(range(SHARDS)) - {5}
        await wait_until(lambda: set(member.leases.owned()) == others, "every other shard held")
        rounds = member.leases.stats.rounds
        await wait_until(lambda: member.leases.stats.rounds >= rounds + 3, "three more rounds")
        assert member.task is not None and not member.task.done()
        assert set(member.leases.owned()) == others
        assert documents.snapshot()[path] == bad
        blocked = member.leases.blocked()
        assert list(blocked) == [5] and path in blocked[5] and message in blocked[5]
        assert member.leases.stats.counts()["lease_blocked"] == 1
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and path in errors[0] and message in errors[0] and "\n" not in errors[0]
    finally:
        await member.stop()


async def test_lease_documents_that_all_name_another_shard_count_stop_the_subscription_untouched() -> None:
    """This pod's ``sharding.shards`` is the odd one out: refused before it writes any lease document
    (its own member document, written when it joined, is all it wrote)."""
    documents = MemoryDocuments()
    await documents.commit(
        [docs.create(lease_path(SUB_PATH, s), lease_fields(4, "pod-z", 3, 9, LEASE_MS, "")) for s in range(4)]
    )
    before = documents.snapshot()
    manager = _manager(documents)
    with pytest.raises(LeaseLayoutError) as raised:
        await asyncio.wait_for(manager.run(), 5)
    assert "written with shards=4, this pod is configured with shards=8" in str(raised.value)
    assert SUB_PATH in str(raised.value) and "\n" not in str(raised.value)
    after = documents.snapshot()
    assert after.pop(member_path(SUB_PATH, "pod-a"))["incarnation"] == manager.incarnation
    assert after == before


async def test_a_held_shard_whose_document_turns_corrupt_is_dropped_and_left_alone_until_repaired() -> None:
    """Repaired by hand with a low epoch (as from an old copy): taken again above every epoch before."""
    clock, documents = _frozen()
    member = _member(documents, clock, "pod-a", 2)
    member.start()
    path = lease_path(SUB_PATH, 0)
    try:
        await wait_until(lambda: len(member.leases.owned()) == 2, "both held")
        epoch = member.leases.owned()[0]
        await documents.commit([docs.replace(path, {**documents.snapshot()[path], "epoch": -1})])
        await wait_until(lambda: 0 in member.leases.blocked(), "shard 0 blocked")
        assert member.leases.holds(0) is None and ("lost", 0, epoch) in member.events
        bad, renewals = documents.snapshot()[path], member.leases.stats.renewals
        await wait_until(lambda: member.leases.stats.renewals >= renewals + 3, "shard 1 renewed meanwhile")
        assert documents.snapshot()[path] == bad and member.leases.holds(1) is not None
        await documents.commit([docs.replace(path, lease_fields(2, "", 1, 0, LEASE_MS, ""))])
        await wait_until(lambda: (member.leases.holds(0) or 0) > epoch, "taken again at a newer epoch")
        assert member.leases.blocked() == {} and member.leases.stats.blocked == 0
    finally:
        await member.stop()


async def test_a_lease_document_deleted_by_hand_is_recreated_above_every_epoch_it_had() -> None:
    """Epochs never repeat: the deleted document's history is gone, the read's time is not. Each
    epoch is also part of the delivery ids of its engine (prefix, shard, epoch, counter), so this
    pod never hands out one delivery id twice either."""
    clock, documents = _frozen()
    member = _member(documents, clock, "pod-a", 2)
    member.start()
    path = lease_path(SUB_PATH, 0)
    try:
        await wait_until(lambda: len(member.leases.owned()) == 2, "both held")
        epochs = [member.leases.owned()[0]]
        for _ in range(3):  # the epoch moves on a few times (as a fenced write refused would)
            member.leases.shard_lost(0, epochs[-1])
            await wait_until(lambda: (member.leases.holds(0) or 0) > epochs[-1], "taken again")
            epochs.append(member.leases.owned()[0])
        await documents.commit([docs.delete(path)])
        await wait_until(lambda: (member.leases.holds(0) or 0) > epochs[-1], "re-created at a newer epoch")
        assert ("lost", 0, epochs[-1]) in member.events
        gained = [e for what, s, e in member.events if what == "gained" and s == 0]
        assert gained == sorted(set(gained)) and len(gained) == 5
        assert member.leases.blocked() == {}
    finally:
        await member.stop()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shard_count": 0}, "sharding.shards: must be an integer from 1 to 1024, got 0"),
        ({"shard_count": 2000}, "sharding.shards"),
        ({"lease_ms": 100}, "sharding.lease_duration: must be from 300 ms to 600000 ms, got 100 ms"),
        ({"pod_id": " "}, "pod id: must be a non-empty string"),
        ({"sub_path": "/x/"}, "subscription path"),
    ],
)
def test_constructor_refuses_bad_values_naming_them(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"sub_path": SUB_PATH, "shard_count": SHARDS, "pod_id": "pod-a", **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ShardLeases(
            MemoryDocuments(),
            arguments["sub_path"],  # type: ignore[arg-type]
            arguments["shard_count"],  # type: ignore[arg-type]
            arguments["pod_id"],  # type: ignore[arg-type]
            lease_ms=kwargs.get("lease_ms", LEASE_MS),  # type: ignore[arg-type]
            on_gained=_noop_gained,
            on_lost=lambda shard, epoch: None,
            before_release=_noop_release,
        )


async def test_a_wall_clock_minutes_off_changes_nothing_because_nothing_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The database keeps its own clock; the pods' wall clock is 7 minutes ahead and must stay unread."""
    real_time_ns = time.time_ns
    clock, documents = _frozen()
    readers: list[str] = []
    off_ns = 7 * 60 * 10**9

    def far_off_time() -> float:
        readers.append(sys._getframe(1).f_globals.get("__name__", "?"))
        return (real_time_ns() + off_ns) / 1e9

    def far_off_time_ns() -> int:
        readers.append(sys._getframe(1).f_globals.get("__name__", "?"))
        return real_time_ns() + off_ns

    monkeypatch.setattr(time, "time", far_off_time)
    monkeypatch.setattr(time, "time_ns", far_off_time_ns)
    members = [_member(documents, clock, f"pod-{i}") for i in range(2)]
    checker = OverlapChecker(members, SHARDS)
    for member in members:
        member.start()
    try:
        await wait_until(lambda: balanced(members, SHARDS), "2 pods balanced")
        await members[0].stop()
        await pass_time(clock, members[1:], LEASE_MS + LEASE_MS // 4, LEASE_MS)
        await wait_until(lambda: len(members[1].leases.owned()) == SHARDS, "failover after the lease")
    finally:
        for member in members:
            await member.stop()
        await checker.close()
    assert [name for name in readers if name.startswith("sidecar.cluster.leases")] == []
