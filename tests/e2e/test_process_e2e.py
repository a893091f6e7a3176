"""End to end, the process contract: config errors exit 2 with one line; probes answer; SIGTERM exits 0
within the grace period and gives unacked messages back (they come again after a restart)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import Scenario
from e2e_config import PROJECT, order_message, subscription_entry, write_config
from e2e_processes import SidecarProcess
from e2e_waits import async_wait_until

from pubsub_sidecar_client import get_status

pytestmark = pytest.mark.e2e

GRACE_SECONDS = 3.0


def _run_with_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_invalid_config_exits_2_with_one_line_naming_the_field(tmp_path: Path) -> None:
    entry = subscription_entry("orders", f"projects/{PROJECT}/subscriptions/orders")
    entry["delivery"]["max_delivery_attempts"] = "five"
    path = write_config(tmp_path / "bad.yaml", listen="127.0.0.1:0", root="r", subscriptions=[entry])

    result = _run_with_config(path)

    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "subscriptions[0].delivery.max_delivery_attempts" in lines[0]
    assert str(path) in lines[0]


def test_missing_config_file_exits_2_with_one_line(tmp_path: Path) -> None:
    result = _run_with_config(tmp_path / "absent.yaml")

    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "absent.yaml" in result.stderr


async def test_probes_answer_and_sigterm_exits_0_within_grace_giving_back_unacked_messages(
    scenario: Scenario,
) -> None:
    sub = scenario.add_subscription("orders")
    # A second subscription in another mode, in the same process.
    events = scenario.add_subscription("events", mode="none", dead_letter=False)
    sidecar = await scenario.start_sidecar(grace_period=GRACE_SECONDS)
    assert sidecar.http_get("/healthz")[0] == 200
    status, body = sidecar.http_get("/readyz")
    assert status == 200
    checks = json.loads(body)["checks"]
    assert checks["firestore"] == "ok" and checks[f"pubsub:{sub.name}"] == "ok" and checks["pubsub:events"] == "ok"
    assert sidecar.http_get("/metrics")[0] == 200
    events_app = scenario.app(events)
    await scenario.pubsub.publish(events.topic, b"unordered")
    await async_wait_until(lambda: [s.data for s in events_app.seen] == [b"unordered"], "the none-mode message")

    # The app acks key "a" and holds key "b": at SIGTERM, b#1 is in flight and unacked.
    app = scenario.app(sub, lambda message: "hold" if message.key == "b" else "ack")
    for key in ("a", "b"):
        data, attributes = order_message(key, 1)
        await scenario.pubsub.publish(sub.topic, data, **attributes)
    await async_wait_until(lambda: len(app.seen) == 2 and len(app.confirmed_at) == 1, "a#1 confirmed, b#1 held")

    started = time.monotonic()
    code = await asyncio.to_thread(sidecar.terminate, GRACE_SECONDS + 30)
    elapsed = time.monotonic() - started
    assert code == 0, sidecar.output_tail()
    assert elapsed < GRACE_SECONDS + 5, f"shutdown took {elapsed:.1f}s with a grace period of {GRACE_SECONDS}s"

    # b#1 was given back: after a restart it comes again, and the confirmed a#1 does not.
    await asyncio.to_thread(sidecar.start, False)
    await sidecar.async_wait_ready()
    await async_wait_until(lambda: len(app.seen) >= 3, "b#1 again after the restart")
    deliveries = [(s.key, s.sequence) for s in app.seen]
    assert sorted(deliveries[:2]) == [("a", 1), ("b", 1)] and deliveries[2:] == [("b", 1)], deliveries


async def test_sigterm_while_streaming_pull_fails_logs_only_json_lines_and_exits_0(scenario: Scenario) -> None:
    scenario.add_subscription("orders")
    sidecar = await scenario.start_sidecar(grace_period=GRACE_SECONDS)
    failures = 1_000_000
    emulators = scenario.emulators
    rule = emulators.add_fault(service="pubsub", method="StreamingPull", code="UNAVAILABLE", remaining=failures)
    emulators.break_streams("pubsub", "UNAVAILABLE")

    def reopen_attempts() -> int:
        [current] = [r for r in emulators.admin("GET", "/faults") if r["id"] == rule["id"]]
        return failures - int(current["remaining"])

    # The client keeps reopening the stream, and each attempt fails: SIGTERM lands in that loop.
    await async_wait_until(lambda: reopen_attempts() >= 3, "the subscriber to retry the failing stream")
    code = await asyncio.to_thread(sidecar.terminate, GRACE_SECONDS + 30)

    output = sidecar.output_lines()
    assert code == 0, sidecar.output_tail()
    not_json = []
    for line in output:
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if not isinstance(entry, dict):
            not_json.append(line)
    assert not not_json, "lines that are not one JSON object:\n" + "\n".join(not_json[:20])
    entries = [json.loads(line) for line in output]
    assert any(entry["message"].startswith("sidecar stopped") for entry in entries), entries[-10:]
    # The client was not closed under its stream thread: no "Cannot invoke RPC: Channel closed!".
    errors = [entry for entry in entries if entry["severity"] in ("ERROR", "CRITICAL")]
    assert not errors, errors


def _run_beside(scenario: Scenario, name: str, *, listen: str, http: str) -> subprocess.CompletedProcess[str]:
    """A second sidecar on the scenario's config, with ``listen`` and ``http`` set, run to its end."""
    path = write_config(scenario.workdir / name, listen=listen, root=scenario.root, subscriptions=scenario.entries)
    body = yaml.safe_load(path.read_text())
    body["http"] = http
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.endswith("_EMULATOR_HOST")}
    env.update(scenario.emulators.env)
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


async def _answers_get_status(target: str, name: str) -> bool:
    response = await get_status(target, name, max_keys=0, timeout_seconds=10)
    return [sub.name for sub in response.subscriptions] == [name]


async def test_a_second_sidecar_on_a_running_ones_ports_refuses_with_one_line_and_exit_2(scenario: Scenario) -> None:
    sub = scenario.add_subscription("orders")
    path = write_config(
        scenario.workdir / "first.yaml", listen="127.0.0.1:0", root=scenario.root, subscriptions=scenario.entries
    )
    first = SidecarProcess(path, dict(scenario.emulators.env))
    scenario.sidecars.append(first)
    first.start(wait_ready=False)
    await first.async_wait_ready()
    assert first.grpc.startswith("127.0.0.1:") and not first.grpc.endswith(":0")

    # Its gRPC port: before, SO_REUSEPORT let the second bind it too and answer part of the calls.
    result = await asyncio.to_thread(_run_beside, scenario, "same-grpc.yaml", listen=first.grpc, http="127.0.0.1:0")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"cannot listen on {first.grpc} (listen): the address is in use" in lines[0]
    assert result.stdout == ""

    # Its HTTP port: before, a CRITICAL line and a traceback (and exit 1).
    result = await asyncio.to_thread(_run_beside, scenario, "same-http.yaml", listen="127.0.0.1:0", http=first.http)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"cannot listen on {first.http} (http): the address is in use" in lines[0]

    # The first serves on, alone: every status call reaches it (a second process on the port would
    # have answered some of them with its own, unrecovered runtime).
    for _ in range(20):
        assert await _answers_get_status(first.grpc, sub.name)
    assert first.http_get("/readyz")[0] == 200
    assert first.returncode is None


async def test_a_second_sidecar_on_a_live_unix_socket_refuses_and_leaves_it_in_place(scenario: Scenario) -> None:
    sub = scenario.add_subscription("orders")
    first = await scenario.start_sidecar()

    # Before, the socket file was taken for a stale one, deleted and bound anew: new connections
    # went to the second process.
    result = await asyncio.to_thread(
        _run_beside, scenario, "same-socket.yaml", listen=scenario.listen, http="127.0.0.1:0"
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"cannot listen on {scenario.listen} (listen): another process listens on it" in lines[0]
    assert await _answers_get_status(scenario.listen, sub.name)
    assert first.returncode is None
