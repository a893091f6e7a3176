"""Builders and document readers shared by the store tests."""

from __future__ import annotations

import hashlib
from typing import Any

from google.cloud import firestore

from sidecar.engine.types import AckIntent, Message
from sidecar.store.api import IncomingMessage
from sidecar.store.firestore import FirestoreStore


def incoming(
    key: str,
    sequence: int | None = None,
    *,
    data: bytes = b"payload",
    dedup_id: str | None = None,
    attributes: dict[str, str] | None = None,
    timestamp_ms: int | None = None,
) -> IncomingMessage:
    attrs = attributes if attributes is not None else {"k": key}
    fingerprint = hashlib.sha256(data + repr(sorted(attrs.items())).encode()).digest()
    ident = dedup_id or f"{key}#{sequence}#{timestamp_ms}"
    return IncomingMessage(
        key=key,
        dedup_id=ident,
        message_id=f"m-{ident}",
        data=data,
        attributes=attrs,
        ordering_key="",
        publish_time_ms=1_700_000_000_000,
        known_fingerprint=fingerprint,
        sequence=sequence,
        timestamp_ms=timestamp_ms,
    )


def ack(message: Message, cursor: int | tuple[int, str] | None) -> AckIntent:
    return AckIntent(delivery_id=f"d-{message.dedup_id}", message=message, cursor=cursor)


def client_of(store: FirestoreStore) -> firestore.AsyncClient:
    """A second official client on the store's project, to look at what was stored."""
    return firestore.AsyncClient(project=store.project)


async def documents(client: firestore.AsyncClient, path: str) -> dict[str, dict[str, Any]]:
    return {snap.id: snap.to_dict() or {} async for snap in client.collection(path).stream()}


async def cursors(client: firestore.AsyncClient, sub_path: str) -> dict[str, dict[str, Any]]:
    """Every key's latest written cursor, by key: its shard checkpoint's overlay entry (``cursors``)
    where there is one, else its own cursor document, as recovery reads them."""
    out = {fields["key"]: fields for fields in (await documents(client, f"{sub_path}/keys")).values()}
    for checkpoint in (await documents(client, f"{sub_path}/checkpoints")).values():
        for entry in (checkpoint.get("cursors") or {}).values():
            out[entry["key"]] = entry
    return out
