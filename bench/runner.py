"""Runs one scenario by its kind, against the run's one emulators process.

Rules this module keeps:
- It only dispatches: what a scenario does is in the module of its kind (``bench.throughput``,
  ``bench.backlog``, ``bench.cost``, ``bench.scale_out``, ``bench.relay``), each a function of the run's
  ``RunContext`` and the scenario. No scenario module imports this one.
"""

from __future__ import annotations

from pathlib import Path

from bench.backlog import run_held_gap, run_recovery
from bench.cost import run_cost
from bench.emulators_process import Emulators
from bench.pubsub_clients import PubSub
from bench.relay import run_relay
from bench.run_context import RunContext
from bench.scale_out import run_scale_out
from bench.scenarios import Result, Scenario, Sizes
from bench.throughput import run_baseline, run_sidecar


class Runner:
    """Runs scenarios against one emulators process; ``workdir`` holds the sidecar configs."""

    def __init__(self, emulators: Emulators, pubsub: PubSub, sizes: Sizes, workdir: Path) -> None:
        self.context = RunContext(emulators, pubsub, sizes, workdir)

    async def run(self, scenario: Scenario) -> Result:
        if scenario.kind == "baseline":
            return await run_baseline(self.context, scenario)
        if scenario.kind == "sidecar":
            return await run_sidecar(self.context, scenario)
        if scenario.kind == "held":
            return await run_held_gap(self.context, scenario)
        if scenario.kind == "cost":
            return await run_cost(self.context, scenario)
        if scenario.kind == "scale-out":
            return await run_scale_out(self.context, scenario)
        if scenario.kind == "relay":
            return await run_relay(self.context, scenario)
        return await run_recovery(self.context, scenario)
