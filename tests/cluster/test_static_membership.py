"""Static membership over MemoryDocuments: a process restarted under its pod name takes its own
shards back at once with new epochs, a second process under a living name is refused, a process
whose name was taken over stops, and ``route`` names each shard's owner with its address.

Time is a ``FakeTime`` (``test_manager_memory``): "at once" below means without the clock moving at
all, so no lease ran out for it. The earlier process's address is a real TCP listener (it lives)
or a port that was just closed (a container killed with -9)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest
from lease_harness import SUB_PATH, FakeTime, Member, balanced, pass_time, wait_until

from sidecar.cluster.leases import Route, ShardLeases
from sidecar.cluster.leases.layout import lease_path
from sidecar.cluster.leases.members import MembershipRefused, Superseded, member_fields, member_path
from sidecar.store import documents as docs
from sidecar.store.memory_documents import MemoryDocuments

LEASE_MS = 600
SHARDS = 8


def _frozen() -> tuple[FakeTime, MemoryDocuments]:
    clock = FakeTime()
    return clock, MemoryDocuments(clock_us=clock.clock_us)


@contextlib.asynccontextmanager
async def _listening() -> AsyncIterator[str]:
    """A live process's peer port: a real listener on the loopback interface."""

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


def _closed_address() -> str:
    """A port nothing listens on any more (a killed process's): connecting is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"127.0.0.1:{port}"


def _member(documents: MemoryDocuments, clock: FakeTime, name: str, address: str = "") -> Member:
    return Member(documents, name, SHARDS, lease_ms=LEASE_MS, monotonic_ms=clock.monotonic_ms, address=address)


async def test_a_process_restarted_under_its_pod_name_takes_its_shards_back_at_once_at_new_epochs() -> None:
    """Killed with -9 (nothing released, its member document fresh) and started again in the same
    pod: the address recorded is the new process's own, which it has bound (as the sidecar binds
    its peer port before its leases start), so nobody else can be listening there."""
    clock, documents = _frozen()
    async with _listening() as address:
        first = _member(documents, clock, "pod-a", address=address)
        first.start()
        try:
            await wait_until(lambda: len(first.leases.owned()) == SHARDS, "the first process holds every shard")
            old = first.leases.owned()
            old_incarnation = first.leases.incarnation
        finally:
            await first.stop()
        second = _member(documents, clock, "pod-a", address=address)
        second.start()
        try:
            # The clock never moves: no lease, no member document expired, and nothing waited out.
            await wait_until(lambda: len(second.leases.owned()) == SHARDS, "the restarted process holds every shard")
            assert all(epoch > old[shard] for shard, epoch in second.leases.owned().items())
            assert second.leases.incarnation is not None and old_incarnation is not None
            assert second.leases.incarnation > old_incarnation
            stored = documents.snapshot()[member_path(SUB_PATH, "pod-a")]
            assert (stored["incarnation"], stored["address"], stored["left"]) == (
                second.leases.incarnation,
                address,
                False,
            )
        finally:
            await second.stop()


async def test_a_process_whose_predecessor_recorded_another_address_takes_over_when_nothing_answers_there() -> None:
    """The earlier process of the name ran elsewhere (another address): killed, its port refuses."""
    clock, documents = _frozen()
    dead = _closed_address()
    first = _member(documents, clock, "pod-a", address=dead)
    first.start()
    await wait_until(lambda: len(first.leases.owned()) == SHARDS, "the first process holds every shard")
    old = first.leases.owned()
    await first.stop()
    async with _listening() as address:
        second = _member(documents, clock, "pod-a", address=address)
        second.start()
        try:
            await wait_until(lambda: len(second.leases.owned()) == SHARDS, "the new process holds every shard")
            assert all(epoch > old[shard] for shard, epoch in second.leases.owned().items())
        finally:
            await second.stop()


async def test_a_second_process_under_a_living_pod_name_is_refused_and_the_first_goes_on() -> None:
    clock, documents = _frozen()
    async with _listening() as address:
        first = _member(documents, clock, "pod-a", address=address)
        first.start()
        try:
            await wait_until(lambda: len(first.leases.owned()) == SHARDS, "the first process holds every shard")
            held = first.leases.owned()
            leases_before = {p: f for p, f in documents.snapshot().items() if "/leases/" in p}
            second = _member(documents, clock, "pod-a", address="127.0.0.1:1")
            with pytest.raises(MembershipRefused) as raised:
                await asyncio.wait_for(second.leases.run(), 10)
            assert "'pod-a' is taken" in str(raised.value) and address in str(raised.value)
            assert second.leases.owned() == {} and second.events == []
            assert {p: f for p, f in documents.snapshot().items() if "/leases/" in p} == leases_before
            stored = documents.snapshot()[member_path(SUB_PATH, "pod-a")]
            assert stored["incarnation"] == first.leases.incarnation
            renewals = first.leases.stats.renewals
            await pass_time(clock, [first], LEASE_MS * 2, LEASE_MS)
            assert first.leases.owned() == held and first.leases.stats.renewals > renewals
        finally:
            await first.stop()


async def test_a_refused_process_is_not_settled_and_says_why_at_once() -> None:
    """The start waits on ``settled`` before it pulls: a refused pod name must end that wait at once
    (False, ``failure`` naming the refusal), not after its bound, so that nothing is pulled."""
    clock, documents = _frozen()
    async with _listening() as address:
        first = _member(documents, clock, "pod-a", address=address)
        first.start()
        try:
            await wait_until(lambda: len(first.leases.owned()) == SHARDS, "the first process holds every shard")
            second = _member(documents, clock, "pod-a", address="127.0.0.1:1")
            second.start()
            assert await asyncio.wait_for(second.leases.settled(), 10) is False
            assert isinstance(second.leases.failure, MembershipRefused)
            assert second.task is not None and second.task.done()
            second.task = None  # its failure was read above
        finally:
            await first.stop()


async def test_without_an_address_a_restarted_process_waits_until_the_member_document_expires() -> None:
    """Nothing to ask whether the earlier process lives: only time tells (one lease at most)."""
    clock, documents = _frozen()
    first = _member(documents, clock, "pod-a")
    first.start()
    await wait_until(lambda: len(first.leases.owned()) == SHARDS, "the first process holds every shard")
    await first.stop()
    second = _member(documents, clock, "pod-a")
    second.start()
    try:
        # Rounds never run for the second one while it waits: it has not joined.
        await asyncio.sleep(0)
        for _ in range(20):
            await asyncio.sleep(0.01)
            assert second.leases.incarnation is None and second.leases.stats.rounds == 0
        clock.now_ms += LEASE_MS + 1
        await wait_until(lambda: len(second.leases.owned()) == SHARDS, "taken after the member document expired")
    finally:
        await second.stop()


async def test_a_process_whose_name_was_taken_over_is_fenced_out_then_stops_and_drops_every_shard() -> None:
    """The earlier process was only paused and its probe found nothing (a cut network): the newer one
    takes over at once, so the paused one may still count shards as its own by its margin when it
    wakes, but every write it would make is fenced out (the newer one took them at new epochs), and
    its next round reads its member document naming the newer incarnation: it stops."""
    clock, documents = _frozen()
    dead = _closed_address()
    paused = _member(documents, clock, "pod-a", address=dead)
    paused.start()
    await wait_until(lambda: len(paused.leases.owned()) == SHARDS, "the first process holds every shard")
    await paused.stop()
    newer = _member(documents, clock, "pod-a", address=_closed_address())
    newer.start()
    try:
        await wait_until(lambda: len(newer.leases.owned()) == SHARDS, "the newer process holds every shard")
        for shard in range(SHARDS):
            with pytest.raises(docs.Fenced):
                await documents.commit(
                    [docs.replace(f"{SUB_PATH}/probe/{shard}", {"x": 1})], [paused.leases.fence(shard)]
                )
        with pytest.raises(Superseded) as raised:
            await asyncio.wait_for(paused.leases.run(), 10)
        assert "a newer process runs under this pod name" in str(raised.value)
        assert paused.leases.owned() == {}
        assert {s for what, s, _ in paused.events if what == "lost"} == set(range(SHARDS))
        assert len(newer.leases.owned()) == SHARDS
    finally:
        await newer.stop()


async def test_after_release_all_the_member_document_says_left_and_a_restart_takes_over_without_asking() -> None:
    clock, documents = _frozen()
    async with _listening() as address:
        first = _member(documents, clock, "pod-a", address=address)
        first.start()
        await wait_until(lambda: len(first.leases.owned()) == SHARDS, "the first process holds every shard")

        async def drained(shards: set[int]) -> None:
            return None

        await first.leases.release_all(drained)
        await first.stop()
        assert documents.snapshot()[member_path(SUB_PATH, "pod-a")]["left"] is True
        # Its port still answers (a process that stops later), but it left: nothing to ask.
        second = _member(documents, clock, "pod-a", address=address)
        second.start()
        try:
            await wait_until(lambda: len(second.leases.owned()) == SHARDS, "the restarted process holds every shard")
        finally:
            await second.stop()


async def test_a_member_document_of_a_newer_layout_refuses_the_name_and_is_left_alone() -> None:
    clock, documents = _frozen()
    fields = member_fields("pod-a", 5, "", LEASE_MS, 0) | {"v": 2}
    await documents.commit([docs.create(member_path(SUB_PATH, "pod-a"), fields)])
    member = _member(documents, clock, "pod-a")
    with pytest.raises(MembershipRefused) as raised:
        await asyncio.wait_for(member.leases.run(), 5)
    assert "layout version 2 was written by a newer sidecar" in str(raised.value)
    assert documents.snapshot() == {member_path(SUB_PATH, "pod-a"): fields}


async def test_route_names_each_owner_its_epoch_and_address_and_stays_current() -> None:
    clock, documents = _frozen()
    async with _listening() as address_a, _listening() as address_b:
        members = [_member(documents, clock, "pod-a", address_a), _member(documents, clock, "pod-b", address_b)]
        for member in members:
            member.start()
        try:
            await wait_until(lambda: balanced(members, SHARDS), "2 pods balanced")
            addresses = {"pod-a": address_a, "pod-b": address_b}

            def routes_current() -> bool:
                expected = {
                    shard: Route(m.name, epoch, addresses[m.name])
                    for m in members
                    for shard, epoch in m.leases.owned().items()
                }
                return (
                    all({s: m.leases.route(s) for s in range(SHARDS)} == expected for m in members)
                    and len(expected) == SHARDS
                )

            await wait_until(routes_current, "every pod routes every shard to its owner, with its address")
            await pass_time(clock, members, LEASE_MS * 2, LEASE_MS)
            owners = {s: (m.name, e) for m in members for s, e in m.leases.owned().items()}
            wrong = [
                (m.name, s, m.leases.route(s), owners.get(s))
                for m in members
                for s in range(SHARDS)
                if (lambda r: None if r is None else (r.pod, r.epoch))(m.leases.route(s)) != owners.get(s)
            ]
            assert routes_current(), str(wrong)
        finally:
            for member in members:
                await member.stop()


def test_route_is_none_before_any_round_and_for_a_shard_out_of_range() -> None:
    async def gained(shard: int, epoch: int) -> None:
        return None

    async def release(shard: int) -> None:
        return None

    leases = ShardLeases(
        MemoryDocuments(),
        SUB_PATH,
        SHARDS,
        "pod-a",
        lease_ms=LEASE_MS,
        on_gained=gained,
        on_lost=lambda shard, epoch: None,
        before_release=release,
    )
    assert leases.route(0) is None and leases.route(SHARDS) is None and leases.route(-1) is None
    assert lease_path(SUB_PATH, 0) != member_path(SUB_PATH, "pod-a")
