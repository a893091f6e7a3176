"""Real processes for end-to-end tests: the emulators and the sidecar, started as the user would.

Both are started with ``python -m sidecar``; tests talk to them only over the network: the official
Google clients (publishing, topic and subscription admin, pulling dead letters), the project's app
client (``pubsub_sidecar_client.OrderedSubscriber``) and HTTP. Waits are polls with deadlines or events,
never bare sleeps.

Named ``e2e_harness`` (not ``harness``): test directories have no ``__init__.py``, so their helper
modules share one namespace, and ``tests/engine/harness.py`` exists.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

import yaml
from google.api_core import exceptions as api_exceptions
from google.cloud import pubsub_v1
from prometheus_client.parser import text_string_to_metric_families

from pubsub_sidecar_client import Message, OrderedSubscriber
from pubsub_sidecar_client.status import get_status

_T = TypeVar("_T")

PROJECT = "e2e-project"

START_TIMEOUT_SECONDS = 60.0
"""Two cores shared with other tests: a cold `python -m sidecar` with the Google clients takes seconds."""

LOG_DIR = os.environ.get("E2E_LOG_DIR")
"""When set, every sidecar start's whole output is also written there (``<test dir>-<config>-<start>.log``,
and the emulators' as ``emulators-*.log``), and
``E2E_LOG_LEVEL`` (default INFO) sets its log level: for finding why a long run failed."""

WAIT_SECONDS = 60.0
"""Default deadline for a test's polls: generous, since other suites may share the two cores."""


def wait_until(predicate: Callable[[], _T], timeout: float, what: str, interval: float = 0.05) -> _T:
    """Poll ``predicate`` until it returns a truthy value; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


async def async_wait_until(
    predicate: Callable[[], _T], what: str, within_seconds: float = WAIT_SECONDS, interval: float = 0.05
) -> _T:
    """``wait_until`` for async tests: the event loop (and the app client on it) keeps running."""
    timeout = within_seconds
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


async def async_poll(
    probe: Callable[[], Awaitable[_T | None]], what: str, within_seconds: float = WAIT_SECONDS, interval: float = 0.1
) -> _T:
    """Await ``probe`` until it returns something truthy (e.g. a GetStatus answer showing a state)."""
    deadline = time.monotonic() + within_seconds
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_seconds:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


class OutputPump:
    """Reads a process's output in a thread, keeping every line (for diagnostics and parsing)."""

    def __init__(self, stream: Any, echo_prefix: str | None = None, copy_to: Path | None = None) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._echo = echo_prefix
        self._copy = copy_to.open("w", encoding="utf-8") if copy_to is not None else None
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: Any) -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
            if self._echo is not None:
                print(f"{self._echo}{line}", file=sys.stderr)
            if self._copy is not None:
                self._copy.write(raw)
                self._copy.flush()
        if self._copy is not None:
            self._copy.close()

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.lines), timeout)

    def snapshot(self) -> list[str]:
        with self._cond:
            return list(self.lines)

    def tail(self, n: int = 40) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])


def _python_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_EMULATOR_HOST")}
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


INDEXES_FILE = Path(__file__).resolve().parents[2] / "firestore.indexes.json"
"""The repository's shipped Firestore index exemptions and TTL policy."""


@dataclass
class EmulatorsProcess:
    """``pubsub-sidecar emulators`` on port 0, with the addresses it printed."""

    metric_period: float = 1.0
    metric_delay: float = 2.0
    env: dict[str, str] = field(default_factory=dict)
    admin_url: str = ""
    _proc: subprocess.Popen[str] | None = None
    _out: OutputPump | None = None

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "sidecar", "emulators",
            "--pubsub-port", "0", "--firestore-port", "0", "--monitoring-port", "0", "--admin-port", "0",
            "--metric-period", str(self.metric_period), "--metric-delay", str(self.metric_delay),
            # The shipped index exemptions, so a query production would refuse fails here too; TTL
            # sweeps after every commit, so expired documents go at once.
            "--firestore-indexes", str(INDEXES_FILE), "--firestore-ttl-sweep", "0",
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_python_env({})
        )
        copy_to = None
        if LOG_DIR:
            Path(LOG_DIR).mkdir(parents=True, exist_ok=True)
            copy_to = Path(LOG_DIR) / f"emulators-{os.getpid()}-{id(self):x}.log"
        self._out = OutputPump(self._proc.stdout, None, copy_to)
        wanted = ("PUBSUB_EMULATOR_HOST", "FIRESTORE_EMULATOR_HOST", "MONITORING_EMULATOR_HOST", "EMULATORS_ADMIN_URL")

        def has_all(lines: list[str]) -> bool:
            return all(any(line.startswith(f"export {name}=") for line in lines) for name in wanted)

        if not self._out.wait_for(has_all, START_TIMEOUT_SECONDS):
            self.stop()
            raise AssertionError(f"emulators did not start:\n{self._out.tail()}")
        for line in self._out.snapshot():
            if line.startswith("export ") and "=" in line:
                name, _, value = line[len("export ") :].partition("=")
                value = value.strip().strip("'\"")
                if name == "EMULATORS_ADMIN_URL":
                    self.admin_url = value
                else:
                    self.env[name] = value

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)

    # ---- admin API ---------------------------------------------------------------------------

    def admin(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.admin_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    def add_fault(self, **rule: Any) -> Any:
        return self.admin("POST", "/faults", rule)

    def clear_faults(self, service: str | None = None) -> None:
        """Remove every fault rule, or those of one service ("firestore", "pubsub")."""
        self.admin("DELETE", "/faults" if service is None else f"/faults?service={service}")

    def break_streams(self, service: str = "pubsub", code: str = "UNAVAILABLE") -> int:
        return int(self.admin("POST", "/streams/break", {"service": service, "code": code})["broken"])

    def firestore_counters(self) -> dict[str, int]:
        return dict(self.admin("GET", "/firestore/counters"))

    def pubsub_counters(self) -> dict[str, int]:
        """Acknowledge / ModifyAckDeadline calls and ack ids the emulator received so far."""
        return dict(self.admin("GET", "/pubsub/counters"))

    def leases(self, subscription: str) -> list[dict[str, Any]]:
        """The subscription's outstanding leases: ``message_id``, ``seconds_left``, ``extensions``."""
        return list(self.admin("GET", "/pubsub/leases?" + urllib.parse.urlencode({"subscription": subscription})))

    def unacked(self, subscription: str) -> list[dict[str, Any]]:
        """Every unacked message of the subscription: ``message_id``, ``delivery_attempt``, ``leased``."""
        return list(self.admin("GET", "/pubsub/unacked?" + urllib.parse.urlencode({"subscription": subscription})))


def dump_firestore(env: Mapping[str, str], path: Path) -> None:
    """Every document of the emulated Firestore, as JSON lines (``path``, fields): a failed run's state."""
    from google.cloud import firestore  # only for this diagnostic, so the suite does not load it

    with emulator_env(env):
        client = firestore.Client(project=PROJECT)
    with path.open("w", encoding="utf-8") as out:

        def walk(collections: Any) -> None:
            for collection in collections:
                for snapshot in collection.stream():
                    record = {"path": snapshot.reference.path, **(snapshot.to_dict() or {})}
                    out.write(json.dumps(record, default=repr) + "\n")
                    walk(snapshot.reference.collections())

        walk(client.collections())
    client.close()  # type: ignore[no-untyped-call]


_READY_LINE = re.compile(r"sidecar ready: .*gRPC on (?P<grpc>[^\s\",]+), HTTP on (?P<http>[^\s\",]+)")
"""``sidecar.wiring.app`` logs this once recovery is done; with port 0 it is how a test learns the ports."""


@dataclass
class SidecarProcess:
    """``pubsub-sidecar run --config FILE`` as a real process; ``grpc``/``http`` are the bound addresses."""

    config_path: Path
    env: dict[str, str]
    grace_period: float = 10.0
    echo: bool = False
    grpc: str = ""
    http: str = ""
    _proc: subprocess.Popen[str] | None = None
    _out: OutputPump | None = None
    _starts: int = 0

    def start(self, wait_ready: bool = True) -> None:
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError("sidecar already running")
        cmd = [
            sys.executable, "-m", "sidecar", "run", "--config", str(self.config_path),
            "--log-format", "json", "--grace-period", str(self.grace_period),
            "--log-level", os.environ.get("E2E_LOG_LEVEL", "INFO"),
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_python_env(self.env)
        )
        self._starts += 1
        copy_to = None
        if LOG_DIR:
            Path(LOG_DIR).mkdir(parents=True, exist_ok=True)
            copy_to = Path(LOG_DIR) / f"{self.config_path.parent.name}-{self.config_path.stem}-{self._starts}.log"
        self._out = OutputPump(self._proc.stdout, "[sidecar] " if self.echo else None, copy_to)
        self.grpc = self.http = ""
        if wait_ready:
            self.wait_ready()

    def _ready_match(self) -> re.Match[str] | None:
        for line in self._out.snapshot() if self._out else []:
            match = _READY_LINE.search(line)
            if match:
                return match
        return None

    def wait_ready(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        def ready() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise AssertionError(f"sidecar exited with {self._proc.returncode}:\n{self.output_tail()}")
            match = self._ready_match()
            if match is None:
                return False
            self.grpc, self.http = match["grpc"], match["http"]
            return self.http_get("/readyz")[0] == 200

        try:
            wait_until(ready, timeout, "the sidecar's /readyz")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.output_tail()}") from None

    async def async_wait_ready(self, within_seconds: float = START_TIMEOUT_SECONDS) -> None:
        """``wait_ready`` from an async test: runs in a thread so that the loop keeps serving."""
        await asyncio.to_thread(self.wait_ready, within_seconds)

    def http_get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.http}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    def metric(self, name: str, **labels: str) -> float:
        """One sample from ``/metrics`` (0 when absent), e.g. ``metric("pubsub_sidecar_duplicates_total",
        subscription="orders")``."""
        status, body = self.http_get("/metrics")
        if status != 200:
            raise AssertionError(f"/metrics answered {status}")
        total = 0.0
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def kill9(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGKILL)
        self._proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but runs nothing (a GC pause, a frozen node)."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self._proc is not None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
        return self._proc.wait(timeout)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def output_lines(self) -> list[str]:
        """Every line the process wrote to stdout and stderr so far (both go to one pipe)."""
        return self._out.snapshot() if self._out is not None else []

    def output_tail(self, n: int = 60) -> str:
        return self._out.tail(n) if self._out is not None else ""

    def log_records(self) -> list[dict[str, Any]]:
        records = []
        for line in self._out.snapshot() if self._out else []:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records


# ---- config files --------------------------------------------------------------------------------


def subscription_entry(
    name: str,
    subscription: str,
    *,
    mode: str = "sequence",
    dead_letter_topic: str | None = None,
    ordering: Mapping[str, Any] | None = None,
    delivery: Mapping[str, Any] | None = None,
    dedup: Mapping[str, Any] | None = None,
    flow_control: Mapping[str, Any] | None = None,
    sharding: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``subscriptions[]`` entry with test-sized timings (short backoffs and ack deadline).

    Shard leases keep the product's default, 10 s: a pod stops delivering a shard when a renewal is
    about half a lease late, and on two loaded cores a sidecar process can go that long without
    running (with 3 s leases, every shard was dropped and taken again mid-test now and then, and
    the messages in flight were delivered again). A restart after kill -9 waits out the dead
    process's leases; tests about failover pass a shorter ``lease_duration`` themselves."""
    order: dict[str, Any] = {"mode": mode}
    if mode == "sequence":
        order["key"] = {"attribute": "order_id"}
        order["sequence"] = {"attribute": "seq", "start": 1}
    order.update(ordering or {})
    entry: dict[str, Any] = {
        "name": name,
        "subscription": subscription,
        "ordering": order,
        "delivery": {
            "max_in_flight_per_key": 1,
            "ack_deadline": "10s",
            "max_delivery_attempts": 5,
            "backoff": {"initial": "100ms", "maximum": "500ms"},
            "on_dead_letter": "block",
            **(delivery or {}),
        },
    }
    if dedup is not None:
        entry["dedup"] = dict(dedup)
    if flow_control is not None:
        entry["flow_control"] = dict(flow_control)
    if dead_letter_topic is not None:
        entry["dead_letter_topic"] = dead_letter_topic
    entry["sharding"] = {"lease_duration": "10s", "drain_timeout": "2s", **(sharding or {})}
    return entry


def write_config(path: Path, *, listen: str, root: str, subscriptions: list[dict[str, Any]]) -> Path:
    body = {
        "project": PROJECT,
        "listen": listen,
        "http": "127.0.0.1:0",
        "firestore": {"database": "(default)", "root": root},
        "subscriptions": subscriptions,
    }
    path.write_text(yaml.safe_dump(body, sort_keys=False, allow_unicode=True))
    return path


# ---- Pub/Sub through the official clients ---------------------------------------------------------


_ENV_LOCK = threading.Lock()


@contextmanager
def emulator_env(env: Mapping[str, str]) -> Iterator[None]:
    """The official clients read ``PUBSUB_EMULATOR_HOST`` at construction: set it just for that.

    Serialised: ``patch.dict`` restores the environment it saw on entry, so two threads patching at
    once would leave the variable set for good (and later suites would take it for an external
    emulator)."""
    with _ENV_LOCK, mock.patch.dict(os.environ, dict(env)):
        yield


@dataclass(frozen=True, slots=True)
class Pulled:
    data: bytes
    attributes: dict[str, str]
    message_id: str


class PubSub:
    """Topics, subscriptions, publishing and pulling on the emulator, with the official clients."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = dict(env)
        with emulator_env(env):
            self.publisher = pubsub_v1.PublisherClient()
            self.subscriber = pubsub_v1.SubscriberClient()
        self._ordered_publisher: Any = None

    def close(self) -> None:
        self.publisher.stop()
        if self._ordered_publisher is not None:
            self._ordered_publisher.stop()
        self.subscriber.close()

    @property
    def ordered_publisher(self) -> Any:
        """A publisher with message ordering enabled (needed to publish with ordering keys), made on
        first use: ``emulator_env`` patches the process environment, so no more clients are built
        in ``__init__`` than every test needs (tests build ``PubSub`` objects in parallel threads)."""
        if self._ordered_publisher is None:
            with emulator_env(self._env):
                self._ordered_publisher = pubsub_v1.PublisherClient(
                    publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True)
                )
        return self._ordered_publisher

    def topic(self, prefix: str) -> str:
        path = f"projects/{PROJECT}/topics/{prefix}-{uuid.uuid4().hex[:8]}"
        self.publisher.create_topic(name=path)
        return path

    def subscription(self, topic: str, ack_deadline_seconds: int = 10, enable_message_ordering: bool = False) -> str:
        path = topic.replace("/topics/", "/subscriptions/")
        self.subscriber.create_subscription(
            request={
                "name": path,
                "topic": topic,
                "ack_deadline_seconds": ack_deadline_seconds,
                "enable_message_ordering": enable_message_ordering,
            }
        )
        return path

    async def publish(self, topic: str, data: bytes, **attributes: str) -> str:
        """Publish one message; returns its message id once the emulator accepted it."""
        return await asyncio.wrap_future(self.publisher.publish(topic, data, **attributes))

    async def publish_all(self, topic: str, messages: list[tuple[bytes, dict[str, str]]]) -> list[str]:
        """Publish in the given order (the client batches them); returns the message ids."""
        futures = [self.publisher.publish(topic, data, **attrs) for data, attrs in messages]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    async def publish_ordered(self, topic: str, messages: list[tuple[str, bytes, dict[str, str]]]) -> list[str]:
        """Publish (ordering key, data, attributes) in the given order with the ordering publisher."""
        publish = self.ordered_publisher.publish
        futures = [publish(topic, data, ordering_key=key, **attrs) for key, data, attrs in messages]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def pull_available(self, subscription: str) -> list[Pulled]:
        """One unary Pull of what is there, acked (a dead-letter topic's subscription)."""
        try:
            # Pull waits for messages up to its deadline: a short one keeps the polling loop lively.
            response = self.subscriber.pull(subscription=subscription, max_messages=100, retry=None, timeout=2.0)
        except api_exceptions.DeadlineExceeded:
            return []
        if response.received_messages:
            self.subscriber.acknowledge(
                subscription=subscription, ack_ids=[m.ack_id for m in response.received_messages]
            )
        return [
            Pulled(m.message.data, dict(m.message.attributes), m.message.message_id) for m in response.received_messages
        ]

    async def pull_until(
        self, subscription: str, count: int, what: str, within_seconds: float = WAIT_SECONDS
    ) -> list[Pulled]:
        """Pull until at least ``count`` messages arrived (from a thread; the loop keeps running)."""
        pulled: list[Pulled] = []

        def enough() -> bool:
            pulled.extend(self.pull_available(subscription))
            return len(pulled) >= count

        await async_wait_until_threaded(enough, what, within_seconds)
        return pulled


async def async_wait_until_threaded(
    predicate: Callable[[], bool], what: str, within_seconds: float = WAIT_SECONDS
) -> None:
    """Poll a blocking predicate in a thread (it makes RPCs) until true or the deadline."""
    timeout = within_seconds
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


# ---- the app ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Seen:
    """One delivery as the app saw it."""

    key: str
    sequence: int
    data: bytes
    message_id: str
    dedup_id: str
    delivery_attempt: int
    skipped: tuple[tuple[int, int], ...]
    attributes: dict[str, str]
    at: float
    epoch: int = 0
    delivery_id: str = ""


@dataclass(slots=True)
class AckRecord:
    """One delivery the app acked on a live stream (``ack()`` returned True), and what became of it.

    ``confirmed_at``: when the sidecar confirmed it as durable; ``ended_at``: when the client said it
    never will be (the stream ended first). Both None: still waiting. Monotonic clock.
    """

    seen: Seen
    acked_at: float
    confirmed_at: float | None = None
    ended_at: float | None = None


Decision = str
"""What the app does with a message: "ack", "nack", "hold" (keep it unacked) or "dead_letter"."""


class App:
    """The app: reads one subscription through ``OrderedSubscriber``, records and settles each message.

    ``decide(message)`` picks "ack" (the default), "nack", "hold" or "dead_letter". Acked messages
    whose ack the sidecar confirmed are in ``confirmed`` (by dedup id): G3 says they never come again.
    """

    def __init__(
        self,
        target: str,
        subscription: str,
        decide: Callable[[Message], Decision] | None = None,
        *,
        max_outstanding_messages: int = 0,
    ) -> None:
        self.target = target
        self.subscription = subscription
        self.decide = decide or (lambda _m: "ack")
        self.max_outstanding_messages = max_outstanding_messages
        self.seen: list[Seen] = []
        self.held: list[Message] = []
        self.confirmed_at: dict[tuple[str, int, str], float] = {}
        """(key, sequence, dedup id) -> when the sidecar confirmed the ack (monotonic clock)."""
        self.acked_at: dict[tuple[str, int], float] = {}
        """(key, sequence) -> when the app first sent an ack for it (monotonic clock)."""
        self.acks: list[AckRecord] = []
        """Every ack sent on a live stream, one per delivery, with its confirmation (or its end)."""
        self.changed = asyncio.Event()
        self._subscriber: OrderedSubscriber | None = None
        self._task: asyncio.Task[None] | None = None
        self._confirm_tasks: set[asyncio.Task[None]] = set()
        self._held_seen: dict[int, Seen] = {}
        """id(message) -> its Seen, for the messages in ``held`` (which keeps them alive)."""

    def start(self) -> App:
        self._subscriber = OrderedSubscriber(
            self.target,
            self.subscription,
            max_outstanding_messages=self.max_outstanding_messages,
            reconnect_backoff_initial_seconds=0.05,
            reconnect_backoff_max_seconds=0.5,
        )
        self._subscriber.start()
        self._task = asyncio.create_task(self._read(self._subscriber))
        return self

    async def _read(self, subscriber: OrderedSubscriber) -> None:
        async for message in subscriber:
            seen = Seen(
                message.key,
                message.sequence,
                message.data,
                message.message_id,
                message.dedup_id,
                message.delivery_attempt,
                message.skipped,
                dict(message.attributes),
                time.monotonic(),
                message.epoch,
                message.delivery_id,
            )
            self.seen.append(seen)
            decision = self.decide(message)
            if decision == "ack":
                self.acked_at.setdefault((message.key, message.sequence), time.monotonic())
                if await message.ack():
                    self._track_confirmation(message, seen)
            elif decision == "nack":
                await message.nack()
            elif decision == "dead_letter":
                await message.nack(dead_letter=True)
            else:
                self.held.append(message)
                self._held_seen[id(message)] = seen
            self.changed.set()

    def _track_confirmation(self, message: Message, seen: Seen) -> None:
        record = AckRecord(seen, time.monotonic())
        self.acks.append(record)
        task = asyncio.create_task(self._await_confirmation(message, record))
        self._confirm_tasks.add(task)
        task.add_done_callback(self._confirm_tasks.discard)

    async def _await_confirmation(self, message: Message, record: AckRecord) -> None:
        try:
            await message.confirmed()
        except Exception:
            record.ended_at = time.monotonic()
            return  # not confirmed: the sidecar may deliver it again, which G3 allows
        record.confirmed_at = time.monotonic()
        self.confirmed_at.setdefault((message.key, message.sequence, message.dedup_id), record.confirmed_at)

    async def stop(self) -> None:
        if self._subscriber is not None:
            await self._subscriber.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for task in list(self._confirm_tasks):
            task.cancel()
        await asyncio.gather(*self._confirm_tasks, return_exceptions=True)

    async def ack_held(self) -> int:
        """Ack every held message still valid (those of a broken stream are redelivered instead)."""
        held, self.held = self.held, []
        held_seen, self._held_seen = self._held_seen, {}
        acked = 0
        for message in held:
            self.acked_at.setdefault((message.key, message.sequence), time.monotonic())
            if await message.ack():
                acked += 1
                self._track_confirmation(message, held_seen[id(message)])
        return acked

    # ---- what tests read ---------------------------------------------------------------------

    def by_key(self) -> dict[str, list[Seen]]:
        keys: dict[str, list[Seen]] = defaultdict(list)
        for seen in self.seen:
            keys[seen.key].append(seen)
        return keys

    def distinct(self) -> set[tuple[str, int, str]]:
        return {(seen.key, seen.sequence, seen.dedup_id) for seen in self.seen}


def check_sequence_guarantees(app: App, expected: Mapping[str, int]) -> None:
    """G1, G2 and G3 for sequence mode, from what the app saw.

    ``expected`` maps each key to its last sequence (1..N published). Nothing lost: every sequence
    seen. Order: sequence s reaches the app only after s - 1 did. Dedup: a delivery never comes
    after the sidecar confirmed an ack of that same message.
    """
    per_key = app.by_key()
    assert set(per_key) == set(expected), f"keys differ: missing {set(expected) - set(per_key)}"
    for key, deliveries in per_key.items():
        delivered: set[int] = set()
        for seen in deliveries:
            assert seen.sequence == 1 or seen.sequence - 1 in delivered, (
                f"key {key!r}: sequence {seen.sequence} delivered before {seen.sequence - 1}: "
                f"{[d.sequence for d in deliveries]}"
            )
            confirmed_at = app.confirmed_at.get((key, seen.sequence, seen.dedup_id))
            assert confirmed_at is None or seen.at < confirmed_at, (
                f"key {key!r}: sequence {seen.sequence} delivered again after its ack was confirmed"
            )
            delivered.add(seen.sequence)
        assert delivered == set(range(1, expected[key] + 1)), f"key {key!r}: saw {sorted(delivered)}"


def check_sequence_guarantees_across(apps: Sequence[App], expected: Mapping[str, int]) -> None:
    """G1, G2 and G3 for sequence mode over several apps, each behind its own sidecar pod.

    Nothing lost: every sequence seen by some app. Order: a delivery of sequence s (s > 1), to any
    app, comes after some app sent its ack of s - 1 (one clock: every app runs in this process).
    Dedup: no delivery, to any app, after the sidecar confirmed an ack of that message to any app.
    """
    acked: dict[tuple[str, int], float] = {}
    confirmed: dict[tuple[str, int, str], float] = {}
    for app in apps:
        for ident, at in app.acked_at.items():
            acked[ident] = min(at, acked.get(ident, at))
        for ident3, at in app.confirmed_at.items():
            confirmed[ident3] = min(at, confirmed.get(ident3, at))
    deliveries = sorted((seen for app in apps for seen in app.seen), key=lambda seen: seen.at)
    per_key: dict[str, set[int]] = defaultdict(set)
    for seen in deliveries:
        if seen.sequence > 1:
            before = acked.get((seen.key, seen.sequence - 1))
            assert before is not None and before <= seen.at, (
                f"key {seen.key!r}: sequence {seen.sequence} delivered (epoch {seen.epoch}) before any app "
                f"acked {seen.sequence - 1}"
            )
        confirmed_at = confirmed.get((seen.key, seen.sequence, seen.dedup_id))
        assert confirmed_at is None or seen.at < confirmed_at, (
            f"key {seen.key!r}: sequence {seen.sequence} delivered again after its ack was confirmed"
        )
        per_key[seen.key].add(seen.sequence)
    assert set(per_key) == set(expected), f"keys differ: missing {sorted(set(expected) - set(per_key))}"
    for key, sequences in per_key.items():
        assert sequences == set(range(1, expected[key] + 1)), f"key {key!r}: saw {sorted(sequences)}"


def order_message(key: str, seq: int | str, **extra: str) -> tuple[bytes, dict[str, str]]:
    """A sequence-mode message: key in ``order_id``, sequence in ``seq``, data naming both."""
    return f"{key}#{seq}".encode(), {"order_id": key, "seq": str(seq), **extra}


# ---- checks over several apps, per delivery (issue 27's runs) ---------------------------------------


def check_confirmed_deliveries_are_final(apps: Sequence[App]) -> None:
    """G3 per delivery, across apps (sequence mode): a delivery whose ack the sidecar confirmed is
    the last delivery of its key and sequence anywhere, whichever copy or pod delivers it.

    Stricter than ``check_sequence_guarantees_across`` (no delivery after the confirmation): this
    also refuses a confirmation that arrives for an old delivery after the message was delivered
    again (an ack accepted under an old epoch made durable after a new owner loaded the shard), and
    two confirmed deliveries of one position (a duplicate publish, other message id).
    """
    latest: dict[tuple[str, int], Seen] = {}
    for seen in sorted((seen for app in apps for seen in app.seen), key=lambda seen: seen.at):
        latest[(seen.key, seen.sequence)] = seen
    for app in apps:
        for record in app.acks:
            if record.confirmed_at is None:
                continue
            first = record.seen
            last = latest[(first.key, first.sequence)]
            assert last is first, (
                f"key {first.key!r}: sequence {first.sequence} delivered again (delivery {last.delivery_id}, epoch "
                f"{last.epoch}, {last.at - first.at:+.1f}s) after delivery {first.delivery_id} (epoch {first.epoch}), "
                f"whose ack was confirmed {record.confirmed_at - first.at:+.1f}s after it was delivered"
            )


def check_every_position_confirmed(apps: Sequence[App], expected: Mapping[str, int]) -> None:
    """Every key's 1..N has an ack the sidecar confirmed, at some app; a position missing one is
    described by what became of its acks (confirmation pending, stream ended, or never acked)."""
    confirmed = {(r.seen.key, r.seen.sequence) for app in apps for r in app.acks if r.confirmed_at is not None}
    missing = [
        (key, seq) for key, last in expected.items() for seq in range(1, last + 1) if (key, seq) not in confirmed
    ]
    if not missing:
        return
    now = time.monotonic()
    lines = []
    for key, seq in missing[:20]:
        records = [r for app in apps for r in app.acks if (r.seen.key, r.seen.sequence) == (key, seq)]
        fates = [
            f"delivery {r.seen.delivery_id} (epoch {r.seen.epoch}) acked {now - r.acked_at:.1f}s ago, "
            + (f"stream ended {r.ended_at - r.acked_at:.1f}s after the ack" if r.ended_at else "still unconfirmed")
            for r in records
        ]
        lines.append(f"  {key}#{seq}: " + ("; ".join(fates) or "never acked"))
    raise AssertionError(f"{len(missing)} positions never confirmed:\n" + "\n".join(lines))


def check_acks_confirmed_within(apps: Sequence[App], bound_seconds: float) -> list[float]:
    """Every ack sent on a live stream is confirmed within ``bound_seconds``, unless its stream ended
    within that time (the app then gets the message again, or it was durable: G3 allows either).
    Returns the ack-to-confirmation delays, for the report."""
    now = time.monotonic()
    delays: list[float] = []
    late: list[str] = []
    for app in apps:
        for r in app.acks:
            what = f"{r.seen.key}#{r.seen.sequence} (delivery {r.seen.delivery_id})"
            if r.confirmed_at is not None:
                delays.append(r.confirmed_at - r.acked_at)
                if r.confirmed_at - r.acked_at > bound_seconds:
                    late.append(f"{what}: confirmed {r.confirmed_at - r.acked_at:.1f}s after the ack")
            elif r.ended_at is not None:
                if r.ended_at - r.acked_at > bound_seconds:
                    late.append(f"{what}: unconfirmed while its stream lived {r.ended_at - r.acked_at:.1f}s more")
            elif now - r.acked_at > bound_seconds:
                late.append(f"{what}: unconfirmed {now - r.acked_at:.1f}s after the ack, stream alive")
    assert not late, (
        f"{len(late)} of {sum(len(app.acks) for app in apps)} acks not confirmed within {bound_seconds:.0f}s "
        "while their stream lived:\n  " + "\n  ".join(late[:20])
    )
    return delays


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


def positions_unconfirmed(apps: Sequence[App], expected: Mapping[str, int]) -> int:
    """How many of every key's 1..N have no ack the sidecar confirmed yet, at any app."""
    confirmed = {(r.seen.key, r.seen.sequence) for app in apps for r in app.acks if r.confirmed_at is not None}
    return sum(1 for key, last in expected.items() for seq in range(1, last + 1) if (key, seq) not in confirmed)


async def async_wait_every_position_confirmed(
    apps: Sequence[App], expected: Mapping[str, int], within_seconds: float = WAIT_SECONDS
) -> None:
    """Wait until every key's 1..N has a confirmed ack; at the deadline, fail describing each
    position still without one (``check_every_position_confirmed``)."""
    try:
        await async_wait_until(
            lambda: not positions_unconfirmed(apps, expected), "every position confirmed", within_seconds
        )
    except AssertionError:
        check_every_position_confirmed(apps, expected)
        raise


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
