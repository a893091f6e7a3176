"""Wider sampling of the sequence-mode property test, restricted to gap skips (on_gap_timeout: skip).

The property test runs 300 derandomized examples; this calls its inner function over many seeded
draws of the same parameter space (same draws as the script that found the gap-skip defects) and
prints every failing draw, then the totals. Usage: ``.venv/bin/python scripts/widen_gap_skip.py [N]``
(default 3,000 draws).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "engine"))

import test_properties

inner = test_properties.test_sequence_mode_keeps_order_dedup_and_loses_nothing.hypothesis.inner_test  # type: ignore[attr-defined]


def draw(seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    return dict(
        seed=seed,
        keys=rng.randint(1, 3),
        per_key=rng.randint(1, 7),
        max_in_flight=rng.choice([1, 1, 2, 3]),
        attempts=rng.randint(1, 4),
        gap=rng.choice([(30, "skip"), (0, "skip")]),
        on_late=rng.choice(["dead_letter", "deliver"]),
        on_dead_letter=rng.choice(["block", "skip"]),
        drop_rate=rng.choice([0.0, 0.2]),
        steps=rng.randint(0, 150),
    )


def main() -> int:
    draws = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    assertions = errors = 0
    for seed in range(draws):
        args = draw(seed)
        try:
            inner(**args)
        except AssertionError as exc:
            assertions += 1
            print(f"AssertionError {args}: {str(exc)[:160]}")
        except Exception as exc:  # any other exception is an engine crash: report it
            errors += 1
            print(f"{type(exc).__name__} {args}: {exc}")
    print(f"draws {draws}: assertion failures {assertions}, other exceptions {errors}")
    return 1 if assertions or errors else 0


if __name__ == "__main__":
    sys.exit(main())
