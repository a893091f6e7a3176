"""Explore the crash simulation with many seeded random runs, beyond what ``make test`` runs.

    .venv/bin/python scripts/explore_crashes.py --runs 2000 [--steps 120] [--first-seed 0]

Each run draws a configuration (keys, window, attempts, policies, gaps, conflicts, memory budget,
idle keys, pods and shards) and a list of operations from its seed, plays them through ``tests/store/crash_sim.py``
(crashes included), drains, and checks G1-G3 and liveness. Prints each violation with its seed
(rerun one with ``--runs 1 --first-seed N``) and the totals: crashes, crash points inside store
writes, shard handovers, writes fenced off an old owner, confirmed acks, dead letters. Exit code 1
when any run broke a guarantee.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "store"))

from crash_sim import Simulation
from sim_world import SimConfig


def draw(seed: int, steps: int) -> tuple[SimConfig, list[tuple[str, int]]]:
    rng = random.Random(seed)
    keys, per_key = rng.randint(1, 3), rng.randint(1, 6)
    identities = [(f"k{k}", seq) for k in range(keys) for seq in range(1, per_key + 1)]
    skip = rng.random() < 0.5
    unpublished = frozenset(rng.sample(identities, min(len(identities), rng.randint(0, 2)))) if skip else frozenset()
    conflicts = frozenset(rng.sample(identities, min(len(identities), rng.randint(0, 1)))) - unpublished
    config = SimConfig(
        keys=keys,
        per_key=per_key,
        max_in_flight=rng.randint(1, 3),
        max_attempts=rng.randint(1, 3),
        on_dead_letter=rng.choice(["block", "skip"]),
        gap_timeout_ms=1_000 if skip else None,
        on_gap_timeout="skip" if skip else "hold",
        on_late=rng.choice(["dead_letter", "deliver"]),
        unpublished=unpublished,
        conflicts=conflicts,
        tombstones_per_commit=rng.randint(1, 3),
        max_held_bytes=rng.choice([None, 0, 20]),
        max_idle_keys=rng.choice([0, 1, 10_000]),
        pods=rng.randint(1, 3),
        shards=rng.randint(1, 3),
    )
    operations = [(rng.choice(Simulation.OPS), rng.randint(0, 1_000)) for _ in range(steps)]
    return config, operations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1_000)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("sidecar.store").setLevel(logging.ERROR)  # every fenced write logs a lost shard
    totals = dict.fromkeys(
        ("runs", "violations", "crashes", "crash_points", "handovers", "fenced", "confirmed", "dead_lettered"), 0
    )
    for seed in range(args.first_seed, args.first_seed + args.runs):
        config, operations = draw(seed, args.steps)
        sim = Simulation(config)
        try:
            sim.run(operations)
        except AssertionError as exc:
            totals["violations"] += 1
            print(f"seed {seed}: {exc}", flush=True)
        totals["runs"] += 1
        totals["crashes"] += sim.crashes
        totals["crash_points"] += sim.crash_points
        totals["handovers"] += sim.handovers
        totals["fenced"] += sim.fenced_writes
        totals["confirmed"] += len(sim.confirmed)
        totals["dead_lettered"] += len(sim.dead_lettered)
    print(" ".join(f"{name}={value}" for name, value in totals.items()))
    return 1 if totals["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
