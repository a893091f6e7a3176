"""What every scenario of one run shares: the emulators process, the Pub/Sub clients, the size
profile and the directory of the sidecars' config files.

Rules this module keeps:
- A scenario gets its own subscription (``new_subscription``: the scenario's name and a random tail)
  and its own Firestore root, so one scenario's traffic and documents never reach another's figures.
- Scenario modules take a ``RunContext``, never the runner that dispatches to them: no scenario
  module imports ``bench.runner``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.emulators_process import Emulators
from bench.pubsub_clients import PubSub
from bench.scenarios import Sizes


@dataclass(frozen=True, slots=True)
class RunContext:
    """One run's shared resources; ``workdir`` holds the sidecar configs."""

    emulators: Emulators
    pubsub: PubSub
    sizes: Sizes
    workdir: Path

    def new_subscription(self, name: str) -> str:
        """A new topic and subscription named ``name`` with a random tail; returns the subscription."""
        return self.pubsub.create(f"{name}-{uuid.uuid4().hex[:8]}")
