"""Crash at any point between two store writes, recover, go on: G1-G3 and liveness hold (crash_sim.py),
for any generated run, and while recovery reads pending records by pages.

Each defect the recovery rules fix is kept as an explicit example, named for the rule it pins down,
in the other ``test_crash_*.py`` files.
"""

from __future__ import annotations

import dataclasses

from crash_sim import Simulation
from crash_sim_support import _EXAMPLES, _PAGED_EXAMPLES, sim_configs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_world import SimConfig

_STEPS = st.lists(st.tuples(st.sampled_from(Simulation.OPS), st.integers(0, 1_000)), max_size=120)


@settings(
    max_examples=_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(config=sim_configs(), steps=_STEPS)
def test_any_crash_point_keeps_every_guarantee(config: SimConfig, steps: list[tuple[str, int]]) -> None:
    Simulation(config).run(steps)


# Paged recoveries only, in longer runs with more crashes, take-overs and pages: the short runs
# above rarely crash with messages pending, and a paged load matters only when pages race the
# acks, dead letters, drops, flushes and intake of the shard that is loading.
_PAGED_STEPS = st.lists(
    st.tuples(st.sampled_from((*Simulation.OPS, "crash", "take_over", "page", "page")), st.integers(0, 1_000)),
    min_size=30,
    max_size=120,
)


@settings(
    max_examples=_PAGED_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(config=sim_configs().map(lambda config: dataclasses.replace(config, paged=True)), steps=_PAGED_STEPS)
def test_any_crash_point_keeps_every_guarantee_while_pages_are_read(
    config: SimConfig, steps: list[tuple[str, int]]
) -> None:
    Simulation(config).run(steps)
