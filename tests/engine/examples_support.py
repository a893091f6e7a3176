"""Helpers the engine's example tests share: an engine in sequence mode, what a take hands out, a
take acked durably at once.

Each returns plain ``(key, sequence)`` pairs so that an example reads as the order it asserts.
"""

from __future__ import annotations

from sidecar.engine import Engine, EngineConfig


def sequence_engine(**overrides: object) -> Engine:
    return Engine(EngineConfig(mode="sequence", **overrides))  # type: ignore[arg-type]


def taken(engine: Engine, consumer: str = "c", now_ms: int = 0) -> list[tuple[str, int | None]]:
    return [(d.message.key, d.message.sequence) for d in engine.take(consumer, 100, now_ms)]


def ack_all(engine: Engine, consumer: str = "c", now_ms: int = 0) -> list[tuple[str, int | None]]:
    deliveries = engine.take(consumer, 100, now_ms)
    engine.ack_durable([engine.ack(consumer, d.delivery_id, now_ms).delivery_id for d in deliveries], now_ms)
    return [(d.message.key, d.message.sequence) for d in deliveries]
