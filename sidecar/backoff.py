"""Capped exponential backoff with jitter: the one helper every retry loop of the sidecar uses.

The delay for the ``attempt``-th consecutive failure (0-based) is drawn uniformly from half to all
of ``min(maximum, initial * 2**attempt)``: growing fast enough that an outage costs few calls, capped
so a recovered dependency is used again soon, and jittered so that many tasks (or pods) that failed
together do not retry together.
"""

from __future__ import annotations

import random

_MAX_EXPONENT = 32
"""Past this, 2**attempt only overflows floats for nothing: every realistic cap is reached long before."""


def backoff_seconds(attempt: int, initial: float, maximum: float) -> float:
    """Seconds to wait before retry number ``attempt + 1``."""
    if attempt < 0 or initial <= 0 or maximum < initial:
        raise ValueError(f"backoff: need attempt >= 0 and 0 < initial <= maximum, got {attempt}, {initial}, {maximum}")
    ceiling = min(maximum, initial * 2 ** min(attempt, _MAX_EXPONENT))
    return random.uniform(ceiling / 2, ceiling)
