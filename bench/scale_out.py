"""The scale-out scenario: several sidecar pods on one subscription (shard leases), in one run.

    python -m bench --quick --scenario scale-out

Each pod is a real ``pubsub-sidecar run`` process (``POD_NAME`` pod-0, pod-1, ...) with its own gRPC
port and its own no-op app (``BenchApp``), and the peer channel on (docs/forwarding.md): the run's
shared secret file, its own peer port on 127.0.0.1 advertised as ``advertise_address``, one config
file per pod, kept across the pod's restart. Every fleet of pods gets a fresh subscription and
Firestore root on the run's one emulators process, and is stopped before the next starts, so the
Firestore counters belong to one fleet. Shards: 16; lease 10 s, drain timeout 5 s, except for the
failover (5 s lease). Before any traffic the bench waits until every pod holds its share of the
shards (GetStatus), so nothing measured includes the start-up's balancing.

1. **Throughput, CPU and Firestore operations per message, 1 pod against 3 pods**, each for an
   **in-order** stream (every key's messages published in sequence, no duplicate) and then the
   scenario's usual **shuffled** one (sequence mode, 100 keys, 10% shuffled, 1% duplicated), on keys of
   their own. msg/s = distinct messages delivered / (last delivery - first publish); operations =
   reads + writes + deletes counted by the emulator from the first publish until every app ack is
   durable (lease upkeep included), per distinct message; CPU = user + system seconds of every pod
   over the same window; forwarded per message from the pods' ``pubsub_sidecar_peer_forwarded_total``.
   The lease upkeep inside a window is estimated from the same fleet's idle rate (see 5) times its
   length.
2. **Restart with the same pod name**: steady traffic on the 3-pod fleet; pod 1 is killed with -9
   and started again at once (same config, same ``POD_NAME``: a container restarted in its pod);
   the figure runs from the kill to the first delivery, by the restarted pod's new app, of a key of
   the shards it held (its process start to ready, and ready to that delivery, are in the JSON).
3. **Hand-over on SIGTERM**: the same fleet, steady traffic; pod 1's shards are read from its
   GetStatus, then it gets SIGTERM; the figure runs to the first delivery, by another pod's app, of a
   key of one of those shards; the pod's exit code is reported too.
4. **Failover after kill -9**: a new 3-pod fleet (5 s lease), the same with kill -9.
5. **Idle upkeep**: each fleet idles (apps connected, no traffic) for ``UPKEEP_SECONDS``; the
   emulator's counter deltas / pods / minutes. The 3-pod figure is the one reported.

The goals (issue 29) are checked in ``extra.goals_met``; the table's row is the 3-pod shuffled stream.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.app import BenchApp
from bench.emulators_process import billed_operations
from bench.harness import BenchError, cpu_seconds, wait_until
from bench.pubsub_clients import Outgoing
from bench.run_context import RunContext
from bench.scenarios import Result, Scenario
from bench.sidecar_process import Sidecar, write_sidecar_config
from bench.workload import build_stream, phase_timeout, subscription_entry
from pubsub_sidecar_client.status import get_status
from sidecar.shards import shard_of

SHARDS = 16
PODS = 3
LEASE_SECONDS = 10.0
"""The default lease: the throughput and hand-over fleets run as a user's would."""
FAILOVER_LEASE_SECONDS = 5.0
"""Failover after kill -9 is bounded by the lease: a short one keeps the run short."""
DRAIN_TIMEOUT = "5s"
UPKEEP_SECONDS = 30.0
"""Idle window per fleet: ten lease rounds at the default lease, enough to average out their phase."""
STEADY_RATE_PER_SECOND = 100.0
"""Traffic around a kill or SIGTERM: every shard gets several messages a second, so the first
delivery after a take-over is not waiting for traffic, and far below what three pods can take."""
STEADY_KEYS = 480
STEADY_SECONDS = 20.0
"""Long enough to cover signal + lease expiry + take-over + load with margin."""
BALANCE_TIMEOUT_SECONDS = 90.0
TAKEOVER_TIMEOUT_SECONDS = 60.0


@dataclass
class Fleet:
    """The pods of one subscription, all from one config file; ``apps[i]`` reads from ``pods[i]``."""

    context: RunContext
    subscription: str
    config_name: str
    lease_seconds: float
    pods: list[Sidecar] = field(default_factory=list)
    apps: list[BenchApp] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    """Indexes of the pods still running."""
    keys: int = 100
    """Keys of the throughput streams (the scenario's)."""
    peering: bool = True
    """Each pod runs the peer channel (its own port on 127.0.0.1, the run's shared secret file)."""
    _apps_stopped: set[int] = field(default_factory=set)

    @classmethod
    def create(cls, context: RunContext, scenario: Scenario, tag: str, lease_seconds: float) -> Fleet:
        name = f"{scenario.name}-{tag}"
        subscription = context.pubsub.create(f"{name}-{uuid.uuid4().hex[:8]}")
        return cls(context, subscription, name, lease_seconds, keys=scenario.keys)

    async def start(self, scenario: Scenario, count: int) -> None:
        entry = subscription_entry(scenario, self.subscription)
        entry["sharding"] = {
            "shards": SHARDS,
            "lease_duration": f"{self.lease_seconds:g}s",
            "drain_timeout": DRAIN_TIMEOUT,
        }
        root = f"bench-{self.config_name}-{uuid.uuid4().hex[:6]}"
        secret = self.context.workdir / "peer-secret"
        if self.peering and not secret.exists():
            secret.write_text(uuid.uuid4().hex + "\n")
        for index in range(count):
            # One config per pod: each advertises its own peer port, kept across a restart (static
            # membership recognises the address as this pod's own).
            config = write_sidecar_config(
                self.context.workdir / f"{self.config_name}-pod{index}.yaml",
                root=root,
                subscription=entry,
                peering=_peering_section(secret) if self.peering else None,
            )
            pod = Sidecar(config, {**self.context.emulators.env, "POD_NAME": f"pod-{index}"})
            self.pods.append(pod)
            pod.start()
            self.live.append(index)
        await asyncio.gather(*(asyncio.to_thread(pod.wait_ready) for pod in self.pods))
        for pod in self.pods:
            app = BenchApp(pod.grpc, track_arrivals=True)
            app.start()
            self.apps.append(app)

    async def restart(self, index: int) -> None:
        """Start pod ``index`` again (same config, same ``POD_NAME``) and give it a new app; returns
        once it is ready."""
        pod = self.pods[index]
        pod.start()
        await asyncio.to_thread(pod.wait_ready)
        app = BenchApp(pod.grpc, track_arrivals=True)
        app.start()
        self.apps[index] = app
        self._apps_stopped.discard(index)
        self.live.append(index)

    def peer_counts(self) -> dict[str, float]:
        """The live pods' peer counters summed: forwarded (as sender) and answered (as owner)."""
        return {
            "forwarded": sum(self.pods[i].metric("pubsub_sidecar_peer_forwarded_total") for i in self.live),
            "answered": sum(self.pods[i].metric("pubsub_sidecar_peer_answered_total") for i in self.live),
            "unauthenticated": sum(self.pods[i].metric("pubsub_sidecar_peer_unauthenticated_total") for i in self.live),
        }

    async def shards_of(self, index: int) -> set[int]:
        response = await get_status(self.pods[index].grpc, "bench")
        return {shard.shard for shard in response.subscriptions[0].shards}

    async def wait_balanced(self) -> dict[int, set[int]]:
        """Until the live pods' shards are disjoint, cover every shard and each holds its share."""
        deadline = time.monotonic() + BALANCE_TIMEOUT_SECONDS
        owned: dict[int, set[int]] = {}
        while True:
            owned = {index: await self.shards_of(index) for index in self.live}
            held = sorted(shard for shards in owned.values() for shard in shards)
            floor, ceil = SHARDS // len(self.live), -(-SHARDS // len(self.live))
            if held == list(range(SHARDS)) and all(floor <= len(s) <= ceil for s in owned.values()):
                return owned
            if time.monotonic() > deadline:
                counts = {index: len(shards) for index, shards in owned.items()}
                raise BenchError(
                    f"shards not balanced over pods {self.live} in {BALANCE_TIMEOUT_SECONDS:.0f}s: {counts}"
                )
            await asyncio.sleep(0.2)

    def distinct(self) -> set[str]:
        return set().union(*(app.distinct for app in self.apps))

    async def wait_delivered(self, count: int, within_seconds: float) -> None:
        deadline = time.monotonic() + within_seconds
        while len(self.distinct()) < count:
            if time.monotonic() > deadline:
                raise BenchError(f"the apps got {len(self.distinct())} of {count} messages in {within_seconds:.0f}s")
            await asyncio.sleep(0.05)

    async def wait_acks_durable(self, count: int) -> None:
        def acked() -> bool:
            return sum(self.pods[i].metric("pubsub_sidecar_acked_total") for i in self.live) >= count

        await asyncio.to_thread(wait_until, acked, phase_timeout(count), f"the pods to make {count} acks durable", 0.1)

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(self.pods[i].pid) for i in self.live)

    async def stop_app(self, index: int) -> None:
        if index not in self._apps_stopped:
            self._apps_stopped.add(index)
            await self.apps[index].stop()

    async def stop(self) -> list[int | None]:
        """Stop every app, then every pod (SIGTERM, in turn); returns the exit codes. Idempotent; a
        failure to stop one is printed and the others are still stopped (a loop, not a gather, so
        that each step is known to be done before the next)."""
        codes: list[int | None] = []
        for index in range(len(self.apps)):
            try:
                await self.stop_app(index)
            except Exception as exc:
                print(f"bench: stopping app {index} of {self.config_name}: {exc!r}", file=sys.stderr, flush=True)
        for index, pod in enumerate(self.pods):
            try:
                codes.append(await asyncio.to_thread(pod.stop))
            except Exception as exc:
                codes.append(None)
                print(f"bench: stopping pod {index} of {self.config_name}: {exc!r}", file=sys.stderr, flush=True)
        self.live.clear()
        return codes


def _free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick for port 0, released at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _peering_section(secret_file: Any) -> dict[str, Any]:
    port = _free_port()
    return {"port": port, "advertise_address": f"127.0.0.1:{port}", "secret_file": str(secret_file)}


def _first_arrival(apps: Sequence[BenchApp], shards: set[int], after: float) -> float | None:
    """The earliest delivery after ``after``, by one of ``apps``, of a key of one of ``shards``."""
    return min(
        (at for app in apps for at, key in app.arrivals if at > after and shard_of(key, SHARDS) in shards),
        default=None,
    )


async def _idle_upkeep(fleet: Fleet) -> dict[str, float]:
    """Firestore operations per pod per minute while the fleet idles for ``UPKEEP_SECONDS``."""
    emulators = fleet.context.emulators
    emulators.reset_firestore_counters()
    started = time.monotonic()
    await asyncio.sleep(UPKEEP_SECONDS)  # the measured window itself, not a synchronisation
    counters = emulators.firestore_counters()
    minutes = (time.monotonic() - started) / 60.0
    pods = len(fleet.live)
    per_pod_minute = {name: value / pods / minutes for name, value in counters.items()}
    per_pod_minute["operations"] = billed_operations(counters) / pods / minutes
    return per_pod_minute


async def _stream(fleet: Fleet, order: str, seed: int, upkeep: dict[str, float]) -> dict[str, Any]:
    """One stream through the balanced fleet: ``order`` "in-order" (every key's messages published
    in sequence, no duplicate) or "shuffled" (10% swapped, 1% published twice), on keys of its own."""
    context = fleet.context
    pods = len(fleet.live)
    count = context.sizes.messages
    shuffled = {"shuffled": {}, "in-order": {"shuffled": 0.0, "duplicated": 0.0}}[order]
    stream, distinct = build_stream(count, fleet.keys, "throughput", f"{order}-k-", seed=seed, **shuffled)
    already = len(fleet.distinct())
    acked_before = sum(fleet.pods[i].metric("pubsub_sidecar_acked_total") for i in fleet.live)
    peer_before = fleet.peer_counts()
    context.emulators.reset_firestore_counters()
    window_started = time.monotonic()
    cpu_before = fleet.cpu_seconds()
    started = await asyncio.to_thread(context.pubsub.publish, fleet.subscription, stream)
    await fleet.wait_delivered(already + distinct, phase_timeout(count))
    elapsed = max(app.last_at for app in fleet.apps) - started
    await fleet.wait_acks_durable(int(acked_before) + distinct)
    counters = context.emulators.firestore_counters()
    window_seconds = time.monotonic() - window_started
    cpu_used = fleet.cpu_seconds() - cpu_before
    peer_after = fleet.peer_counts()
    operations = billed_operations(counters)
    lease_estimate = upkeep["operations"] * pods * window_seconds / 60.0
    return {
        "order": order,
        "messages": distinct,
        "published": len(stream),
        "messages_per_second": distinct / elapsed,
        "operations_per_message": operations / distinct,
        "reads_per_message": counters["reads"] / distinct,
        "writes_deletes_per_message": (counters["writes"] + counters["deletes"]) / distinct,
        "lease_operations_estimate": lease_estimate,
        "lease_operations_per_message_estimate": lease_estimate / distinct,
        "window_seconds": window_seconds,
        "firestore": counters,
        "cpu_seconds_per_10k": cpu_used / distinct * 10_000,
        "forwarded_per_message": (peer_after["forwarded"] - peer_before["forwarded"]) / distinct,
    }


async def _throughput(context: RunContext, scenario: Scenario, pods: int) -> tuple[dict[str, Any], Fleet]:
    """Idle upkeep, then an in-order and a shuffled stream, on a new fleet of ``pods``; returns the
    figures and the fleet (still running: the caller stops it)."""
    fleet = Fleet.create(context, scenario, f"{pods}pod", LEASE_SECONDS)
    await fleet.start(scenario, pods)
    await fleet.wait_balanced()
    upkeep = await _idle_upkeep(fleet)
    in_order = await _stream(fleet, "in-order", 1, upkeep)
    shuffled = await _stream(fleet, "shuffled", 2, upkeep)
    figures = {
        "pods": pods,
        "in_order": in_order,
        "shuffled": shuffled,
        # The table's row and the summary's headline: the shuffled stream, as before.
        **{name: shuffled[name] for name in ("messages", "messages_per_second", "operations_per_message")},
        "reads_per_message": shuffled["reads_per_message"],
        "writes_deletes_per_message": shuffled["writes_deletes_per_message"],
        "lease_operations_per_message_estimate": shuffled["lease_operations_per_message_estimate"],
        "cpu_seconds_per_10k": shuffled["cpu_seconds_per_10k"],
        "idle_upkeep_per_pod_per_minute": upkeep,
        "idle_upkeep_per_pod_per_second": upkeep["operations"] / 60.0,
        "peer": fleet.peer_counts(),
        "redeliveries_to_apps": sum(app.redeliveries for app in fleet.apps),
        "delivered_per_pod": [len(app.distinct) for app in fleet.apps],
    }
    return figures, fleet


async def _takeover(fleet: Fleet, how: str) -> dict[str, Any]:
    """Steady traffic on the balanced fleet; ``how`` ("kill9" or "sigterm") stops pod 1; the time
    from the signal to the first delivery, by another pod, of a key of one of its shards."""
    context = fleet.context
    victim = 1
    count = int(STEADY_RATE_PER_SECOND * STEADY_SECONDS)
    # A new key prefix per take-over: sequences start at 1 on keys no earlier phase touched.
    stream = [Outgoing(f"{how}-{i % STEADY_KEYS}", i // STEADY_KEYS + 1, how) for i in range(count)]
    owned = await fleet.wait_balanced()
    publishing = asyncio.create_task(
        asyncio.to_thread(context.pubsub.publish, fleet.subscription, stream, STEADY_RATE_PER_SECOND)
    )
    try:
        # Traffic flows through every pod before the signal.
        deadline = time.monotonic() + TAKEOVER_TIMEOUT_SECONDS
        while not all(any(key.startswith(f"{how}-") for _, key in fleet.apps[i].arrivals) for i in fleet.live):
            if time.monotonic() > deadline or publishing.done():
                raise BenchError(f"{how}: steady traffic did not reach every pod's app")
            await asyncio.sleep(0.05)
        shards = await fleet.shards_of(victim)
        if shards != owned[victim]:
            raise BenchError(f"{how}: pod {victim}'s shards moved before the signal: {owned[victim]} -> {shards}")
        others = [fleet.apps[i] for i in fleet.live if i != victim]
        signalled_at = time.time()
        restart: dict[str, float] = {}
        ready_at = 0.0
        if how == "kill9":
            exiting: asyncio.Future[int | None] = asyncio.create_task(asyncio.to_thread(fleet.pods[victim].kill9))
        elif how == "restart":
            # A container restarted in its pod: kill -9, then the same command, config and POD_NAME
            # at once; the figure is the signal to the first delivery of one of its shards' keys by
            # the restarted pod's (new) app.
            exiting = asyncio.get_running_loop().create_future()
            exiting.set_result(await asyncio.to_thread(fleet.pods[victim].kill9))
            fleet.live.remove(victim)
            await fleet.stop_app(victim)
            started_at = time.time()
            await fleet.restart(victim)
            ready_at = time.time()
            restart = {"kill_to_start": started_at - signalled_at, "start_to_ready": ready_at - started_at}
            others = [fleet.apps[victim]]
        else:
            exiting = asyncio.create_task(asyncio.to_thread(fleet.pods[victim].stop))
        if how != "restart":
            fleet.live.remove(victim)
        deadline = time.monotonic() + TAKEOVER_TIMEOUT_SECONDS
        while (first := _first_arrival(others, shards, signalled_at)) is None:
            if time.monotonic() > deadline:
                raise BenchError(f"{how}: no pod delivered a key of shards {sorted(shards)} in 60s")
            await asyncio.sleep(0.02)
        exit_code = await exiting
        if how == "restart":
            restart["ready_to_first_delivery"] = first - ready_at
            taken_back = await fleet.shards_of(victim)
            restart["shards_taken_back"] = len(taken_back & shards)
        else:
            await fleet.stop_app(victim)
        rebalanced = await fleet.wait_balanced()
    finally:
        await publishing
    return {
        "seconds": first - signalled_at,
        **restart,
        "victim_shards": sorted(shards),
        "exit_code": exit_code,
        "lease_seconds": fleet.lease_seconds,
        "survivor_shard_counts": [len(s) for s in rebalanced.values()],
        "steady_rate_per_second": STEADY_RATE_PER_SECOND,
        "steady_keys": STEADY_KEYS,
    }


async def run_scale_out(context: RunContext, scenario: Scenario) -> Result:
    fleets: list[Fleet] = []
    try:
        one, fleet = await _throughput(context, scenario, 1)
        fleets.append(fleet)
        one["exit_codes"] = await fleet.stop()
        three, fleet = await _throughput(context, scenario, PODS)
        fleets.append(fleet)
        restart = await _takeover(fleet, "restart")
        handover = await _takeover(fleet, "sigterm")
        three["exit_codes"] = await fleet.stop()
        fleet = Fleet.create(context, scenario, "failover", FAILOVER_LEASE_SECONDS)
        fleets.append(fleet)
        await fleet.start(scenario, PODS)
        failover = await _takeover(fleet, "kill9")
    finally:
        # Stopping twice is harmless: this catches a fleet left running by a failed step.
        for leftover in fleets:
            await leftover.stop()
    upkeep = three["idle_upkeep_per_pod_per_minute"]["operations"]
    extra: dict[str, Any] = {
        "shards": SHARDS,
        "peering": True,
        "one_pod": one,
        "three_pods": three,
        "throughput_ratio": three["messages_per_second"] / one["messages_per_second"],
        "operations_per_message_delta": three["operations_per_message"] - one["operations_per_message"],
        "by_order": {
            order: {
                "throughput_ratio": three[order]["messages_per_second"] / one[order]["messages_per_second"],
                "operations_per_message_delta": three[order]["operations_per_message"]
                - one[order]["operations_per_message"],
                "cpu_ratio": three[order]["cpu_seconds_per_10k"] / one[order]["cpu_seconds_per_10k"],
            }
            for order in ("in_order", "shuffled")
        },
        "failover_kill9": failover,
        "handover_sigterm": handover,
        "restart_same_pod_name": restart,
        "lease_upkeep_per_pod_per_minute": upkeep,
        "upkeep_seconds": UPKEEP_SECONDS,
    }
    by_order = extra["by_order"]
    extra["goals_met"] = {
        "operations_per_message_delta_at_most_0.05": all(
            figures["operations_per_message_delta"] <= 0.05 for figures in by_order.values()
        ),
        "cpu_ratio_at_most_1.3": all(figures["cpu_ratio"] <= 1.3 for figures in by_order.values()),
        "throughput_ratio_at_least_0.9": all(figures["throughput_ratio"] >= 0.9 for figures in by_order.values()),
        "idle_upkeep_at_most_1_op_per_second_per_pod": upkeep / 60.0 <= 1.0,
        "failover_within_lease_plus_1s": failover["seconds"] <= FAILOVER_LEASE_SECONDS + 1.0,
        "handover_under_1s": handover["seconds"] < 1.0,
        "restart_same_pod_name_under_2s": restart["seconds"] < 2.0,
    }
    _print_summary(extra)
    return Result(
        scenario.name,
        f"{PODS} pods, {SHARDS} shards (1 pod, failover, handover, upkeep: see the JSON)",
        messages=three["messages"],
        messages_per_second=three["messages_per_second"],
        reads_per_message=three["reads_per_message"],
        writes_deletes_per_message=three["writes_deletes_per_message"],
        cpu_seconds_per_10k=three["cpu_seconds_per_10k"],
        extra=extra,
    )


def _print_summary(extra: dict[str, Any]) -> None:
    one, three = extra["one_pod"], extra["three_pods"]
    for figures in (one, three):
        for order in ("in_order", "shuffled"):
            stream = figures[order]
            print(
                f"bench: scale-out {figures['pods']} pod(s), {order}: {stream['messages_per_second']:,.0f} msg/s, "
                f"{stream['operations_per_message']:.2f} Firestore ops/msg (lease upkeep about "
                f"{stream['lease_operations_per_message_estimate']:.2f} of them), "
                f"{stream['cpu_seconds_per_10k']:.1f} CPU s/10k, {stream['forwarded_per_message']:.2f} forwarded/msg",
                flush=True,
            )
    for order, ratios in extra["by_order"].items():
        print(
            f"bench: scale-out 3 vs 1 pod, {order}: throughput x{ratios['throughput_ratio']:.2f}, "
            f"{ratios['operations_per_message_delta']:+.2f} ops/msg, CPU x{ratios['cpu_ratio']:.2f}",
            flush=True,
        )
    failover, handover, restart = extra["failover_kill9"], extra["handover_sigterm"], extra["restart_same_pod_name"]
    print(
        f"bench: scale-out failover after kill -9 {failover['seconds']:.2f} s (lease {failover['lease_seconds']:g} s); "
        f"hand-over after SIGTERM {handover['seconds']:.2f} s (exit code {handover['exit_code']}); restart with the "
        f"same pod name {restart['seconds']:.2f} s (process start to ready {restart['start_to_ready']:.2f} s, "
        f"ready to its first delivery {restart['ready_to_first_delivery']:.2f} s); "
        f"idle upkeep {extra['lease_upkeep_per_pod_per_minute'] / 60.0:.2f} ops/s per pod",
        flush=True,
    )
