"""The pure ordering engine (DESIGN §4): see ``core`` for the rules and invariants.

``core`` (the ``Engine``) sits on ``books`` (its state and primitives) and delegates each job to
one module: ``arrival``, ``acks`` (and rewinds), ``dead_letters``, ``gap_skip`` (an operator's
skip of a gap), ``recovery``, ``fast_path``, ``status``; ``payloads`` sizes held messages. The
ordering policies are ``sequence``, ``watermark`` and ``unordered``; ``state``, ``dedup``,
``timers`` and ``types`` are what they share.
No module here imports I/O, a clock or asyncio (tests/engine/test_purity.py).
"""

from sidecar.engine.acks import UnknownDelivery
from sidecar.engine.core import Engine
from sidecar.engine.types import (
    AckIntent,
    Action,
    DeadLetter,
    DeadLetterPolicy,
    Deliver,
    DropDuplicate,
    EngineConfig,
    EngineSnapshot,
    EngineStatus,
    GapPolicy,
    Hold,
    KeyCursor,
    KeyState,
    KeyStatus,
    LatePolicy,
    Message,
    Mode,
    Payload,
    SkippedRange,
)

__all__ = [
    "AckIntent",
    "Action",
    "DeadLetter",
    "DeadLetterPolicy",
    "Deliver",
    "DropDuplicate",
    "Engine",
    "EngineConfig",
    "EngineSnapshot",
    "EngineStatus",
    "GapPolicy",
    "Hold",
    "KeyCursor",
    "KeyState",
    "KeyStatus",
    "LatePolicy",
    "Message",
    "Mode",
    "Payload",
    "SkippedRange",
    "UnknownDelivery",
]
