"""What a held message costs in memory, and leaving its payload to the store.

Rules:

- The engine never looks inside a payload: stripping one (``stripped``) changes no decision.
- Only a payload the store can give back (it has a ``ref``) is stripped; a stripped one keeps its
  ``ref`` and says so (``Payload.stripped``), so the I/O layer reads it back before the app sees it.
- Sizes are estimates of CPython's memory (data and attribute text plus object headers), the same
  for every caller that budgets held messages (the runtime, the store's reader, the delivery layer).
"""

from __future__ import annotations

from dataclasses import replace

from sidecar.engine.types import Message, Payload

HELD_MESSAGE_OVERHEAD_BYTES = 600
"""What a held message costs in memory besides its payload, measured roughly: the message and its
entry, ids, fingerprint, heap and index slots."""


def payload_size(payload: Payload) -> int:
    """Bytes a payload holds in memory, roughly: data and attribute text plus CPython's object
    headers (a bytes object, and per attribute two strings and a dict slot)."""
    return 33 + len(payload.data) + attributes_text(payload.attributes) + 110 * len(payload.attributes)


def attributes_text(attributes: dict[str, str]) -> int:
    """Characters of all names and values (``sum(map(len, ...))``: no Python frame per attribute)."""
    return sum(map(len, attributes)) + sum(map(len, attributes.values()))


def strippable(payload: Payload | None) -> bool:
    """True when ``payload`` holds data the store can give back (it has a ``ref``), not yet stripped."""
    return payload is not None and not payload.stripped and bool(payload.ref)


def stripped(message: Message, payload: Payload) -> Message:
    """``message`` without its payload's data and attributes (the store keeps them)."""
    return replace(message, payload=replace(payload, data=b"", attributes={}, stripped=True))
