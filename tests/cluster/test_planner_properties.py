"""Pods joining, leaving, dying and pausing, in random interleavings, against one model of the leases.

Now and then an operator deletes a lease document, writes a corrupt one (ill-typed, negative, a newer
layout, another S) or repairs one with an old epoch.

Invariants, checked after every step: no two pods believe they hold one shard at one instant (each
on its own clock, with the 0.8 safety margin; after a change by hand, two may for a moment, at
different epochs); every change of owner writes an epoch above every epoch the shard ever had, even
across deletion and corruption, and a bad document is never written (``Database.apply``). When the
changes stop: within a bounded number of rounds every shard whose document is not bad is held by a
live pod, and every live pod holds floor(S'/P) or ceil(S'/P) of those S' shards.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lease_model import LEASE_MS, Database, Phase, Pod, check_one_holder

from sidecar.cluster.leases.planner import Mode, fair_share

MAX_PODS = 5
SETTLE_ROUNDS = 12
"""Rounds (a third of a lease apart, every live pod once per round) the leases get to settle once
changes stop: a dead pod's leases expire within 3 rounds (4 after an ask); taking them, and the
asks, hand-overs and takes of balancing, need a few more."""

_ACTIONS = ["step"] * 16 + ["round"] * 6 + ["advance"] * 8 + ["join"] * 4 + ["kill", "leave", "pause"] * 2
_ACTIONS += ["delete", "corrupt", "repair"]
"""Weights: mostly pods working and time passing; now and then a change of membership, and rarely
an operator's hand on a lease document."""

_CORRUPTIONS: list[dict[str, object]] = [
    {"epoch": "7"},
    {"epoch": -1},
    {"owner": None},
    {"v": 2},
    {"shards": 99},
]


class Cluster:
    def __init__(self, shard_count: int) -> None:
        self.db = Database(shard_count)
        self.pods: list[Pod] = []
        self.dead: list[str] = []
        self.names = 0

    def join(self, offset_ms: int, rate: float, reuse: bool) -> None:
        """A new pod; or, with ``reuse``, a pod id whose process died comes back (a restarted container)."""
        taken = {pod.name for pod in self.pods}
        name = next((n for n in self.dead if n not in taken), None) if reuse else None
        if name is None:
            self.names += 1
            name = f"pod-{self.names}"
        self.pods.append(Pod(name, offset_ms, rate))

    def step(self, pod: Pod) -> None:
        pod.step(self.db)
        if pod.leaving:
            self.pods.remove(pod)
        self.check()

    def check(self) -> None:
        check_one_holder(self.db, self.pods)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), shard_count=st.integers(1, 12))
def test_leases_stay_exclusive_epochs_never_repeat_and_settle_balanced(data: st.DataObject, shard_count: int) -> None:
    cluster = Cluster(shard_count)
    db = cluster.db
    for _ in range(data.draw(st.integers(0, 120), label="actions")):
        action = data.draw(st.sampled_from(_ACTIONS))
        if action == "join" and len(cluster.pods) < MAX_PODS:
            offset = data.draw(st.integers(0, 10**9))
            rate = data.draw(st.sampled_from([0.95, 1.0, 1.05]))
            cluster.join(offset, rate, data.draw(st.booleans()))
        elif action == "advance":
            db.now_ms += data.draw(st.one_of(st.integers(0, LEASE_MS // 8), st.integers(0, 2 * LEASE_MS)))
        elif not cluster.pods:
            continue
        elif action == "step":
            cluster.step(data.draw(st.sampled_from(cluster.pods)))
            db.now_ms += data.draw(st.sampled_from([0, 0, 10, 50, 150]))
        elif action == "round":
            # One pod's whole round with nothing in between (a quick pod next to a slow one).
            pod = data.draw(st.sampled_from(cluster.pods))
            while pod in cluster.pods and pod.phase is not Phase.IDLE:
                cluster.step(pod)
            for _ in range(4):
                if pod in cluster.pods:
                    cluster.step(pod)
        elif action == "kill":
            # kill -9: the pod does nothing more and believes nothing more.
            pod = data.draw(st.sampled_from(cluster.pods))
            cluster.pods.remove(pod)
            cluster.dead.append(pod.name)
        elif action == "leave":
            # SIGTERM: a draining round, then a leaving one, then the pod is gone.
            running = [pod for pod in cluster.pods if pod.mode is Mode.RUN]
            if running:
                data.draw(st.sampled_from(running)).mode = Mode.DRAIN
        elif action == "pause":
            # Stopped mid-round (planned, or its writes sent but not yet applied) past its lease.
            pod = data.draw(st.sampled_from(cluster.pods))
            for _ in range(data.draw(st.integers(1, 2))):
                if pod in cluster.pods and pod.phase is not Phase.APPLIED:
                    cluster.step(pod)
            db.now_ms += data.draw(st.integers(LEASE_MS // 2, 2 * LEASE_MS))
        elif action == "delete":
            db.delete_by_hand(data.draw(st.integers(0, shard_count - 1)))
        elif action == "corrupt":
            db.corrupt_by_hand(data.draw(st.integers(0, shard_count - 1)), data.draw(st.sampled_from(_CORRUPTIONS)))
        elif action == "repair":
            db.repair_by_hand(data.draw(st.integers(0, shard_count - 1)), data.draw(st.sampled_from([0.0, 0.5, 1.0])))
        cluster.check()

    # Changes stop: pods finish what they were doing; leaving pods leave.
    for pod in list(cluster.pods):
        while pod in cluster.pods and (pod.phase is not Phase.IDLE or pod.mode is not Mode.RUN):
            cluster.step(pod)
    live = cluster.pods
    if not live:
        return
    for round_number in range(SETTLE_ROUNDS):
        for index in range(len(live)):
            live[(index + round_number) % len(live)].round(db)  # each round starts with another pod
            cluster.check()
        db.now_ms += LEASE_MS // 3
    holders = {shard: pod.name for pod in live for shard in pod.believes(db.now_ms)}
    usable = [shard for shard in range(shard_count) if not db.is_bad(shard)]
    assert sorted(holders) == usable, (
        f"after {SETTLE_ROUNDS} rounds shards {sorted(set(usable) - set(holders))} "
        f"have no live holder; leases: {db.docs}"
    )
    if not usable:
        return
    base, ceiling = fair_share(len(usable), len(live))
    counts = {pod.name: len(pod.believes(db.now_ms)) for pod in live}
    assert all(base <= count <= ceiling for count in counts.values()), (
        f"unbalanced after {SETTLE_ROUNDS} rounds: {counts} (share {base}..{ceiling})"
    )
