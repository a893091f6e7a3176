"""The lease planner on hand-made situations: each rule of its docstring once."""

from __future__ import annotations

from sidecar.cluster.leases.layout import LeaseView
from sidecar.cluster.leases.planner import Action, Mode, fair_share, plan

LEASE_MS = 1_000


def owned(shard: int, owner: str, epoch: int = 1, *, wanted_by: str = "", expired: bool = False) -> LeaseView:
    return LeaseView(shard, True, owner, epoch, 5, LEASE_MS, wanted_by, expired, 1000 + shard)


def free(shard: int) -> LeaseView:
    return LeaseView(shard, False)


def actions(views: list[LeaseView], me: str, held: dict[int, int], mode: Mode = Mode.RUN) -> dict[int, tuple]:
    return {w.shard: (w.action, w.owner, w.epoch, w.wanted_by) for w in plan(views, me, held, LEASE_MS, mode).writes}


def test_fair_share_is_floor_and_ceiling() -> None:
    assert fair_share(16, 3) == (5, 6)
    assert fair_share(16, 4) == (4, 4)
    assert fair_share(2, 3) == (0, 1)


def test_first_pod_creates_every_lease_free_at_the_read_time_then_takes_them_at_a_later_epoch() -> None:
    """Nobody holds a create's epoch: a create planned before a deletion may apply after it."""
    read_us = 1_700_000_000_000_000
    writes = plan([LeaseView(s, False, read_us=read_us) for s in range(4)], "a", {}, LEASE_MS).writes
    assert [(w.action, w.owner, w.epoch, w.update_time_us) for w in writes] == [(Action.CREATE, "", read_us, None)] * 4
    created = [LeaseView(s, True, "", read_us, 0, LEASE_MS, "", True, read_us + s, read_us + 9) for s in range(4)]
    writes = plan(created, "a", {}, LEASE_MS).writes
    assert [(w.action, w.owner, w.epoch, w.update_time_us) for w in writes] == [
        (Action.ACQUIRE, "a", read_us + 9, read_us + s) for s in range(4)
    ]


def test_renewal_bumps_beat_keeps_epoch_and_clears_an_ask_it_does_not_grant() -> None:
    views = [owned(0, "a", 3, wanted_by="b"), owned(1, "b")]
    (write,) = plan(views, "a", {0: 3}, LEASE_MS).writes
    assert (write.action, write.owner, write.epoch, write.beat, write.wanted_by) == (Action.RENEW, "a", 3, 6, "")
    assert write.update_time_us == views[0].update_time_us


def test_pod_above_its_floor_hands_an_asked_shard_to_the_asker_at_the_next_epoch() -> None:
    views = [owned(0, "a", 3, wanted_by="c"), owned(1, "a"), owned(2, "b")]
    assert actions(views, "a", {0: 3, 1: 1}) == {
        0: (Action.HAND_OVER, "c", 4, ""),
        1: (Action.RENEW, "a", 1, ""),
    }


def test_newcomer_asks_pods_above_the_floor_for_what_it_lacks_and_never_asks_twice() -> None:
    views = [owned(s, "a") for s in range(5)] + [owned(s, "b") for s in range(5, 8)] + [owned(8, "d")]
    # 9 shards, 4 pods: floor 2. a can spare 3, b 1, d none; c lacks 2: the most loaded gives first.
    assert actions(views, "c", {}) == {0: (Action.ASK, "a", 1, "c"), 1: (Action.ASK, "a", 1, "c")}
    standing = [owned(0, "a", wanted_by="c"), *views[1:]]
    assert actions(standing, "c", {}) == {1: (Action.ASK, "a", 1, "c")}
    both = [owned(0, "a", wanted_by="c"), owned(1, "a", wanted_by="c"), *views[2:]]
    assert actions(both, "c", {}) == {}


def test_an_ask_on_a_dead_owners_lease_is_written_once_then_the_lease_is_taken_when_expired() -> None:
    asked = [owned(0, "dead", wanted_by="c"), owned(1, "dead", wanted_by="c")]
    assert actions(asked, "c", {}) == {}
    expired = [owned(0, "dead", wanted_by="c", expired=True), owned(1, "dead", wanted_by="c", expired=True)]
    assert actions(expired, "c", {}) == {0: (Action.ACQUIRE, "c", 2, ""), 1: (Action.ACQUIRE, "c", 2, "")}


def test_another_pods_ask_is_not_overwritten() -> None:
    views = [owned(0, "a", wanted_by="b"), *(owned(s, "a") for s in range(1, 6))]
    assert actions(views, "c", {}) == {1: (Action.ASK, "a", 1, "c"), 2: (Action.ASK, "a", 1, "c")}


def test_surplus_above_the_ceiling_is_released_to_free() -> None:
    views = [owned(s, "a") for s in range(3)] + [owned(3, "b")]  # 2 pods: 2 each
    result = actions(views, "a", {0: 1, 1: 1, 2: 1})
    assert result == {0: (Action.RENEW, "a", 1, ""), 1: (Action.RENEW, "a", 1, ""), 2: (Action.RELEASE, "", 2, "")}


def test_a_held_shard_showing_another_owner_or_epoch_is_lost() -> None:
    views = [owned(0, "b", 4), owned(1, "a", 7), owned(2, "a", 2)]
    decided = plan(views, "a", {0: 3, 1: 6, 2: 2}, LEASE_MS)
    assert decided.lost == {0, 1}
    # Shard 1 names this pod at an epoch it does not hold: taken again, at a new epoch.
    assert {w.shard: (w.action, w.epoch) for w in decided.writes} == {1: (Action.ACQUIRE, 8), 2: (Action.RENEW, 2)}


def test_a_lease_naming_this_pod_that_it_does_not_hold_is_taken_at_a_new_epoch() -> None:
    """Handed over to it, or held by an earlier process with this pod id: a write fenced with the
    old epoch must not pass."""
    assert actions([owned(0, "a", 5)], "a", {}) == {0: (Action.ACQUIRE, "a", 6, "")}


def test_draining_renews_only() -> None:
    views = [owned(0, "a", wanted_by="b"), free(1), owned(2, "b")]
    assert actions(views, "a", {0: 1}, Mode.DRAIN) == {0: (Action.RENEW, "a", 1, "b")}


def test_leaving_hands_asked_shards_over_frees_the_rest_and_withdraws_its_own_asks() -> None:
    views = [owned(0, "a", wanted_by="b"), owned(1, "a"), owned(2, "b", wanted_by="a"), owned(3, "a", 9)]
    assert actions(views, "a", {0: 1, 1: 1}, Mode.LEAVE) == {
        0: (Action.HAND_OVER, "b", 2, ""),
        1: (Action.RELEASE, "", 2, ""),
        2: (Action.WITHDRAW, "b", 1, ""),
        3: (Action.RELEASE, "", 10, ""),
    }


def test_leaving_hands_what_nobody_asks_for_to_the_successor_holding_fewest_by_name() -> None:
    """A named owner at once (its Listen pokes it), rather than a free lease every pod races for."""
    views = [owned(0, "a", wanted_by="b"), owned(1, "a"), owned(2, "a"), owned(3, "b"), owned(4, "c"), owned(5, "c")]
    held = {0: 1, 1: 1, 2: 1}

    def heirs(successors: list[str]) -> dict[int, tuple[Action, str]]:
        return {w.shard: (w.action, w.owner) for w in plan(views, "a", held, LEASE_MS, Mode.LEAVE, successors).writes}

    # The asker first; then the successor holding fewest (b holds 1, c 2), ties to the name first alphabetically.
    assert heirs(["b", "c"]) == {0: (Action.HAND_OVER, "b"), 1: (Action.HAND_OVER, "b"), 2: (Action.HAND_OVER, "b")}
    assert heirs(["c", "a"]) == {0: (Action.HAND_OVER, "b"), 1: (Action.HAND_OVER, "c"), 2: (Action.HAND_OVER, "c")}
    assert heirs([]) == {0: (Action.HAND_OVER, "b"), 1: (Action.RELEASE, ""), 2: (Action.RELEASE, "")}
    views[3] = owned(3, "c")  # b holds nothing now, c 3: b gets both
    assert heirs(["c", "b"]) == {0: (Action.HAND_OVER, "b"), 1: (Action.HAND_OVER, "b"), 2: (Action.HAND_OVER, "b")}
    views[4] = owned(4, "b")  # b 1, c 2: b first (2 then), then the tie goes to the name first alphabetically
    assert heirs(["c", "b"]) == {0: (Action.HAND_OVER, "b"), 1: (Action.HAND_OVER, "b"), 2: (Action.HAND_OVER, "b")}


def test_requesters_count_as_live_pods_only_on_unexpired_leases() -> None:
    views = [owned(0, "a", wanted_by="ghost", expired=True), owned(1, "a")]
    assert plan(views, "a", {1: 1}, LEASE_MS).pods == 1
    views = [owned(0, "a", wanted_by="b"), owned(1, "a")]
    assert plan(views, "a", {0: 1, 1: 1}, LEASE_MS).pods == 2


def test_every_change_of_owner_is_at_an_epoch_no_lower_than_the_read_time() -> None:
    """A missing document (first use, or deleted by hand) is created at the read's time; an existing
    one moves to the read time too when its epoch is below it (rewritten by hand with a low epoch)."""
    read_us = 1_700_000_000_000_000
    views = [
        LeaseView(0, False, read_us=read_us),
        LeaseView(1, True, "", 4, 5, LEASE_MS, "", False, read_us - 10, read_us),
        LeaseView(2, True, "", read_us + 7, 5, LEASE_MS, "", False, read_us - 10, read_us),
    ]
    assert actions(views, "a", {}) == {
        0: (Action.CREATE, "", read_us, ""),
        1: (Action.ACQUIRE, "a", read_us, ""),
        2: (Action.ACQUIRE, "a", read_us + 8, ""),
    }
    held = [LeaseView(0, True, "a", 4, 5, LEASE_MS, "b", False, read_us - 10, read_us), owned(1, "a")]
    assert actions(held, "a", {0: 4, 1: 1})[0] == (Action.HAND_OVER, "b", read_us, "")


def test_a_bad_document_is_never_written_a_held_one_is_lost_and_neither_counts_in_the_share() -> None:
    bad = LeaseView(1, True, problem="lease document l/0001: field 'epoch' is int -1, not a non-negative integer")
    views = [owned(0, "a"), bad, owned(2, ""), owned(3, "b")]
    decided = plan(views, "a", {0: 1, 1: 1}, LEASE_MS)
    assert decided.lost == {1}
    # Three readable shards over two pods: a may hold two, so it renews 0 and takes 2; shard 1 is left alone.
    assert {w.shard: w.action for w in decided.writes} == {0: Action.RENEW, 2: Action.ACQUIRE}
    for mode in Mode:
        assert all(w.shard != 1 for w in plan(views, "a", {1: 1}, LEASE_MS, mode).writes)
