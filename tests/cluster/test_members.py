"""Member documents read strictly, the join decision of a process starting under a pod name, the
document ids pod names become, and the liveness probe against real sockets."""

from __future__ import annotations

import asyncio
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.cluster.leases.members import (
    Join,
    MemberView,
    answers,
    decide_join,
    member_doc_id,
    member_fields,
    member_path,
    read_member,
)
from sidecar.store import documents as docs

PATH = "pubsub-sidecar/orders/members/pod-a"
LEASE_MS = 1000


def _read(fields: dict[str, object] | None, update_us: int | None = 5_000_000, read_us: int = 5_500_000) -> MemberView:
    return read_member(PATH, "pod-a", read_us, docs.Versioned(fields, update_us if fields is not None else None))


def test_a_fresh_member_document_is_read_with_every_field() -> None:
    view = _read(member_fields("pod-a", 7, "10.0.0.5:7100", LEASE_MS, 3))
    assert (view.exists, view.incarnation, view.address, view.beat, view.left, view.expired) == (
        True,
        7,
        "10.0.0.5:7100",
        3,
        False,
        False,
    )
    assert view.problem == "" and view.update_time_us == 5_000_000


def test_expiry_is_judged_on_the_database_clock_only() -> None:
    fields = member_fields("pod-a", 7, "", LEASE_MS, 3)
    assert not _read(fields, update_us=1_000_000, read_us=2_000_000).expired  # exactly one lease: not yet
    assert _read(fields, update_us=1_000_000, read_us=2_000_001).expired


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"v": 2}, "layout version 2 was written by a newer sidecar"),
        ({"v": "1"}, "field 'v' is '1', not an integer"),
        ({"incarnation": -1}, "field 'incarnation' is -1, not a non-negative integer"),
        ({"beat": True}, "field 'beat' is True, not a non-negative integer"),
        ({"address": None}, "field 'address' is None, not a string"),
        ({"left": 0}, "field 'left' is 0, not a boolean"),
        ({"pod": "pod-b"}, "names pod 'pod-b', not 'pod-a'"),
    ],
)
def test_a_bad_member_document_is_a_view_with_its_problem_named(change: dict[str, object], problem: str) -> None:
    view = _read(member_fields("pod-a", 7, "", LEASE_MS, 3) | change)
    assert problem in view.problem and PATH in view.problem
    assert decide_join(view, "") is Join.REFUSE


def test_the_join_decision_for_each_state_of_the_member_document() -> None:
    own = "10.0.0.9:7100"
    assert decide_join(_read(None), own) is Join.TAKE_OVER
    left = member_fields("pod-a", 7, "10.0.0.5:7100", LEASE_MS, 3, left=True)
    assert decide_join(_read(left), own) is Join.TAKE_OVER
    fields = member_fields("pod-a", 7, "10.0.0.5:7100", LEASE_MS, 3)
    assert decide_join(_read(fields, update_us=1_000_000, read_us=2_500_000), own) is Join.TAKE_OVER  # expired
    assert decide_join(_read(fields), own) is Join.PROBE
    # Restarted in the same pod: the address is this process's own, bound by it, so nobody else listens there.
    assert decide_join(_read(fields), "10.0.0.5:7100") is Join.TAKE_OVER
    assert decide_join(_read(member_fields("pod-a", 7, "", LEASE_MS, 3)), own) is Join.WAIT
    assert decide_join(_read(member_fields("pod-a", 7, "", LEASE_MS, 3)), "") is Join.WAIT


@given(
    incarnation=st.integers(0, 2**62),
    read_us=st.integers(0, 2**62),
)
def test_a_new_incarnation_is_above_the_one_read_and_never_below_the_read_time(incarnation: int, read_us: int) -> None:
    view = read_member(PATH, "pod-a", read_us, docs.Versioned(member_fields("pod-a", incarnation, "", 1, 0), 0))
    assert view.next_incarnation > incarnation and view.next_incarnation >= read_us


@given(st.text(min_size=1, max_size=300))
def test_every_pod_name_becomes_one_valid_document_id(pod: str) -> None:
    doc_id = member_doc_id(pod)
    assert "/" not in doc_id and doc_id not in (".", "..") and 0 < len(doc_id.encode()) <= 1500
    assert not (doc_id.startswith("__") and doc_id.endswith("__"))
    assert member_path("root/sub", pod) == f"root/sub/members/{doc_id}"


def test_a_kubernetes_pod_name_is_its_own_document_id() -> None:
    assert member_doc_id("orders-7f9c8d-x2k4q") == "orders-7f9c8d-x2k4q"
    assert member_doc_id("a/b") != member_doc_id("a/c") and member_doc_id("a/b").startswith("sha256-")


async def test_answers_is_true_for_a_listener_and_false_for_a_closed_port_or_a_bad_address() -> None:
    server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert await answers(f"127.0.0.1:{port}")
    finally:
        server.close()
        await server.wait_closed()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    assert not await answers(f"127.0.0.1:{closed}")
    assert not await answers("no-port")
    assert not await answers(":7100")
