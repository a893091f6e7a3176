"""``google.iam.v1.IAMPolicy`` for the Pub/Sub emulator's topics, subscriptions and snapshots.

The official clients call it on the Pub/Sub channel (``publisher.get_iam_policy(request={"resource":
topic})``, ``subscriber.set_iam_policy(...)``, ``test_iam_permissions``). Production's rules kept:
- an unknown resource is NOT_FOUND, a name that is no topic, subscription or snapshot is
  INVALID_ARGUMENT;
- a resource that never had a policy has an empty one with etag ``ACAB`` (bytes 00 00 01); every
  SetIamPolicy gives a new etag; a SetIamPolicy carrying an etag other than the current one is
  ABORTED (a concurrent change: redo the read-modify-write), one without an etag overwrites blindly;
- roles must be basic, Pub/Sub or custom roles; members must be principals (``user:``,
  ``serviceAccount:``, ``group:``, ``domain:``, ``allUsers``, ...); conditions and audit configs are
  refused (Pub/Sub resources support neither); bindings of one role are merged;
- deleting the resource deletes its policy (the broker drops it).
Policies are stored and returned, never enforced: the emulator has no identities, so
TestIamPermissions grants the caller every requested permission that applies to the resource.
"""

from __future__ import annotations

import itertools
import re
import struct
from typing import Any

import grpc
from google.iam.v1 import iam_policy_pb2, policy_pb2

from sidecar.emulators.pubsub_model import PubsubError
from sidecar.emulators.pubsub_names import InvalidName, parse_snapshot, parse_subscription, parse_topic
from sidecar.emulators.pubsub_replay import Replay
from sidecar.emulators.pubsub_rpc import invalid, unary
from sidecar.emulators.pubsub_state import Broker

EMPTY_POLICY_ETAG = b"\x00\x00\x01"
"""What production returns (base64 ``ACAB``) for a resource that has never had a policy."""
_CONCURRENT_CHANGE = (
    "There were concurrent policy changes. Please retry the whole read-modify-write with exponential backoff."
)
_POLICY_VERSIONS = (0, 1, 3)
_BASIC_ROLES = frozenset({"roles/owner", "roles/editor", "roles/viewer"})
_PUBSUB_ROLES = frozenset(
    {"roles/pubsub.admin", "roles/pubsub.editor", "roles/pubsub.publisher", "roles/pubsub.subscriber",
     "roles/pubsub.viewer"}
)  # fmt: skip
_CUSTOM_ROLE = re.compile(r"(projects|organizations)/[^/]+/roles/[A-Za-z0-9_.]{3,64}")
_EMAIL = r"[^@\s:]+@[^@\s:]+\.[^@\s:]+"
_MEMBER = re.compile(
    rf"(user|serviceAccount|group):{_EMAIL}|domain:[A-Za-z0-9.-]+\.[A-Za-z]{{2,}}|allUsers|allAuthenticatedUsers"
    rf"|principal(Set)?://\S+|deleted:(user|serviceAccount|group):{_EMAIL}\?uid=\d+"
)
_VERBS = {
    "topics": "attachSubscription create delete detachSubscription get getIamPolicy list publish setIamPolicy "
    "update updateTag",
    "subscriptions": "consume create delete get getIamPolicy list setIamPolicy update",
    "snapshots": "create delete get getIamPolicy list seek setIamPolicy update",
}
_PERMISSIONS = {kind: frozenset(f"pubsub.{kind}.{verb}" for verb in verbs.split()) for kind, verbs in _VERBS.items()}
"""Pub/Sub's permissions on each kind of resource: TestIamPermissions grants these."""
_PERMISSION = re.compile(r"[a-z][a-zA-Z0-9]*(\.[a-zA-Z][a-zA-Z0-9]*){2}")
MAX_TEST_PERMISSIONS = 100
_PARSERS = {"topics": parse_topic, "subscriptions": parse_subscription, "snapshots": parse_snapshot}


class IamService:
    """GetIamPolicy, SetIamPolicy and TestIamPermissions over the broker's resources."""

    def __init__(self, broker: Broker, replay: Replay) -> None:
        self._broker = broker
        self._replay = replay
        self._etags = itertools.count(1)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        handlers = {
            "GetIamPolicy": unary(self.get_iam_policy, iam_policy_pb2.GetIamPolicyRequest, policy_pb2.Policy),
            "SetIamPolicy": unary(self.set_iam_policy, iam_policy_pb2.SetIamPolicyRequest, policy_pb2.Policy),
            "TestIamPermissions": unary(
                self.test_iam_permissions,
                iam_policy_pb2.TestIamPermissionsRequest,
                iam_policy_pb2.TestIamPermissionsResponse,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("google.iam.v1.IAMPolicy", handlers),))

    def _resource(self, name: str) -> str:
        """The collection of an existing resource; INVALID_ARGUMENT or NOT_FOUND otherwise."""
        if not name:
            raise invalid("resource is required")
        parts = name.split("/")
        collection = parts[2] if len(parts) == 4 else ""
        parser = _PARSERS.get(collection)
        if parser is None:
            raise InvalidName(
                f"Invalid resource name: (name={name!r}); expected projects/P/topics/T, "
                "projects/P/subscriptions/S or projects/P/snapshots/S"
            )
        parser(name)
        if collection == "topics":
            self._broker.topic(name)
        elif collection == "subscriptions":
            self._broker.subscription(name)
        else:
            self._replay.snapshot(name)
        return collection

    def _current(self, name: str) -> Any:
        policy = self._broker.iam_policies.get(name)
        return policy if policy is not None else policy_pb2.Policy(etag=EMPTY_POLICY_ETAG)

    async def get_iam_policy(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._resource(request.resource)
        version = request.options.requested_policy_version
        if version not in _POLICY_VERSIONS:
            raise invalid(f"GetIamPolicy: invalid requested_policy_version {version}; use 1 or 3")
        return self._current(request.resource)

    async def set_iam_policy(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._resource(request.resource)
        if not request.HasField("policy"):
            raise invalid("SetIamPolicy: policy is required")
        paths = set(request.update_mask.paths) if request.HasField("update_mask") else {"bindings", "etag"}
        unknown = sorted(paths - {"bindings", "etag"})
        if unknown:
            raise invalid(f"SetIamPolicy: update_mask may name only bindings and etag (got {', '.join(unknown)})")
        policy = request.policy
        current = self._current(request.resource)
        if "etag" in paths and policy.etag and policy.etag != current.etag:
            raise PubsubError(grpc.StatusCode.ABORTED, _CONCURRENT_CHANGE)
        if policy.version not in _POLICY_VERSIONS:
            raise invalid(f"SetIamPolicy: invalid policy version {policy.version}; use 1 or 3")
        if policy.audit_configs:
            raise invalid("SetIamPolicy: audit configs are not supported on Pub/Sub resources")
        stored = policy_pb2.Policy(version=1, etag=struct.pack(">Q", next(self._etags)))
        stored.bindings.extend(_checked_bindings(policy.bindings) if "bindings" in paths else current.bindings)
        self._broker.iam_policies[request.resource] = stored
        return stored

    async def test_iam_permissions(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        collection = self._resource(request.resource)
        if len(request.permissions) > MAX_TEST_PERMISSIONS:
            raise invalid(f"TestIamPermissions: at most {MAX_TEST_PERMISSIONS} permissions may be tested")
        for permission in request.permissions:
            if "*" in permission:
                raise invalid(f"Permission {permission!r} is not valid: wildcards are not allowed here")
            if not _PERMISSION.fullmatch(permission):
                raise invalid(f"Permission {permission!r} is not valid: expected service.resource.verb")
        applicable = _PERMISSIONS[collection]
        granted = [p for p in dict.fromkeys(request.permissions) if p in applicable]
        return iam_policy_pb2.TestIamPermissionsResponse(permissions=granted)


def _checked_bindings(bindings: Any) -> list[Any]:
    """Validate roles and members, merge bindings of one role, drop those without members."""
    members_by_role: dict[str, dict[str, None]] = {}
    for index, binding in enumerate(bindings):
        role = binding.role
        if not role:
            raise invalid(f"SetIamPolicy: bindings[{index}]: role is required")
        if not role.startswith("roles/") and not _CUSTOM_ROLE.fullmatch(role):
            raise invalid(f"SetIamPolicy: bindings[{index}]: role {role!r} is not a valid role name")
        if role.startswith("roles/") and role not in _BASIC_ROLES and role not in _PUBSUB_ROLES:
            raise invalid(f"SetIamPolicy: Role {role} is not supported for this resource.")
        if binding.HasField("condition"):
            raise invalid(f"SetIamPolicy: bindings[{index}]: conditions are not supported on Pub/Sub resources")
        for member in binding.members:
            if not _MEMBER.fullmatch(member):
                raise invalid(f"SetIamPolicy: bindings[{index}]: invalid member {member!r}")
        members_by_role.setdefault(role, {}).update(dict.fromkeys(binding.members))
    return [
        policy_pb2.Binding(role=role, members=list(members)) for role, members in members_by_role.items() if members
    ]
