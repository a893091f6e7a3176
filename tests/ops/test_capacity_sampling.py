"""What ``sidecar.wiring.reporting.Reports`` samples: intake is what the engines took in as new (not
a backlog a load restored), delivery what they finished; lease health from the lease rounds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sidecar.engine.types import EngineStatus
from sidecar.wiring.reporting import Reports


class _Runtime:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.is_ready = True

    def status(self, max_keys: int = 100) -> tuple[EngineStatus, list[Any]]:
        return EngineStatus("sequence", 0, 0, 0, 0, 0, None, None, dict(self.counts)), []  # type: ignore[arg-type]


def _parts(runtime: _Runtime, leases: Any = None) -> Any:
    return SimpleNamespace(runtime=runtime, leases=leases)


def test_a_restored_backlog_is_not_intake_and_finishing_it_is_delivery() -> None:
    runtime = _Runtime()
    clock = [0.0]
    reports = Reports({"orders": _parts(runtime)}, monotonic=lambda: clock[0], wall=lambda: 1_000.0)
    # A restart restored 5,000 pending messages (``recovered``, not in ``stored``); then 20 new
    # messages a second arrive while 120 a second are finished.
    runtime.counts = {"recovered": 5_000, "stored": 0, "acked": 0}
    for second in range(61):
        clock[0] = float(second)
        runtime.counts.update(stored=20 * second, acked=120 * second)
        reports.sample()
    capacity = reports.capacity("orders")
    assert capacity.known
    assert (capacity.intake_per_second, capacity.delivered_per_second) == (20, 120)
    assert not capacity.growing


def test_lease_reads_failing_are_said_with_the_time_they_began() -> None:
    runtime = _Runtime()
    stats = SimpleNamespace(rounds=0, read_failures=0)
    wall = [1_764_000_000.0]
    reports = Reports(
        {"orders": _parts(runtime, SimpleNamespace(stats=stats))}, monotonic=lambda: 0.0, wall=lambda: wall[0]
    )
    reports.sample()
    assert reports.lease_problem("orders") is None
    stats.rounds, stats.read_failures = 1, 1  # every round since the last sample failed to read
    wall[0] += 3
    reports.sample()
    stats.rounds, stats.read_failures = 2, 2
    wall[0] += 3
    reports.sample()
    problem = reports.lease_problem("orders")
    assert problem is not None
    assert problem.startswith("Firestore unavailable since 2025-11-24T16:00:03.000Z: 2 lease reads failed")
    stats.rounds = 3  # a round that read
    reports.sample()
    assert reports.lease_problem("orders") is None
