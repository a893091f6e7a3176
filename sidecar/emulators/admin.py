"""The emulators' HTTP admin API (aiohttp): fault injection at run time, stream breaking, health.

Routes (JSON in and out; bad input is 400 with ``{"error": reason}``, never a crash):
- ``GET /healthz``: ``{"status": "ok"}``;
- ``GET /faults``: the active rules; ``POST /faults``: add one rule (``FaultRule.from_json``), answers
  the rule with its id; ``DELETE /faults[?service=S]``: remove all rules (of one service). A rule
  fails calls before they run, or with ``"lose_reply": true`` after they ran (a write applied whose
  answer never came; unary calls only);
- ``POST /streams/break`` ``{"service": "pubsub", "code": "UNAVAILABLE"}``: end that service's open
  streams with the code, answers how many were broken.
Each emulator adds its own routes through ``build_admin_app(injector, extra_routes)``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

import grpc
from aiohttp import web

from sidecar.emulators.faults import FaultInjector, FaultRule

_LOGGER = logging.getLogger(__name__)

_INJECTOR_KEY = web.AppKey("injector", FaultInjector)
_SERVICES = ("pubsub", "firestore", "monitoring")


def _bad_request(reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=400)


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"body: not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    return body


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _list_faults(request: web.Request) -> web.Response:
    return web.json_response([rule.to_json() for rule in request.app[_INJECTOR_KEY].rules()])


async def _add_fault(request: web.Request) -> web.Response:
    try:
        rule = FaultRule.from_json(await _json_object(request))
    except (ValueError, TypeError) as exc:
        return _bad_request(str(exc))
    request.app[_INJECTOR_KEY].add(rule)
    _LOGGER.info("fault added: %s", rule.to_json())
    return web.json_response(rule.to_json(), status=201)


async def _clear_faults(request: web.Request) -> web.Response:
    service = request.query.get("service")
    if service is not None and service not in _SERVICES:
        return _bad_request(f"service: must be one of {', '.join(_SERVICES)}")
    request.app[_INJECTOR_KEY].clear(service)
    return web.json_response({"cleared": service or "all"})


async def _break_streams(request: web.Request) -> web.Response:
    try:
        body = await _json_object(request)
    except ValueError as exc:
        return _bad_request(str(exc))
    service = body.get("service", "pubsub")
    if service not in _SERVICES:
        return _bad_request(f"service: must be one of {', '.join(_SERVICES)}")
    code_name = str(body.get("code", "UNAVAILABLE")).upper()
    try:
        code = grpc.StatusCode[code_name]
    except KeyError:
        return _bad_request(f"code: unknown gRPC status code {code_name!r}")
    if code is grpc.StatusCode.OK:
        return _bad_request("code: OK would end the subscriber for good; use a retryable code such as UNAVAILABLE")
    broken = await request.app[_INJECTOR_KEY].break_streams(service, code)
    return web.json_response({"service": service, "code": code.name, "broken": broken})


def build_admin_app(injector: FaultInjector, extra_routes: Iterable[web.RouteDef] = ()) -> web.Application:
    app = web.Application()
    app[_INJECTOR_KEY] = injector
    app.add_routes(
        [
            web.get("/healthz", _healthz),
            web.get("/faults", _list_faults),
            web.post("/faults", _add_fault),
            web.delete("/faults", _clear_faults),
            web.post("/streams/break", _break_streams),
            *extra_routes,
        ]
    )
    return app
