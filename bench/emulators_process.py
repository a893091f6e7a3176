"""The emulators as the bench runs them: ``pubsub-sidecar emulators`` as a real process on port 0,
and the Firestore emulator's admin counters.

Rules this module keeps:
- The emulators run as a real process, started the way a user starts them; the bench talks to them
  only over the network, and learns their addresses from the ``export`` lines they print.
- Costs that can be counted are counted, not timed: Firestore reads, writes and deletes come from the
  emulator's admin counters (``GET /firestore/counters``, reset with ``POST``). What Firestore bills
  is ``billed_operations`` of them (``ttl_deletes`` is a part of ``deletes``, never added again).
- What the run could not set up as asked (no index file, an emulator without the option) is a note
  in ``Emulators.notes``, not an error: the caller prints it and keeps it in the JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import START_TIMEOUT_SECONDS, BenchError, OutputPump, child_env, stop_process, wait_until


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
    _out: OutputPump | None = None

    @property
    def pid(self) -> int:
        """The emulators' process (one process serves Pub/Sub, Firestore and Monitoring)."""
        assert self._proc is not None, "start() first"
        return self._proc.pid

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "sidecar", "emulators",
            "--pubsub-port", "0", "--firestore-port", "0", "--monitoring-port", "0", "--admin-port", "0",
            "--metric-period", str(self.metric_period_seconds), "--metric-delay", str(self.metric_delay_seconds),
        ]  # fmt: skip
        cmd += self._firestore_index_options()
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env({})
        )
        out = self._out = OutputPump(self._proc.stdout)
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
        stop_process(self._proc, 15)

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
            capture_output=True, text=True, env=child_env({}), timeout=START_TIMEOUT_SECONDS,
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
