"""``google.firestore.admin.v1.FirestoreAdmin`` GetField and ListFields, from the index config.

What a deployment check reads (``sidecar.store.deployment``): whether a field is exempted from
indexing and whether it is a collection group's TTL field. Answers follow production:
- GetField of a field with an override: ``index_config.indexes`` as configured (empty: exempted),
  ``uses_ancestor_config`` false; a TTL field has ``ttl_config.state`` ACTIVE.
- GetField of any other field: the database default (ascending, descending and array-contains,
  collection scope), ``uses_ancestor_config`` true, ``ancestor_field``
  ``.../collectionGroups/__default__/fields/*``; no ``ttl_config``.
- ListFields lists only overridden fields, and only with the filters production supports:
  ``indexConfig.usesAncestorConfig:false`` (every override) or ``ttlConfig:*`` (TTL fields);
  parent ``collectionGroups/-`` lists every group. Other filters are INVALID_ARGUMENT.
The config applies to every project and database the emulator serves. Every other FirestoreAdmin
method is UNIMPLEMENTED (gRPC's answer for a method no handler registers).
"""

from __future__ import annotations

import re
from typing import Any

import grpc

from sidecar.emulators.firestore import protos as pb
from sidecar.emulators.firestore.errors import invalid
from sidecar.emulators.firestore.indexes import CONTAINS, DEFAULT_SINGLE, IndexConfig
from sidecar.emulators.firestore.paths import FieldPath, format_field_path, parse_field_path
from sidecar.emulators.firestore.service import _unary

_GROUP_NAME = re.compile(r"(projects/[^/]+/databases/[^/]+)/collectionGroups/([^/]+)\Z")
_FIELD_NAME = re.compile(r"(projects/[^/]+/databases/[^/]+)/collectionGroups/([^/]+)/fields/(.+)\Z")
_DEFAULT_GROUP = "__default__"
_FILTERS = {"indexConfig.usesAncestorConfig:false": False, "ttlConfig:*": True}
"""The filters production's ListFields supports -> whether the listing keeps TTL fields only."""
_DEFAULT_PAGE_SIZE = 100
_READY = pb.AdminIndex.State.Value("READY")
_ACTIVE = pb.AdminField.TtlConfig.State.Value("ACTIVE")


class FieldAdminService:
    """The FirestoreAdmin field RPCs over an ``IndexConfig`` (read-only)."""

    def __init__(self, indexes: IndexConfig) -> None:
        self.indexes = indexes

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            pb.ADMIN_SERVICE_NAME,
            {
                "GetField": grpc.unary_unary_rpc_method_handler(
                    _unary(self.get_field),
                    request_deserializer=pb.GetFieldRequest.FromString,
                    response_serializer=pb.AdminField.SerializeToString,
                ),
                "ListFields": grpc.unary_unary_rpc_method_handler(
                    _unary(self.list_fields),
                    request_deserializer=pb.ListFieldsRequest.FromString,
                    response_serializer=pb.ListFieldsResponse.SerializeToString,
                ),
            },
        )

    async def get_field(self, request: Any, context: Any) -> Any:
        match = _FIELD_NAME.match(request.name)
        if match is None:
            raise invalid(
                f"Invalid field name {request.name!r}: expected "
                "projects/{project}/databases/{database}/collectionGroups/{group}/fields/{field}."
            )
        database, group, field_text = match.groups()
        if group == _DEFAULT_GROUP and field_text == "*":
            return self._field(database, group, None, "*")
        path = parse_field_path(field_text)
        return self._field(database, group, path, field_text)

    async def list_fields(self, request: Any, context: Any) -> Any:
        match = _GROUP_NAME.match(request.parent)
        if match is None:
            raise invalid(
                f"Invalid parent {request.parent!r}: expected "
                "projects/{project}/databases/{database}/collectionGroups/{group}."
            )
        database, group = match.groups()
        wanted = "".join(request.filter.split())
        if wanted not in _FILTERS:
            raise invalid(
                "ListFields only supports listing fields that have been explicitly overridden: use the filter "
                "indexConfig.usesAncestorConfig:false or ttlConfig:*."
            )
        if request.page_size < 0:
            raise invalid("page_size must not be negative.")
        ttl_only = _FILTERS[wanted]
        chosen = self.indexes.overrides.values()
        overrides = sorted(
            (o for o in chosen if group in ("-", o.collection_group) and (o.ttl or not ttl_only)),
            key=lambda o: (o.collection_group, format_field_path(o.field_path)),
        )
        start = int(request.page_token) if request.page_token.isdigit() else 0
        if request.page_token and not request.page_token.isdigit():
            raise invalid("Invalid page_token.")
        size = request.page_size or _DEFAULT_PAGE_SIZE
        response = pb.ListFieldsResponse()
        for override in overrides[start : start + size]:
            text = format_field_path(override.field_path)
            response.fields.append(self._field(database, override.collection_group, override.field_path, text))
        if start + size < len(overrides):
            response.next_page_token = str(start + size)
        return response

    def _field(self, database: str, group: str, path: FieldPath | None, text: str) -> Any:
        field = pb.AdminField(name=f"{database}/collectionGroups/{group}/fields/{text}")
        override = None if path is None else self.indexes.overrides.get((group, path))
        config = field.index_config
        if override is None or override.indexes is None:
            indexes = DEFAULT_SINGLE if override is None else override.single_indexes
            config.uses_ancestor_config = path is not None
            if path is not None:
                config.ancestor_field = f"{database}/collectionGroups/{_DEFAULT_GROUP}/fields/*"
        else:
            indexes = override.indexes
            config.uses_ancestor_config = False
        for kind, scope in sorted(indexes):
            index = config.indexes.add(query_scope=pb.AdminIndex.QueryScope.Value(scope), state=_READY)
            entry = index.fields.add(field_path=text)
            if kind == CONTAINS:
                entry.array_config = pb.AdminIndex.IndexField.ArrayConfig.Value(CONTAINS)
            else:
                entry.order = pb.AdminIndex.IndexField.Order.Value(kind)
        if override is not None and override.ttl:
            field.ttl_config.state = _ACTIVE
        return field
