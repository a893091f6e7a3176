"""Several running sidecars watched at once: their readiness over time (``ReadinessWatch``), a
subscription drained everywhere, shards spread over the pods; pods with the peer channel on
(``PeeringFleet``: a shared secret file, a port and an advertised address per pod on 127.0.0.1) and
the network between them (``PeerLink``, a relay the test cuts and restores).

Rules: seen only from outside (``/readyz``, ``/metrics``, ``GetStatus`` and the emulators' admin
API), and every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from e2e_app import App
from e2e_config import order_message, write_config
from e2e_processes import EmulatorsProcess, SidecarProcess
from e2e_waits import async_poll, async_wait_until_threaded
from prometheus_client.parser import text_string_to_metric_families

from pubsub_sidecar_client.status import get_status

if TYPE_CHECKING:
    from conftest import Scenario


class ReadinessWatch:
    """Polls ``/readyz`` of several sidecars, each from its own thread, keeping every answer with its
    time (monotonic clock; status 0 when the pod did not answer within 5 s)."""

    def __init__(self, sidecars: Sequence[SidecarProcess], interval_seconds: float = 0.1) -> None:
        self.sidecars = list(sidecars)
        self.answers: list[list[tuple[float, int]]] = [[] for _ in self.sidecars]
        self._interval = interval_seconds
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._poll, args=(index,), daemon=True) for index in range(len(self.sidecars))
        ]

    def __enter__(self) -> ReadinessWatch:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _poll(self, index: int) -> None:
        while not self._stop.is_set():
            status, _body = self.sidecars[index].http_get("/readyz")
            self.answers[index].append((time.monotonic(), status))
            self._stop.wait(self._interval)

    def first_unready(self, index: int, since: float) -> float | None:
        return next((at for at, status in list(self.answers[index]) if at >= since and status != 200), None)

    def ready_since(self, index: int, since: float) -> float | None:
        """When pod ``index`` first answered 200 at or after ``since`` (None: not yet)."""
        return next((at for at, status in list(self.answers[index]) if at >= since and status == 200), None)

    def all_ready_since(self, since: float) -> list[float] | None:
        """Each pod's first 200 at or after ``since``, once every pod has one."""
        times = [self.ready_since(index, since) for index in range(len(self.sidecars))]
        return None if any(at is None for at in times) else [at for at in times if at is not None]


async def async_wait_drained(
    emulators: EmulatorsProcess, sidecars: Sequence[SidecarProcess], sub_name: str, subscription: str
) -> None:
    """Nothing left in flight anywhere: every running sidecar buffers nothing of ``sub_name`` and
    Pub/Sub has no lease on ``subscription`` (every message pulled was acked, or given back and
    taken again), twice in a row half a second apart. Dead letters are published before the
    message is acked in Pub/Sub, so after this the dead-letter topic holds all it will get."""
    quiet_since: float | None = None

    def drained() -> bool:
        nonlocal quiet_since
        quiet = not emulators.leases(subscription) and all(
            sidecar.metric("pubsub_sidecar_buffered_messages", subscription=sub_name) == 0
            for sidecar in sidecars
            if sidecar.returncode is None
        )
        if not quiet:
            quiet_since = None
            return False
        quiet_since = quiet_since or time.monotonic()
        return time.monotonic() - quiet_since >= 0.5

    await async_wait_until_threaded(drained, f"{sub_name} to drain (no buffered message, no Pub/Sub lease)")


async def async_wait_shards_spread(listens: Sequence[str], sub_name: str, shards: int) -> dict[int, set[int]]:
    """Wait until the pods at ``listens`` (gRPC targets) hold every shard between them, each at
    least its floor share; returns pod index -> shards held (from GetStatus)."""

    async def spread() -> dict[int, set[int]] | None:
        owned: dict[int, set[int]] = {}
        for index, listen in enumerate(listens):
            try:
                response = await get_status(listen, sub_name)
            except Exception:
                return None  # not serving yet
            owned[index] = {shard.shard for shard in response.subscriptions[0].shards}
        held = sorted(shard for shards_held in owned.values() for shard in shards_held)
        fair = all(len(shards_held) >= shards // len(listens) for shards_held in owned.values())
        return owned if held == list(range(shards)) and fair else None

    return await async_poll(spread, f"{shards} shards spread over {len(listens)} pods")


# ---- pods with the peer channel on (docs/forwarding.md) ------------------------------------------


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick for port 0 on every interface, released
    at once: the peer server binds ``[::]:<port>``)."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
        probe.bind(("::", 0))
        return int(probe.getsockname()[1])


@dataclass
class PeerPod:
    """One pod's peer channel: the port its server binds and the address the others dial (the
    server itself, or a ``PeerLink`` in front of it)."""

    port: int
    advertise: str

    def section(self, secret_file: Path) -> dict[str, Any]:
        return {"port": self.port, "advertise_address": self.advertise, "secret_file": str(secret_file)}


class PeeringFleet:
    """Pods of one scenario with the peer channel on: one shared secret file, one config per pod
    (its own gRPC socket, peer port and advertised address), each kept for the pod's restarts (the
    same ``POD_NAME`` and address: static membership recognises its own)."""

    def __init__(self, scenario: Scenario, secret: bytes = b"e2e-peer-secret\n") -> None:
        self.scenario = scenario
        self.secret_file = scenario.workdir / "peer-secret"
        self.secret_file.write_bytes(secret)
        self.secret = secret.strip()
        self.peers: dict[int, PeerPod] = {}
        self.links: dict[int, PeerLink] = {}

    async def link(self, pod: int) -> PeerLink:
        """Put a ``PeerLink`` in front of pod ``pod``'s peer server (before the pod's config is
        written): the others dial the link, which the test can cut and restore."""
        port = free_port()
        link = PeerLink(port)
        await link.start()
        self.links[pod] = link
        return link

    def sidecar(
        self, pod: int, *, listen: str | None = None, config_name: str | None = None, peer: PeerPod | None = None
    ) -> SidecarProcess:
        """Pod ``pod``'s sidecar (``POD_NAME`` pod-<n>), not started; ``listen``, ``config_name`` and
        ``peer`` give another process of the same pod name its own socket, file and peer port."""
        if peer is None and pod not in self.peers:
            port = free_port()
            link = self.links.get(pod)
            if link is not None:
                link.target_port = port
            advertise = f"127.0.0.1:{link.port if link is not None else port}"
            self.peers[pod] = PeerPod(port, advertise)
        path = write_config(
            self.scenario.workdir / f"{config_name or f'peer-pod{pod}'}.yaml",
            listen=listen or self.scenario.pod_listen(pod),
            root=self.scenario.root,
            subscriptions=self.scenario.entries,
            peering=(peer or self.peers[pod]).section(self.secret_file),
        )
        process = SidecarProcess(path, {**self.scenario.emulators.env, "POD_NAME": f"pod-{pod}"})
        self.scenario.sidecars.append(process)
        return process

    async def start(self, count: int) -> list[SidecarProcess]:
        pods = [self.sidecar(index) for index in range(count)]
        for pod in pods:
            pod.start(wait_ready=False)
        await asyncio.gather(*(pod.async_wait_ready() for pod in pods))
        return pods

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()


def peer_counts(sidecar: SidecarProcess, family: str) -> dict[str, float]:
    """``pubsub_sidecar_peer_<family>_total`` by answer, from the pod's ``/metrics`` (``family``:
    ``forwarded`` as the sender, ``answered`` as the owner)."""
    status, body = sidecar.http_get("/metrics")
    if status != 200:
        raise AssertionError(f"/metrics answered {status}")
    counts: dict[str, float] = {}
    for metric in text_string_to_metric_families(body):
        for sample in metric.samples:
            if sample.name == f"pubsub_sidecar_peer_{family}_total":
                counts[sample.labels["answer"]] = counts.get(sample.labels["answer"], 0.0) + sample.value
    return counts


class PeerLink:
    """A TCP relay in front of one pod's peer server, in the test's event loop: the network between
    the pods, which the test can cut (every connection through it reset, new ones refused: the
    senders see UNAVAILABLE) and restore (listening again on the same port)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.target_port = 0
        self.connections = 0
        """Connections relayed since the start (each a sender's channel, or a reconnection)."""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port, reuse_address=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._writers |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                sink.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}

    async def cut(self) -> None:
        """Stop listening and reset every relayed connection."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()

    async def restore(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()


def shuffled_traffic(
    seed: int, keys: int, per_key: int, prefix: str = "k"
) -> tuple[list[tuple[bytes, dict[str, str]]], dict[str, int]]:
    """Every key's 1..per_key, shuffled, a fifth of them published twice; and the expected last
    sequence of each key (for the checks)."""
    rng = random.Random(seed)
    messages = [order_message(f"{prefix}{k}", s) for k in range(keys) for s in range(1, per_key + 1)]
    messages += rng.sample(messages, len(messages) // 5)
    rng.shuffle(messages)
    return messages, {f"{prefix}{k}": per_key for k in range(keys)}


def all_seen(apps: Sequence[App], expected: dict[str, int]) -> bool:
    """Every expected position delivered to some app."""
    seen = {(s.key, s.sequence) for app in apps for s in app.seen}
    return all((key, seq) in seen for key, last in expected.items() for seq in range(1, last + 1))
