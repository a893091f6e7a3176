"""Several running sidecars watched at once: their readiness over time (``ReadinessWatch``), a
subscription drained everywhere, shards spread over the pods.

Rules: seen only from outside (``/readyz``, ``/metrics``, ``GetStatus`` and the emulators' admin
API), and every wait has a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from e2e_processes import EmulatorsProcess, SidecarProcess
from e2e_waits import async_poll, async_wait_until_threaded

from pubsub_sidecar_client.status import get_status


class ReadinessWatch:
    """Polls ``/readyz`` of several sidecars, each from its own thread, keeping every answer with its
    time (monotonic clock; status 0 when the pod did not answer within 5 s)."""

    def __init__(self, sidecars: Sequence[SidecarProcess], interval_seconds: float = 0.1) -> None:
        self.sidecars = list(sidecars)
        self.answers: list[list[tuple[float, int]]] = [[] for _ in self.sidecars]
        self._interval = interval_seconds
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._poll, args=(index,), daemon=True) for index in range(len(self.sidecars))
        ]

    def __enter__(self) -> ReadinessWatch:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _poll(self, index: int) -> None:
        while not self._stop.is_set():
            status, _body = self.sidecars[index].http_get("/readyz")
            self.answers[index].append((time.monotonic(), status))
            self._stop.wait(self._interval)

    def first_unready(self, index: int, since: float) -> float | None:
        return next((at for at, status in list(self.answers[index]) if at >= since and status != 200), None)

    def ready_since(self, index: int, since: float) -> float | None:
        """When pod ``index`` first answered 200 at or after ``since`` (None: not yet)."""
        return next((at for at, status in list(self.answers[index]) if at >= since and status == 200), None)

    def all_ready_since(self, since: float) -> list[float] | None:
        """Each pod's first 200 at or after ``since``, once every pod has one."""
        times = [self.ready_since(index, since) for index in range(len(self.sidecars))]
        return None if any(at is None for at in times) else [at for at in times if at is not None]


async def async_wait_drained(
    emulators: EmulatorsProcess, sidecars: Sequence[SidecarProcess], sub_name: str, subscription: str
) -> None:
    """Nothing left in flight anywhere: every running sidecar buffers nothing of ``sub_name`` and
    Pub/Sub has no lease on ``subscription`` (every message pulled was acked, or given back and
    taken again), twice in a row half a second apart. Dead letters are published before the
    message is acked in Pub/Sub, so after this the dead-letter topic holds all it will get."""
    quiet_since: float | None = None

    def drained() -> bool:
        nonlocal quiet_since
        quiet = not emulators.leases(subscription) and all(
            sidecar.metric("pubsub_sidecar_buffered_messages", subscription=sub_name) == 0
            for sidecar in sidecars
            if sidecar.returncode is None
        )
        if not quiet:
            quiet_since = None
            return False
        quiet_since = quiet_since or time.monotonic()
        return time.monotonic() - quiet_since >= 0.5

    await async_wait_until_threaded(drained, f"{sub_name} to drain (no buffered message, no Pub/Sub lease)")


async def async_wait_shards_spread(listens: Sequence[str], sub_name: str, shards: int) -> dict[int, set[int]]:
    """Wait until the pods at ``listens`` (gRPC targets) hold every shard between them, each at
    least its floor share; returns pod index -> shards held (from GetStatus)."""

    async def spread() -> dict[int, set[int]] | None:
        owned: dict[int, set[int]] = {}
        for index, listen in enumerate(listens):
            try:
                response = await get_status(listen, sub_name)
            except Exception:
                return None  # not serving yet
            owned[index] = {shard.shard for shard in response.subscriptions[0].shards}
        held = sorted(shard for shards_held in owned.values() for shard in shards_held)
        fair = all(len(shards_held) >= shards // len(listens) for shards_held in owned.values())
        return owned if held == list(range(shards)) and fair else None

    return await async_poll(spread, f"{shards} shards spread over {len(listens)} pods")
