"""Fault injection for the emulators, switchable at run time.

A rule fails calls to one RPC (or all, ``method="*"``) of one emulator with a status code at a
rate, and/or delays them. A rule with ``lose_reply`` lets the call run and fails its answer
instead: a write that applied although its caller saw an error (production's "outcome unknown"),
which a caller's retry then meets as a duplicate or a failed precondition. Rules are applied by a
gRPC server interceptor, so the emulators' servicers need not know about faults at all.
Stream-specific faults (breaking open StreamingPull streams) are the Pub/Sub emulator's own; they
hang off the same injector via ``stream_breakers``.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

_LOGGER_NAME = __name__


@dataclass(slots=True)
class FaultRule:
    """Fail ``rate`` of the calls to ``service``/``method`` with ``code``, after ``delay_seconds``.

    ``service`` is "pubsub", "firestore" or "monitoring"; ``method`` the bare RPC name
    ("Commit", "StreamingPull") or "*". ``code`` None means delay only. ``remaining`` bounds how
    many calls the rule fails (None: no bound). ``writes_to`` (Firestore Commit and BatchWrite) limits
    the rule to requests writing a document whose name contains that text, e.g. "/messages/" slows
    a sidecar's message writes and leaves its lease renewals alone. ``lose_reply`` runs the call
    first and then fails it with ``code``: only unary calls (Commit, BatchWrite, Acknowledge,
    Publish...) have a reply to lose, so streaming calls ignore such a rule.
    """

    service: str
    method: str = "*"
    code: grpc.StatusCode | None = grpc.StatusCode.UNAVAILABLE
    rate: float = 1.0
    delay_seconds: float = 0.0
    remaining: int | None = None
    rule_id: int = 0
    writes_to: str | None = None
    lose_reply: bool = False

    def matches(self, service: str, method: str, request: Any = None) -> bool:
        if self.service != service or self.method not in ("*", method):
            return False
        if self.writes_to is None:
            return True
        writes = getattr(request, "writes", None) or ()
        return any(self.writes_to in (w.update.name or w.delete) for w in writes)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.rule_id,
            "service": self.service,
            "method": self.method,
            "code": self.code.name if self.code else None,
            "rate": self.rate,
            "delay_seconds": self.delay_seconds,
            "remaining": self.remaining,
            "writes_to": self.writes_to,
            "lose_reply": self.lose_reply,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> FaultRule:
        """Build a rule from the admin API's JSON; raises ValueError naming the bad field."""
        service = body.get("service")
        if service not in ("pubsub", "firestore", "monitoring"):
            raise ValueError("service: must be one of pubsub, firestore, monitoring")
        code_name = body.get("code", "UNAVAILABLE")
        code: grpc.StatusCode | None = None
        if code_name is not None:
            try:
                code = grpc.StatusCode[str(code_name).upper()]
            except KeyError:
                raise ValueError(f"code: unknown gRPC status code {code_name!r}") from None
            if code is grpc.StatusCode.OK:
                raise ValueError("code: OK is not a fault; use null for a delay-only rule")
        rate = float(body.get("rate", 1.0))
        if not 0.0 <= rate <= 1.0:
            raise ValueError("rate: must be between 0 and 1")
        delay = float(body.get("delay_seconds", 0.0))
        if delay < 0:
            raise ValueError("delay_seconds: must not be negative")
        remaining = body.get("remaining")
        if remaining is not None and int(remaining) < 0:
            raise ValueError("remaining: must not be negative")
        writes_to = body.get("writes_to")
        if writes_to is not None and (not isinstance(writes_to, str) or not writes_to):
            raise ValueError("writes_to: must be a non-empty string (part of a document name)")
        lose_reply = body.get("lose_reply", False)
        if not isinstance(lose_reply, bool):
            raise ValueError("lose_reply: must be true or false")
        if lose_reply and code is None:
            raise ValueError("lose_reply: needs a code to fail the reply with")
        return cls(
            service=service,
            method=str(body.get("method", "*")),
            code=code,
            rate=rate,
            delay_seconds=delay,
            remaining=None if remaining is None else int(remaining),
            writes_to=writes_to,
            lose_reply=lose_reply,
        )


@dataclass(frozen=True, slots=True)
class FaultDecision:
    """One call's fate: wait ``delay_seconds``, then fail with ``code`` (None: run normally), before
    the call runs or, with ``lose_reply``, after it ran (its effect stays, its answer is lost)."""

    delay_seconds: float
    code: grpc.StatusCode | None
    lose_reply: bool


@dataclass
class FaultInjector:
    """The set of active rules, shared by all emulators of one process (thread-safe)."""

    seed: int | None = None
    _rules: list[FaultRule] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _random: random.Random = field(init=False)
    stream_breakers: dict[str, Callable[[grpc.StatusCode], Awaitable[int]]] = field(default_factory=dict)
    """service -> coroutine that breaks that service's open streams with a code, returning how many."""

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def add(self, rule: FaultRule) -> FaultRule:
        with self._lock:
            rule.rule_id = next(self._ids)
            self._rules.append(rule)
        return rule

    def clear(self, service: str | None = None) -> None:
        with self._lock:
            self._rules = [r for r in self._rules if service is not None and r.service != service]

    def rules(self) -> list[FaultRule]:
        with self._lock:
            return list(self._rules)

    def decide(self, service: str, method: str, request: Any = None) -> tuple[float, grpc.StatusCode | None]:
        """(delay in seconds, code to fail with or None) for one streaming call (no reply to lose)."""
        decision = self.decide_call(service, method, request, unary=False)
        return decision.delay_seconds, decision.code

    def decide_call(self, service: str, method: str, request: Any = None, *, unary: bool) -> FaultDecision:
        """What to do with one call: its delay, and the code to fail it with before it runs or,
        for a unary call hit by a ``lose_reply`` rule, after it ran."""
        delay = 0.0
        with self._lock:
            for rule in self._rules:
                if not rule.matches(service, method, request):
                    continue
                delay = max(delay, rule.delay_seconds)
                if rule.code is None or rule.remaining == 0 or (rule.lose_reply and not unary):
                    continue
                if self._random.random() < rule.rate:
                    if rule.remaining is not None:
                        rule.remaining -= 1
                    return FaultDecision(delay, rule.code, rule.lose_reply)
        return FaultDecision(delay, None, False)

    async def break_streams(self, service: str, code: grpc.StatusCode) -> int:
        breaker = self.stream_breakers.get(service)
        return 0 if breaker is None else await breaker(code)


class FaultInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpcio ships no types
    """Applies the injector's rules to every RPC of one emulator's server."""

    def __init__(self, injector: FaultInjector, service: str) -> None:
        self._injector = injector
        self._service = service

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        return _wrap(handler, self._injector, self._service, method)


def _wrap(handler: grpc.RpcMethodHandler, injector: FaultInjector, service: str, method: str) -> Any:
    async def apply(context: grpc.aio.ServicerContext, request: Any = None) -> None:
        delay, code = injector.decide(service, method, request)
        if delay:
            await asyncio.sleep(delay)
        if code is not None:
            await context.abort(code, f"injected fault: {code.name} on {service}/{method}")

    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            decision = injector.decide_call(service, method, request, unary=True)
            if decision.delay_seconds:
                await asyncio.sleep(decision.delay_seconds)
            if decision.code is not None and not decision.lose_reply:
                await context.abort(decision.code, f"injected fault: {decision.code.name} on {service}/{method}")
            response = await inner_uu(request, context)
            if decision.code is not None:
                # The call ran (a write is applied); its caller sees only the error.
                await context.abort(
                    decision.code, f"injected fault: {decision.code.name} on {service}/{method} (reply lost)"
                )
            return response

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await apply(context)
            async for item in inner_us(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_unary:
        inner_su = handler.stream_unary

        async def stream_unary(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            await apply(context)
            return await inner_su(request_iterator, context)

        return grpc.stream_unary_rpc_method_handler(
            stream_unary, handler.request_deserializer, handler.response_serializer
        )
    inner_ss = handler.stream_stream

    async def stream_stream(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await apply(context)
        async for item in inner_ss(request_iterator, context):
            yield item

    return grpc.stream_stream_rpc_method_handler(
        stream_stream, handler.request_deserializer, handler.response_serializer
    )
