"""Real processes and measurements for the benchmark: emulators, sidecar, publisher, apps.

Rules this module keeps:
- The emulators and the sidecar run as real processes (``python -m sidecar ...``), started the way
  a user starts them; the benchmark talks to them only over the network. What is measured about the
  sidecar comes from the kernel: CPU seconds from ``/proc/<pid>/stat`` (utime + stime), peak RSS
  from ``/proc/<pid>/status`` (``VmHWM``), so the figures cost the sidecar nothing to report.
- Costs that can be counted are counted, not timed: Firestore reads, writes and deletes come from the
  emulator's admin counters (``GET /firestore/counters``, reset with ``POST``).
- This is the only bench module that imports ``google.cloud.pubsub_v1``: the official publisher for
  every scenario, and the official subscriber with a no-op callback as the baseline (run as its own
  process by ``bench.baseline_process``, so that its CPU time is measured apart).
- Every wait is a poll with a deadline that names what it waited for; a deadline missed raises
  ``BenchError`` with the process's last output, never a hang.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

import yaml
from google.cloud import pubsub_v1
from prometheus_client.parser import text_string_to_metric_families

_T = TypeVar("_T")

PROJECT = "bench-project"

START_TIMEOUT_SECONDS = 120.0
"""A cold ``python -m sidecar`` on two shared cores takes seconds; recovery of 100,000 messages more."""

_CLOCK_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
"""Units of utime/stime in /proc/<pid>/stat."""


class BenchError(Exception):
    """A benchmark step failed or timed out; the message says which and why."""


def wait_until(predicate: Callable[[], _T], timeout: float, what: str, interval: float = 0.05) -> _T:
    """Poll ``predicate`` until it returns something truthy; raise ``BenchError`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# ---- /proc ---------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may contain spaces: split after its closing parenthesis.
    fields = raw[raw.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / _CLOCK_TICKS_PER_SECOND


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set size (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise BenchError(f"/proc/{pid}/status has no VmHWM line")


# ---- processes -------------------------------------------------------------------------------------


class _OutputPump:
    """Reads a process's output in a thread and keeps the lines (for diagnostics and parsing)."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: Any) -> None:
        for raw in stream:
            with self._lock:
                self.lines.append(raw.rstrip("\n"))
                # A long run logs a lot; only the tail is ever shown.
                if len(self.lines) > 5000:
                    del self.lines[:1000]

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.snapshot()[-n:])


def _child_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_EMULATOR_HOST")}
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _stop_process(proc: subprocess.Popen[str] | None, timeout: float) -> int | None:
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


@dataclass
class Emulators:
    """``pubsub-sidecar emulators`` on port 0, with the addresses it printed."""

    metric_period_seconds: float
    metric_delay_seconds: float
    firestore_indexes: Path | None = None
    """A ``firestore.indexes.json`` (index exemptions, TTL policies) for ``--firestore-indexes``, so the
    Firestore emulator refuses and expires what production would; skipped, with a note, when the file
    or the option is missing."""
    firestore_ttl_sweep_seconds: float = 0.0
    """``--firestore-ttl-sweep`` (with ``firestore_indexes``). 0 sweeps after every commit: a document
    past its TTL goes at a commit, never on a timer at a random instant of a measured window."""
    env: dict[str, str] = field(default_factory=dict)
    admin_url: str = ""
    notes: list[str] = field(default_factory=list)
    """What the run could not set up as asked (printed by the caller, kept in the JSON)."""
    firestore_indexes_used: str | None = None
    _proc: subprocess.Popen[str] | None = None
    _out: _OutputPump | None = None

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "sidecar", "emulators",
            "--pubsub-port", "0", "--firestore-port", "0", "--monitoring-port", "0", "--admin-port", "0",
            "--metric-period", str(self.metric_period_seconds), "--metric-delay", str(self.metric_delay_seconds),
        ]  # fmt: skip
        cmd += self._firestore_index_options()
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_child_env({})
        )
        out = self._out = _OutputPump(self._proc.stdout)
        wanted = ("PUBSUB_EMULATOR_HOST", "FIRESTORE_EMULATOR_HOST", "MONITORING_EMULATOR_HOST", "EMULATORS_ADMIN_URL")

        def exports() -> dict[str, str] | None:
            if self._proc is not None and self._proc.poll() is not None:
                raise BenchError(f"emulators exited with {self._proc.returncode}:\n{out.tail()}")
            found: dict[str, str] = {}
            for line in out.snapshot():
                if line.startswith("export ") and "=" in line:
                    name, _, value = line[len("export ") :].partition("=")
                    found[name] = value.strip().strip("'\"")
            return found if all(name in found for name in wanted) else None

        try:
            found = wait_until(exports, START_TIMEOUT_SECONDS, "the emulators' export lines")
        except BenchError:
            self.stop()
            raise
        self.admin_url = found.pop("EMULATORS_ADMIN_URL")
        self.env = found

    def stop(self) -> None:
        _stop_process(self._proc, 15)

    def _firestore_index_options(self) -> list[str]:
        if self.firestore_indexes is None:
            return []
        if not self.firestore_indexes.is_file():
            self.notes.append(
                f"no {self.firestore_indexes.name} at {self.firestore_indexes}: the Firestore "
                "emulator runs without index exemptions or TTL policies"
            )
            return []
        usage = subprocess.run(
            [sys.executable, "-m", "sidecar", "emulators", "--help"],
            capture_output=True, text=True, env=_child_env({}), timeout=START_TIMEOUT_SECONDS,
        )  # fmt: skip
        if "--firestore-indexes" not in usage.stdout:
            self.notes.append(
                "`pubsub-sidecar emulators` has no --firestore-indexes: the Firestore emulator "
                "runs without index exemptions or TTL policies"
            )
            return []
        self.firestore_indexes_used = str(self.firestore_indexes)
        options = ["--firestore-indexes", str(self.firestore_indexes)]
        if "--firestore-ttl-sweep" in usage.stdout:
            options += ["--firestore-ttl-sweep", f"{self.firestore_ttl_sweep_seconds:g}"]
        return options

    def _admin(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        request = urllib.request.Request(self.admin_url + path, data=data, method=method)
        if body is not None:
            request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=60) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    def firestore_snapshot(self) -> dict[str, Any]:
        """``GET /firestore/counters`` as the emulator answers it (counters, and hotspots if it has them)."""
        snapshot: dict[str, Any] = self._admin("GET", "/firestore/counters")
        return snapshot

    def firestore_counters(self) -> dict[str, int]:
        """The numeric counters only (reads, writes, deletes, and ttl_deletes where the emulator counts
        them; deletes include ttl_deletes): sum them with ``billed_operations``, not ``sum()``."""
        return numeric_counters(self.firestore_snapshot())

    def reset_firestore_counters(self) -> None:
        self._admin("POST", "/firestore/counters/reset")

    def firestore_ttl_sweep(self, as_of_ms: int) -> int | None:
        """``POST /firestore/ttl/sweep``: delete every document whose TTL field is before ``as_of_ms``,
        billed as deletes; returns how many, or None when the emulator has no such route (404)."""
        try:
            answer = self._admin("POST", "/firestore/ttl/sweep", {"as_of_ms": as_of_ms})
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise BenchError(f"POST /firestore/ttl/sweep answered {exc.code}: {exc.read().decode()[:300]}") from None
        return int(answer["deleted"])


def numeric_counters(snapshot: Mapping[str, Any]) -> dict[str, int]:
    """The counters of a ``GET /firestore/counters`` answer, without the nested ``hotspots``."""
    return {k: int(v) for k, v in snapshot.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def billed_operations(counters: Mapping[str, int]) -> int:
    """Reads + writes + deletes: what Firestore bills. ``ttl_deletes`` is a part of ``deletes``."""
    return counters["reads"] + counters["writes"] + counters["deletes"]


_READY_LINE = re.compile(r"sidecar ready: .*gRPC on (?P<grpc>[^\s\",]+), HTTP on (?P<http>[^\s\",]+)")
"""``sidecar.wiring.app`` logs this once recovery is done; with port 0 it is how the bench learns the ports."""


@dataclass
class Profiler:
    """``python -m bench --py-spy DIR``: every sidecar process runs under ``py-spy record --gil``
    (samples only while a thread holds the GIL: the work that competes for the one interpreter),
    writing collapsed stacks to ``DIR/<scenario>[-N].txt`` (``bench/profile_report.py`` summarises
    and draws them). py-spy starts the sidecar itself: attaching to a running pid is refused here."""

    directory: Path | None = None
    rate: int = 250
    _runs: dict[str, int] = field(default_factory=dict)

    def wrap(self, cmd: list[str], name: str) -> list[str] | None:
        if self.directory is None:
            return None
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(py_spy).exists():
            raise BenchError("--py-spy: the py-spy command is not installed (pip install py-spy)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._runs[name] = self._runs.get(name, 0) + 1
        suffix = "" if self._runs[name] == 1 else f"-{self._runs[name]}"
        out = self.directory / f"{name}{suffix}.txt"
        return [py_spy, "record", "--gil", "--rate", str(self.rate), "--format", "raw", "-o", str(out), "--", *cmd]


PROFILER = Profiler()
"""Set by ``--py-spy``; off by default."""


def _child_pid(parent: int, timeout: float = 10.0) -> int:
    """The first child of ``parent`` (the process py-spy started)."""
    path = Path(f"/proc/{parent}/task/{parent}/children")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = path.read_text().split() if path.exists() else []
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise BenchError(f"py-spy (pid {parent}) started no sidecar within {timeout:.0f}s")


@dataclass
class Sidecar:
    """``pubsub-sidecar run --config FILE`` as a real process."""

    config_path: Path
    env: dict[str, str]
    grpc: str = ""
    http: str = ""
    _proc: subprocess.Popen[str] | None = None
    _out: _OutputPump | None = None

    _pid: int = 0
    _profiled: list[str] | None = None

    @property
    def pid(self) -> int:
        """The sidecar's own process (under a profiler, the profiler's child)."""
        if self._proc is None:
            raise BenchError("the sidecar is not running")
        return self._pid

    def start(self) -> None:
        """Start the process; returns at once (``wait_ready`` waits for /readyz). Under
        ``PROFILER.directory`` the sidecar runs under ``py-spy record``."""
        if self._proc is not None and self._proc.poll() is None:
            raise BenchError("the sidecar is already running")
        cmd = [sys.executable, "-m", "sidecar", "run", "--config", str(self.config_path), "--log-format", "json"]
        self._profiled = PROFILER.wrap(cmd, self.config_path.stem)
        self._proc = subprocess.Popen(
            self._profiled or cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_child_env(self.env)
        )
        self._out = _OutputPump(self._proc.stdout)
        self.grpc = self.http = ""
        self._pid = self._proc.pid if not self._profiled else _child_pid(self._proc.pid)

    def wait_ready(self, timeout: float = START_TIMEOUT_SECONDS, interval: float = 0.05) -> None:
        def ready() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise BenchError(f"the sidecar exited with {self._proc.returncode}:\n{self.output_tail()}")
            if not self.http:
                for line in self._out.snapshot() if self._out else []:
                    match = _READY_LINE.search(line)
                    if match:
                        self.grpc, self.http = match["grpc"], match["http"]
                        break
                else:
                    return False
            return self.http_get("/readyz")[0] == 200

        try:
            wait_until(ready, timeout, "the sidecar's /readyz", interval)
        except BenchError as exc:
            raise BenchError(f"{exc}\n{self.output_tail()}") from None

    def http_get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.http}{path}", timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    def metric(self, name: str) -> float:
        """The sum of a metric's samples on ``/metrics`` (0 when absent)."""
        status, body = self.http_get("/metrics")
        if status != 200:
            raise BenchError(f"the sidecar's /metrics answered {status}")
        return sum(
            sample.value
            for family in text_string_to_metric_families(body)
            for sample in family.samples
            if sample.name == name
        )

    def stop(self) -> int | None:
        """SIGTERM (the sidecar drains and exits) and wait; returns the exit code."""
        if self._profiled and self._proc is not None and self._proc.poll() is None:
            # The profiler writes its file once its child exits: signal the sidecar, not py-spy.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGTERM)
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        return _stop_process(self._proc, 60)

    def kill9(self) -> int | None:
        """SIGKILL (a crash: no drain, no hand-over) and wait; returns the exit code."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)  # the sidecar's own pid, also under a profiler
        return self._proc.wait(10)

    def output_tail(self, n: int = 30) -> str:
        return self._out.tail(n) if self._out is not None else ""

    def error_log_lines(self) -> list[str]:
        """The JSON log lines at ERROR or above (kept within the output pump's window)."""
        lines = self._out.snapshot() if self._out is not None else []
        return [line for line in lines if '"severity": "ERROR"' in line or '"severity": "CRITICAL"' in line]


def write_sidecar_config(path: Path, *, root: str, subscription: Mapping[str, Any]) -> Path:
    body = {
        "project": PROJECT,
        "listen": "127.0.0.1:0",
        "http": "127.0.0.1:0",
        "firestore": {"database": "(default)", "root": root},
        "subscriptions": [dict(subscription)],
    }
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


# ---- Pub/Sub with the official clients ------------------------------------------------------------


@contextmanager
def _emulator_env(env: Mapping[str, str]) -> Iterator[None]:
    """The official clients read ``PUBSUB_EMULATOR_HOST`` at construction: set it just for that."""
    with mock.patch.dict(os.environ, dict(env)):
        yield


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message to publish: its key, sequence and any extra attributes."""

    key: str
    sequence: int
    phase: str


TIMESTAMP_ATTRIBUTE = "bench_ts"
"""Wall-clock publish instant (seconds since the epoch), read by the app for publish-to-app latency."""


def message_attributes(message: Outgoing) -> dict[str, str]:
    return {
        "order_id": message.key,
        "seq": str(message.sequence),
        # Dedup id for dedup-only mode: a publisher retry has the same one, a new message_id.
        "event_id": f"{message.key}:{message.sequence}",
        "phase": message.phase,
    }


class PubSub:
    """Topics, subscriptions and publishing on the emulator; the baseline subscriber runs apart."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = dict(env)
        with _emulator_env(env):
            self.publisher = pubsub_v1.PublisherClient()
            self.subscriber = pubsub_v1.SubscriberClient()

    def close(self) -> None:
        self.publisher.stop()
        self.subscriber.close()

    def create(self, name: str) -> str:
        """A topic and its subscription, both called ``name``; returns the subscription path."""
        topic = f"projects/{PROJECT}/topics/{name}"
        subscription = f"projects/{PROJECT}/subscriptions/{name}"
        self.publisher.create_topic(name=topic)
        self.subscriber.create_subscription(name=subscription, topic=topic, ack_deadline_seconds=60)
        return subscription

    def publish(
        self,
        subscription: str,
        messages: Sequence[Outgoing],
        rate_per_second: float | None = None,
        data_bytes: int = 0,
    ) -> float:
        """Publish in order (the client batches), paced at ``rate_per_second`` if given; returns
        the wall-clock instant of the first publish once every message is accepted."""
        topic = subscription.replace("/subscriptions/", "/topics/")
        futures = []
        # A retry must be the same message (data and attributes) with a new message_id: the
        # sidecar treats the same key and sequence with other content as a conflict.
        first_published: dict[Outgoing, str] = {}
        started = time.time()
        start_mono = time.monotonic()
        for index, message in enumerate(messages):
            if rate_per_second:
                # Open-loop pacing: a late loop catches up instead of drifting.
                delay = start_mono + index / rate_per_second - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            attributes = message_attributes(message)
            attributes[TIMESTAMP_ATTRIBUTE] = first_published.setdefault(message, repr(time.time()))
            data = f"{message.key}#{message.sequence}".encode()
            if len(data) < data_bytes:
                data += b"." * (data_bytes - len(data))
            futures.append(self.publisher.publish(topic, data, **attributes))
        for future in futures:
            future.result(timeout=300)
        return started

    def start_baseline(self, subscription: str) -> tuple[BaselineResult, Callable[[int, float], None]]:
        """Start the baseline subscriber (``bench.baseline_process``, a process of its own, so that its
        CPU time is its own) now; returns its result and ``wait(expected, timeout)``."""
        result = BaselineResult()
        changed = threading.Condition()
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.baseline_process", subscription],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(self._env),
        )
        result.pid = proc.pid
        final: dict[str, Any] = {}

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                report = json.loads(line)
                with changed:
                    result.received, result.last_at = int(report["received"]), float(report["last_at"])
                    if report.get("final"):
                        final.update(report)
                    changed.notify_all()

        reader = threading.Thread(target=pump, name="baseline-reader", daemon=True)
        reader.start()

        def wait(expected: int, timeout: float) -> None:
            with changed:
                ok = changed.wait_for(lambda: result.received >= expected or proc.poll() is not None, timeout)
            if not ok or result.received < expected:
                stop()
                raise BenchError(f"baseline subscriber got {result.received} of {expected} in {timeout:.0f}s")

        def stop() -> None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reader.join(timeout=5)
            result.latencies = [float(x) for x in final.get("latencies", [])]
            if proc.returncode != 0:
                error = proc.stderr.read() if proc.stderr is not None else ""
                raise BenchError(f"baseline subscriber exited with {proc.returncode}: {error[-2000:]}")

        result.stop = stop
        return result, wait


def subscriber_client() -> Any:
    """The official subscriber client (the emulator's from ``PUBSUB_EMULATOR_HOST``): the bench's
    one importer of google-cloud-pubsub hands it to ``bench.baseline_process``."""
    return pubsub_v1.SubscriberClient()


@dataclass
class BaselineResult:
    received: int = 0
    last_at: float = 0.0
    pid: int = 0
    """The baseline subscriber's process (its CPU time is read from ``/proc``)."""
    latencies: list[float] = field(default_factory=list)
    stop: Callable[[], None] = field(default=lambda: None, repr=False)


# ---- statistics ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """Nearest-rank percentile (None for no values): no interpolation between two samples."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1))
    return ordered[rank]
