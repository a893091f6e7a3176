"""The one module of the Firestore emulator that imports Google's libraries.

Everything else works on the raw protobuf classes re-exported here (``Type.pb()`` of the client's
proto-plus types): the emulator never builds proto-plus wrappers, which are several times slower.
"""

from __future__ import annotations

from google.cloud.firestore_admin_v1.types import field as admin_field
from google.cloud.firestore_admin_v1.types import firestore_admin
from google.cloud.firestore_admin_v1.types import index as admin_index
from google.cloud.firestore_v1.types import (
    aggregation_result,
    common,
    document,
    firestore,
    query,
    write,
)
from google.protobuf import empty_pb2, timestamp_pb2
from google.rpc import status_pb2
from google.type import latlng_pb2

SERVICE_NAME = "google.firestore.v1.Firestore"
ADMIN_SERVICE_NAME = "google.firestore.admin.v1.FirestoreAdmin"

Document = document.Document.pb()
Value = document.Value.pb()
ArrayValue = document.ArrayValue.pb()
MapValue = document.MapValue.pb()
DocumentMask = common.DocumentMask.pb()
Precondition = common.Precondition.pb()
TransactionOptions = common.TransactionOptions.pb()
Write = write.Write.pb()
WriteResult = write.WriteResult.pb()
DocumentTransform = write.DocumentTransform.pb()
FieldTransform = write.DocumentTransform.FieldTransform.pb()
StructuredQuery = query.StructuredQuery.pb()
StructuredAggregationQuery = query.StructuredAggregationQuery.pb()
Cursor = query.Cursor.pb()
AggregationResult = aggregation_result.AggregationResult.pb()

GetDocumentRequest = firestore.GetDocumentRequest.pb()
ListDocumentsRequest = firestore.ListDocumentsRequest.pb()
ListDocumentsResponse = firestore.ListDocumentsResponse.pb()
CreateDocumentRequest = firestore.CreateDocumentRequest.pb()
UpdateDocumentRequest = firestore.UpdateDocumentRequest.pb()
DeleteDocumentRequest = firestore.DeleteDocumentRequest.pb()
BatchGetDocumentsRequest = firestore.BatchGetDocumentsRequest.pb()
BatchGetDocumentsResponse = firestore.BatchGetDocumentsResponse.pb()
BeginTransactionRequest = firestore.BeginTransactionRequest.pb()
BeginTransactionResponse = firestore.BeginTransactionResponse.pb()
CommitRequest = firestore.CommitRequest.pb()
CommitResponse = firestore.CommitResponse.pb()
RollbackRequest = firestore.RollbackRequest.pb()
RunQueryRequest = firestore.RunQueryRequest.pb()
RunQueryResponse = firestore.RunQueryResponse.pb()
RunAggregationQueryRequest = firestore.RunAggregationQueryRequest.pb()
RunAggregationQueryResponse = firestore.RunAggregationQueryResponse.pb()
BatchWriteRequest = firestore.BatchWriteRequest.pb()
BatchWriteResponse = firestore.BatchWriteResponse.pb()
ListCollectionIdsRequest = firestore.ListCollectionIdsRequest.pb()
ListCollectionIdsResponse = firestore.ListCollectionIdsResponse.pb()
ListenRequest = firestore.ListenRequest.pb()
ListenResponse = firestore.ListenResponse.pb()
Target = firestore.Target.pb()
TargetChange = firestore.TargetChange.pb()
DocumentChange = write.DocumentChange.pb()
DocumentDelete = write.DocumentDelete.pb()
DocumentRemove = write.DocumentRemove.pb()

# FirestoreAdmin (field configuration only; see ``admin_fields``).
AdminField = admin_field.Field.pb()
AdminIndex = admin_index.Index.pb()
GetFieldRequest = firestore_admin.GetFieldRequest.pb()
ListFieldsRequest = firestore_admin.ListFieldsRequest.pb()
ListFieldsResponse = firestore_admin.ListFieldsResponse.pb()

Empty = empty_pb2.Empty
Timestamp = timestamp_pb2.Timestamp
Status = status_pb2.Status
LatLng = latlng_pb2.LatLng

# Enum numbers used in hot paths, read from the descriptors so they can't drift.
OP = StructuredQuery.FieldFilter.Operator
UNARY_OP = StructuredQuery.UnaryFilter.Operator
COMPOSITE_OP = StructuredQuery.CompositeFilter.Operator
DIRECTION = StructuredQuery.Direction
SERVER_VALUE = FieldTransform.ServerValue
TARGET_CHANGE = TargetChange.TargetChangeType


def timestamp_from_micros(micros: int) -> Timestamp:
    """A Timestamp for a count of microseconds since the epoch."""
    seconds, rest = divmod(micros, 1_000_000)
    return Timestamp(seconds=seconds, nanos=rest * 1000)


def nanos_of(ts: Timestamp) -> int:
    """Nanoseconds since the epoch of a Timestamp message."""
    return ts.seconds * 1_000_000_000 + ts.nanos
