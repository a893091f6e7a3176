"""The emulators and the sidecar as real processes, started as the user would (``python -m sidecar``),
and their output.

Rules: tests talk to them only over the network (the emulators' admin HTTP API, the sidecar's gRPC
and HTTP), never in process. Each process's output is read by a thread (``OutputPump``) and kept
whole: for parsing (the sidecar's ready line gives the ports it bound with port 0) and for
diagnostics; with ``E2E_LOG_DIR`` set it is also written to files. A start waits for what the
process prints, within ``START_TIMEOUT_SECONDS``. A child's environment drops every
``*_EMULATOR_HOST`` of the test process (``_python_env``): it reaches only the emulators it is given.
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
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e_waits import wait_until
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_SECONDS = 60.0
"""Two cores shared with other tests: a cold `python -m sidecar` with the Google clients takes seconds."""

LOG_DIR = os.environ.get("E2E_LOG_DIR")
"""When set, every sidecar start's whole output is also written there (``<test dir>-<config>-<start>.log``,
and the emulators' as ``emulators-*.log``), and
``E2E_LOG_LEVEL`` (default INFO) sets its log level: for finding why a long run failed."""


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
