"""The baseline: Google's official subscriber with a no-op callback, in a process of its own.

``python -m bench.baseline_process SUBSCRIPTION`` (with ``PUBSUB_EMULATOR_HOST`` set) acks every
message at once. It runs apart from the bench process, which publishes, so that its CPU time
(``/proc/<pid>/stat``) is the subscriber's alone, as the sidecar's is the sidecar's: the bench
reports the sidecar's CPU per message as a ratio to this one.

Protocol, one JSON object per stdout line: ``{"received": n, "last_at": t}`` whenever the count
changed (at most every 20 ms); after SIGTERM, ``{"received": n, "last_at": t, "latencies": [...],
"final": true}`` (latencies in seconds of the messages published with ``phase=latency``), then exit 0.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from typing import Any

from bench.pubsub_clients import TIMESTAMP_ATTRIBUTE, subscriber_client

_REPORT_SECONDS = 0.02


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m bench.baseline_process SUBSCRIPTION", file=sys.stderr)
        return 2
    lock = threading.Lock()
    state: dict[str, Any] = {"received": 0, "last_at": 0.0}
    latencies: list[float] = []
    stop = threading.Event()

    def callback(message: Any) -> None:
        now = time.time()
        message.ack()
        with lock:
            state["received"] += 1
            state["last_at"] = now
            if message.attributes.get("phase") == "latency":
                latencies.append(now - float(message.attributes[TIMESTAMP_ATTRIBUTE]))

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    subscriber = subscriber_client()
    future = subscriber.subscribe(argv[0], callback)
    reported = -1
    while not stop.wait(_REPORT_SECONDS):
        with lock:
            snapshot = dict(state)
        if snapshot["received"] != reported:
            reported = snapshot["received"]
            print(json.dumps(snapshot), flush=True)
    future.cancel()
    future.result(timeout=30)
    subscriber.close()
    with lock:
        print(json.dumps({**state, "latencies": latencies, "final": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
