"""The Pub/Sub emulator's admin routes (on the admin HTTP API): delays, clock, RPC counters, leases.

| route | effect |
|---|---|
| ``GET/POST/DELETE /pubsub/delay`` | new messages of a subscription (or all) become deliverable only after a delay |
| ``GET/POST /pubsub/clock`` | move the emulator's clock forward, so that messages age (retention, snapshots) |
| ``GET /pubsub/counters``, ``POST /pubsub/counters/reset`` | Acknowledge and ModifyAckDeadline calls and ack ids |
| ``GET /pubsub/leases?subscription=S`` | outstanding leases with seconds left and extensions so far: how long a |
| | message stays hidden if its holder dies now |
| ``GET /pubsub/unacked?subscription=S`` | unacked messages, oldest first, with their last events |
| ``GET /pubsub/finished?subscription=S`` | the last 1,000 acked or dead-lettered messages with their last events |
| ``GET /pubsub/streams?subscription=S`` | open StreamingPull streams: number, client id, flow control, unwritten |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from aiohttp import web

from sidecar.emulators.pubsub_counters import RpcCounters
from sidecar.emulators.pubsub_model import Subscription
from sidecar.emulators.pubsub_names import InvalidName, parse_subscription
from sidecar.emulators.pubsub_replay import Replay
from sidecar.emulators.pubsub_state import Broker

MAX_CLOCK_ADVANCE_SECONDS = 400 * 24 * 3600
"""More than a year ahead has no use (31 days is the longest retention)."""


class PubsubAdmin:
    """Handlers of the Pub/Sub admin routes over one broker."""

    def __init__(self, broker: Broker, replay: Replay, counters: RpcCounters) -> None:
        self.broker = broker
        self.replay = replay
        self.counters = counters

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/pubsub/delay", self._get_delay),
            web.post("/pubsub/delay", self._post_delay),
            web.delete("/pubsub/delay", self._delete_delay),
            web.get("/pubsub/clock", self._get_clock),
            web.post("/pubsub/clock", self._post_clock),
            web.get("/pubsub/counters", self._get_counters),
            web.post("/pubsub/counters/reset", self._reset_counters),
            web.get("/pubsub/leases", self._get_leases),
            web.get("/pubsub/unacked", self._get_unacked),
            web.get("/pubsub/finished", self._get_finished),
            web.get("/pubsub/streams", self._get_streams),
        ]

    # -- RPC counters and leases -------------------------------------------------------------

    async def _get_counters(self, request: web.Request) -> web.Response:
        return web.json_response(asdict(self.counters))

    async def _reset_counters(self, request: web.Request) -> web.Response:
        self.counters.reset()
        return web.json_response(asdict(self.counters))

    async def _get_leases(self, request: web.Request) -> web.Response:
        return self._report(request, self.broker.lease_report)

    async def _get_unacked(self, request: web.Request) -> web.Response:
        return self._report(request, self.broker.unacked_report)

    async def _get_finished(self, request: web.Request) -> web.Response:
        return self._report(request, self.broker.finished_report)

    async def _get_streams(self, request: web.Request) -> web.Response:
        return self._report(request, self.broker.stream_report)

    def _report(self, request: web.Request, report: Callable[[Subscription], list[dict[str, Any]]]) -> web.Response:
        name = request.query.get("subscription", "")
        try:
            parse_subscription(name)
        except InvalidName as exc:
            return web.json_response({"error": f"subscription: {exc}"}, status=400)
        sub = self.broker.subscriptions.get(name)
        if sub is None:
            return web.json_response({"error": f"subscription: {name} does not exist"}, status=404)
        return web.json_response(report(sub))

    # -- delay deliveries --------------------------------------------------------------------

    async def _get_delay(self, request: web.Request) -> web.Response:
        return web.json_response(self.broker.delivery_delay_seconds)

    async def _post_delay(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            seconds = float(body["seconds"])
            target = str(body.get("subscription", "*"))
        except (ValueError, KeyError, TypeError) as exc:
            reason = f"expected JSON {{'seconds': N, 'subscription'?: name}}: {exc}"
            return web.json_response({"error": reason}, status=400)
        if not 0 <= seconds <= 3600:
            return web.json_response({"error": "seconds: must be between 0 and 3600"}, status=400)
        if target != "*":
            try:
                parse_subscription(target)
            except InvalidName as exc:
                return web.json_response({"error": f"subscription: {exc}"}, status=400)
        self.broker.delivery_delay_seconds[target] = seconds
        return web.json_response(self.broker.delivery_delay_seconds)

    async def _delete_delay(self, request: web.Request) -> web.Response:
        self.broker.delivery_delay_seconds.clear()
        return web.json_response({})

    # -- the clock ------------------------------------------------------------------

    def _clock_body(self) -> dict[str, float]:
        return {"offset_seconds": self.broker.clock_offset_ns / 1e9}

    async def _get_clock(self, request: web.Request) -> web.Response:
        return web.json_response(self._clock_body())

    async def _post_clock(self, request: web.Request) -> web.Response:
        """Move the emulator's clock forward (never back): messages age, retention and snapshots expire."""
        try:
            body = await request.json()
            seconds = float(body["advance_seconds"])
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"expected JSON {{'advance_seconds': N}}: {exc}"}, status=400)
        if not 0 <= seconds <= MAX_CLOCK_ADVANCE_SECONDS:
            return web.json_response(
                {"error": f"advance_seconds: must be between 0 and {MAX_CLOCK_ADVANCE_SECONDS}"}, status=400
            )
        self.broker.clock_offset_ns += int(seconds * 1e9)
        self.replay.expunge()
        return web.json_response(self._clock_body())
