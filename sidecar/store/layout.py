"""Firestore document layout of the store: ids, fields, sizes, chunks. Pure: no I/O, no Google imports.

``sidecar.store.document_store`` writes the plain Python values built here (str, int, bytes, bool,
list of str, datetime) through ``sidecar.store.documents``, and hands back what it read as plain
dicts to decode here.

Rules:

- Document ids are hashes, never raw keys: ids cannot contain ``/``, are capped at 1,500 bytes,
  and sequential ids hotspot. ``message_doc_id`` is sha256 of ``(key, sequence)`` in sequence mode
  (so two publishes of one key and sequence meet at one document, and a different payload there is
  a conflict), otherwise of the dedup id; a replay's (``replay``) is sha256 of its replay id in
  every mode: a record of its own beside its original's tombstone, where two publishes of one
  replay meet. Each part is length-prefixed so that no two different inputs hash the same text.
- A replay's tombstone carries ``replay``, and ``aside`` when it finished outside its key's order
  (acked as a flagged replay, or dead-lettered aside): recovery folds no ``aside`` tombstone into a
  cursor, since its position may belong to another message.
- Attributes are stored as a flat array ``[name1, value1, name2, value2, ...]``, not as a map:
  attribute names then never meet Firestore's field-name rules (``__x__`` is reserved there).
- A message whose document would exceed ``INLINE_LIMIT_BYTES`` keeps its data in ``CHUNK_BYTES``
  pieces in the ``chunks`` subcollection of its document (ids ``000``, ``001``, ...); the main
  document records how many. Pub/Sub's 10 MB message then needs 10 chunk documents plus the main
  one, about 10.1 MB in one Commit: under the 10 MiB request limit.
- Document sizes follow Firestore's storage-size formula (name + 32 + per field name + value).
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence
from typing import Any

from sidecar.engine.types import Message, Payload
from sidecar.store.api import DEAD_LETTERED, DEAD_LETTERED_ASIDE, DROPPED, IncomingMessage

PENDING = "pending"
ACKED = "acked"
DONE_STATES = frozenset({ACKED, DEAD_LETTERED, DEAD_LETTERED_ASIDE, DROPPED})
FINISH_STATES = frozenset({DEAD_LETTERED, DEAD_LETTERED_ASIDE, DROPPED})
"""What ``Store.mark_done`` accepts (acks go through ``commit_acks``)."""

LAYOUT_VERSION = 2
"""Written as ``v`` on every document; a document with a higher ``v`` (a newer sidecar wrote it)
stops recovery rather than being misread. A document without ``v`` is read as version 1.
Version 2 (shards): message, cursor and checkpoint documents carry ``shard``; pending messages
written for another pod carry ``inbox``. Version 1 documents are refused at load (``require_v2``)."""

SHARD = "shard"
"""Field of message, cursor and checkpoint documents: the key's shard (``sidecar.shards.shard_of``)."""
INBOX = "inbox"
"""Field of a pending message written by a pod that does not own its shard: the shard, for the
owner's Listen (``inbox == X and state == pending``). A tombstone (a replace) drops it."""

OVERLAY = "cursors"
"""Field of a checkpoint document: a map from key document id to the key's cursor fields, for the
keys whose latest cursor is kept there rather than in their own document (``CursorBook``)."""

MAX_DOCUMENT_BYTES = 1_048_576
"""Firestore's per-document limit (storage size, field names included)."""

INLINE_LIMIT_BYTES = 1_000_000
"""Above this estimated size the data moves to chunk documents: leaves ~48 KiB for the name and
for rounding, so a document we call inline is never refused for size."""

CHUNK_BYTES = 1_000_000
"""Data bytes per chunk document: 1 MB plus the chunk's tiny name and one field stays under 1 MiB."""

MAX_CHUNKS = 11
"""10 MiB of data at most (Pub/Sub caps a message at 10 MB): larger cannot fit one Commit."""

MAX_REQUEST_BYTES = 9 * 1_048_576
"""Budget for one BatchWrite/Commit request, under Firestore's 10 MiB with room for protobuf framing."""

_ID_BYTES = 20
"""160-bit hashes: collisions are out of reach, and ids stay short (40 hex characters)."""


def _digest(*parts: bytes) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(f"{len(part)}:".encode())
        hasher.update(part)
    return hasher.hexdigest()[: _ID_BYTES * 2]


def message_doc_id(key: str, dedup_id: str, sequence: int | None, replay_id: str = "") -> str:
    """The message document id: hash(key, seq) in sequence mode, hash(dedup id) otherwise;
    hash(replay id) for a replay."""
    if replay_id:
        return _digest(b"replay", replay_id.encode())
    if sequence is not None:
        return _digest(b"seq", key.encode(), str(sequence).encode())
    return _digest(b"dedup", dedup_id.encode())


def key_doc_id(key: str) -> str:
    return _digest(b"key", key.encode())


def message_path(sub_path: str, doc_id: str) -> str:
    """Relative path of a message document under its subscription document."""
    return f"{sub_path}/messages/{doc_id}"


def checkpoint_path(sub_path: str, shard: int) -> str:
    """A shard's cursor checkpoint (``clean_ms``): one per shard, so that each owner writes its own."""
    return f"{sub_path}/checkpoints/{shard:04d}"


def require_v2(what: str, fields: dict[str, Any]) -> int:
    """The document's shard; CorruptDocument naming it when it is of layout v1 (no ``shard``)."""
    check_version(what, fields)
    shard = fields.get(SHARD)
    if shard is None and fields.get("v", 1) == 1:
        raise CorruptDocument(
            f"{what} is of layout v1 (written before shards): drain the subscription with the previous "
            "sidecar version first (docs/store.md, upgrading to layout 2)"
        )
    if type(shard) is not int or shard < 0:
        raise CorruptDocument(f"{what}: shard={shard!r} is not a non-negative integer")
    return shard


def chunk_doc_id(index: int) -> str:
    return f"{index:03d}"


def ref_for(doc_id: str, chunks: int) -> str:
    """``Payload.ref``: the document id, plus ``+N`` when the data lives in N chunk documents."""
    return f"{doc_id}+{chunks}" if chunks else doc_id


def parse_ref(ref: str) -> tuple[str, int]:
    doc_id, _, chunks = ref.partition("+")
    return doc_id, int(chunks) if chunks else 0


def doc_id_of(message: Message) -> tuple[str, int] | None:
    """(document id, chunk count) of a message the store returned; None if it was never stored.

    A CONFLICT result carries ``ref=""``: its document holds the other payload, and marking it
    done would finish the wrong message.
    """
    if message.payload is None:
        return message_doc_id(message.key, message.dedup_id, message.sequence, message.replay_id), 0
    if not message.payload.ref:
        return None
    return parse_ref(message.payload.ref)


def split_data(data: bytes) -> list[bytes]:
    return [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]


def flat_attributes(attributes: dict[str, str]) -> list[str]:
    flat: list[str] = []
    for name in sorted(attributes):
        flat += (name, attributes[name])
    return flat


def value_size(value: Any) -> int:
    """Firestore's storage size of one value."""
    if value is None or isinstance(value, bool):
        return 1
    if isinstance(value, int | float | datetime.datetime):
        return 8
    if isinstance(value, str):
        return len(value.encode()) + 1
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, list):
        return sum(value_size(item) for item in value)
    if isinstance(value, dict):
        return sum(len(name.encode()) + 1 + value_size(item) for name, item in value.items())
    raise TypeError(f"store_codec: no Firestore size for {type(value).__name__}")


def document_size(relative_path: str, fields: dict[str, Any]) -> int:
    """Storage size of a document at ``relative_path`` (below ``/documents/``) with ``fields``."""
    name = len(relative_path.encode()) + 1 + 16
    return name + 32 + sum(len(field.encode()) + 1 + value_size(value) for field, value in fields.items())


def message_fields(incoming: IncomingMessage, now_ms: int, chunks: int, shard: int) -> dict[str, Any]:
    """A pending message document. ``data`` is inline unless ``chunks`` > 0; ``inbox`` when it is
    written for the shard's owner (``IncomingMessage.to_owner``).

    Pending documents never carry ``expire_at``: TTL must never delete an undelivered message.
    """
    fields: dict[str, Any] = {
        "key": incoming.key,
        "dedup_id": incoming.dedup_id,
        "message_id": incoming.message_id,
        "fp": incoming.fingerprint,
        "attrs": flat_attributes(incoming.attributes),
        "okey": incoming.ordering_key,
        "publish_ms": incoming.publish_time_ms,
        "stored_ms": now_ms,
        "state": PENDING,
        "chunks": chunks,
        "v": LAYOUT_VERSION,
        SHARD: shard,
    }
    if incoming.to_owner:
        fields[INBOX] = shard
    if incoming.sequence is not None:
        fields["seq"] = incoming.sequence
    if incoming.timestamp_ms is not None:
        fields["ts"] = incoming.timestamp_ms
    if incoming.replay_id:
        fields["replay"] = incoming.replay_id
    if not chunks:
        fields["data"] = incoming.data
    return fields


def message_from_incoming(incoming: IncomingMessage, now_ms: int, ref: str) -> Message:
    return incoming.to_message(now_ms, ref)


class CorruptDocument(ValueError):
    """A stored document lacks a field the store always writes (edited by hand, or foreign), or
    comes from a newer layout. Recovery stops on it with this message, naming the document."""


def check_version(what: str, fields: dict[str, Any]) -> None:
    version = fields.get("v", 1)
    if type(version) is not int or version < 1:
        raise CorruptDocument(f"{what}: layout version v={version!r} is not a positive integer")
    if version > LAYOUT_VERSION:
        raise CorruptDocument(
            f"{what}: layout version {version} is newer than this sidecar's {LAYOUT_VERSION} "
            "(a newer release wrote it): upgrade this sidecar"
        )


def message_from_fields(
    doc_id: str, fields: dict[str, Any], data: bytes | None = None, *, stripped: bool = False
) -> Message:
    """Decode a pending message document; ``data`` overrides the inline data (reassembled chunks).
    ``stripped``: without its data and attributes (``Payload.stripped``): the store keeps them.

    Builds the message once, from the fields as read (recovery decodes 100,000 of these)."""
    version = fields.get("v", 1)
    if type(version) is not int or not 1 <= version <= LAYOUT_VERSION:
        check_version(f"message document {doc_id}", fields)
    get = fields.get
    try:
        if stripped:
            attributes: dict[str, str] = {}
            data = b""
        else:
            flat = get("attrs") or ()
            attributes = dict(zip(flat[0::2], flat[1::2], strict=True))
            if data is None:
                data = bytes(get("data") or b"")
        chunks = int(get("chunks") or 0)
        seq = get("seq")
        ts = get("ts")
        return Message(
            key=str(fields["key"]),
            dedup_id=str(fields["dedup_id"]),
            message_id=str(get("message_id", "")),
            known_fingerprint=bytes(get("fp") or b""),
            stored_at_ms=int(fields["stored_ms"]),
            sequence=None if seq is None else int(seq),
            timestamp_ms=None if ts is None else int(ts),
            payload=Payload(
                data=data,
                attributes=attributes,
                publish_time_ms=int(get("publish_ms") or 0),
                ordering_key=str(get("okey") or ""),
                ref=ref_for(doc_id, chunks),
                stripped=stripped,
            ),
            replay_id=str(get("replay") or ""),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptDocument(f"message document {doc_id}: {exc!r}") from exc


def stripped_message_from_fields(doc_id: str, fields: dict[str, Any]) -> Message:
    """A pending message without its data and attributes (``Payload.stripped``): the store keeps them."""
    return message_from_fields(doc_id, fields, stripped=True)


DONE_AT = "done_at"
"""Field of a tombstone: ``done_at_value(shard, done_ms)``, the one indexed field recovery ranges over.

Not ``done_ms`` itself: an indexed field whose values only grow puts every new index entry at the
end of its index, and production caps such a collection near 500 writes/s (an *index hotspot*).
The shard in front gives each shard its own insertion point (S of them), so the end of the index
takes 1/S of the tombstones; and a per-shard load asks for exactly its shard's range
(``done_at_range``). ``done_ms`` is kept for reading, exempted from indexing (firestore.indexes.json)."""


CURSOR_SKIPS = "cursor_skips"
"""Field of an ack's tombstone beside ``cursor_seq``: the ranges a gap timeout skipped below that
cursor, as the engine knew them (``AckIntent.skipped``), flat ``[first, last, ...]``. Recovery
records exactly these as skipped when it folds the cursor; every other sequence the cursor passes
was finished. A tombstone with ``cursor_seq`` and no ``cursor_skips`` comes from an earlier release,
which inferred the skips from the cursor's movement: recovery infers them the same way for it."""


def done_at_value(shard: int, done_ms: int) -> str:
    """``SSSS/ddddddddddddddd``: ordered by shard, then by time (fixed widths: text order is number order)."""
    return f"{shard:04d}/{max(done_ms, 0):015d}"


def done_at_range(shard: int, since_ms: int) -> tuple[str, str]:
    """[low, high) of the ``done_at`` values of ``shard``'s tombstones finished at or after ``since_ms``."""
    return done_at_value(shard, since_ms), f"{shard:04d}0"  # "0" sorts right after "/"


def expire_at(now_ms: int, ttl_ms: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp((now_ms + ttl_ms) / 1000, tz=datetime.UTC)


def tombstone_fields(
    message: Message,
    state: str,
    now_ms: int,
    ttl_ms: int,
    cursor: int | tuple[int, str] | None,
    shard: int,
    *,
    aside: bool = False,
    skipped: Sequence[tuple[int, int]] = (),
) -> dict[str, Any]:
    """A finished message's whole document: identity stays (a late copy is still a duplicate),
    data and attributes go, ``expire_at`` lets a TTL policy delete it after the dedup TTL.

    Written as a replace, never a merge: complete on its own, so a tombstone written where the
    document is already gone (its earlier tombstone expired) is still one recovery can read.
    ``cursor_*`` is the key's cursor once this ack is durable (``AckIntent.cursor``): recovery folds
    recent tombstones in, so a cursor document that lagged behind (coalesced writes) loses nothing.
    A sequence cursor comes with ``cursor_skips`` (``CURSOR_SKIPS``), the ranges a gap timeout
    skipped below it (``AckIntent.skipped``, flat: first, last, ...; usually empty).
    """
    fields: dict[str, Any] = {
        "key": message.key,
        "dedup_id": message.dedup_id,
        "message_id": message.message_id,
        "fp": message.fingerprint,
        "state": state,
        "done_ms": now_ms,
        DONE_AT: done_at_value(shard, now_ms),
        "expire_at": expire_at(now_ms, ttl_ms),
        "chunks": 0,
        "v": LAYOUT_VERSION,
        SHARD: shard,
    }
    if message.sequence is not None:
        fields["seq"] = message.sequence
    if message.timestamp_ms is not None:
        fields["ts"] = message.timestamp_ms
    if message.replay_id:
        fields["replay"] = message.replay_id
    if aside:
        fields["aside"] = True
    if isinstance(cursor, int):
        fields["cursor_seq"] = cursor
        fields[CURSOR_SKIPS] = [bound for first_last in skipped for bound in first_last]
    elif isinstance(cursor, tuple):
        fields["cursor_ts"], fields["cursor_id"] = cursor
    return fields
