"""ShardLeases over FirestoreDocuments against our Firestore emulator (official client, real gRPC):
several managers in one process, each with its own client, as separate pods would have.

The emulator keeps the wall clock, so a round the machine delays past the margin really loses its
shard here: every assertion holds whether or not that happened (waits are polls with deadlines;
what must never happen, two holders at once or an epoch going back, is checked all along). The
exact counts live in the MemoryDocuments tests, on a clock that moves only when they move it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from lease_harness import SUB_PATH, Member, OverlapChecker, balanced, wait_until

from sidecar.cluster.leases.layout import lease_path
from sidecar.store import documents as docs
from sidecar.store.firestore import FirestoreDocuments

LEASE_MS = 900
"""Short for the tests, with room for a round on a loaded 2-core machine (the emulator shares this
process): a renewal every 300 ms, a safety margin of 720 ms."""

MemberFactory = Callable[..., Member]


@pytest.fixture
async def make_member(emulator: object) -> AsyncIterator[MemberFactory]:
    """Members on one fresh project, each with its own Firestore client; all stopped and closed at the end."""
    project = f"leases-{uuid.uuid4().hex[:12]}"
    members: list[Member] = []

    def build(name: str, shards: int) -> Member:
        member = Member(FirestoreDocuments(project), name, shards, lease_ms=LEASE_MS)
        members.append(member)
        member.start()
        return member

    try:
        yield build
    finally:
        for member in members:
            await member.stop()
            await member.documents.close()


async def test_three_managers_balance_and_a_new_one_gets_its_share(make_member: MemberFactory) -> None:
    members = [make_member(f"pod-{i}", 8) for i in range(3)]
    checker = OverlapChecker(members, 8)
    await wait_until(lambda: balanced(members, 8), "3 pods balanced over 8 shards (2 or 3 each)")
    members.append(make_member("pod-3", 8))
    await wait_until(lambda: balanced(members, 8), "4 pods balanced over 8 shards (2 each)")
    await checker.close()


async def test_release_all_hands_over_at_once_to_a_poked_manager(make_member: MemberFactory) -> None:
    leaving, staying = make_member("pod-a", 8), make_member("pod-b", 8)
    checker = OverlapChecker([leaving, staying], 8)
    await wait_until(lambda: balanced([leaving, staying], 8), "2 pods balanced")

    async def drain(shards: set[int]) -> None:
        return None

    held = leaving.leases.owned()
    await leaving.leases.release_all(drain)
    _, released = await leaving.documents.get_versioned([lease_path(SUB_PATH, s) for s in held])
    staying.leases.poke()  # as a Listen on the lease documents would
    await wait_until(lambda: len(staying.leases.owned()) == 8, "the staying pod holds every shard")
    assert leaving.leases.owned() == {}
    # Released at a new epoch (or, had a delayed round run a margin out, already taken by the
    # other pod), then taken at a newer one; the leaving pod's name is on none of them.
    moved = {s: released[lease_path(SUB_PATH, s)].fields or {} for s in held}
    assert all(fields["owner"] in ("", "pod-b") and fields["epoch"] > held[s] for s, fields in moved.items())
    epochs = staying.leases.owned()
    assert all(epochs[s] >= fields["epoch"] > held[s] for s, fields in moved.items())
    await checker.close()


async def test_a_killed_manager_loses_its_shards_and_the_others_take_them_after_the_lease(
    make_member: MemberFactory,
) -> None:
    members = [make_member(f"pod-{i}", 6) for i in range(3)]
    checker = OverlapChecker(members, 6)
    await wait_until(lambda: balanced(members, 6), "3 pods balanced")
    victim = members[0]
    held = victim.leases.owned()
    await victim.stop()  # as kill -9: no release
    await wait_until(lambda: balanced(members[1:], 6), "the survivors hold every shard")
    taken = {s: e for m in members[1:] for s, e in m.leases.owned().items()}
    assert all(taken[s] > e for s, e in held.items())
    assert victim.leases.owned() == {}
    await checker.close()


async def test_a_paused_manager_learns_it_lost_its_shards_and_never_holds_one_another_holds(
    make_member: MemberFactory,
) -> None:
    members = [make_member(f"pod-{i}", 6) for i in range(2)]
    checker = OverlapChecker(members, 6)
    await wait_until(lambda: balanced(members, 6), "2 pods balanced")
    paused, other = members
    held = paused.leases.owned()
    before = len(paused.events)
    await paused.stop()
    await wait_until(lambda: len(other.leases.owned()) == 6, "the other pod took every shard")
    assert paused.leases.owned() == {}
    paused.start()
    await wait_until(lambda: balanced(members, 6), "balanced again after the restart")
    # Each shard it held is lost once at the epoch it held (later takes may be lost too, at theirs).
    lost = [(s, e) for what, s, e in paused.events[before:] if what == "lost"]
    assert all(lost.count(item) == 1 for item in held.items())
    await checker.close()


async def test_a_lease_document_deleted_by_hand_is_taken_again_above_every_epoch_it_had(
    make_member: MemberFactory,
) -> None:
    """On Firestore's clock: the re-created document's epoch comes from a read time later than the
    deletion, which is later than every update time the document had, each no lower than its epoch."""
    member = make_member("pod-a", 2)
    await wait_until(lambda: len(member.leases.owned()) == 2, "both held")
    epoch = member.leases.owned()[0]
    await member.documents.commit([docs.delete(lease_path(SUB_PATH, 0))])
    await wait_until(lambda: (member.leases.holds(0) or 0) > epoch, "taken again at a newer epoch")
    assert ("lost", 0, epoch) in member.events and member.leases.stats.creates == 3


async def test_a_corrupt_lease_document_stops_its_shard_only_and_is_never_written(make_member: MemberFactory) -> None:
    member = make_member("pod-a", 2)
    await wait_until(lambda: len(member.leases.owned()) == 2, "both held")
    path = lease_path(SUB_PATH, 1)
    _, found = await member.documents.get_versioned([path])
    await member.documents.commit([docs.replace(path, {**(found[path].fields or {}), "v": 2})])
    _, found = await member.documents.get_versioned([path])
    await wait_until(lambda: list(member.leases.blocked()) == [1], "shard 1 blocked")
    renewals = member.leases.stats.renewals
    await wait_until(lambda: member.leases.stats.renewals >= renewals + 3, "shard 0 renewed meanwhile")
    assert 1 not in member.leases.owned() and path in member.leases.blocked()[1]
    _, after = await member.documents.get_versioned([path])
    assert after[path] == found[path]  # same update time: never written
