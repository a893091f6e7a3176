"""Leases judged by their owners' member documents (``sidecar.cluster.leases.liveness``): properties
of the pure rules with the planner, and the race they exist for, run for real: a pod's late beat
and another pod's take of its leases exclude each other."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from lease_harness import SUB_PATH, FakeTime, Member, wait_until

from sidecar.cluster.leases import planner
from sidecar.cluster.leases.layout import LeaseView, lease_path
from sidecar.cluster.leases.liveness import judged, lapses
from sidecar.cluster.leases.members import MemberView, member_fields, member_path
from sidecar.store import documents as docs
from sidecar.store.memory_documents import MemoryDocuments

PODS = ("me", "p1", "p2")
LEASE_MS = 600


@st.composite
def _world(draw: st.DrawFn) -> tuple[list[LeaseView], dict[str, MemberView], dict[int, int]]:
    shards = draw(st.integers(1, 8))
    members: dict[str, MemberView] = {}
    for pod in PODS:
        state = draw(st.sampled_from(["alive", "expired", "left", "lapsed", "missing"]))
        if state == "missing":
            members[pod] = MemberView(pod, exists=False, read_us=10_000)
            continue
        members[pod] = MemberView(
            pod,
            exists=True,
            incarnation=1,
            lease_ms=LEASE_MS,
            left=state == "left",
            lapsed=state == "lapsed",
            expired=state == "expired",
            update_time_us=5_000,
            read_us=10_000,
        )
    members["me"] = MemberView(
        "me", exists=True, incarnation=1, lease_ms=LEASE_MS, update_time_us=9_000, read_us=10_000
    )
    views = []
    held: dict[int, int] = {}
    for shard in range(shards):
        owner = draw(st.sampled_from(["", *PODS]))
        epoch = draw(st.integers(1, 5))
        views.append(
            LeaseView(
                shard,
                exists=True,
                owner=owner,
                epoch=epoch,
                lease_ms=LEASE_MS,
                wanted_by=draw(st.sampled_from(["", *PODS])),
                expired=draw(st.booleans()),  # the lease document's own expiry: what counts without a member document
                update_time_us=1_000 + shard,
                read_us=10_000,
            )
        )
        if owner == "me" and draw(st.booleans()):
            held[shard] = epoch
    return views, members, held


@settings(max_examples=300)
@given(_world())
def test_a_lease_is_expired_exactly_when_its_owners_member_document_says_so(
    world: tuple[list[LeaseView], dict[str, MemberView], dict[int, int]],
) -> None:
    views, members, _ = world
    for raw, seen in zip(views, judged(views, members), strict=True):
        owner = members.get(raw.owner)
        if raw.owner and owner is not None and owner.exists:
            assert seen.expired == (not owner.alive)
        else:
            assert seen.expired == raw.expired  # free, or no member document: the lease's own expiry
        asker = members.get(raw.wanted_by)
        dead_asker = asker is not None and asker.exists and not asker.alive
        assert seen.wanted_by == ("" if dead_asker else raw.wanted_by)


@settings(max_examples=300)
@given(_world())
def test_no_lease_of_a_living_pod_is_ever_taken_and_every_take_from_a_process_that_may_live_lapses_it(
    world: tuple[list[LeaseView], dict[str, MemberView], dict[int, int]],
) -> None:
    views, members, held = world
    plan = planner.plan(judged(views, members), "me", held, LEASE_MS)
    by_shard = {view.shard: view for view in views}
    lapsing = lapses(plan.writes, by_shard, members, "me")
    in_commits = {w.shard: owner for owner, (_, writes) in lapsing.items() for w in writes}
    for write in plan.writes:
        if write.action is not planner.Action.ACQUIRE:
            assert write.shard not in in_commits
            continue
        owner = by_shard[write.shard].owner
        member = members.get(owner)
        if owner and owner != "me" and member is not None and member.exists:
            assert not member.alive, f"took shard {write.shard} from {owner}, whose member document is alive"
        may_live = bool(owner) and owner != "me" and member is not None and member.exists
        may_live = may_live and member is not None and not (member.left or member.lapsed)
        assert (write.shard in in_commits) == may_live
        if may_live:
            assert in_commits[write.shard] == owner and lapsing[owner][0] is member


class _BeatBeforeCommit(MemoryDocuments):
    """Before the next Commit applies, ``late_beat`` runs: the owner's beat, sent before and applied now."""

    def __init__(self, clock_us: FakeTime) -> None:
        super().__init__(clock_us=clock_us.clock_us)
        self.late_beat: str | None = None
        self.beat_applied: list[int] = []

    async def commit(self, writes: Sequence[docs.Write], fences: Sequence[docs.Fence] = ()) -> None:
        path, self.late_beat = self.late_beat, None
        if path is not None:
            _, found = await self.get_versioned([path])
            fields = dict(found[path].fields or {})
            fields["beat"] += 1
            (status,) = await self.batch_write([docs.compare_and_set(path, fields, found[path].update_time_us)])
            self.beat_applied.append(status[0])
        await super().commit(writes, fences)


async def test_a_late_beat_that_applies_before_the_take_fails_the_take_and_the_owner_keeps_its_leases() -> None:
    """pod-a's member document is read expired by pod-b, which takes pod-a's leases in a Commit that
    lapses it; pod-a's beat applies between pod-b's read and that Commit: the Commit fails whole,
    pod-b sees pod-a alive from then on, and every lease still names pod-a at its epoch."""
    clock = FakeTime()
    documents = _BeatBeforeCommit(clock)
    owner = Member(documents, "pod-a", 4, lease_ms=LEASE_MS, monotonic_ms=clock.monotonic_ms)
    owner.start()
    await wait_until(lambda: len(owner.leases.owned()) == 4, "pod-a holds every shard")
    epochs = owner.leases.owned()
    await owner.stop()  # paused: it beats no more on its own
    clock.now_ms += LEASE_MS + 1  # its member document reads expired from now on
    documents.late_beat = member_path(SUB_PATH, "pod-a")
    taker = Member(documents, "pod-b", 4, lease_ms=LEASE_MS, monotonic_ms=clock.monotonic_ms)
    taker.start()
    try:
        await wait_until(lambda: documents.beat_applied == [docs.OK], "pod-a's beat applied before pod-b's Commit")
        await wait_until(lambda: taker.leases.stats.rounds >= 4, "pod-b's rounds after its take failed")
        assert taker.leases.owned() == {} and taker.leases.stats.takes == 0 and taker.leases.stats.conflicts >= 1
        stored = documents.snapshot()
        assert {
            s: (stored[lease_path(SUB_PATH, s)]["owner"], stored[lease_path(SUB_PATH, s)]["epoch"]) for s in epochs
        } == {s: ("pod-a", e) for s, e in epochs.items()}
        assert stored[member_path(SUB_PATH, "pod-a")]["lapsed"] is False
    finally:
        await taker.stop()


async def test_a_take_that_applies_first_lapses_the_owner_whose_next_beat_fails_and_it_joins_again() -> None:
    clock = FakeTime()
    documents = MemoryDocuments(clock_us=clock.clock_us)
    owner = Member(documents, "pod-a", 4, lease_ms=LEASE_MS, monotonic_ms=clock.monotonic_ms)
    owner.start()
    await wait_until(lambda: len(owner.leases.owned()) == 4, "pod-a holds every shard")
    first = owner.leases.incarnation
    await owner.stop()
    clock.now_ms += LEASE_MS + 1
    taker = Member(documents, "pod-b", 4, lease_ms=LEASE_MS, monotonic_ms=clock.monotonic_ms)
    taker.start()
    try:
        await wait_until(lambda: len(taker.leases.owned()) == 4, "pod-b took every shard")
        lapsed = documents.snapshot()[member_path(SUB_PATH, "pod-a")]
        assert lapsed == member_fields("pod-a", first or 0, "", LEASE_MS, lapsed["beat"], lapsed=True)
        owner.start()  # wakes: its beat can never apply; it joins again as a new incarnation
        await wait_until(
            lambda: owner.leases.incarnation not in (None, first) and owner.task is not None, "pod-a joined again"
        )
        assert {what for what, _, _ in owner.events[-8:] if what == "lost"} <= {"lost"}
        assert documents.snapshot()[member_path(SUB_PATH, "pod-a")]["lapsed"] is False
    finally:
        await taker.stop()
        await owner.stop()
