"""The relay's waiting room, as operators see and act on it (``pubsub-sidecar outbox``).

An entry waits when it can never be published as written (``entries.Unpublishable``: every pod reads
the same verdict from the entry itself) or when the relay gave up on it after publishes that failed
for good (a waiting document, ``sidecar.store.outbox``). Either way its key waits behind it, and no
number was used for it.

Rules:

- ``list_waiting`` reads one consistent snapshot of the outbox and of the waiting documents; for
  each waiting entry it says why, its key, and how many entries of the key wait behind it.
- ``retry`` applies to an entry the relay gave up on: its waiting document is deleted and the relay
  (listening to them) publishes it again at once, with the key's next number. An entry that is
  unpublishable as written is refused (``WaitingRoomRefusal``): a retry cannot change its verdict;
  discard it and have the app write a new one (which is ordered after the key's later entries).
- ``discard`` needs a note; in one Commit it deletes the entry from the outbox and records the
  decision (reason, note, when) in its waiting document. Its key flows on with the number the
  entry would have had. A discard is not fenced by the relay's leases: an entry the relay is
  publishing at that moment (only after an operator's retry) may be published as well.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.config.relays import RelayConfig
from sidecar.publishing.entries import Rules, Unpublishable, read_entry
from sidecar.publishing.plan import order_key
from sidecar.store import documents as docs
from sidecar.store import outbox


class WaitingRoomRefusal(Exception):
    """The entry is not in the waiting room, or the action cannot help it. One line."""


@dataclass(frozen=True, slots=True)
class Waiting:
    relay: str
    entry_id: str
    key: str | None
    reason: str
    given_up: bool
    """True: the relay gave up on it (a retry may help); False: unpublishable as written."""
    behind: int
    """Entries of its key waiting behind it."""

    def to_json(self) -> dict[str, object]:
        return {
            "relay": self.relay,
            "entry": self.entry_id,
            "key": self.key,
            "reason": self.reason,
            "retry_helps": self.given_up,
            "behind": self.behind,
        }


def rules_of(config: RelayConfig, project: str) -> Rules:
    return Rules(project, config.topic, config.key_attribute, config.sequence.attribute, config.ordering_key)


async def list_waiting(documents: docs.Documents, config: RelayConfig, project: str, root: str) -> list[Waiting]:
    relay_root = outbox.relay_root(root, config.name)
    rules = rules_of(config, project)
    entries = [read_entry(i, f, t, rules) for i, f, t in await outbox.snapshot(documents, "", config.outbox.collection)]
    given_up = {
        entry_id: str(fields.get("reason", ""))
        for entry_id, fields, _ in await outbox.snapshot(
            documents, relay_root, "waiting", [docs.Filter("state", "EQUAL", outbox.WAITING)]
        )
    }
    found: list[Waiting] = []
    for entry in entries:
        if isinstance(entry, Unpublishable):
            reason, retry_helps = entry.reason, False
        elif entry.id in given_up:
            reason, retry_helps = given_up[entry.id], True
        else:
            continue
        behind = 0
        if entry.key is not None:
            behind = sum(1 for e in entries if e.key == entry.key and order_key(e) > order_key(entry))
        found.append(Waiting(config.name, entry.id, entry.key, reason, retry_helps, behind))
    return sorted(found, key=lambda w: (w.key or "", w.entry_id))


async def _find(documents: docs.Documents, config: RelayConfig, project: str, root: str, entry_id: str) -> Waiting:
    for waiting in await list_waiting(documents, config, project, root):
        if waiting.entry_id == entry_id:
            return waiting
    raise WaitingRoomRefusal(f"relay {config.name!r}: entry {entry_id!r} is not in the waiting room")


async def retry(documents: docs.Documents, config: RelayConfig, project: str, root: str, entry_id: str) -> Waiting:
    waiting = await _find(documents, config, project, root, entry_id)
    if not waiting.given_up:
        raise WaitingRoomRefusal(
            f"relay {config.name!r}: entry {entry_id!r} can never be published as written ({waiting.reason}): "
            "discard it with a note, and have the app write a corrected entry"
        )
    await outbox.retry(documents, outbox.relay_root(root, config.name), entry_id)
    return waiting


async def discard(
    documents: docs.Documents, config: RelayConfig, project: str, root: str, entry_id: str, note: str
) -> Waiting:
    if not note.strip():
        raise WaitingRoomRefusal("a discard needs --note: why the entry is dropped")
    waiting = await _find(documents, config, project, root, entry_id)
    relay_root = outbox.relay_root(root, config.name)
    await outbox.discard(
        documents, config.outbox.collection, relay_root, entry_id, waiting.key, waiting.reason, note.strip()
    )
    return waiting


def open_documents(project: str, database: str) -> docs.Documents:
    """The Firestore client of an outbox's database (imported here only: the command loads it on use)."""
    from sidecar.store.firestore import FirestoreDocuments

    return FirestoreDocuments(project, database)
