"""ShardLeases over FirestoreDocuments against our Firestore emulator (official client, real gRPC):
several managers in one process, each with its own client, as separate pods would have."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from lease_harness import Member, OverlapChecker, balanced, wait_until

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
    staying.leases.poke()  # as a Listen on the lease documents would
    await wait_until(lambda: len(staying.leases.owned()) == 8, "the staying pod holds every shard")
    assert leaving.leases.owned() == {} and leaving.leases.stats.lost == 0
    # Taken from free leases, not after expiry: released (epoch + 1), then taken (epoch + 1).
    epochs = staying.leases.owned()
    assert all(epochs[shard] == epoch + 2 for shard, epoch in held.items())
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
    assert sorted((s, e) for what, s, e in paused.events[before:] if what == "lost") == sorted(held.items())
    await checker.close()
