"""Crash simulation under static membership: the lease documents name the pod, and every process
of that pod writes under the same owner name (docs/leases.md, "Member documents and static
membership"). Only the epoch tells the processes apart: a newer incarnation takes the shard back at
a new epoch, and whatever the earlier one still sends under the same name is fenced out.
"""

from __future__ import annotations

from crash_sim import Simulation
from crash_sim_support import _finish
from sim_world import SimConfig, lease_path


def _restart_under_the_same_name(sim: Simulation) -> None:
    """The lease of shard 0 goes to p0 again at a new epoch (its newer incarnation took it back),
    while the earlier incarnation of p0, still running, is not told."""
    sim.step("lose_lease", sim.config.shards)  # arg // shards = 1: with 2 pods, back to p0 at epoch + 1
    assert sim.documents.docs[lease_path(0)]["owner"] == "p0"


def test_a_stale_incarnations_ack_under_the_same_pod_name_is_fenced_out_and_never_confirmed() -> None:
    """p0 delivers k0/1 and its app acks it; before the ack is committed a newer process of p0 takes
    the shard back (epoch 2). The earlier incarnation's Commit names owner p0, as the lease does,
    but epoch 1: refused, nothing of it applies. The newer incarnation loads the shard, delivers
    k0/1 again (never confirmed: G3 allows it), and the run ends with every guarantee checked."""
    sim = Simulation(SimConfig(keys=1, per_key=3, pods=2))
    sim.ingest_all()
    (delivery,) = sim.take()
    assert delivery.message.sequence == 1
    sim.step("app_ack", 0)  # accepted by the earlier incarnation's engine, not yet durable
    _restart_under_the_same_name(sim)
    messages = sim.snapshot_of_messages()
    sim.step("commit_acks", 0)
    assert sim.fenced_writes == 1 and sim.snapshot_of_messages() == messages
    assert ("k0", 1) not in sim.confirmed
    assert sim.take() == [], "the earlier incarnation delivered a shard its name holds at another epoch"
    sim.step("take_over", 0)  # the newer incarnation loads the shard at epoch 2
    assert sim.active == 0 and sim.handovers == 1
    (again,) = sim.take()
    assert again.message.sequence == 1
    sim.ack("k0", 1)
    sim.settle()
    assert ("k0", 1) in sim.confirmed
    _finish(sim)


def test_a_restart_under_the_same_name_after_a_crash_between_writes_keeps_every_guarantee() -> None:
    """kill -9 of p0 in the middle of its ack Commit, then its newer incarnation takes the shard back
    at a new epoch and finishes the key: nothing confirmed is delivered again, nothing is lost."""
    sim = Simulation(SimConfig(keys=1, per_key=3, pods=2))
    sim.ingest_all()
    (delivery,) = sim.take()
    sim.ack("k0", delivery.message.sequence)
    sim.step("arm_crash", 0)  # the next write crashes the process before it applies
    sim.step("commit_acks", 0)
    assert sim.crashes == 1
    _restart_under_the_same_name(sim)
    sim.step("take_over", 0)
    assert sim.active == 0
    _finish(sim)
