"""Resource names: ``projects/P/databases/D/documents/c1/d1/c2/d2...``.

A document name has an even number of segments after ``documents`` (collection, id pairs); a
query or list parent is either the root ``.../documents`` or a document name. Every id is checked
against production's id rules (``limits.check_id``); names must belong to the request's database.
"""

from __future__ import annotations

from sidecar.emulators.firestore import limits
from sidecar.emulators.firestore.errors import invalid

_VALIDATED_PARENTS: dict[str, None] = {}
_CACHE_MAX = 100_000
"""Bound on remembered valid collection paths (writes into a few collections skip re-validation)."""


def _split(name: str, what: str) -> list[str]:
    parts = name.split("/")
    if len(parts) < 5 or parts[0] != "projects" or parts[2] != "databases" or parts[4] != "documents":
        raise invalid(f"{what} {name!r} is not of the form projects/P/databases/D/documents/...")
    if not parts[1] or not parts[3]:
        raise invalid(f"{what} {name!r} has an empty project or database id.")
    return parts[5:]


def check_database(database: str) -> str:
    parts = database.split("/")
    if len(parts) != 4 or parts[0] != "projects" or parts[2] != "databases" or not parts[1] or not parts[3]:
        raise invalid(f"Database {database!r} is not of the form projects/P/databases/D.")
    return database


def document_name(name: str, database: str | None = None) -> str:
    """Validate a document name; returns its path relative to ``/documents/``."""
    parent, _, doc_id = name.rpartition("/")
    if parent in _VALIDATED_PARENTS:
        limits.check_id(doc_id, "Document id", name)
        relative = name.split("/documents/", 1)[1]
    else:
        segments = _split(name, "Document name")
        if not segments or len(segments) % 2:
            raise invalid(f"Document name {name!r} must have an even number of path segments after 'documents'.")
        for index, segment in enumerate(segments):
            limits.check_id(segment, "Collection id" if index % 2 == 0 else "Document id", name)
        relative = "/".join(segments)
        if len(_VALIDATED_PARENTS) < _CACHE_MAX:
            _VALIDATED_PARENTS[parent] = None
    if database is not None and not name.startswith(database + "/documents/"):
        raise invalid(f"Document {name!r} is not in database {database!r}.")
    return relative


def parent_name(parent: str) -> str:
    """Validate a query/list parent (the root or a document); returns it unchanged."""
    segments = _split(parent, "Parent")
    if len(segments) % 2:
        raise invalid(f"Parent {parent!r} must be the documents root or a document name.")
    for index, segment in enumerate(segments):
        limits.check_id(segment, "Collection id" if index % 2 == 0 else "Document id", parent)
    return parent


def database_of(name: str) -> str:
    return "/".join(name.split("/", 4)[:4])
