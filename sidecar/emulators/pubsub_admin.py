"""The Pub/Sub emulator's admin routes: delivery delays, RPC counters and the lease report.

- ``POST/GET/DELETE /pubsub/delay``: new messages become deliverable only after a delay (a fault).
- ``GET /pubsub/counters``, ``POST /pubsub/counters/reset``: how many Acknowledge and
  ModifyAckDeadline calls (unary, or carried on a StreamingPull stream) the clients made, and how
  many ack ids they carried. Modacks are what a subscriber's lease management costs; counting them
  at the server measures the official client as it is, with nothing added to it.
- ``GET /pubsub/leases?subscription=S``: the subscription's outstanding leases, each with the
  seconds left before it expires and the deadline changes it got. This is how long a message stays
  hidden if its holder dies now.

Bad input is HTTP 400 with ``{"error": "<field>: <reason>"}``, as on the shared admin routes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from aiohttp import web

from sidecar.emulators.pubsub_names import InvalidName, parse_subscription
from sidecar.emulators.pubsub_state import Broker


@dataclass(slots=True)
class RpcCounters:
    """Acknowledge and ModifyAckDeadline traffic; a nack is a modack to 0 and counted apart."""

    acknowledge_calls: int = 0
    acknowledge_ack_ids: int = 0
    modify_ack_deadline_calls: int = 0
    """Calls that change deadlines (seconds > 0): receipt modacks and lease extensions."""
    modify_ack_deadline_ack_ids: int = 0
    nack_calls: int = 0
    """ModifyAckDeadline calls with 0 seconds."""
    nack_ack_ids: int = 0

    def count_ack(self, ack_ids: int) -> None:
        self.acknowledge_calls += 1
        self.acknowledge_ack_ids += ack_ids

    def count_modack(self, seconds: int, ack_ids: int) -> None:
        if seconds == 0:
            self.nack_calls += 1
            self.nack_ack_ids += ack_ids
        else:
            self.modify_ack_deadline_calls += 1
            self.modify_ack_deadline_ack_ids += ack_ids

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


def _error(reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=400)


def admin_routes(broker: Broker, counters: RpcCounters) -> list[web.RouteDef]:
    async def get_delay(request: web.Request) -> web.Response:
        return web.json_response(broker.delivery_delay_seconds)

    async def post_delay(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            seconds = float(body["seconds"])
            target = str(body.get("subscription", "*"))
        except (ValueError, KeyError, TypeError) as exc:
            return _error(f"expected JSON {{'seconds': N, 'subscription'?: name}}: {exc}")
        if not 0 <= seconds <= 3600:
            return _error("seconds: must be between 0 and 3600")
        if target != "*":
            try:
                parse_subscription(target)
            except InvalidName as exc:
                return _error(f"subscription: {exc}")
        broker.delivery_delay_seconds[target] = seconds
        return web.json_response(broker.delivery_delay_seconds)

    async def delete_delay(request: web.Request) -> web.Response:
        broker.delivery_delay_seconds.clear()
        return web.json_response({})

    async def get_counters(request: web.Request) -> web.Response:
        return web.json_response(asdict(counters))

    async def reset_counters(request: web.Request) -> web.Response:
        counters.reset()
        return web.json_response(asdict(counters))

    async def get_leases(request: web.Request) -> web.Response:
        name = request.query.get("subscription", "")
        try:
            parse_subscription(name)
        except InvalidName as exc:
            return _error(f"subscription: {exc}")
        sub = broker.subscriptions.get(name)
        if sub is None:
            return web.json_response({"error": f"subscription: {name} does not exist"}, status=404)
        return web.json_response(broker.lease_report(sub))

    return [
        web.get("/pubsub/delay", get_delay),
        web.post("/pubsub/delay", post_delay),
        web.delete("/pubsub/delay", delete_delay),
        web.get("/pubsub/counters", get_counters),
        web.post("/pubsub/counters/reset", reset_counters),
        web.get("/pubsub/leases", get_leases),
    ]
