"""Long exploration of the crash simulation, with the totals of what it explored.

    .venv/bin/python tests/store/explore_crash_sim.py --runs 2000 [--pods 2] [--seed 1]

Draws configurations and operation lists from the property tests' own strategies (random, not
derandomized: each seed explores other runs), runs each to the end (drain and the final checks),
and prints how many runs, crash points (crashes inside a store write), crashes, shard hand-overs,
fenced writes, brownout-refused writes and stale acks refused they went through. A failing run is
printed with its configuration and steps, and the exit code is 1. Not collected by pytest: the
suite runs the derandomized property tests; this is for the long runs quoted in docs/store.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from crash_sim import Simulation
from crash_sim_support import sim_configs
from hypothesis import strategies as st
from sim_world import SimConfig

_COUNTERS = ("crash_points", "crashes", "handovers", "fenced_writes", "unavailable", "stale_acks", "pages_restored")


def _steps(rng: random.Random, count: int) -> list[tuple[str, int]]:
    ops = (*Simulation.OPS, "crash", "take_over", "lose_lease", "brownout", "page")
    return [(rng.choice(ops), rng.randrange(1_000)) for _ in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--pods", type=int, default=None, help="force this many pods (default: drawn, 1-3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    configs = sim_configs()
    totals: Counter[str] = Counter()
    multi_pod = 0
    for run in range(args.runs):
        config: SimConfig = _draw(configs, rng)
        if args.pods is not None:
            config = dataclasses.replace(config, pods=args.pods, shards=max(config.shards, 1))
        steps = _steps(rng, rng.randint(30, args.steps))
        sim = Simulation(config)
        try:
            sim.run(steps)
        except Exception:
            print(f"run {run} failed\nconfig: {config}\nsteps: {steps}", file=sys.stderr)
            traceback.print_exc()
            return 1
        multi_pod += config.pods > 1
        for name in _COUNTERS:
            totals[name] += getattr(sim, name)
    print(f"{args.runs} runs ({multi_pod} with several pods): " + ", ".join(f"{n} {totals[n]}" for n in _COUNTERS))
    return 0


def _draw(strategy: st.SearchStrategy[SimConfig], rng: random.Random) -> SimConfig:
    """One configuration: the strategy's example (hypothesis' own randomness), with the fast path
    and paged recovery drawn from ``rng`` so that a seed sets what the runs cover most."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # example() outside a test is what this script is for
        config = strategy.example()
    return dataclasses.replace(config, fast_path=rng.random() < 0.5, paged=rng.random() < 0.5)


if __name__ == "__main__":
    sys.exit(main())
