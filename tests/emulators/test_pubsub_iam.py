"""IAM policies on topics, subscriptions and snapshots, through the official clients' IAM calls."""

from __future__ import annotations

from typing import Any

import pytest
from google.api_core import exceptions
from google.iam.v1 import policy_pb2

pytestmark = pytest.mark.timeout(60)

EMPTY_ETAG = b"\x00\x00\x01"
APP = "serviceAccount:app@conformance-test.iam.gserviceaccount.com"


def with_binding(policy: Any, role: str, *members: str) -> Any:
    changed = policy_pb2.Policy()
    changed.CopyFrom(policy)
    changed.bindings.add(role=role, members=list(members))
    return changed


def test_topic_policy_read_modify_write_with_etags_and_a_stale_etag_is_aborted(resources: Any, publisher: Any) -> None:
    topic = resources.topic()
    empty = publisher.get_iam_policy(request={"resource": topic})
    assert list(empty.bindings) == [] and empty.etag == EMPTY_ETAG

    first = publisher.set_iam_policy(
        request={"resource": topic, "policy": with_binding(empty, "roles/pubsub.publisher", APP)}
    )
    assert [(b.role, list(b.members)) for b in first.bindings] == [("roles/pubsub.publisher", [APP])]
    assert first.etag not in (b"", EMPTY_ETAG)
    assert publisher.get_iam_policy(request={"resource": topic}) == first

    # A writer that read before the first write: its etag is stale, the write is refused, nothing changes.
    with pytest.raises(exceptions.Aborted, match="concurrent policy changes"):
        publisher.set_iam_policy(
            request={"resource": topic, "policy": with_binding(empty, "roles/pubsub.viewer", "allUsers")}
        )
    assert publisher.get_iam_policy(request={"resource": topic}) == first

    # Read-modify-write with the current etag succeeds and moves the etag on.
    second = publisher.set_iam_policy(
        request={"resource": topic, "policy": with_binding(first, "roles/pubsub.viewer", "group:ops@example.com")}
    )
    assert second.etag != first.etag
    assert {b.role for b in second.bindings} == {"roles/pubsub.publisher", "roles/pubsub.viewer"}
    # Without an etag the write is blind: it replaces whatever is there.
    blind = policy_pb2.Policy(bindings=[policy_pb2.Binding(role="roles/pubsub.admin", members=["user:a@example.com"])])
    third = publisher.set_iam_policy(request={"resource": topic, "policy": blind})
    assert [b.role for b in third.bindings] == ["roles/pubsub.admin"]


def test_subscription_policy_and_test_iam_permissions_through_the_subscriber(resources: Any, subscriber: Any) -> None:
    subscription = resources.subscription(resources.topic())
    policy = subscriber.get_iam_policy(request={"resource": subscription})
    stored = subscriber.set_iam_policy(
        request={"resource": subscription, "policy": with_binding(policy, "roles/pubsub.subscriber", APP, APP)}
    )
    assert [list(b.members) for b in stored.bindings] == [[APP]], "duplicate members are merged"
    assert subscriber.get_iam_policy(request={"resource": subscription}).etag == stored.etag

    granted = subscriber.test_iam_permissions(
        request={
            "resource": subscription,
            "permissions": ["pubsub.subscriptions.consume", "pubsub.subscriptions.get", "pubsub.topics.publish"],
        }
    )
    # A topic permission does not apply to a subscription.
    assert list(granted.permissions) == ["pubsub.subscriptions.consume", "pubsub.subscriptions.get"]


def test_snapshot_has_a_policy_too(resources: Any, subscriber: Any) -> None:
    subscription = resources.subscription(resources.topic())
    snapshot = subscriber.snapshot_path(resources.project, f"iam-{subscription.rsplit('-', 1)[-1]}")
    subscriber.create_snapshot(request={"name": snapshot, "subscription": subscription})
    try:
        policy = subscriber.get_iam_policy(request={"resource": snapshot})
        assert policy.etag == EMPTY_ETAG
        stored = subscriber.set_iam_policy(
            request={"resource": snapshot, "policy": with_binding(policy, "roles/pubsub.viewer", "domain:example.com")}
        )
        assert stored.bindings[0].members == ["domain:example.com"]
        granted = subscriber.test_iam_permissions(
            request={"resource": snapshot, "permissions": ["pubsub.snapshots.seek"]}
        )
        assert list(granted.permissions) == ["pubsub.snapshots.seek"]
    finally:
        subscriber.delete_snapshot(request={"snapshot": snapshot})


def test_a_deleted_and_recreated_topic_starts_with_an_empty_policy(resources: Any, publisher: Any) -> None:
    topic = resources.topic()
    publisher.set_iam_policy(
        request={"resource": topic, "policy": with_binding(policy_pb2.Policy(), "roles/owner", APP)}
    )
    publisher.delete_topic(topic=topic)
    with pytest.raises(exceptions.NotFound):
        publisher.get_iam_policy(request={"resource": topic})
    publisher.create_topic(name=topic)
    assert publisher.get_iam_policy(request={"resource": topic}).etag == EMPTY_ETAG


def test_unknown_resources_are_not_found(resources: Any, publisher: Any, subscriber: Any) -> None:
    project = resources.project
    with pytest.raises(exceptions.NotFound):
        publisher.get_iam_policy(request={"resource": publisher.topic_path(project, "no-such-topic")})
    with pytest.raises(exceptions.NotFound):
        subscriber.set_iam_policy(
            request={"resource": subscriber.subscription_path(project, "no-such-sub"), "policy": policy_pb2.Policy()}
        )
    with pytest.raises(exceptions.NotFound):
        subscriber.test_iam_permissions(
            request={
                "resource": subscriber.snapshot_path(project, "no-such-snap"),
                "permissions": ["pubsub.snapshots.get"],
            }
        )


@pytest.mark.parametrize(
    ("binding", "message"),
    [
        (policy_pb2.Binding(role="roles/storage.admin", members=[APP]), "not supported for this resource"),
        (policy_pb2.Binding(role="pubsub.publisher", members=[APP]), "not a valid role"),
        (policy_pb2.Binding(role="", members=[APP]), "role is required"),
        (policy_pb2.Binding(role="roles/pubsub.viewer", members=["someone"]), "invalid member"),
        (policy_pb2.Binding(role="roles/pubsub.viewer", members=["user:not-an-email"]), "invalid member"),
    ],
)
def test_malformed_policies_are_invalid_argument(resources: Any, publisher: Any, binding: Any, message: str) -> None:
    topic = resources.topic()
    with pytest.raises(exceptions.InvalidArgument, match=message):
        publisher.set_iam_policy(request={"resource": topic, "policy": policy_pb2.Policy(bindings=[binding])})
    assert publisher.get_iam_policy(request={"resource": topic}).etag == EMPTY_ETAG, "a refused write changed nothing"


def test_other_bad_requests_are_invalid_argument(resources: Any, publisher: Any) -> None:
    topic = resources.topic()
    conditional = policy_pb2.Binding(role="roles/pubsub.viewer", members=[APP])
    conditional.condition.expression = "request.time < timestamp('2030-01-01T00:00:00Z')"
    bad_calls = [
        lambda: publisher.get_iam_policy(request={"resource": f"projects/{resources.project}/buckets/b"}),
        lambda: publisher.get_iam_policy(request={"resource": ""}),
        lambda: publisher.get_iam_policy(request={"resource": topic, "options": {"requested_policy_version": 2}}),
        lambda: publisher.set_iam_policy(request={"resource": topic}),
        lambda: publisher.set_iam_policy(
            request={"resource": topic, "policy": policy_pb2.Policy(bindings=[conditional])}
        ),
        lambda: publisher.set_iam_policy(
            request={"resource": topic, "policy": policy_pb2.Policy(), "update_mask": {"paths": ["version"]}}
        ),
        lambda: publisher.test_iam_permissions(request={"resource": topic, "permissions": ["pubsub.topics.*"]}),
        lambda: publisher.test_iam_permissions(request={"resource": topic, "permissions": ["publish"]}),
    ]
    for index, call in enumerate(bad_calls):
        with pytest.raises(exceptions.InvalidArgument):
            call()
            pytest.fail(f"bad call {index} was accepted")
