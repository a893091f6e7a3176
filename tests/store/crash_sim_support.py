"""What the crash simulation's tests share: how many examples a property test runs, the configs it
draws, and how an explicit run ends.

The property tests are deterministic (derandomized) and sized for ``make test``; set
``CRASH_SIM_EXAMPLES`` (e.g. 5000) to explore longer. An explicit run ends with ``_finish``: drain
everything, check the end state (G1-G3 and liveness), close the simulation even when a check fails.
"""

from __future__ import annotations

import os

from crash_sim import Simulation
from hypothesis import strategies as st
from sim_world import SimConfig

_EXAMPLES = int(os.environ.get("CRASH_SIM_EXAMPLES", "150"))
_PAGED_EXAMPLES = int(os.environ.get("CRASH_SIM_EXAMPLES", "80"))


@st.composite
def sim_configs(draw: st.DrawFn) -> SimConfig:
    keys = draw(st.integers(1, 3))
    per_key = draw(st.integers(1, 6))
    identities = [(f"k{k}", seq) for k in range(keys) for seq in range(1, per_key + 1)]
    skip = draw(st.booleans())
    unpublished = frozenset(draw(st.sets(st.sampled_from(identities), max_size=2))) if skip else frozenset()
    conflicts = frozenset(draw(st.sets(st.sampled_from(identities), max_size=2))) - unpublished
    return SimConfig(
        keys=keys,
        per_key=per_key,
        max_in_flight=draw(st.integers(1, 3)),
        max_attempts=draw(st.integers(1, 3)),
        on_dead_letter=draw(st.sampled_from(["block", "skip"])),
        gap_timeout_ms=1_000 if skip else None,
        on_gap_timeout="skip" if skip else "hold",
        on_late=draw(st.sampled_from(["dead_letter", "deliver"])),
        unpublished=unpublished,
        conflicts=conflicts,
        malformed=draw(st.integers(0, 1)),
        tombstones_per_commit=draw(st.integers(1, 3)),
        max_held_bytes=draw(st.sampled_from([None, 0, 20])),
        max_idle_keys=draw(st.sampled_from([0, 1, 10_000])),
        pods=draw(st.integers(1, 3)),
        shards=draw(st.integers(1, 3)),
        fast_path=draw(st.booleans()),
        paged=draw(st.booleans()),
        page_size=draw(st.integers(1, 3)),
    )


def _finish(sim: Simulation) -> None:
    try:
        sim.drain()
        sim.check_end()
    finally:
        sim.close()
