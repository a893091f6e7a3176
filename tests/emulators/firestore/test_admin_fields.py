"""FirestoreAdmin GetField / ListFields through the official admin client, from the ``indexed`` config."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from firestore_harness import Endpoint
from google.api_core import exceptions
from google.cloud.firestore_admin_v1 import FirestoreAdminClient
from google.cloud.firestore_admin_v1.services.firestore_admin.transports import FirestoreAdminGrpcTransport
from google.cloud.firestore_admin_v1.types import Field, Index


@pytest.fixture
def admin(indexed: Endpoint) -> Iterator[FirestoreAdminClient]:
    channel = grpc.insecure_channel(indexed.host)
    try:
        yield FirestoreAdminClient(transport=FirestoreAdminGrpcTransport(channel=channel))
    finally:
        channel.close()


_GROUPS = "projects/p/databases/(default)/collectionGroups"


def test_an_exempted_ttl_field_reads_no_indexes_and_an_active_ttl(admin: FirestoreAdminClient) -> None:
    field = admin.get_field(name=f"{_GROUPS}/sessions/fields/expire_at")
    assert field.name == f"{_GROUPS}/sessions/fields/expire_at"
    assert list(field.index_config.indexes) == []
    assert field.index_config.uses_ancestor_config is False
    assert field.ttl_config.state == Field.TtlConfig.State.ACTIVE


def test_a_field_without_override_inherits_the_default(admin: FirestoreAdminClient) -> None:
    field = admin.get_field(name=f"{_GROUPS}/people/fields/city")
    assert field.index_config.uses_ancestor_config is True
    assert field.index_config.ancestor_field == f"{_GROUPS}/__default__/fields/*"
    kinds = {(i.fields[0].order, i.fields[0].array_config, i.query_scope) for i in field.index_config.indexes}
    assert kinds == {
        (Index.IndexField.Order.ASCENDING, 0, Index.QueryScope.COLLECTION),
        (Index.IndexField.Order.DESCENDING, 0, Index.QueryScope.COLLECTION),
        (0, Index.IndexField.ArrayConfig.CONTAINS, Index.QueryScope.COLLECTION),
    }
    assert field.ttl_config.state == Field.TtlConfig.State.STATE_UNSPECIFIED


def test_an_override_keeping_some_indexes_lists_them(admin: FirestoreAdminClient) -> None:
    field = admin.get_field(name=f"{_GROUPS}/people/fields/age")
    assert field.index_config.uses_ancestor_config is False
    scopes = sorted(i.query_scope for i in field.index_config.indexes)
    assert scopes == [Index.QueryScope.COLLECTION, Index.QueryScope.COLLECTION_GROUP]
    assert all(i.state == Index.State.READY for i in field.index_config.indexes)


def test_list_fields_supports_production_filters_only(admin: FirestoreAdminClient) -> None:
    overridden = admin.list_fields(
        request={"parent": f"{_GROUPS}/people", "filter": "indexConfig.usesAncestorConfig:false"}
    )
    assert sorted(f.name.rpartition("/")[2] for f in overridden) == ["age", "nick", "tags"]
    ttl = admin.list_fields(request={"parent": f"{_GROUPS}/-", "filter": "ttlConfig:*"})
    assert [f.name for f in ttl] == [f"{_GROUPS}/sessions/fields/expire_at"]
    paged = admin.list_fields(
        request={"parent": f"{_GROUPS}/-", "filter": "indexConfig.usesAncestorConfig:false", "page_size": 2}
    )
    assert len(list(paged)) == 5
    with pytest.raises(exceptions.InvalidArgument, match="explicitly overridden"):
        list(admin.list_fields(request={"parent": f"{_GROUPS}/people"}))


def test_bad_names_and_other_methods_are_refused(admin: FirestoreAdminClient) -> None:
    with pytest.raises(exceptions.InvalidArgument):
        admin.get_field(name="projects/p/databases/(default)/fields/x")
    with pytest.raises(exceptions.MethodNotImplemented):
        admin.get_index(name=f"{_GROUPS}/people/indexes/abc")
