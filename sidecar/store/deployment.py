"""What the Firestore database must be configured with, and the warnings when it is not (pure).

The store writes fields it never queries; left indexed, each costs an index write per document
write, and the monotonic ones (timestamps, sequence numbers) cap a collection near 500 writes/s
(an index hotspot). So every field the store does not query is exempted from indexing, and
``messages.expire_at`` is the TTL field that deletes finished messages. The repository ships the
same list as ``firestore.indexes.json`` (a test keeps the two equal); the sidecar must not need the
repository at run time, so the list lives here.

``sidecar.store.firestore.check_deployment`` reads each field through the FirestoreAdmin API and
hands the answers to ``deployment_warnings``, which returns at most one warning: a summary of
everything missing (the TTL policy, the fields still indexed, by collection group) with the one
command that deploys it all and the per-field commands' form; ``unverifiable_warning`` is the one
warning when the admin API refuses. One line, not one per field: an operator acts on the whole
file at once, and 45 lines at every start drown the log. Nothing here fails a start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

TTL_GROUP = "messages"
TTL_FIELD = "expire_at"
EXEMPTED_FIELDS: Mapping[str, tuple[str, ...]] = {
    "messages": (
        "key", "dedup_id", "message_id", "fp", "data", "attrs", "okey", "publish_ms", "stored_ms", "chunks",
        "seq", "ts", "replay", "v", "done_ms", "cursor_seq", "cursor_ts", "cursor_id", "aside", TTL_FIELD,
    ),
    "keys": (
        "key", "next_seq", "above_seq", "pos_ts", "pos_id", "blk_seq", "blk_ts", "blk_id", "unb_seq", "unb_ts",
        "unb_id", "written_ms", "v",
    ),
    "checkpoints": ("clean_ms", "cursors", "v"),
    "leases": ("owner", "epoch", "beat", "lease_ms", "wanted_by", "shards", "v"),
    "chunks": ("d",),
}  # fmt: skip
"""Collection group -> the fields exempted from single-field indexing (the store never queries them)."""
INDEXED_FIELDS: Mapping[str, tuple[str, ...]] = {
    "messages": ("shard", "inbox", "state", "done_slot"),
    "keys": ("shard",),
}
"""The only fields the store queries: they keep production's default single-field indexes."""
ROLE_HINT = "roles/datastore.indexAdmin (or the permissions datastore.indexes.list and datastore.indexes.get)"


@dataclass(frozen=True, slots=True)
class FieldState:
    """One FirestoreAdmin ``Field`` answer, reduced to what the check needs."""

    exempted: bool
    """``index_config.indexes`` empty and not inherited (``uses_ancestor_config`` false)."""
    ttl_active: bool
    """``ttl_config.state`` is ACTIVE (CREATING does not delete yet)."""


def fields_to_check() -> list[tuple[str, str]]:
    """(collection group, field) pairs to read, the TTL field first."""
    pairs = [(TTL_GROUP, TTL_FIELD)]
    pairs += [(group, name) for group, names in EXEMPTED_FIELDS.items() for name in names if name != TTL_FIELD]
    return pairs


def deployment_warnings(answers: Mapping[tuple[str, str], FieldState], database: str) -> list[str]:
    """At most one warning: everything missing (TTL policy, fields still indexed) and the commands to run."""
    problems: list[str] = []
    ttl = answers.get((TTL_GROUP, TTL_FIELD))
    if ttl is None or not ttl.ttl_active:
        problems.append(
            f"the TTL policy on {TTL_GROUP}.{TTL_FIELD} is not active (finished messages are never deleted; "
            f"gcloud firestore fields ttls update {TTL_FIELD} --collection-group={TTL_GROUP} --enable-ttl "
            f"--database={database})"
        )
    indexed: dict[str, list[str]] = {}
    for group, name in fields_to_check():
        state = answers.get((group, name))
        if state is None or not state.exempted:
            indexed.setdefault(group, []).append(name)
    if indexed:
        count = sum(len(names) for names in indexed.values())
        listed = "; ".join(f"{group}: {', '.join(names)}" for group, names in indexed.items())
        problems.append(
            f"{count} fields are still indexed ({listed}): every write pays an index entry per field, and a "
            "monotonic one caps its collection near 500 writes/s (one by one: gcloud firestore indexes fields "
            f"update FIELD --collection-group=GROUP --disable-indexes --database={database})"
        )
    if not problems:
        return []
    return [
        f"Firestore database {database} is not deployed as the sidecar expects: {'; and '.join(problems)}. "
        "Deploy the repository's firestore.indexes.json, all of it at once: firebase deploy --only firestore:indexes "
        "(docs/operations.md)"
    ]


def unverifiable_warning(database: str, reason: str) -> str:
    """The one warning when the admin API cannot be read (permission, not implemented, unavailable)."""
    return (
        f"Could not verify the Firestore index exemptions and TTL policy of database {database}: {reason}. "
        f"Grant the sidecar's service account {ROLE_HINT} to let it check, or deploy them with: "
        "firebase deploy --only firestore:indexes"
    )
