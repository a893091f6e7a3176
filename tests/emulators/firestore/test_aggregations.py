"""sum / avg / count through the official client: limits, order, implicit field filters, errors.

Production computes sum and avg from the field's index: documents lacking the field take no part
(count included) and a limit picks the first documents by the query's explicit orders, then by
that field. The official system test ``test_sum_query_get_with_limit`` relies on it: over 25
documents with products a*b (a, b in 0..4), ``limit(12).sum("stats.product")`` is 5, the sum of
the 12 smallest products, whatever the documents' random ids.
"""

from __future__ import annotations

import math

import pytest
from firestore_harness import gapic
from google.api_core import exceptions
from google.cloud import firestore
from google.cloud.firestore_v1.aggregation import AggregationQuery
from google.cloud.firestore_v1.async_aggregation import AsyncAggregationQuery
from google.cloud.firestore_v1.base_query import FieldFilter


def _products(client: firestore.Client | firestore.AsyncClient) -> list[tuple[firestore.DocumentReference, dict]]:
    col = client.collection("stats")
    rows = []
    for a in range(5):
        for b in range(5):
            # Ids chosen so that name order and product order disagree.
            index = (a * 5 + b) * 7 % 25  # a permutation of 0..24
            rows.append((col.document(f"d{index:02d}"), {"a": a, "b": b, "stats": {"product": a * b}}))
    return rows


def _value(result: list) -> object:
    ((aggregation,),) = result
    return aggregation.value


@pytest.fixture
def stats(client: firestore.Client) -> firestore.CollectionReference:
    batch = client.batch()
    for ref, data in _products(client):
        batch.set(ref, data)
    batch.commit()
    return client.collection("stats")


def test_sum_and_avg_with_limit_take_the_first_documents_by_the_aggregated_field(
    stats: firestore.CollectionReference,
) -> None:
    assert _value(stats.sum("stats.product").get()) == 100
    assert _value(stats.limit(12).sum("stats.product").get()) == 5
    avg = _value(stats.limit(12).avg("stats.product").get())
    assert isinstance(avg, float) and avg == 5 / 12
    assert _value(stats.avg("stats.product").get()) == 4.0


def test_aggregation_over_order_by_limit_uses_the_first_n_by_that_order(stats: firestore.CollectionReference) -> None:
    # The 5 documents with the largest a are those with a == 4: their products sum to 4*(0+..+4).
    by_a = stats.order_by("a", direction=firestore.Query.DESCENDING).limit(5)
    assert _value(by_a.sum("stats.product").get()) == 40
    assert _value(by_a.avg("b").get()) == 2.0
    assert _value(by_a.count().get()) == 5
    # order_by(f).limit(n) on the aggregated field itself: the n smallest.
    assert _value(stats.order_by("stats.product").limit(10).sum("stats.product").get()) == 1
    assert [d.get("stats.product") for d in stats.order_by("stats.product").limit(10).stream()][-1] == 1


def test_documents_without_the_field_take_no_part_in_the_aggregation(client: firestore.Client) -> None:
    col = client.collection("mixed")
    for doc_id, data in {
        "a": {"v": 1, "w": 1},
        "b": {"v": 2.5, "w": 1},
        "c": {"v": "text", "w": 1},
        "d": {"v": None, "w": 1},
        "e": {"w": 1},
    }.items():
        col.document(doc_id).set(data)
    (results,) = col.count(alias="n").sum("v", alias="s").avg("v", alias="m").get()
    assert {r.alias: r.value for r in results} == {"n": 4, "s": 3.5, "m": 1.75}
    assert _value(col.count().get()) == 5
    # The first two documents by v (null < numbers < strings) are d and a: only a is a number.
    assert _value(col.limit(2).sum("v").get()) == 1


def test_sum_types_overflow_and_nan(client: firestore.Client) -> None:
    col = client.collection("numbers")
    col.document("big").set({"i": 2**63 - 1, "x": float("nan")})
    col.document("one").set({"i": 1, "x": 1.0})
    assert _value(col.sum("i").get()) == float(2**63)  # the total leaves int64: a double
    assert math.isnan(_value(col.sum("x").get()))
    col.document("big").delete()
    total = _value(col.sum("i").get())
    assert total == 1 and isinstance(total, int)
    assert _value(col.where(filter=FieldFilter("i", ">", 5)).sum("i").get()) == 0


def test_avg_of_nothing_is_null_and_sum_of_nothing_is_integer_zero(client: firestore.Client) -> None:
    # The Python client reads a null result as 0.0: look at the response itself.
    client.collection("empty-ish").document("x").set({"s": "text"})
    request = {
        "parent": f"projects/{client.project}/databases/(default)/documents",
        "structured_aggregation_query": {
            "structured_query": {"from_": [{"collection_id": "empty-ish"}]},
            "aggregations": [{"avg": {"field": {"field_path": "s"}}}, {"sum": {"field": {"field_path": "s"}}}],
        },
    }
    (response,) = gapic(client).run_aggregation_query(request=request)
    fields = response.result.aggregate_fields
    assert "null_value" in fields["field_1"] and fields["field_2"].integer_value == 0
    assert "integer_value" in fields["field_2"]


def test_aggregation_errors_carry_production_messages(stats: firestore.CollectionReference) -> None:
    query = stats.where(filter=FieldFilter("a", "==", 1))
    with pytest.raises(exceptions.InvalidArgument) as empty:
        AggregationQuery(query).get()
    assert "Aggregations can not be empty" in empty.value.message
    with pytest.raises(exceptions.InvalidArgument) as duplicate:
        query.count(alias="total").count(alias="total").get()
    assert "Aggregation aliases contain duplicate alias" in duplicate.value.message
    with pytest.raises(exceptions.InvalidArgument) as duplicate_stream:
        list(query.count(alias="total").sum("a", alias="total").stream())
    assert "Aggregation aliases contain duplicate alias: total." in duplicate_stream.value.message
    too_many = r"maximum number of aggregations allowed .* is 5\. Received: 6"
    with pytest.raises(exceptions.InvalidArgument, match=too_many):
        aggregation = query.count(alias="c0")
        for index in range(1, 6):
            aggregation = aggregation.count(alias=f"c{index}")
        aggregation.get()


def _aggregation_request(client: firestore.Client, aggregations: list[dict]) -> dict:
    root = f"projects/{client.project}/databases/(default)/documents"
    return {
        "parent": root,
        "structured_aggregation_query": {
            "structured_query": {"from_": [{"collection_id": "stats"}]},
            "aggregations": aggregations,
        },
    }


@pytest.mark.parametrize(
    ("aggregations", "message"),
    [
        ([{"alias": "x"}], "Operator field in Aggregation is not set."),
        ([{"count": {"up_to": -1}}], "The `up_to` value in a COUNT aggregation must be greater than or equal to zero."),
        ([{"sum": {"field": {"field_path": "__name__"}}}], "Aggregations are not supported for the property: __key__"),
        ([{"avg": {}}], "Invalid empty property path string."),
        ([{"sum": {"field": {"field_path": "a..b"}}}], "Invalid field path"),
        ([{"count": {}, "alias": "__x__"}], 'The property.name "__x__" is reserved.'),
        # Unnamed aggregations are field_1, field_2... counting unnamed ones only.
        ([{"count": {}, "alias": "field_1"}, {"sum": {"field": {"field_path": "a"}}}], "duplicate alias: field_1."),
    ],
)
def test_malformed_aggregations_are_invalid_argument(
    stats: firestore.CollectionReference, client: firestore.Client, aggregations: list[dict], message: str
) -> None:
    with pytest.raises(exceptions.InvalidArgument) as error:
        list(gapic(client).run_aggregation_query(request=_aggregation_request(client, aggregations)))
    assert message in error.value.message


def test_count_up_to_zero_is_zero(stats: firestore.CollectionReference, client: firestore.Client) -> None:
    (response,) = gapic(client).run_aggregation_query(request=_aggregation_request(client, [{"count": {"up_to": 0}}]))
    assert response.result.aggregate_fields["field_1"].integer_value == 0


async def test_async_sum_avg_with_limit_and_errors(aclient: firestore.AsyncClient) -> None:
    for ref, data in _products(aclient):
        await ref.set(data)
    col = aclient.collection("stats")
    assert _value(await col.limit(12).sum("stats.product").get()) == 5
    assert _value(await col.limit(12).avg("stats.product").get()) == 5 / 12
    by_a = col.order_by("a", direction=firestore.Query.DESCENDING).limit(5)
    assert _value(await by_a.sum("stats.product").get()) == 40
    query = col.where(filter=FieldFilter("a", "==", 1))
    with pytest.raises(exceptions.InvalidArgument, match="Aggregations can not be empty"):
        await AsyncAggregationQuery(query).get()
    with pytest.raises(exceptions.InvalidArgument, match="Aggregation aliases contain duplicate alias"):
        await query.count(alias="total").count(alias="total").get()
